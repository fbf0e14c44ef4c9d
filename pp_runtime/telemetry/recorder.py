"""What a run records for its reports, one micro-batch at a time. No torch.

`RunRecorder` is the driver's `on_microbatch` callback, the same for simulated and real
runs. It applies the bubble rule online (`bubbles.StageAccumulator`, one per stage, as the
live metrics do) and keeps only what the reports need, in compact arrays: one row per
micro-batch, the bubble and micro-batch count of every request, the times between
consecutive tokens, and the full per-stage timings of two windows of micro-batches for the
timeline: the run's start and its steady state; and each stage's running totals before
every micro-batch that carries a request for the first time, which cut the run into
warm-up, steady state and tail (`windows.py`). A 100K-request simulation thus keeps a few
numbers per micro-batch instead of a `StageTiming` object per micro-batch and stage.

Times in the rows are seconds from each stage's own start (stages need no common clock).
"""
from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.telemetry.bubbles import BubbleReport, StageAccumulator, add_microbatch
from pp_runtime.telemetry.windows import AdmissionSnapshots, Cut, totals, windows

TIMELINE_MBS = 300  # micro-batches per timeline window

MB_COLUMNS = ("mb_id", "prefill_tokens", "decodes", "num_tokens", "num_requests", "start_s",
              "end_s", "compute_s", "bubble_s")
TIMELINE_COLUMNS = ("mb_id", "stage", "compute_start_s", "compute_end_s", "wait_s",
                    "transfer_s", "send_wait_s", "upstream_s", "dependency_s", "idle_s",
                    "downstream_s", "prefill_tokens", "decodes", "token_wait_s")


def _window_starts(n: int) -> bool:
    """Micro-batch indices that open a timeline window: 0, then W, 2W, 4W, ..."""
    return n == 0 or (n % TIMELINE_MBS == 0 and (k := n // TIMELINE_MBS) & (k - 1) == 0)


@dataclass
class RunRecorder:
    clock: Callable[[], float]  # the driver's clock (for times between tokens)
    replica: int = 0
    on_tokens: Callable[[int], None] | None = None  # progress: called with tokens sampled
    stages: dict[int, StageAccumulator] = field(default_factory=dict)
    mb_columns: dict[str, array] = field(default_factory=lambda: {
        c: array("d") if c.endswith("_s") else array("q") for c in MB_COLUMNS})
    request_bubble_s: Counter = field(default_factory=Counter)  # request id -> bubble
    request_mbs: Counter = field(default_factory=Counter)  # request id -> micro-batches
    token_gaps_s: array = field(default_factory=lambda: array("d"))  # time between tokens
    windows: dict[int, list[tuple]] = field(default_factory=dict)  # first index -> timeline rows
    # each stage's totals before each micro-batch that carried a new request (windows.py)
    admissions: AdmissionSnapshots = field(default_factory=AdmissionSnapshots)
    _last_token_s: dict[int, float] = field(default_factory=dict)

    @property
    def num_microbatches(self) -> int:
        return len(self.mb_columns["mb_id"])

    def __call__(self, mb: MicroBatch, out: SampledTokens) -> None:
        n = self.num_microbatches
        if _window_starts(n):
            self.windows[n] = []
        rows = self.windows.get(n - n % TIMELINE_MBS)  # None outside a window
        rids = {s.request_id for s in mb.seqs}
        self.admissions.before(rids, self.stages)  # before: the micro-batch opens a window
        prefill = decodes = 0
        for s in mb.seqs:
            if s.is_decode:
                decodes += 1
            else:
                prefill += s.num_tokens
        bubble, compute, first, last_end = 0.0, 0.0, None, 0.0
        for t, acc, split in add_microbatch(self.stages, out.timings, mb.idle_before_s):
            bubble += split.charged
            compute = max(compute, split.busy)
            start, end = t.compute_start_s - acc.start_s, t.compute_end_s - acc.start_s
            first = start if first is None else first
            last_end = end
            if rows is not None:
                rows.append((mb.mb_id, t.stage, start, end, t.wait_s, t.transfer_s, t.send_wait_s,
                             split.upstream, split.dependency, split.idle, split.downstream,
                             prefill, decodes, t.token_wait_s))
        for col, v in zip(MB_COLUMNS, (mb.mb_id, prefill, decodes, prefill + decodes, len(rids),
                                       0.0 if first is None else first, last_end, compute, bubble)):
            self.mb_columns[col].append(v)
        for rid in rids:
            self.request_bubble_s[rid] += bubble
        self.request_mbs.update(rids)
        self._tokens(out)

    def _tokens(self, out: SampledTokens) -> None:
        now, last = self.clock(), self._last_token_s
        for rid in out.tokens:
            if rid in last:
                self.token_gaps_s.append(now - last[rid])
            last[rid] = now
        if self.on_tokens:
            self.on_tokens(len(out.tokens))

    # ---- what the reports read ---------------------------------------------------------
    def bubbles(self) -> BubbleReport:
        """The run's bubble report (per-micro-batch bubbles are in `mb_columns`)."""
        per_stage = [self.stages[s].stats() for s in sorted(self.stages)]
        mb = dict(zip(self.mb_columns["mb_id"], self.mb_columns["bubble_s"]))
        return BubbleReport(per_stage, mb, dict(self.request_bubble_s))

    def run_windows(self, arrival_s: Mapping[int, float],
                    finish_s: Mapping[int, float | None]) -> Cut:
        """Each stage's parts in the warm-up, steady and tail windows, and the requests that
        entered in each (windows.py); times: request id -> the driver's clock."""
        return windows(self.admissions, totals(self.stages), arrival_s, finish_s)

    def timeline(self) -> dict[str, list[tuple]]:
        """Timeline rows (TIMELINE_COLUMNS) of the `start` window and, when the run is long
        enough, a `steady` one: the last full window that opened by half-way through."""
        out = {"start": self.windows.get(0, [])}
        full = TIMELINE_MBS * max(1, len(self.stages))
        half = self.num_microbatches // 2
        steady = [i for i, rows in self.windows.items() if 0 < i <= half and len(rows) >= full]
        if steady:
            out["steady"] = self.windows[max(steady)]
        return out
