"""Bubble accounting: one rule for real and simulated runs (see docs/bubbles.md).

Input: `StageTiming` records (one per micro-batch per stage, TP rank 0) and which requests
each micro-batch carried. Every stage's timeline is cut into four kinds of time that add
up to the stage's wall time:

  busy      computing a micro-batch
  transfer  receiving its activations once they were on their way
  bubble    holding a micro-batch whose input the previous stage had not sent yet
  idle      holding no micro-batch at all (the planner had nothing to give)

Only differences of one stage's own clock are used, so stages on different nodes need no
common clock. A micro-batch's bubble is the bubble before it on every stage; a request's
bubble is the sum over the micro-batches that carried it (paper §5.3).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from pp_runtime.batch import StageTiming


@dataclass(frozen=True)
class StageStats:
    stage: int
    wall_s: float  # from the stage's start to its last compute end
    busy_s: float
    transfer_s: float
    bubble_s: float
    idle_s: float
    num_microbatches: int


@dataclass(frozen=True)
class BubbleReport:
    per_stage: list[StageStats]
    mb_bubble_s: dict[int, float]  # micro-batch id -> bubble before it, all stages
    request_bubble_s: dict[int, float] = field(default_factory=dict)  # request id -> bubble

    @property
    def bubble_fraction(self) -> float:
        """Bubble time / wall time, summed over stages."""
        wall = sum(s.wall_s for s in self.per_stage)
        return sum(s.bubble_s for s in self.per_stage) / wall if wall > 0 else 0.0


class StageAccumulator:
    """The rule for one stage, applied one `StageTiming` at a time (in compute order).

    The gap between the previous compute end (or the stage's start) and this compute
    start is split first into transfer (at most `transfer_s`), then bubble (at most
    `wait_s`), and the rest is idle. `account()` runs it over a finished run;
    `telemetry.metrics` runs it online, as each micro-batch comes back.
    """

    __slots__ = ("stage", "start_s", "prev_end_s", "busy_s", "transfer_s", "bubble_s", "idle_s",
                 "num_microbatches")

    def __init__(self, stage: int, start_s: float | None = None):
        self.stage = stage
        self.start_s = start_s  # the stage's start on its own clock; None: its first call
        self.prev_end_s = start_s
        self.busy_s = self.transfer_s = self.bubble_s = self.idle_s = 0.0
        self.num_microbatches = 0

    def add(self, t: StageTiming) -> tuple[float, float, float]:
        """Account one micro-batch; returns its (transfer, bubble, idle) seconds before it."""
        if self.start_s is None:  # the stage started when it took its first call
            self.start_s = self.prev_end_s = t.compute_start_s - t.wait_s - t.transfer_s
        if t.compute_start_s < self.prev_end_s - 1e-9:
            raise ValueError(f"stage {self.stage}: micro-batch {t.mb_id} starts at {t.compute_start_s} "
                             f"before the previous one ended at {self.prev_end_s}")
        gap = t.compute_start_s - self.prev_end_s
        t_transfer = min(t.transfer_s, gap)
        t_bubble = min(t.wait_s, gap - t_transfer)
        t_idle = gap - t_transfer - t_bubble
        self.transfer_s += t_transfer
        self.bubble_s += t_bubble
        self.idle_s += t_idle
        self.busy_s += t.compute_s
        self.num_microbatches += 1
        self.prev_end_s = t.compute_end_s
        return t_transfer, t_bubble, t_idle

    @property
    def wall_s(self) -> float:
        """From the stage's start to its last compute end (0 before the first record)."""
        return 0.0 if self.start_s is None else self.prev_end_s - self.start_s

    def stats(self) -> StageStats:
        return StageStats(self.stage, self.wall_s, self.busy_s, self.transfer_s, self.bubble_s,
                          self.idle_s, self.num_microbatches)


def account(timings: Iterable[StageTiming],
            mb_requests: Mapping[int, Sequence[int]] | None = None,
            stage_start_s: Mapping[int, float] | None = None) -> BubbleReport:
    """Split every stage's time into busy / transfer / bubble / idle (`StageAccumulator`).

    `stage_start_s`: when each stage began the run, on its own clock (default: when it got
    its first micro-batch, so nothing before counts). Only TP rank 0 is counted: the ranks
    of a stage run in lock step.
    """
    by_stage: dict[int, list[StageTiming]] = defaultdict(list)
    for t in timings:
        if t.tp_rank == 0:
            by_stage[t.stage].append(t)
    per_stage, mb_bubble = [], defaultdict(float)
    for stage in sorted(by_stage):
        acc = StageAccumulator(stage, (stage_start_s or {}).get(stage))
        for t in sorted(by_stage[stage], key=lambda t: t.compute_start_s):
            mb_bubble[t.mb_id] += acc.add(t)[1]
        per_stage.append(acc.stats())
    request_bubble: dict[int, float] = defaultdict(float)
    for mb_id, rids in (mb_requests or {}).items():
        for rid in rids:
            request_bubble[rid] += mb_bubble.get(mb_id, 0.0)
    return BubbleReport(per_stage, dict(mb_bubble), dict(request_bubble))
