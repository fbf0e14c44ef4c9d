"""Live metrics of a run, exported through Ray's metrics agent (docs/monitoring.md).

A `RuntimeMetrics` is made per engine and fed by the driver loop's own hooks
(`driver.run`'s `on_submit` / `on_collect` count the micro-batches in flight, a lost one
included) and its `on_microbatch` callback. Per micro-batch it applies the bubble rule online
with the same `StageAccumulator` that `bubbles.account()` and the run recorder use, so the
live per-stage numbers, bubble by cause included, equal the report's. Per-request numbers (bubble, TTFT, time between
tokens) are recorded when the request finishes.

Values go to a `Sink`: `RaySink` (`ray.util.metrics`, imported only here and only when Ray
is already running) or `NullSink`, so the in-process executor and the simulator never need
Ray. Ray prefixes every name with `ray_` and counters also get `_total`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping, Protocol

from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.config import Config
from pp_runtime.core.request import Request
from pp_runtime.telemetry.bubbles import StageAccumulator, add_microbatch


FLUSH_S = 0.5  # the per-stage series reach the sink at least this often while running


class Metric(str, Enum):
    """Every series this runtime exports (Prometheus name: `ray_` + value, `_total` on counters)."""

    STAGE_BUSY = "pp_runtime_stage_busy_seconds"  # computing micro-batches
    STAGE_TRANSFER = "pp_runtime_stage_transfer_seconds"  # receiving activations already sent
    STAGE_BUBBLE = "pp_runtime_stage_bubble_seconds"  # a bubble, tag cause=upstream|downstream|dependency
    STAGE_IDLE = "pp_runtime_stage_idle_seconds"  # no arrived, unfinished request anywhere
    STAGE_DEPENDENCY_TOKEN = "pp_runtime_stage_dependency_token_seconds"  # of dependency: the hop
    STAGE_WALL = "pp_runtime_stage_wall_seconds"  # all of the above and busy: the denominator
    STAGE_BUBBLE_FRACTION = "pp_runtime_stage_bubble_fraction"  # by cause, / wall of this run
    REQUEST_BUBBLE = "pp_runtime_request_bubble_seconds"  # per finished request
    REQUEST_TTFT = "pp_runtime_request_ttft_seconds"  # arrival to first token
    REQUEST_TBT = "pp_runtime_request_tbt_seconds"  # every gap between two tokens of a request
    IN_FLIGHT = "pp_runtime_microbatches_in_flight"  # submitted, result not back yet
    QUEUE_DEPTH = "pp_runtime_queue_depth"  # arrived requests waiting for a KV slot
    MB_TOKENS = "pp_runtime_microbatch_tokens"  # per micro-batch; kind=prefill|decode
    PREEMPTIONS = "pp_runtime_preemptions"  # KV taken back from a request (counted as it ends)
    PREFIX_HIT_TOKENS = "pp_runtime_prefix_cache_hit_tokens"  # prompt tokens not computed
    RECOVERIES = "pp_runtime_recoveries"  # stage workers replaced after a failure; tag stage
    RECOMPUTED_TOKENS = "pp_runtime_recomputed_tokens"  # computed again after a recovery
    RECOVERING = "pp_runtime_recovering"  # 1 while the workers are being replaced


class Kind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Spec:
    kind: Kind
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()  # histogram bucket upper bounds


_STAGE = ("deployment", "stage")
_CAUSE = ("deployment", "stage", "cause")
_RUN = ("deployment",)
# latency buckets in seconds: 1 ms .. 5 min, about 2.5x apart
_LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
              25.0, 60.0, 120.0, 300.0)
_TBT_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
          2.5, 5.0, 10.0)
_TOKENS = tuple(float(2 ** i) for i in range(15))  # 1 .. 16384 tokens

SPECS: dict[Metric, Spec] = {
    Metric.STAGE_BUSY: Spec(Kind.COUNTER, "Seconds a pipeline stage spent computing", _STAGE),
    Metric.STAGE_TRANSFER: Spec(Kind.COUNTER, "Seconds a stage spent receiving activations "
                                "once the previous stage had sent them", _STAGE),
    Metric.STAGE_BUBBLE: Spec(Kind.COUNTER, "Pipeline bubble seconds of a stage by cause: "
                              "upstream (input not sent yet), downstream (send not taken yet), "
                              "dependency (holding nothing while requests are unfinished)", _CAUSE),
    Metric.STAGE_IDLE: Spec(Kind.COUNTER, "Seconds a stage held nothing and no arrived request "
                            "was unfinished (not a bubble)", _STAGE),
    Metric.STAGE_DEPENDENCY_TOKEN: Spec(Kind.COUNTER, "Of a stage's dependency bubble, seconds "
                                        "it held a call while its decodes' input tokens came "
                                        "from the last stage on the token hop", _STAGE),
    Metric.STAGE_WALL: Spec(Kind.COUNTER, "Wall seconds of a stage (busy + transfer + bubble + "
                            "idle): the denominator of bubble shares", _STAGE),
    Metric.STAGE_BUBBLE_FRACTION: Spec(Kind.GAUGE, "Bubble seconds of a cause / wall seconds of a "
                                       "stage since its first micro-batch of the current run", _CAUSE),
    Metric.REQUEST_BUBBLE: Spec(Kind.HISTOGRAM, "Pipeline bubble seconds per finished request "
                                "(upstream and downstream bubbles of every micro-batch that carried it)", _RUN,
                                _LATENCY_S),
    Metric.REQUEST_TTFT: Spec(Kind.HISTOGRAM, "Seconds from arrival to first token, per "
                              "finished request", _RUN, _LATENCY_S),
    Metric.REQUEST_TBT: Spec(Kind.HISTOGRAM, "Seconds between consecutive tokens of a request "
                             "(every gap, recorded when the request finishes)", _RUN, _TBT_S),
    Metric.IN_FLIGHT: Spec(Kind.GAUGE, "Micro-batches submitted to the pipeline whose result "
                           "is not back yet", _RUN),
    Metric.QUEUE_DEPTH: Spec(Kind.GAUGE, "Requests that arrived and wait for a KV slot", _RUN),
    Metric.MB_TOKENS: Spec(Kind.HISTOGRAM, "Tokens per micro-batch: prefill tokens "
                           "(kind=prefill) and decodes (kind=decode)", _RUN + ("kind",), _TOKENS),
    Metric.PREEMPTIONS: Spec(Kind.COUNTER, "Times a request's KV blocks were taken back to "
                             "make room (it computes them again), counted when it ends", _RUN),
    Metric.PREFIX_HIT_TOKENS: Spec(Kind.COUNTER, "Prompt tokens whose KV was found in the "
                                   "prefix cache (not computed), counted when the request ends", _RUN),
    Metric.RECOVERIES: Spec(Kind.COUNTER, "Recoveries in place: the stage workers replaced "
                            "after a worker of this stage died or hung (stage=unknown when "
                            "the failure named none)", _STAGE),
    Metric.RECOMPUTED_TOKENS: Spec(Kind.COUNTER, "Tokens whose KV a recovery lost, computed "
                                   "again (prompt and generated tokens of running requests)", _RUN),
    Metric.RECOVERING: Spec(Kind.GAUGE, "1 while the stage workers are being replaced after "
                            "a failure, else 0", _RUN),
}


class Sink(Protocol):
    """Where values go: one call per value, tags as strings."""

    def record(self, metric: Metric, value: float, tags: Mapping[str, str]) -> None: ...


class NullSink:
    """Drops everything (no Ray running): the accounting still works, nothing is exported."""

    def record(self, metric: Metric, value: float, tags: Mapping[str, str]) -> None:
        pass


class RaySink:
    """A `ray.util.metrics` object for every `Metric`, made with the sink (one per run).

    Ray keeps one instrument per name and node, shared by every object of that name; the
    first registration's histogram boundaries win, so keep SPECS stable within a cluster.
    """

    def __init__(self):
        from ray.util import metrics as rm

        self._record: dict[Metric, Callable] = {}
        for metric, spec in SPECS.items():
            if spec.kind is Kind.COUNTER:
                self._record[metric] = rm.Counter(metric.value, spec.description, spec.tag_keys).inc
            elif spec.kind is Kind.GAUGE:
                self._record[metric] = rm.Gauge(metric.value, spec.description, spec.tag_keys).set
            else:
                self._record[metric] = rm.Histogram(metric.value, spec.description,
                                                    list(spec.boundaries), spec.tag_keys).observe

    def record(self, metric: Metric, value: float, tags: Mapping[str, str]) -> None:
        if value <= 0 and SPECS[metric].kind is Kind.COUNTER:
            return  # Ray counters take only positive increments
        self._record[metric](value, dict(tags))


def default_sink() -> Sink:
    """`RaySink` when this process is connected to Ray, else `NullSink` (Ray not imported)."""
    ray = sys.modules.get("ray")  # never imported: certainly not running
    if ray is not None and ray.is_initialized():
        return RaySink()
    return NullSink()


def deployment_tag(cfg: Config) -> str:
    """`deployment` tag value: model name and parallel shape, e.g. `tiny-gpt-tp1xpp2`."""
    return f"{cfg.model.name}-tp{cfg.parallel.tp}xpp{cfg.parallel.pp}"


class RuntimeMetrics:
    """One run's live metrics. Feed it the driver's hooks: `on_submit`, `on_collect` and
    `on_microbatch` (or `chain()` around another callback).

    `requests`: the run's requests by id (for TTFT and finishing); `queue_depth`: how many
    arrived requests wait for admission right now; `clock`: the driver's clock;
    `keep_ended`: keep each finished request's bubble until `take_bubble_s` asks for it
    (the online engine's per-request timing).
    """

    def __init__(self, deployment: str, requests: Mapping[int, Request],
                 clock: Callable[[], float], queue_depth: Callable[[], int] = lambda: 0,
                 sink: Sink | None = None, keep_ended: bool = False):
        self.tags = {"deployment": deployment}
        self.sink = sink if sink is not None else default_sink()
        self.requests, self.clock, self.queue_depth = requests, clock, queue_depth
        self.stages: dict[int, StageAccumulator] = {}
        self.in_flight = 0
        self._bubble_s: dict[int, float] = {}  # request id -> bubble so far (unfinished)
        self._last_token_s: dict[int, float] = {}
        self._gaps_s: dict[int, list[float]] = {}
        self._ended_bubble_s: dict[int, float] | None = {} if keep_ended else None
        self._pending: dict[tuple, float] = {}  # (metric, tags) -> counter sum since the flush
        self._gauges: dict[tuple, float] = {}  # (metric, tags) -> last value since the flush
        self._observed: list[tuple[int, int]] = []  # (prefill, decode) tokens per micro-batch
        self._flushed_s = time.monotonic()

    @classmethod
    def for_config(cls, cfg: Config, requests: Mapping[int, Request],
                   clock: Callable[[], float], queue_depth: Callable[[], int] = lambda: 0,
                   sink: Sink | None = None, keep_ended: bool = False) -> "RuntimeMetrics":
        return cls(deployment_tag(cfg), requests, clock, queue_depth, sink, keep_ended)

    # ---- hooks into the driver loop ------------------------------------------------------
    def on_submit(self, mb: MicroBatch) -> None:
        """`driver.run`'s on_submit: one more micro-batch in flight."""
        self.set_in_flight(self.in_flight + 1)

    def on_collect(self, mb: MicroBatch, out: SampledTokens | None) -> None:
        """`driver.run`'s on_collect: one fewer in flight, its result back or lost (None)."""
        self.set_in_flight(self.in_flight - 1)

    def chain(self, on_microbatch: Callable[[MicroBatch, SampledTokens], None] | None = None):
        """An `on_microbatch` callback that records, then calls `on_microbatch`."""
        def callback(mb: MicroBatch, out: SampledTokens) -> None:
            self.on_microbatch(mb, out)
            if on_microbatch:
                on_microbatch(mb, out)
        return callback

    def set_in_flight(self, n: int) -> None:
        self.in_flight = n
        self._record(Metric.IN_FLIGHT, n)
        self._record(Metric.QUEUE_DEPTH, self.queue_depth())
        if n == 0:  # the pipeline drained: nothing summed waits for the next micro-batch
            self.flush()

    # ---- a recovery (engine/recovery.py) -------------------------------------------------
    def set_recovering(self, on: bool) -> None:
        """While the workers are replaced (the driver collected the micro-batches lost as
        None: nothing is in flight)."""
        self._record(Metric.RECOVERING, 1.0 if on else 0.0)

    def on_recovery(self, stage: int | None, tokens: int) -> None:
        self._record(Metric.RECOVERIES, 1.0, {"stage": "unknown" if stage is None else str(stage)})
        self._record(Metric.RECOMPUTED_TOKENS, float(tokens))

    # ---- one micro-batch ---------------------------------------------------------------
    def on_microbatch(self, mb: MicroBatch, out: SampledTokens) -> None:
        """Account the stages (bubble rule), the tokens, and every request it finished. The
        per-stage series are summed here and reach the sink every `FLUSH_S` and whenever
        the pipeline drains (`flush`): ten records per stage per micro-batch on the engine
        thread between a result and the next decision became a dictionary update."""
        mb_bubble, pend = 0.0, self._pending
        for t, acc, split in add_microbatch(self.stages, out.timings, mb.idle_before_s):
            mb_bubble += split.charged
            stage = str(t.stage)
            for metric, value in ((Metric.STAGE_BUSY, split.busy), (Metric.STAGE_TRANSFER, split.transfer),
                                  (Metric.STAGE_IDLE, split.idle), (Metric.STAGE_WALL, split.wall),
                                  (Metric.STAGE_DEPENDENCY_TOKEN, split.token)):
                key = (metric, (("stage", stage),))
                pend[key] = pend.get(key, 0.0) + value
            wall = acc.wall_s
            for cause, total in acc.stats().bubble_by_cause_s.items():
                key = (Metric.STAGE_BUBBLE, (("stage", stage), ("cause", cause)))
                pend[key] = pend.get(key, 0.0) + getattr(split, cause)
                self._gauges[(Metric.STAGE_BUBBLE_FRACTION, key[1])] = total / wall if wall > 0 else 0.0
        self._observed.append((mb.num_prefill_tokens, mb.num_decodes))
        if not self.in_flight or time.monotonic() - self._flushed_s >= FLUSH_S:
            self.flush()  # the pipeline is empty after this result, or the interval is up

        now = self.clock()
        rids = [s.request_id for s in mb.seqs]  # a request has at most one sequence in it
        for rid in rids:
            self._bubble_s[rid] = self._bubble_s.get(rid, 0.0) + mb_bubble
        for rid in out.tokens:
            if rid in self._last_token_s:
                self._gaps_s.setdefault(rid, []).append(now - self._last_token_s[rid])
            self._last_token_s[rid] = now
        for rid in rids:
            req = self.requests.get(rid)
            if req is not None and req.finished:
                self._finish(req)

    def take_bubble_s(self, request_id: int) -> float:
        """The bubble of a request that ended, and forget it: as recorded when it finished
        (kept with `keep_ended`), or so far for one that ended unrecorded (aborted)."""
        if self._ended_bubble_s is not None and request_id in self._ended_bubble_s:
            return self._ended_bubble_s.pop(request_id)
        self._last_token_s.pop(request_id, None)
        self._gaps_s.pop(request_id, None)
        return self._bubble_s.pop(request_id, 0.0)

    def _finish(self, req: Request) -> None:
        rid = req.request_id
        bubble = self._bubble_s.pop(rid, 0.0)
        if self._ended_bubble_s is not None:
            self._ended_bubble_s[rid] = bubble
        self._record(Metric.REQUEST_BUBBLE, bubble)
        if req.first_token_s is not None:
            self._record(Metric.REQUEST_TTFT, req.first_token_s - req.arrival_s)
        for gap in self._gaps_s.pop(rid, ()):
            self._record(Metric.REQUEST_TBT, gap)
        self._last_token_s.pop(rid, None)
        if req.num_preemptions:
            self._record(Metric.PREEMPTIONS, req.num_preemptions)
        if req.num_cached:
            self._record(Metric.PREFIX_HIT_TOKENS, req.num_cached)

    # ---- to the sink -------------------------------------------------------------------
    def flush(self) -> None:
        """Send what `on_microbatch` summed: each counter's total, each gauge's last value,
        every micro-batch's token counts."""
        pend, gauges, observed = self._pending, self._gauges, self._observed
        self._pending, self._gauges, self._observed = {}, {}, []
        self._flushed_s = time.monotonic()
        for (metric, tags), value in pend.items():
            self._record(metric, value, dict(tags))
        for (metric, tags), value in gauges.items():
            self._record(metric, value, dict(tags))
        for prefill, decodes in observed:
            self._record(Metric.MB_TOKENS, prefill, {"kind": "prefill"})
            self._record(Metric.MB_TOKENS, decodes, {"kind": "decode"})

    def _record(self, metric: Metric, value: float, tags: Mapping[str, str] | None = None) -> None:
        """Add to a counter, set a gauge or observe a histogram: the sink knows which."""
        self.sink.record(metric, value, {**self.tags, **tags} if tags else self.tags)
