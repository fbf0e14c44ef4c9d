"""The parallel tests' way to run a handful of spawned ranks on 127.0.0.1."""
from __future__ import annotations

import multiprocessing

from pp_runtime.core.net import free_port
from pp_runtime.profile.p2p import _reap


def run_ranks(target, n: int, timeout: float = 60) -> list:
    """Start `target(rank, port, out)` in `n` spawned processes (one free port on
    127.0.0.1); return the `n` items they put on `out`, every process reaped after."""
    ctx, port = multiprocessing.get_context("spawn"), free_port("127.0.0.1")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(n)]
    try:
        for p in procs:
            p.start()
        return [out.get(timeout=timeout) for _ in procs]
    finally:
        _reap(procs, 10)
