"""The online engine's intake: the requests between `add_request` and their `Finished`.

Callers on any thread put requests in (`take`) and ask for aborts (`ask_abort`); the
engine thread, inside `driver.run`, hands the planner what has arrived and applies the
aborts that can be (`pull`, the `driver.Intake` protocol), and sleeps in `wait` when
nothing is left to do. One condition guards all of it; only the engine thread touches
the planner. No torch.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from pp_runtime.core import driver
from pp_runtime.core.request import FinishReason, InvalidRequestError, Request, SamplingParams
from pp_runtime.engine.streams import Listener, RequestHandle, Watcher


class EngineClosed(RuntimeError):
    """The engine takes no more requests: it was closed, or its executor failed."""


class QueueFull(RuntimeError):
    """`max_waiting` requests already wait for KV blocks: come back later."""


# why a request taken in was refused: it could not be admitted and `max_waiting` requests
# already waited for KV blocks (it ends aborted, its `Finished.refused` set)
QUEUE_FULL = "refused: max_waiting requests already wait for KV blocks"


@dataclass(eq=False)
class Open:
    """A request between intake and its `Finished`."""

    key: str
    req: Request
    handle: RequestHandle
    watcher: Watcher | None
    in_planner: bool = False
    dropped: bool = False  # aborted before it reached the planner
    first_submit_s: float | None = None
    error: str | None = None


class Intake:
    """The open requests and the aborts asked for (`driver.Intake`).

    `max_waiting`: requests allowed to wait for KV blocks (None: no bound); `end(o)`: the
    engine's, called on the engine thread for a request ended here (after `release`);
    `clock`/`sleep`: the engine's (a virtual clock jumps to a held-back arrival).
    """

    def __init__(self, max_waiting: int | None, end: Callable[[Open], None],
                 clock: Callable[[], float], sleep: Callable[[float], None] | None):
        self.max_waiting, self.end, self.clock, self.sleep = max_waiting, end, clock, sleep
        self.cond = threading.Condition()
        self.open: dict[int, Open] = {}  # by planner id
        self.requests: dict[int, Request] = {}  # the same, for the metrics
        self._pending: list[tuple[float, int, Open]] = []  # (arrival, order, request) heap
        self._aborts: dict[int, tuple[FinishReason, str | None]] = {}
        self._keys: dict[str, int] = {}
        self._ids = itertools.count()
        self.closed = False
        self.failure: BaseException | None = None  # the executor's error, once it failed
        self.kv_waiting = 0  # requests the planner could not admit (engine thread writes)
        self._injected: BaseException | None = None  # a failure found outside the loop

    # ---- callers (any thread) ----------------------------------------------------------
    def take(self, prompt: Sequence[int], params: SamplingParams, seed: int,
             request_id: str | None, listener: Listener | None, watcher: Watcher | None,
             arrival_s: float | None, start: Callable[[], None],
             generated: Sequence[int] = ()) -> Open:
        """Register a checked request (arrival: now, or `arrival_s` if later; `generated`:
        tokens it already produced, `Request.resume`); `start`: called under the lock (the
        engine thread, on the first request)."""
        with self.cond:
            if self.failure is not None:
                raise EngineClosed(f"the engine failed: {self.failure}")
            if self.closed:
                raise EngineClosed("the engine is closed")
            if request_id is not None and request_id in self._keys:
                raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                          "request_id")
            if self.max_waiting is not None and self.kv_waiting >= max(1, self.max_waiting):
                raise QueueFull(f"{self.kv_waiting} requests already wait for KV blocks "
                                f"(max_waiting {self.max_waiting})")
            rid = next(self._ids)
            now = self.clock()
            arrival = now if arrival_s is None else max(now, arrival_s)
            key = str(rid) if request_id is None else request_id
            req = Request(rid, prompt, params, seed, arrival_s=arrival)
            if generated:
                req.resume(generated)
            o = Open(key, req, RequestHandle(key, listener), watcher)
            self.open[rid], self.requests[rid], self._keys[key] = o, o.req, rid
            if watcher is not None:
                watcher.request_ids.add(rid)
            heapq.heappush(self._pending, (arrival, rid, o))
            start()
            self.cond.notify_all()
        return o

    def ask_abort(self, request_id: str, reason: FinishReason, error: str | None) -> bool:
        """Abort by the caller's id at the next `pull`; False when it already ended."""
        with self.cond:
            rid = self._keys.get(request_id)
            if rid is None:
                return False
            self.abort_later(rid, reason, error)
            return True

    def abort_later(self, rid: int, reason: FinishReason, error: str | None) -> None:
        """Abort by planner id at the next `pull` (a first reason asked for wins)."""
        with self.cond:
            self._aborts.setdefault(rid, (reason, error))
            self.cond.notify_all()

    def abort_watched(self, watcher: Watcher, reason: FinishReason, error: str | None) -> None:
        """Abort every open request added with `watcher` at the next `pull`."""
        with self.cond:
            for rid in watcher.request_ids:
                self._aborts.setdefault(rid, (reason, error))
            self.cond.notify_all()

    def close(self, reason: FinishReason, error: str | None) -> list[Open]:
        """Take no more requests; every open one ends at the next `pull` (returned)."""
        with self.cond:
            self.closed = True
            opened = list(self.open.values())
            for o in opened:
                self._aborts.setdefault(o.req.request_id, (reason, error))
            self.cond.notify_all()
        return opened

    def inject_failure(self, exc: BaseException, start: Callable[[], None]) -> None:
        """A worker failure found outside the loop: the next `pull` raises it (as
        driver.ExecutorFailed); `start`: the engine thread, if it never ran."""
        with self.cond:
            self._injected = exc
            start()
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.failure = exc

    def count(self, holding_blocks: bool) -> int:
        """Open requests that hold a KV slot (or that hold none yet)."""
        with self.cond:
            return sum(1 for o in self.open.values() if (o.req.blocks is not None) == holding_blocks)

    def opened(self, only_planned: bool = False) -> list[Open]:
        with self.cond:
            return [o for o in self.open.values() if o.in_planner or not only_planned]

    def release(self, o: Open) -> None:
        """Forget an ended request (the engine then emits its `Finished`)."""
        rid = o.req.request_id
        with self.cond:
            self.open.pop(rid, None)
            self.requests.pop(rid, None)
            self._keys.pop(o.key, None)
            self._aborts.pop(rid, None)
            if o.watcher is not None:
                o.watcher.request_ids.discard(rid)

    # ---- the engine thread (driver.Intake) ---------------------------------------------
    def pull(self, planner: driver.Planner, now: float) -> None:
        """Hand the planner what arrived by `now`, then apply the aborts that can be."""
        arrived = []
        with self.cond:
            injected, self._injected = self._injected, None
            if injected is not None:
                raise driver.ExecutorFailed(f"{type(injected).__name__}: {injected}") from injected
            while self._pending and self._pending[0][0] <= now:
                o = heapq.heappop(self._pending)[2]
                if not o.dropped:
                    o.in_planner = True
                    arrived.append(o)
            aborts, self._aborts = self._aborts, {}
        for o in arrived:
            planner.add(o.req)
        if self.max_waiting is not None:
            self._refuse_overflow(planner, now)
        for rid, (reason, error) in aborts.items():
            o = self.open.get(rid)
            if o is not None and not self._abort_now(planner, o, reason, error, now):
                self.abort_later(rid, reason, error)  # in the pipeline: again once it is back

    def _refuse_overflow(self, planner: driver.Planner, now: float) -> None:
        """Admit what the free KV blocks take now; of the arrived requests still waiting,
        end the newest never-run ones beyond `max_waiting` (QUEUE_FULL). Preempted ones
        (they have run) always wait."""
        planner.admit(now)
        queued = planner.queued(now)
        fresh = [r for r in queued if r.num_preemptions == 0 and not r.output_token_ids]
        over = min(len(fresh), len(queued) - self.max_waiting)
        for req in fresh[len(fresh) - over:] if over > 0 else ():
            self._abort_now(planner, self.open[req.request_id], FinishReason.ABORTED,
                            QUEUE_FULL, now)
        self.kv_waiting = len(queued) - max(0, over)

    def wait(self) -> bool:
        """Sleep until a request arrives or an abort is asked for; False once closed."""
        with self.cond:
            while True:
                if self._aborts or self._injected is not None:
                    return True
                if self.closed:
                    return False
                if self._pending:
                    delay = self._pending[0][0] - self.clock()
                    if delay <= 0:
                        return True
                    if self.sleep is not None:  # a virtual clock: jump to the arrival
                        self.sleep(delay)
                        return True
                    self.cond.wait(delay)
                else:
                    self.cond.wait()

    def _abort_now(self, planner: driver.Planner, o: Open, reason: FinishReason,
                   error: str | None, now: float) -> bool:
        """End `o` unless a micro-batch in flight still carries it (False: try later)."""
        req = o.req
        if req.finished:
            return True
        if not o.in_planner:
            o.dropped = True
            req.finish_reason, req.finish_s = reason, now
        elif not planner.abort(req, reason, now):  # frees its KV slot
            return False
        o.error = error
        self.end(o)
        return True
