"""The driver loop: keep up to `depth` micro-batches in flight, feed results back.

One loop for every executor. With pp stages, depth = pp: the planner plans the next
micro-batch while earlier ones are still in the pipeline, and results come back in order.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Protocol

from pp_runtime.batch import MicroBatch, SampledTokens
from pp_runtime.request import FinishReason, Request


class Executor(Protocol):
    def submit(self, mb: MicroBatch) -> object: ...
    def wait(self, handle: object) -> SampledTokens: ...


class Planner(Protocol):
    def has_work(self) -> bool: ...
    def schedule(self, now: float) -> MicroBatch | None: ...
    def next_arrival_s(self) -> float | None: ...
    def on_result(self, mb: MicroBatch, out: SampledTokens, now: float) -> list[Request]: ...
    def abort_all(self, reason: FinishReason, now: float) -> list[Request]: ...


OnMicroBatch = Callable[[MicroBatch, SampledTokens], None]


class ExecutorFailed(RuntimeError):
    """The executor failed; every unfinished request was ended with finish reason error."""


def run(planner: Planner, executor: Executor, depth: int,
        clock: Callable[[], float] = time.perf_counter,
        on_microbatch: OnMicroBatch | None = None,
        sleep: Callable[[float], None] = time.sleep) -> None:
    """Run until the planner has no work left. On an executor error, end every
    unfinished request with finish reason `error` and raise ExecutorFailed."""
    in_flight: deque[tuple[MicroBatch, object]] = deque()
    try:
        while planner.has_work():
            while len(in_flight) < depth and (mb := planner.schedule(clock())) is not None:
                in_flight.append((mb, executor.submit(mb)))
            if not in_flight:
                arrival = planner.next_arrival_s()
                if arrival is None or arrival <= clock():
                    raise RuntimeError("planner has work but scheduled nothing")
                sleep(arrival - clock())  # idle until the next request arrives
                continue
            mb, handle = in_flight.popleft()
            out = executor.wait(handle)
            planner.on_result(mb, out, clock())
            if on_microbatch:
                on_microbatch(mb, out)
    except Exception as exc:
        planner.abort_all(FinishReason.ERROR, clock())
        raise ExecutorFailed(f"{type(exc).__name__}: {exc}") from exc
