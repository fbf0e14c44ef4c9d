"""Bubble accounting by cause: one rule for real and simulated runs (docs/bubbles.md).

Input: `StageTiming` records (one per micro-batch per stage, TP rank 0), which requests each
micro-batch carried, and how long the system was idle before each micro-batch (the driver's
`MicroBatch.idle_before_s`). Every stage's wall time is cut into parts that add up exactly:

  busy        computing a micro-batch
  transfer    receiving its activations once they were on their way
  upstream    holding a micro-batch whose input the previous stage has not sent   } bubble,
  downstream  computed, blocked until the next stage takes the send (back-pressure) } by
  dependency  holding nothing while arrived requests are unfinished (all in flight) } cause
              (of it `token`: stage 0 holding the call while its decodes' input tokens
              travel the token hop from the last stage; the rest is the driver and the call's
              trip: `StageTiming.token_wait_s`)
  idle        holding nothing, no arrived unfinished request anywhere (not a bubble)

One call of micro-batch k on a stage runs, on that stage's clock:

  ... prev compute end | prev send_wait | holding nothing | token | wait | transfer | compute k | send_wait ...
                         downstream       dependency/idle   dep.    upstream

The holding-nothing part is idle up to the driver's idle time before k (a duration: the
pipeline was empty then, so it lies inside every stage's gap) and dependency beyond it. Only
differences of one stage's own clock are used, so stages on different nodes need no common
clock. A micro-batch is charged the upstream wait before it and the downstream block after
it, on every stage; a request the sum over the micro-batches that carried it (paper §5.3).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

from pp_runtime.core.batch import StageTiming

CAUSES = ("upstream", "downstream", "dependency")  # the bubble causes, in report order
# clock rounding tolerated between a stage's consecutive calls (CUDA event times are
# float32 milliseconds placed on the host clock: about 1 us); a larger overlap is an error
EPS = 1e-5


class Split(NamedTuple):
    """How one stage spent one call of a micro-batch (seconds)."""

    transfer: float  # before the compute
    upstream: float  # before the compute
    dependency: float  # before the compute (holding nothing, requests unfinished; token included)
    idle: float  # before the compute (holding nothing, nothing to do)
    downstream: float  # after the compute
    busy: float
    token: float = 0.0  # of `dependency`: holding the call, waiting for the token hop

    @property
    def wall(self) -> float:
        """The wall time the call added to its stage (`token` is within `dependency`)."""
        return (self.transfer + self.upstream + self.dependency + self.idle + self.downstream
                + self.busy)

    @property
    def charged(self) -> float:
        """The bubble charged to the micro-batch itself: it existed and was held up."""
        return self.upstream + self.downstream


@dataclass(frozen=True)
class StageStats:
    stage: int
    wall_s: float  # from the stage's start to the end of its last call
    busy_s: float
    transfer_s: float
    upstream_s: float
    downstream_s: float
    dependency_s: float
    idle_s: float
    num_microbatches: int
    token_s: float = 0.0  # of dependency_s: holding the call, waiting for the token hop

    @property
    def bubble_by_cause_s(self) -> dict[str, float]:
        return {"upstream": self.upstream_s, "downstream": self.downstream_s,
                "dependency": self.dependency_s}

    @property
    def bubble_s(self) -> float:
        return self.upstream_s + self.downstream_s + self.dependency_s


@dataclass(frozen=True)
class BubbleReport:
    per_stage: list[StageStats]
    mb_bubble_s: dict[int, float]  # micro-batch id -> bubble charged to it, all stages
    request_bubble_s: dict[int, float] = field(default_factory=dict)  # request id -> bubble

    @property
    def bubble_fraction(self) -> float:
        """Bubble time / wall time, summed over stages."""
        return sum(self.bubble_fraction_by_cause.values())

    @property
    def bubble_fraction_by_cause(self) -> dict[str, float]:
        return fractions_by_cause(self.per_stage)


def fractions_by_cause(per_stage: Sequence[StageStats]) -> dict[str, float]:
    """Each cause's time / wall time, summed over stages."""
    wall = sum(s.wall_s for s in per_stage)
    return {c: (sum(s.bubble_by_cause_s[c] for s in per_stage) / wall if wall > 0 else 0.0)
            for c in CAUSES}


class StageAccumulator:
    """The rule for one stage, applied one `StageTiming` at a time (in compute order).

    `account()` runs it over a finished run; the run recorder and the live Ray metrics run
    it as each micro-batch comes back, so all three give the same numbers.
    """

    __slots__ = ("stage", "start_s", "prev_end_s", "busy_s", "transfer_s", "upstream_s",
                 "downstream_s", "dependency_s", "idle_s", "num_microbatches", "token_s")

    def __init__(self, stage: int, start_s: float | None = None):
        self.stage = stage
        self.start_s = start_s  # the stage's start on its own clock; None: its first call
        self.prev_end_s = start_s  # end of the previous call (its compute end + send wait)
        self.busy_s = self.transfer_s = self.upstream_s = self.downstream_s = 0.0
        self.dependency_s = self.idle_s = self.token_s = 0.0
        self.num_microbatches = 0

    def add(self, t: StageTiming, idle_before_s: float = 0.0) -> Split:
        """Account one micro-batch's call; `idle_before_s` is the driver's idle time just
        before the micro-batch was submitted."""
        transfer, upstream, dependency, idle, token = self.take(t, idle_before_s)
        return Split(transfer, upstream, dependency, idle, t.send_wait_s,
                     t.compute_end_s - t.compute_start_s, token)

    def take(self, t: StageTiming, idle_before_s: float = 0.0) -> tuple[float, ...]:
        """`add` without building its Split (the plan's probes call it 10^6 times): the
        call's (transfer, upstream, dependency, idle, token) before its compute."""
        if self.start_s is None:  # the stage started when it took its first call
            self.start_s = self.prev_end_s = t.compute_start_s - t.wait_s - t.transfer_s
        start, end, send_wait = t.compute_start_s, t.compute_end_s, t.send_wait_s
        gap = start - self.prev_end_s
        if gap < -EPS:
            raise ValueError(f"stage {self.stage}: micro-batch {t.mb_id} starts at {start} "
                             f"before the previous call ended at {self.prev_end_s}")
        gap = max(gap, 0.0)
        transfer = t.transfer_s if t.transfer_s < gap else gap
        upstream = min(t.wait_s, gap - transfer)
        empty = gap - transfer - upstream  # holding no micro-batch, or its tokens (token hop)
        token = t.token_wait_s if t.token_wait_s < empty else empty  # last, before the wait
        idle = idle_before_s if idle_before_s < empty - token else empty - token
        self.transfer_s += transfer
        self.upstream_s += upstream
        self.dependency_s += empty - idle
        self.token_s += token
        self.idle_s += idle
        self.busy_s += end - start
        self.downstream_s += send_wait
        self.num_microbatches += 1
        self.prev_end_s = end + send_wait
        return transfer, upstream, empty - idle, idle, token

    @property
    def wall_s(self) -> float:
        """From the stage's start to the end of its last call (0 before the first record)."""
        return 0.0 if self.start_s is None else self.prev_end_s - self.start_s

    @property
    def bubble_s(self) -> float:
        return self.upstream_s + self.downstream_s + self.dependency_s

    def stats(self) -> StageStats:
        return StageStats(self.stage, self.wall_s, self.busy_s, self.transfer_s, self.upstream_s,
                          self.downstream_s, self.dependency_s, self.idle_s, self.num_microbatches,
                          self.token_s)


def add_microbatch(stages: dict[int, StageAccumulator], timings: Iterable[StageTiming],
                   idle_before_s: float = 0.0) -> Iterator[tuple[StageTiming, StageAccumulator, Split]]:
    """One micro-batch's records into their stages' accumulators (TP rank 0 only: the ranks
    of a stage run in lock step; a stage's accumulator is made at its first record), in
    order; yields (timing, accumulator, split) for each. The split's parts add up to the
    wall time the call added to its stage (`Split.wall`)."""
    for t in timings:
        if t.tp_rank != 0:
            continue
        acc = stages.get(t.stage)
        if acc is None:
            acc = stages[t.stage] = StageAccumulator(t.stage)
        yield t, acc, acc.add(t, idle_before_s)


def account(timings: Iterable[StageTiming],
            mb_requests: Mapping[int, Sequence[int]] | None = None,
            stage_start_s: Mapping[int, float] | None = None,
            idle_before_s: Mapping[int, float] | None = None) -> BubbleReport:
    """Split every stage's time by the rule (`StageAccumulator`), over a finished run.

    `stage_start_s`: when each stage began the run, on its own clock (default: when it took
    its first call). `idle_before_s`: micro-batch id -> the driver's idle time before it.
    Only TP rank 0 is counted: the ranks of a stage run in lock step.
    """
    by_stage: dict[int, list[StageTiming]] = defaultdict(list)
    for t in timings:
        if t.tp_rank == 0:
            by_stage[t.stage].append(t)
    idle = idle_before_s or {}
    per_stage, mb_bubble = [], defaultdict(float)
    for stage in sorted(by_stage):
        acc = StageAccumulator(stage, (stage_start_s or {}).get(stage))
        for t in sorted(by_stage[stage], key=lambda t: t.compute_start_s):
            mb_bubble[t.mb_id] += acc.add(t, idle.get(t.mb_id, 0.0)).charged
        per_stage.append(acc.stats())
    request_bubble: dict[int, float] = defaultdict(float)
    for mb_id, rids in (mb_requests or {}).items():
        for rid in rids:
            request_bubble[rid] += mb_bubble.get(mb_id, 0.0)
    return BubbleReport(per_stage, dict(mb_bubble), dict(request_bubble))
