"""The Ray stage actor: one process per (stage, TP rank), holding its `StageWorker`.

`RayExecutor` (ray_executor.py) creates one per rank from `stage_actor_class`: a plain Ray
actor, whose calls run one at a time on its own thread in submission order, or, under the
TP relay, one with concurrency groups (`CONCURRENCY_GROUPS`): the follow loop holds one,
and the probes and fault injection answer from the other while it runs. The Ray
dashboard shows the class as `StageActor` and each actor's repr as its stage, TP rank,
layers and node.
"""
from __future__ import annotations

import os
import time

from pp_runtime.config import Config
from pp_runtime.core.batch import MicroBatch, RankResult
from pp_runtime.executors.ray_relay import RelayMember
from pp_runtime.parallel.groups import DistSpec, listen_on

# concurrency groups besides the default one (which runs `execute` in submission order):
# the relay's follow loop holds one; probes and fault injection answer from the other
CONCURRENCY_GROUPS = {"relay": 1, "control": 1}
METHOD_GROUPS = {"follow": "relay", "ping": "control", "progress": "control", "sleep": "control",
                 "pid": "control"}


class StageActor(RelayMember):
    """The body of one Ray actor: a `StageWorker` for (stage, tp_rank) in its own process,
    on the device the driver decided ("cuda": the one GPU Ray gave it, or "cpu")."""

    def __init__(self, cfg: Config, stage: int, tp_rank: int, checkpoint: str | None, device: str):
        import ray
        import torch

        from pp_runtime.worker.device import resolve_device

        workers_here = cfg.parallel.tp * cfg.parallel.pp
        torch.set_num_threads(cfg.runtime.threads_per_worker
                              or max(1, (os.cpu_count() or 1) // workers_here))
        self.cfg, self.stage, self.tp_rank, self.checkpoint = cfg, stage, tp_rank, checkpoint
        self.device = resolve_device(device)  # raises if Ray gave this actor no GPU
        self.worker, self.relay, self.following = None, None, False
        self.stall_s, self.started, self.done = 0.0, 0, 0
        lo, hi = cfg.stage_units(stage)  # half layers: [2.5, 4) starts at layer 2's MLP
        self.label = (f"stage={stage} tp_rank={tp_rank} layers [{lo / 2:g}, {hi / 2:g}) "
                      f"node {ray.util.get_node_ip_address()}")

    def __repr__(self) -> str:  # Ray shows it as the actor's Repr in the dashboard
        return self.label

    def rendezvous_address(self, local: bool) -> tuple[str, int]:
        """Where rank 0 can listen: this node's address (127.0.0.1 for a local Ray), a free port."""
        import ray

        addr = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.server = listen_on(addr)  # listening before any rank starts (`listen_on`)
        return addr, self.server.getsockname()[1]

    def start(self, spec: DistSpec, relay: bool = False) -> list[str]:
        """Join the process group (and, with `relay`, the stage's control channel: every
        rank creates every stage's, in order), warm its communicators up, build the
        worker; returns what the warm-up exchanged (`parallel/p2p.warm_up`)."""
        from pp_runtime.parallel.groups import init_distributed
        from pp_runtime.parallel.p2p import warm_up
        from pp_runtime.worker.stage import StageWorker

        rank, t0 = self.stage * spec.tp + self.tp_rank, time.perf_counter()
        server = getattr(self, "server", None)  # rank 0: the socket rendezvous_address opened
        self.server = None
        if server is not None and server.getsockname()[1] != spec.port:  # runtime.dist_port set
            server.close()
            server = None
        groups = init_distributed(spec, rank, server)
        if relay:  # every rank creates every stage's control group, in stage order
            self.join_relay(spec, rank)
        t1 = time.perf_counter()
        warmed = warm_up(groups, self.device)
        t2 = time.perf_counter()
        self.worker = StageWorker(self.cfg, self.stage, self.device, self.checkpoint, groups)
        self.start_s = {"groups": t1 - t0, "warm-up": t2 - t1,
                        "weights": time.perf_counter() - t2}
        return warmed

    def start_times(self) -> dict[str, float]:
        """Seconds `start` spent joining the groups, warming up, building the worker."""
        return self.start_s

    def execute(self, mb: MicroBatch) -> RankResult | list[RankResult]:
        """This rank's result; under the relay (TP rank 0 only), the plan goes to the
        stage's other TP ranks first, and every TP rank's result comes back, in order."""
        return self._run(mb) if self.relay is None else self.lead(mb)

    def _run(self, mb: MicroBatch) -> RankResult:
        stall, self.stall_s = self.stall_s, 0.0
        if stall:
            time.sleep(stall)
        self.started += 1
        result, _ = self.worker.execute(mb)
        self.done += 1
        return result

    def layers(self) -> tuple[float, float]:
        """Layers [lo, hi) this rank's worker holds, in half layers where a layer is cut
        (2.5: from layer 2's MLP half): the split that runs."""
        ulo, uhi = self.worker.model.units
        return ulo / 2, uhi / 2

    def progress(self) -> int:
        """Micro-batches this rank has started plus those it has finished (answered from
        its own concurrency group, outside the compiled graph's thread and the follow
        loop): the hung rank is the one furthest behind, also where its TP peers wait for
        it inside the same micro-batch."""
        return self.started + self.done

    def ping(self) -> bool:
        """The liveness probe's call: answering is the proof of life."""
        return True

    def pid(self) -> int:
        """This worker's process id (fault injection: a test or benchmark kills it)."""
        return os.getpid()

    def sleep(self, seconds: float) -> None:
        """Fault injection for tests: stall this worker's next micro-batch by `seconds` (a
        compiled graph runs `execute` on a thread of its own, so the stall goes there)."""
        self.stall_s = seconds

    def shutdown(self) -> None:
        from pp_runtime.parallel.groups import destroy

        if self.following:  # its loop still holds the process groups: the kill ends both
            return
        if self.relay is not None:
            self.relay.flush()
        if self.worker is not None:  # every rank is asked at once: stage 0 takes what the
            self.worker.close_hop()  # last stage still sends (parallel/p2p.TokenHop.close)
        if self.worker is not None and self.worker.link is not None:
            self.worker.link.close()  # receives posted ahead ended (parallel/p2p.StageLink.close)
        destroy()


def stage_actor_class(ray, groups: bool):
    """`StageActor` as a Ray actor class: with concurrency groups (each call names its
    group, `Ranks.call` in ray_ranks.py) off the compiled graph, so `ping` and `progress` answer
    while `execute` waits on a hung neighbour and the diagnosis names the rank that hangs
    (measured no dearer per call than a plain actor: docs/distributed.md); under the graph
    a plain actor, whose graph loop runs on a thread of its own."""
    if groups:
        return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(StageActor)
    return ray.remote(StageActor)
