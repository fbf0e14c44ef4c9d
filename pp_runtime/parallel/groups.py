"""Process groups as objects: one world of tp x pp ranks, the TP group of every stage.

Rank r = stage * tp + tp_rank: the TP ranks of a stage are consecutive (and placed on one
node), stage s talks to stages s - 1 and s + 1 through the same TP rank. The rendezvous
address and port are given explicitly (`DistSpec`); nothing here reads them from the
environment. The store listens on that address only (a `tcp://` init method would listen
on every interface), and on a loopback address gloo / NCCL use the loopback interface.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from pp_runtime.core.net import keep_on_loopback


@dataclass(frozen=True)
class DistSpec:
    """How every rank of one deployment joins its process group (picklable)."""

    addr: str  # rendezvous host: where rank 0's store listens
    port: int  # rendezvous port
    tp: int
    pp: int
    backend: str  # nccl on CUDA, gloo on CPU
    timeout_s: float  # rendezvous and every collective / point-to-point call

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class StageGroups:
    """What one rank needs to talk to the others: its TP group and its stage neighbours."""

    tp: int
    pp: int
    rank: int
    tp_group: object  # torch.distributed ProcessGroup of this stage's tp ranks

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def prev_rank(self) -> int | None:
        """The same TP rank of the previous stage (None on stage 0)."""
        return self.rank - self.tp if self.stage > 0 else None

    @property
    def next_rank(self) -> int | None:
        """The same TP rank of the next stage (None on the last stage)."""
        return self.rank + self.tp if self.stage < self.pp - 1 else None


def listen_on(addr: str, port: int = 0) -> socket.socket:
    """A listening socket for rank 0's store, opened before any other rank starts: their
    connections wait in its backlog instead of being refused (a refused TCPStore client
    backs off exponentially, and a rank that started seconds early then waited 20-30 s)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((addr, port))  # fails now, clearly, if the port is taken
    server.listen()
    return server


def init_distributed(spec: DistSpec, rank: int, server: socket.socket | None = None) -> StageGroups:
    """Join the deployment's process group as `rank` and create every stage's TP group;
    rank 0's store takes `server` (`listen_on`) or listens on spec's address now."""
    keep_on_loopback(spec.addr)  # gloo / NCCL sockets on the loopback interface too
    timeout, listen_fd = timedelta(seconds=spec.timeout_s), None
    if rank == 0:
        server = server if server is not None else listen_on(spec.addr, spec.port)
        listen_fd = server.detach()  # the store owns the socket from here
    store = dist.TCPStore(spec.addr, spec.port, spec.world_size, rank == 0, timeout,
                          master_listen_fd=listen_fd)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size,
                            timeout=timeout)
    return stage_groups(spec.tp, spec.pp, rank)


def stage_groups(tp: int, pp: int, rank: int) -> StageGroups:
    """Every stage's TP group, created on every rank of an initialized world (all ranks
    create all groups, in the same order, as torch.distributed requires)."""
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    return StageGroups(tp, pp, rank, tp_groups[rank // tp])


def stage_control_group(tp: int, pp: int, rank: int, timeout_s: float):
    """A gloo group over every stage's TP ranks, created on every rank in stage order (as
    `stage_groups`); returns this rank's. It carries the Ray relay's plans and timings
    (`executors/ray_relay.py`): on the CPU whatever the activations' backend, and apart from
    the TP group the model's collectives use. `timeout_s` bounds each receive: a follower
    waits for its next plan as long as the deployment is idle."""
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), backend="gloo",
                             timeout=timedelta(seconds=timeout_s)) for s in range(pp)]
    return groups[rank // tp]


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
