"""Measure stage-to-stage send/recv on this machine: `send_recv.csv` of a profile.

Two spawned processes form a torch.distributed group (gloo on CPU, NCCL on two GPUs) bound
to 127.0.0.1 only, and ping-pong one TP rank's activations [num_tokens, hidden / tp]; half
the round trip is written. The processes are always reaped, also on failure.
"""
from __future__ import annotations

import queue
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from pp_runtime.config import Config
from pp_runtime.worker.device import dist_backend, now, torch_dtype
from pp_runtime.core.net import free_port
from pp_runtime.parallel.groups import DistSpec, init_distributed
from pp_runtime.profile.grid import Effort, ProfileGrid

P2P_START_S = 120.0  # the two send/recv processes must start and report within this
P2P_JOIN_S = 20.0  # then they must exit within this, or they are terminated


@dataclass(frozen=True)
class _P2PJob:
    """What the two send/recv processes are told (picklable for `spawn`)."""

    port: int  # 127.0.0.1 port of rank 0's store, picked by binding port 0
    backend: str  # gloo | nccl
    devices: tuple[str, str]  # device of rank 0 and rank 1
    dtype: str
    width: int  # hidden / tp: one TP rank's slice of the activations
    tokens: tuple[int, ...]
    warmup: int
    repeats: int


def _p2p_job(cfg: Config, device: torch.device, grid: ProfileGrid,
             effort: Effort) -> tuple[_P2PJob, str]:
    """The job and a note for device.json. NCCL needs two GPUs; with one, the activations
    go through host memory over gloo, and the note says so."""
    backend, devices, note = "gloo", ("cpu", "cpu"), "gloo"
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        backend, devices, note = dist_backend(device), ("cuda:0", "cuda:1"), "nccl, two GPUs"
    elif device.type == "cuda":
        note = "gloo over host memory (one GPU: NCCL needs two)"
    width = cfg.model.hidden_size // cfg.parallel.tp
    dtype = cfg.model.dtype_for(device.type)  # the dtype the stages send in
    return _P2PJob(free_port("127.0.0.1"), backend, devices, dtype, width, grid.send_tokens,
                   effort.warmup + 1, effort.max_repeats), note


def _join_group(rank: int, job: _P2PJob) -> None:
    """A 2-process group whose every socket is on 127.0.0.1 (see parallel/groups.py)."""
    init_distributed(DistSpec("127.0.0.1", job.port, 1, 2, job.backend, P2P_START_S), rank)


def _send_recv_child(rank: int, job: _P2PJob, results) -> None:
    """One of the two processes: ping-pong [n, width] with the other for every n; rank 0
    reports half the median round trip in ms. Errors go to the parent, which raises."""
    torch.set_num_threads(1)
    device, peer = torch.device(job.devices[rank]), 1 - rank
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _join_group(rank, job)
        for n in job.tokens:
            x = torch.randn(n, job.width, dtype=torch_dtype(job.dtype),
                            device=device)  # [n, hidden / tp], contiguous
            samples = []
            for _ in range(job.warmup + job.repeats):
                t0 = now(device)
                for op in ((dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)):
                    op(x, peer)
                samples.append((now(device) - t0) * 1e3 / 2)
            if rank == 0:
                results.put(("ok", n, statistics.median(samples[job.warmup:])))
    except Exception as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reap(procs: list, grace_s: float) -> None:
    """Join the started children; terminate, then kill, any still there after grace_s."""
    for p in (p for p in procs if p.pid is not None):
        p.join(timeout=grace_s)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def measure_send_recv(cfg: Config, device: torch.device, grid: ProfileGrid, effort: Effort,
                      bar: tqdm) -> tuple[list[dict], str]:
    """Rows of send_recv.csv and the backend note, from two spawned processes; raises
    RuntimeError when they cannot be started or fail. They are gone when this returns."""
    job, note = _p2p_job(cfg, device, grid, effort)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_send_recv_child, args=(rank, job, results), daemon=True)
             for rank in (0, 1)]
    rows: list[dict] = []
    try:
        try:
            for p in procs:
                p.start()
        except Exception as exc:
            raise RuntimeError(f"send/recv: could not spawn the two measuring processes: "
                               f"{type(exc).__name__}: {exc}") from exc
        deadline = time.monotonic() + P2P_START_S
        while len(rows) < len(job.tokens):
            try:
                kind, a, b = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"send/recv: the two measuring processes stopped reporting (exit codes "
                        f"{[p.exitcode for p in procs]}; see their stderr). A script that calls "
                        "measure_profile needs `if __name__ == '__main__':` (spawn)") from None
                continue
            if kind == "error":
                raise RuntimeError(f"send/recv: rank {a} failed ({job.backend}, "
                                   f"127.0.0.1:{job.port}): {b}")
            rows.append({"n_embd": cfg.model.hidden_size, "num_tokens": a,
                         "num_tensor_parallel_workers": cfg.parallel.tp,
                         "time_stats.send_recv.median": b})
            deadline = time.monotonic() + P2P_START_S
            bar.update()
    finally:  # after an error the survivor may wait on its peer forever: no grace then
        _reap(procs, P2P_JOIN_S if len(rows) == len(job.tokens) else 0.0)
    return rows, note
