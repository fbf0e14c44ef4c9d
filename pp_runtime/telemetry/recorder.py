"""What a run records for its reports, one micro-batch at a time. No torch.

`RunRecorder` is the driver's `on_microbatch` callback, the same for simulated and real
runs: it keeps each micro-batch's composition, its `StageTiming` records and the times
between consecutive tokens of every request. Reports are built from it afterwards
(`telemetry.report`); nothing here computes a bubble.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable

from pp_runtime.batch import MicroBatch, SampledTokens, StageTiming


@dataclass(frozen=True, slots=True)
class MicroBatchRecord:
    mb_id: int
    request_ids: tuple[int, ...]  # every request it carried (prefill chunks and decodes)
    prefill_tokens: int
    decodes: int
    done_s: float  # when the driver got its result (driver clock)
    timings: tuple[StageTiming, ...]  # one per stage (TP rank 0)


@dataclass
class RunRecorder:
    clock: Callable[[], float]
    replica: int = 0
    on_tokens: Callable[[int], None] | None = None  # progress: called with tokens sampled
    microbatches: list[MicroBatchRecord] = field(default_factory=list)
    token_gaps_s: array = field(default_factory=lambda: array("d"))  # time between tokens
    _last_token_s: dict[int, float] = field(default_factory=dict)

    def __call__(self, mb: MicroBatch, out: SampledTokens) -> None:
        now = self.clock()
        prefill = decodes = 0
        for s in mb.seqs:
            if s.is_decode:
                decodes += 1
            else:
                prefill += s.num_tokens
        self.microbatches.append(MicroBatchRecord(
            mb.mb_id, tuple(s.request_id for s in mb.seqs), prefill, decodes, now,
            tuple(t for t in out.timings if t.tp_rank == 0)))
        last = self._last_token_s
        for rid in out.tokens:
            if rid in last:
                self.token_gaps_s.append(now - last[rid])
            last[rid] = now
        if self.on_tokens:
            self.on_tokens(len(out.tokens))
