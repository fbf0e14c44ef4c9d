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


def account(timings: Iterable[StageTiming],
            mb_requests: Mapping[int, Sequence[int]] | None = None,
            stage_start_s: Mapping[int, float] | None = None) -> BubbleReport:
    """Split every stage's time into busy / transfer / bubble / idle.

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
        records = sorted(by_stage[stage], key=lambda t: t.compute_start_s)
        first = records[0]
        start = (stage_start_s or {}).get(stage, first.compute_start_s - first.wait_s - first.transfer_s)
        prev_end = start
        busy = transfer = bubble = idle = 0.0
        for t in records:
            if t.compute_start_s < prev_end - 1e-9:
                raise ValueError(f"stage {stage}: micro-batch {t.mb_id} starts at {t.compute_start_s} "
                                 f"before the previous one ended at {prev_end}")
            gap = t.compute_start_s - prev_end
            t_transfer = min(t.transfer_s, gap)
            t_bubble = min(t.wait_s, gap - t_transfer)
            transfer += t_transfer
            bubble += t_bubble
            idle += gap - t_transfer - t_bubble
            busy += t.compute_s
            mb_bubble[t.mb_id] += t_bubble
            prev_end = t.compute_end_s
        per_stage.append(StageStats(stage, prev_end - start, busy, transfer, bubble, idle, len(records)))
    request_bubble: dict[int, float] = defaultdict(float)
    for mb_id, rids in (mb_requests or {}).items():
        for rid in rids:
            request_bubble[rid] += mb_bubble.get(mb_id, 0.0)
    return BubbleReport(per_stage, dict(mb_bubble), dict(request_bubble))
