"""The online engine: one driver loop on a background thread, fed while it runs. No torch.

Callers on any thread `add_request` (checked first: InvalidRequestError before anything
runs) and `abort` by id. The loop is `driver.run` with this engine as its intake: before
every decision it pulls the requests that arrived and the aborts asked for, so the one
planner, and with it every KV slot, is touched by the engine thread alone. A request's
arrival time is the engine clock when it was taken in.

Each request streams to its `RequestHandle`: a `Token` as the last stage samples it, then
one `Finished` with the RequestOutput and its `RequestTiming` (queue, TTFT, generation
and the bubble of the micro-batches that carried it, from the same `StageAccumulator`
rule as the reports). An abort ends a request that waits at once and one in the
pipeline when its micro-batch is back (only then is its KV slot free to reuse). With no
work the thread sleeps on a condition. An executor failure ends every open request with
`error`; the engine is then unhealthy and takes no more requests.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from pp_runtime.core import driver
from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.config import Config
from pp_runtime.planner import make_planner
from pp_runtime.core.request import (FinishReason, InvalidRequestError, Request, RequestOutput,
                                SamplingParams, default_seed, prompt_problems)
from pp_runtime.engine.streams import (Event, Finished, Listener, RequestHandle, RequestTiming, Token,
                                Watcher)
from pp_runtime.telemetry.metrics import NullSink, RuntimeMetrics, Sink

__all__ = ["Engine", "EngineClosed", "QueueFull", "Event", "Finished", "Listener",
           "RequestHandle", "RequestTiming", "Token", "Watcher"]

log = logging.getLogger(__name__)


class EngineClosed(RuntimeError):
    """The engine takes no more requests: it was closed, or its executor failed."""


class QueueFull(RuntimeError):
    """`max_waiting` requests already wait for KV blocks: come back later."""


# why a request taken in was refused: it could not be admitted and `max_waiting` requests
# already waited for KV blocks (it ends aborted, its `Finished.refused` set)
QUEUE_FULL = "refused: max_waiting requests already wait for KV blocks"


@dataclass(eq=False)
class _Open:
    """A request between intake and its `Finished`."""

    key: str
    req: Request
    handle: RequestHandle
    watcher: Watcher | None
    in_planner: bool = False
    dropped: bool = False  # aborted before it reached the planner
    first_submit_s: float | None = None
    error: str | None = None


class Engine:
    """`cfg`'s planner and driver loop over `executor` (local, ray, or sim with its clock).

    `sink`: where the live metrics go (Ray's, Prometheus', or nowhere); `max_waiting`:
    requests allowed to wait for KV blocks (0: none waits), counted after admission, so a
    burst the free blocks can take is never refused: `add_request` raises QueueFull while
    that many wait, and one taken in beyond them that cannot be admitted at once ends
    aborted with error `QUEUE_FULL` (`_refuse_overflow`);
    `thread_init`: run first on the engine thread (torch's per-thread settings);
    `clock`/`sleep`: the driver's (a `VirtualClock` and its `sleep` for the simulator).
    """

    def __init__(self, cfg: Config, executor: driver.Executor, *, sink: Sink | None = None,
                 max_waiting: int | None = None, thread_init: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] | None = None):
        self.cfg, self.clock, self.max_waiting = cfg, clock, max_waiting
        self._sleep, self._thread_init = sleep, thread_init
        self._planner = make_planner(cfg)
        self._cond = threading.Condition()
        self._pending: list[tuple[float, int, _Open]] = []  # (arrival, order, request) heap
        self._aborts: dict[int, tuple[FinishReason, str | None]] = {}
        self._open: dict[int, _Open] = {}  # by planner id
        self._requests: dict[int, Request] = {}  # the same, for the metrics
        self._keys: dict[str, int] = {}
        self._watchers: list[Watcher] = []
        self._ids = itertools.count()
        self._closed = False
        self._kv_waiting = 0  # requests the planner could not admit (engine thread writes)
        self.failure: BaseException | None = None  # the executor's error, once it failed
        self._thread: threading.Thread | None = None
        self.metrics = RuntimeMetrics.for_config(cfg, self._requests, clock,
                                                 lambda: self._planner.num_waiting(),
                                                 sink if sink is not None else NullSink(),
                                                 keep_ended=True)
        self._executor = _Stamped(self.metrics.watch(executor), self._open, clock)

    # ---- callers (any thread) ----------------------------------------------------------
    def now(self) -> float:
        return self.clock()

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._closed

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, listener: Listener | None = None,
                    seed: int | None = None, arrival_s: float | None = None,
                    watcher: Watcher | None = None) -> RequestHandle:
        """Take one request in; checked here (InvalidRequestError), nothing runs if bad.

        `seed`: the sampling seed when `params.seed` is None (default: the runtime seed, as
        the first prompt of `LLM.generate`); `arrival_s`: an engine-clock time to hold it
        back until (never before now).
        """
        params = SamplingParams() if params is None else params
        prompt = list(prompt_token_ids) if isinstance(prompt_token_ids, (list, tuple)) else prompt_token_ids
        problems = prompt_problems(prompt, params, self.cfg.model.vocab_size, self.cfg.seq_len)
        if problems:  # `exc.field` names the first one's field (the server's 400 says it)
            raise InvalidRequestError.of(problems)
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = default_seed(self.cfg.runtime.seed)
        with self._cond:
            if self.failure is not None:
                raise EngineClosed(f"the engine failed: {self.failure}")
            if self._closed:
                raise EngineClosed("the engine is closed")
            if request_id is not None and request_id in self._keys:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if self.max_waiting is not None and self._kv_waiting >= max(1, self.max_waiting):
                raise QueueFull(f"{self._kv_waiting} requests already wait for KV blocks "
                                f"(max_waiting {self.max_waiting})")
            rid = next(self._ids)
            now = self.clock()
            arrival = now if arrival_s is None else max(now, arrival_s)
            key = str(rid) if request_id is None else request_id
            o = _Open(key, Request(rid, prompt, params, seed, arrival_s=arrival),
                      RequestHandle(key, listener), watcher)
            self._open[rid], self._requests[rid], self._keys[key] = o, o.req, rid
            if watcher is not None:
                watcher.request_ids.add(rid)
            heapq.heappush(self._pending, (arrival, rid, o))
            self._start()
            self._cond.notify_all()
        return o.handle

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED,
              error: str | None = None) -> bool:
        """End a request (it frees its KV slot); False when it already ended."""
        with self._cond:
            rid = self._keys.get(request_id)
            if rid is None:
                return False
            self._aborts.setdefault(rid, (reason, error))
            self._cond.notify_all()
            return True

    def watch(self, callback: driver.OnMicroBatch) -> Watcher:
        """Call `callback(mb, out)` for every micro-batch until `unwatch`; requests added
        with this watcher end with `error` if it raises."""
        w = Watcher(callback)
        with self._cond:
            self._watchers.append(w)
        return w

    def unwatch(self, watcher: Watcher) -> None:
        with self._cond:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def num_waiting(self) -> int:
        """Requests taken in that hold no KV slot yet."""
        with self._cond:
            return sum(1 for o in self._open.values() if o.req.blocks is None)

    def num_queued(self) -> int:
        """Requests the planner could not admit when it last tried (what `max_waiting` counts)."""
        return self._kv_waiting

    def num_running(self) -> int:
        """Requests that hold a KV slot."""
        with self._cond:
            return sum(1 for o in self._open.values() if o.req.blocks is not None)

    def abandon(self, error: str) -> None:
        """End every open request with `error` now, from this thread, without waiting for
        the pipeline (an interrupt); the engine takes no more requests."""
        with self._cond:
            self._closed = True
            opened = list(self._open.values())
            for o in opened:  # the loop still ends them, and frees their slots
                self._aborts.setdefault(o.req.request_id, (FinishReason.ERROR, error))
            self._cond.notify_all()
        now = self.clock()
        for o in opened:
            r = o.req
            out = RequestOutput(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                                FinishReason.ERROR, r.arrival_s, r.first_token_s, now, error)
            o.handle.emit(Finished(o.key, out, _timing(o, out, 0.0)))

    def close(self, timeout: float | None = 30.0) -> None:
        """Abort every open request, stop the loop and wait for it (up to `timeout`)."""
        with self._cond:
            self._closed = True
            for rid in self._open:
                self._aborts.setdefault(rid, (FinishReason.ABORTED, None))
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pp-engine", daemon=True)
            self._thread.start()

    # ---- the intake, on the engine thread (driver.Intake) -------------------------------
    def pull(self, planner: driver.Planner, now: float) -> None:
        """Hand the planner what arrived by `now`, then apply the aborts that can be."""
        arrived = []
        with self._cond:
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
            o = self._open.get(rid)
            if o is not None and not self._abort_now(planner, o, reason, error, now):
                with self._cond:  # in the pipeline: again once its micro-batch is back
                    self._aborts.setdefault(rid, (reason, error))

    def _refuse_overflow(self, planner: driver.Planner, now: float) -> None:
        """Admit what the free KV blocks take now; of the arrived requests still waiting,
        end the newest never-run ones beyond `max_waiting` (QUEUE_FULL). Preempted ones
        (they have run) always wait."""
        planner.admit(now)
        queued = planner.queued(now)
        fresh = [r for r in queued if r.num_preemptions == 0 and not r.output_token_ids]
        over = min(len(fresh), len(queued) - self.max_waiting)
        for req in fresh[len(fresh) - over:] if over > 0 else ():
            self._abort_now(planner, self._open[req.request_id], FinishReason.ABORTED,
                            QUEUE_FULL, now)
        self._kv_waiting = len(queued) - max(0, over)

    def wait(self) -> bool:
        """Sleep until a request arrives or an abort is asked for; False once closed."""
        with self._cond:
            while True:
                if self._aborts:
                    return True
                if self._closed:
                    return False
                if self._pending:
                    delay = self._pending[0][0] - self.clock()
                    if delay <= 0:
                        return True
                    if self._sleep is not None:  # a virtual clock: jump to the arrival
                        self._sleep(delay)
                        return True
                    self._cond.wait(delay)
                else:
                    self._cond.wait()

    def _abort_now(self, planner: driver.Planner, o: _Open, reason: FinishReason,
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
        self._end(o)
        return True

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            try:
                driver.run(self._planner, self._executor, self.cfg.in_flight, self.clock,
                           self._on_microbatch, self._sleep or time.sleep, intake=self)
                return  # closed
            except driver.ExecutorFailed as exc:
                with self._cond:
                    self.failure = exc
                self._end_all(str(exc))
                return
            except Exception as exc:  # a bug above the executor: the pipeline is still good
                log.exception("engine loop error; its requests end with error")
                self._end_all(f"{type(exc).__name__}: {exc}", only_planned=True)
                self._planner = make_planner(self.cfg)  # abort_all kept the slots

    def _end_all(self, error: str, only_planned: bool = False) -> None:
        """End open requests with `error`: those the planner held (the driver already
        marked them), and unless `only_planned` those still waiting to arrive."""
        now = self.clock()
        with self._cond:
            opened = [o for o in self._open.values() if o.in_planner or not only_planned]
        for o in opened:
            if not o.req.finished:
                o.req.finish_reason, o.req.finish_s = FinishReason.ERROR, now
                o.dropped = True
            o.error = error
            self._end(o)

    def _on_microbatch(self, mb: MicroBatch, out: SampledTokens) -> None:
        """After the planner took a result: metrics, watchers, then each request's events
        (watchers first: a client whose last request ends has seen every micro-batch)."""
        self.metrics.on_microbatch(mb, out)
        with self._cond:
            watchers = list(self._watchers)
        for w in watchers:
            try:
                w.callback(mb, out)
            except Exception as exc:
                w.error = exc
                self.unwatch(w)
                with self._cond:
                    for rid in w.request_ids:
                        self._aborts.setdefault(rid, (FinishReason.ERROR, f"{type(exc).__name__}: {exc}"))
        for s in mb.seqs:
            o = self._open.get(s.request_id)
            if o is None:
                continue
            token = out.tokens.get(s.request_id) if s.sampling is not None else None
            if token is not None:
                self._emit(o, Token(o.key, token))
            if o.req.finished:
                self._end(o)

    def _end(self, o: _Open) -> None:
        rid = o.req.request_id
        with self._cond:
            self._open.pop(rid, None)
            self._requests.pop(rid, None)
            self._keys.pop(o.key, None)
            self._aborts.pop(rid, None)
            if o.watcher is not None:
                o.watcher.request_ids.discard(rid)
        self._planner.forget(rid)  # ended: nothing refers to it any more
        out = o.req.output(o.error)
        self._emit(o, Finished(o.key, out, _timing(o, out, self.metrics.take_bubble_s(rid)),
                               refused=o.error == QUEUE_FULL))

    def _emit(self, o: _Open, event: Event) -> None:
        try:
            o.handle.emit(event)
        except Exception:  # a listener that fails is a client gone: end its request
            log.exception("listener of request %s failed; aborting it", o.key)
            if isinstance(event, Token):
                with self._cond:
                    self._aborts.setdefault(o.req.request_id, (FinishReason.ABORTED, None))


def _timing(o: _Open, out: RequestOutput, bubble_s: float) -> RequestTiming:
    arrival, first, end = out.arrival_s, out.first_token_s, out.finish_s
    return RequestTiming(None if o.first_submit_s is None else o.first_submit_s - arrival,
                         None if first is None else first - arrival,
                         None if first is None or end is None else end - first, bubble_s)


class _Stamped:
    """The executor, noting when each request's first micro-batch was submitted; the rest
    of `driver.Executor` is the executor's own."""

    def __init__(self, executor: driver.Executor, opened: dict[int, _Open],
                 clock: Callable[[], float]):
        self.executor, self.opened, self.clock = executor, opened, clock
        self.name = executor.name

    @property
    def device(self):
        return self.executor.device

    def describe(self) -> str:
        return self.executor.describe()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def submit(self, mb: MicroBatch) -> object:
        now = self.clock()
        for s in mb.seqs:
            o = self.opened.get(s.request_id)
            if o is not None and o.first_submit_s is None:
                o.first_submit_s = now
        return self.executor.submit(mb)

    def wait(self, handle: object) -> SampledTokens:
        return self.executor.wait(handle)
