"""The online engine: one driver loop on a background thread, fed while it runs. No torch.

Callers on any thread `add_request` (checked first: InvalidRequestError before anything
runs) and `abort` by id. The loop is `driver.run` with the engine's `Intake`
(`engine/intake.py`): before every decision it pulls the requests that arrived and the
aborts asked for, so the one planner, and with it every KV slot, is touched by the
engine thread alone. A request's arrival time is the engine clock when it was taken in.

Each request streams to its `RequestHandle`: a `Token` as the last stage samples it, then
one `Finished` with the RequestOutput and its `RequestTiming` (queue, TTFT, generation
and the bubble of the micro-batches that carried it, from the same `StageAccumulator`
rule as the reports). An abort ends a request that waits at once and one in the
pipeline when its micro-batch is back (only then is its KV slot free to reuse). With no
work the thread sleeps on a condition. An executor failure ends every open request with
`error`; the engine is then unhealthy and takes no more requests.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from pp_runtime.core import driver
from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.config import Config
from pp_runtime.planner import make_planner
from pp_runtime.core.request import (FinishReason, InvalidRequestError, RequestOutput,
                                SamplingParams, default_seed, prompt_problems)
from pp_runtime.engine.intake import QUEUE_FULL, EngineClosed, Intake, Open, QueueFull
from pp_runtime.engine.recovery import Budget, Recovery, first_line, named_rank
from pp_runtime.engine.streams import (Event, Finished, Listener, RequestHandle, RequestTiming, Token,
                                Watcher)
from pp_runtime.telemetry.metrics import NullSink, RuntimeMetrics, Sink

__all__ = ["Engine", "EngineClosed", "QueueFull", "Event", "Finished", "Listener",
           "RequestHandle", "RequestTiming", "Token", "Watcher"]

log = logging.getLogger(__name__)


class Engine:
    """`cfg`'s planner and driver loop over `executor` (local, ray, or sim with its clock).

    `sink`: where the live metrics go (Ray's, Prometheus', or nowhere); `max_waiting`:
    requests allowed to wait for KV blocks (0: none waits), counted after admission, so a
    burst the free blocks can take is never refused: `add_request` raises QueueFull while
    that many wait, and one taken in beyond them that cannot be admitted at once ends
    aborted with error `QUEUE_FULL` (`engine/intake.py`);
    `thread_init`: run first on the engine thread (torch's per-thread settings);
    `clock`/`sleep`: the driver's (a `VirtualClock` and its `sleep` for the simulator).
    """

    def __init__(self, cfg: Config, executor: driver.Executor, *, sink: Sink | None = None,
                 max_waiting: int | None = None, thread_init: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] | None = None):
        self.cfg, self.clock, self.max_waiting = cfg, clock, max_waiting
        self._sleep, self._thread_init = sleep, thread_init
        # the token hop (runtime.token_hop, resolved by the executor): the planner plans
        # decodes ahead, and one more micro-batch is in flight, already at stage 0 when the
        # token it waits for arrives (docs/distributed.md, "Tokens skip the driver")
        self._hop = bool(getattr(executor, "token_hop", False))
        self._planner = self._new_planner()
        self.depth = cfg.in_flight + (1 if self._planner.ahead else 0)
        self._intake = Intake(max_waiting, self._end, clock, sleep)
        self._watchers: list[Watcher] = []
        self._watch_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.metrics = RuntimeMetrics.for_config(cfg, self._intake.requests, clock,
                                                 lambda: self._planner.num_waiting(),
                                                 sink if sink is not None else NullSink(),
                                                 keep_ended=True)
        self._executor = executor
        rt = cfg.runtime  # recovery in place (engine/recovery.py): executors that can
        self._recoverable = rt.recovery_attempts > 0 and callable(getattr(executor, "recover", None))
        self._budget = Budget(rt.recovery_attempts, rt.recovery_window_s)
        self.recoveries: list[Recovery] = []  # each one, in order (the report lists them)
        self.recovering = False  # the workers are being replaced (/health says so)

    # ---- callers (any thread) ----------------------------------------------------------
    def now(self) -> float:
        return self.clock()

    @property
    def failure(self) -> BaseException | None:
        """The executor's error, once it failed."""
        return self._intake.failure

    @property
    def healthy(self) -> bool:
        return self._intake.failure is None and not self._intake.closed

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, listener: Listener | None = None,
                    seed: int | None = None, arrival_s: float | None = None,
                    watcher: Watcher | None = None, generated: Sequence[int] = ()) -> RequestHandle:
        """Take one request in; checked here (InvalidRequestError), nothing runs if bad.

        `seed`: the sampling seed when `params.seed` is None (default: the runtime seed, as
        the first prompt of `LLM.generate`); `arrival_s`: an engine-clock time to hold it
        back until (never before now); `generated`: tokens this request already produced
        (a journal replayed after a restart): they are computed with the prompt, not
        streamed again, and generation goes on after them (fewer than `max_tokens`).
        """
        params = SamplingParams() if params is None else params
        prompt = list(prompt_token_ids) if isinstance(prompt_token_ids, (list, tuple)) else prompt_token_ids
        problems = prompt_problems(prompt, params, self.cfg.model.vocab_size, self.cfg.seq_len)
        if problems:  # `exc.field` names the first one's field (the server's 400 says it)
            raise InvalidRequestError.of(problems)
        if len(generated) >= params.max_tokens:
            raise InvalidRequestError(f"{len(generated)} tokens already generated: nothing is "
                                      f"left of max_tokens {params.max_tokens}", "generated")
        if params.seed is not None:  # the one place the request's own seed wins
            seed = params.seed
        elif seed is None:
            seed = default_seed(self.cfg.runtime.seed)
        o = self._intake.take(prompt, params, seed, request_id, listener, watcher, arrival_s,
                              self._start, generated)
        return o.handle

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED,
              error: str | None = None) -> bool:
        """End a request (it frees its KV slot); False when it already ended."""
        return self._intake.ask_abort(request_id, reason, error)

    def watch(self, callback: driver.OnMicroBatch) -> Watcher:
        """Call `callback(mb, out)` for every micro-batch until `unwatch`; requests added
        with this watcher end with `error` if it raises."""
        w = Watcher(callback)
        with self._watch_lock:
            self._watchers.append(w)
        return w

    def unwatch(self, watcher: Watcher) -> None:
        with self._watch_lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def num_waiting(self) -> int:
        """Requests taken in that hold no KV slot yet."""
        return self._intake.count(holding_blocks=False)

    def num_queued(self) -> int:
        """Requests the planner could not admit when it last tried (what `max_waiting` counts)."""
        return self._intake.kv_waiting

    def num_running(self) -> int:
        """Requests that hold a KV slot."""
        return self._intake.count(holding_blocks=True)

    def report_failure(self, exc: BaseException) -> bool:
        """A stage worker found dead from outside the loop (the server's liveness probe):
        the loop recovers as from a failed micro-batch. False when this engine does not
        recover (the caller reports the failure itself)."""
        if not self._recoverable:
            return False
        self._intake.inject_failure(exc, self._start)
        return True

    def abandon(self, error: str) -> None:
        """End every open request with `error` now, from this thread, without waiting for
        the pipeline (an interrupt); the engine takes no more requests."""
        opened = self._intake.close(FinishReason.ERROR, error)  # the loop still ends them
        now = self.clock()  # and frees their slots
        for o in opened:
            r = o.req
            out = RequestOutput(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                                FinishReason.ERROR, r.arrival_s, r.first_token_s, now, error)
            o.handle.emit(Finished(o.key, out, _timing(o, out, 0.0)))

    def close(self, timeout: float | None = 30.0) -> None:
        """Abort every open request, stop the loop and wait for it (up to `timeout`)."""
        with self._intake.cond:
            self._intake.close(FinishReason.ABORTED, None)
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _start(self) -> None:  # under the intake's lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pp-engine", daemon=True)
            self._thread.start()

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            try:
                driver.run(self._planner, self._executor, self.depth, self.clock,
                           self._on_microbatch, self._sleep or time.sleep, intake=self._intake,
                           keep_on_failure=self._recoverable, on_submit=self._on_submit,
                           on_collect=self.metrics.on_collect)
                return  # closed
            except driver.ExecutorFailed as exc:
                failure = self._recover(exc) if self._recoverable else exc
                if failure is None:
                    continue  # recovered: the same loop on the replaced workers
                self._planner.abort_all(FinishReason.ERROR, self.clock())
                self._intake.fail(failure)
                self._end_all(str(failure))
                return
            except Exception as exc:  # a bug above the executor: the pipeline is still good
                log.exception("engine loop error; its requests end with error")
                self._end_all(f"{type(exc).__name__}: {exc}", only_planned=True)
                self._planner = self._new_planner(self._planner)  # abort_all kept the slots

    def _recover(self, exc: driver.ExecutorFailed) -> driver.ExecutorFailed | None:
        """Replace the workers (`executor.recover()`) and hand every unfinished request to
        a fresh planner, which computes each again (`Planner.adopt`): None once the
        pipeline runs again; the failure to end every request with once the budget is
        spent (or the engine closed meanwhile)."""
        t0, (stage, rank) = self.clock(), named_rank(exc)
        log.warning("stage worker failure: %s; recovering", first_line(exc))
        requests = self._planner.unfinished()
        tokens = sum(r.num_computed for r in requests)
        self._planner = self._new_planner(self._planner)
        self._planner.adopt(requests)
        self.recovering, attempts, cause = True, 0, exc
        self.metrics.set_recovering(True)
        try:
            while True:
                if self._intake.closed:
                    return exc
                if not self._budget.take(self.clock()):
                    rt = self.cfg.runtime
                    return driver.ExecutorFailed(
                        f"{first_line(cause)}; not recovered: {rt.recovery_attempts} recovery "
                        f"attempts in {rt.recovery_window_s:g} s spent (runtime.recovery_attempts)")
                attempts += 1
                try:
                    self._executor.recover()
                    break
                except Exception as again:  # a replacement that failed to start: try again
                    log.warning("recovery attempt %d failed: %s", attempts, first_line(again))
                    cause = again
        finally:
            self.recovering = False
            self.metrics.set_recovering(False)
        r = Recovery(t0, stage, rank, first_line(exc), self.clock() - t0, attempts,
                     len(requests), tokens)
        self.recoveries.append(r)
        self.metrics.on_recovery(r.stage, r.tokens)
        phases = getattr(self._executor, "start_phases", None)  # Ray's, of the replacement
        log.warning("recovered in %.1f s (%d attempt(s)%s); %d requests compute %d tokens again",
                    r.seconds, attempts, "".join(f", {k} {v:.1f} s" for k, v in (phases or {}).items()),
                    r.requests, r.tokens)
        return None

    def _new_planner(self, before=None):
        """A planner for this engine's executor (planning ahead with the token hop); after
        `before` it numbers micro-batches on from it (the workers may be the same)."""
        planner = make_planner(self.cfg)
        planner.plan_ahead(self._hop)
        if before is not None:
            planner.continue_from(before)
        return planner

    def _end_all(self, error: str, only_planned: bool = False) -> None:
        """End open requests with `error`: those the planner held (the driver already
        marked them), and unless `only_planned` those still waiting to arrive."""
        now = self.clock()
        for o in self._intake.opened(only_planned):
            if not o.req.finished:
                o.req.finish_reason, o.req.finish_s = FinishReason.ERROR, now
                o.dropped = True
            o.error = error
            self._end(o)

    def _on_submit(self, mb: MicroBatch) -> None:
        """Just before the executor takes `mb`: each request's first submit is stamped (its
        queue time ends), and the metrics count one more micro-batch in flight."""
        now, opened = self.clock(), self._intake.open
        for s in mb.seqs:
            o = opened.get(s.request_id)
            if o is not None and o.first_submit_s is None:
                o.first_submit_s = now
        self.metrics.on_submit(mb)

    def _on_microbatch(self, mb: MicroBatch, out: SampledTokens) -> None:
        """After the planner took a result: metrics, watchers, then each request's events
        (watchers first: a client whose last request ends has seen every micro-batch)."""
        self.metrics.on_microbatch(mb, out)
        with self._watch_lock:
            watchers = list(self._watchers)
        for w in watchers:
            try:
                w.callback(mb, out)
            except Exception as exc:
                w.error = exc
                self.unwatch(w)
                self._intake.abort_watched(w, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        for s in mb.seqs:
            o = self._intake.open.get(s.request_id)
            if o is None:
                continue
            token = out.tokens.get(s.request_id) if s.sampling is not None else None
            if token is not None:
                self._emit(o, Token(o.key, token))
            if o.req.finished:
                self._end(o)

    def _end(self, o: Open) -> None:
        rid = o.req.request_id
        self._intake.release(o)
        self._planner.forget(rid)  # ended: nothing refers to it any more
        out = o.req.output(o.error)
        self._emit(o, Finished(o.key, out, _timing(o, out, self.metrics.take_bubble_s(rid)),
                               refused=o.error == QUEUE_FULL))

    def _emit(self, o: Open, event: Event) -> None:
        try:
            o.handle.emit(event)
        except Exception:  # a listener that fails is a client gone: end its request
            log.exception("listener of request %s failed; aborting it", o.key)
            if isinstance(event, Token):
                self._intake.abort_later(o.req.request_id, FinishReason.ABORTED, None)


def _timing(o: Open, out: RequestOutput, bubble_s: float) -> RequestTiming:
    arrival, first, end = out.arrival_s, out.first_token_s, out.finish_s
    return RequestTiming(None if o.first_submit_s is None else o.first_submit_s - arrival,
                         None if first is None else first - arrival,
                         None if first is None or end is None else end - first, bubble_s)
