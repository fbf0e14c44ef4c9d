"""The driver loop: keep up to `depth` micro-batches in flight, feed results back.

One loop for every executor. With pp stages, depth = `cfg.in_flight` (pp + 1 by default:
the extra one hides the return of a result to the planner): the planner plans the next
micro-batch while earlier ones are still in the pipeline, and results come back in order.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Callable, Protocol

from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.core.request import FinishReason, Request


class Executor(Protocol):
    """What runs the micro-batches (`executors/`: local, ray, torchrun, sim); the loop uses
    `submit` and `wait`, its callers the rest, and nothing else of an executor."""

    name: str  # "local", "ray", "torchrun" or "sim": reports and the start banner name it
    device: object  # what the stages run on, resolved (str() gives "cpu", "cuda", "sim")
    path: str  # how the driver reaches the stages: "" (the executor's one way), or Ray's
    #            "graph" (compiled graph) or "relay" (TP relay); calibrations are kept per path

    def describe(self) -> str: ...  # one line for the banner: device and placement
    def submit(self, mb: MicroBatch) -> object: ...
    def wait(self, handle: object) -> SampledTokens: ...
    def shutdown(self) -> None: ...  # release the stages; a second call does nothing


class Planner(Protocol):
    """What the loop and an intake use (`planner/base.py`'s BasePlanner has them all)."""

    # the loop
    def has_work(self) -> bool: ...
    def schedule(self, now: float) -> MicroBatch | None: ...
    def next_arrival_s(self) -> float | None: ...
    def on_result(self, mb: MicroBatch, out: SampledTokens, now: float) -> list[Request]: ...
    def abort_all(self, reason: FinishReason, now: float) -> list[Request]: ...
    # a recovery: the requests move to a fresh planner
    def unfinished(self) -> list[Request]: ...
    def adopt(self, requests: list[Request]) -> None: ...
    # an intake (the online engine): requests in, one at a time out
    def add(self, req: Request) -> None: ...
    def admit(self, now: float) -> None: ...
    def num_waiting(self) -> int: ...
    def queued(self, now: float) -> list[Request]: ...
    def abort(self, req: Request, reason: FinishReason, now: float) -> bool: ...
    def forget(self, request_id: int) -> None: ...


class Intake(Protocol):
    """Requests that come in while the loop runs (the online engine's, engine/intake.py)."""

    def pull(self, planner: Planner, now: float) -> None:
        """Hand the planner every request that has arrived by `now`; apply aborts."""

    def wait(self) -> bool:
        """Block until `pull` has something to hand over; False once closed (the loop ends)."""


OnMicroBatch = Callable[[MicroBatch, SampledTokens], None]
OnSubmit = Callable[[MicroBatch], None]
OnCollect = Callable[[MicroBatch, "SampledTokens | None"], None]


class ExecutorFailed(RuntimeError):
    """The executor failed; every unfinished request was ended with finish reason error."""


def run(planner: Planner, executor: Executor, depth: int,
        clock: Callable[[], float] = time.perf_counter,
        on_microbatch: OnMicroBatch | None = None,
        sleep: Callable[[float], None] = time.sleep, intake: Intake | None = None,
        keep_on_failure: bool = False, on_submit: OnSubmit | None = None,
        on_collect: OnCollect | None = None) -> None:
    """Run until the planner has no work left (with an `intake`: until it is closed).

    With nothing in flight and nothing arrived, sleep until the next arrival; that stretch,
    from the last result to the arrival, is the system's idle time, handed to the stages'
    bubble accounting as `idle_before_s` of the next micro-batch (a duration: every stage
    can use it on its own clock). On an executor error, end every unfinished request with
    finish reason `error` and raise ExecutorFailed; with `keep_on_failure` leave them as
    they are (the results in flight are lost: the caller recovers, `engine/online.py`). Any other error (a planner or callback
    bug) drains the micro-batches in flight, ends the unfinished requests the same way and
    propagates unchanged: the executor stays usable. A KeyboardInterrupt (Ctrl-C, or SIGTERM
    under `interrupt.handled()`) ends them the same way at once, without waiting for the
    micro-batches in flight, and propagates: the caller shuts the executor down.

    With an `intake` the loop pulls new requests and aborts before every decision, and
    when the planner has no work it blocks in `intake.wait()` instead of returning; the
    stretch from the last result to the first request that ends the wait is idle time,
    handed on as above.

    Hooks around the executor (the engine's first-submit stamps, the metrics' in-flight
    count): `on_submit(mb)` just before `executor.submit(mb)`; `on_collect(mb, out)` once
    for every micro-batch given to `on_submit`: after its `wait`, before the planner sees
    the result, or with `out` None where it was lost (a failed submit or wait, and every
    micro-batch still in flight then or at an interrupt).
    """
    in_flight: deque[tuple[MicroBatch, object]] = deque()
    quiet_since = clock()  # when the last result came back (the run's start before any)
    idle_until: float | None = None  # the arrival the driver last slept for
    now = quiet_since
    try:
        while True:
            if intake is not None:
                empty = not in_flight and not planner.has_work()
                intake.pull(planner, clock())
                if empty and planner.has_work():  # the first arrival after an idle stretch
                    idle_until = planner.next_arrival_s()
            if not planner.has_work():
                if intake is not None and intake.wait():
                    continue
                break
            while len(in_flight) < depth:
                now = clock()  # one reading per decision: what schedule() saw is what counts
                mb = planner.schedule(now)
                if mb is None:
                    break
                if idle_until is not None:
                    mb = replace(mb, idle_before_s=max(0.0, idle_until - quiet_since))
                    idle_until = None
                _submit(executor, mb, in_flight, on_submit)
            if not in_flight:
                arrival = planner.next_arrival_s()
                if arrival is None or arrival <= now:
                    raise RuntimeError(f"planner has work but scheduled nothing at {now} "
                                       f"(next arrival {arrival})")
                idle_until = arrival
                sleep(max(0.0, arrival - clock()))  # idle until the next request arrives
                continue
            mb, out = _collect(executor, in_flight, on_collect)
            quiet_since = clock()
            planner.on_result(mb, out, quiet_since)
            if on_microbatch:
                on_microbatch(mb, out)
    except ExecutorFailed:
        _lose(in_flight, on_collect)
        if not keep_on_failure:
            planner.abort_all(FinishReason.ERROR, clock())
        raise
    except KeyboardInterrupt:
        _lose(in_flight, on_collect)
        planner.abort_all(FinishReason.ERROR, clock())
        raise
    except Exception:
        _drain(executor, in_flight, on_collect)
        planner.abort_all(FinishReason.ERROR, clock())
        raise


def _submit(executor: Executor, mb: MicroBatch, in_flight: deque,
            on_submit: OnSubmit | None) -> None:
    """`on_submit(mb)`, then the executor's submit; `mb` is in flight either way (a failed
    submit's micro-batch is lost with the others)."""
    if on_submit is not None:
        on_submit(mb)
    try:
        handle = _executor_call(executor.submit, mb)
    except ExecutorFailed:
        in_flight.append((mb, None))
        raise
    in_flight.append((mb, handle))


def _collect(executor: Executor, in_flight: deque,
             on_collect: OnCollect | None) -> tuple[MicroBatch, SampledTokens]:
    """Wait for the oldest micro-batch's result and hand it to `on_collect`; where the
    wait fails it stays in flight (lost with the others)."""
    mb, handle = in_flight[0]
    out = _executor_call(executor.wait, handle)
    in_flight.popleft()
    if on_collect is not None:
        on_collect(mb, out)
    return mb, out


def _executor_call(fn: Callable, arg: object):
    """An executor call; whatever it raises becomes ExecutorFailed."""
    try:
        return fn(arg)
    except Exception as exc:
        raise ExecutorFailed(f"{type(exc).__name__}: {exc}") from exc


def _lose(in_flight: deque, on_collect: OnCollect | None) -> None:
    """The micro-batches still in flight are lost: each collected with None."""
    while in_flight:
        mb, _ = in_flight.popleft()
        if on_collect is not None:
            on_collect(mb, None)


def _drain(executor: Executor, in_flight: deque, on_collect: OnCollect | None) -> None:
    """Collect (and drop) the results still in flight, so the executor can run again."""
    while in_flight:
        mb, handle = in_flight[0]
        try:
            out = executor.wait(handle)
        except Exception:  # the error being raised matters more than this one
            break
        in_flight.popleft()
        if on_collect is not None:
            on_collect(mb, out)
    _lose(in_flight, on_collect)
