"""What a probe of the plan records of its simulation, and the summary it reports.

`ProbeRecorder` is the run recorder (telemetry/recorder.py) cut to what a probe reads: the
bubble rule on every stage (`bubbles.StageAccumulator`, the same calls in the same order,
so the same sums) and the times between tokens. It keeps no per-micro-batch rows, no
per-request bubbles, no timeline windows and no admission snapshots: on a deep pipeline
those took a quarter of a probe's time. `summary` is `telemetry.report.build_report`'s
summary for the fields a probe reports, computed the same way (tests/plan/test_search.py
checks them equal on a real simulation).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.telemetry.bubbles import EPS, StageAccumulator, fractions_by_cause
from pp_runtime.telemetry.recorder import RunRecorder
from pp_runtime.telemetry.report import RunResult, percentiles


@dataclass
class ProbeRecorder(RunRecorder):
    prefill_ran: int = 0  # prompt tokens that went through the pipeline
    last_tokens: int = 0  # tokens of the micro-batch that came back last (`probe.Watch`)
    tokens_done: int = 0  # tokens of every micro-batch back so far (`probe.Watch`)
    slow_above: float = float("inf")  # a time between tokens above this is slow (the TBT SLO)
    slow: int = 0  # times between tokens recorded above slow_above (`probe.Watch`)

    def __call__(self, mb: MicroBatch, out: SampledTokens) -> None:
        prefill = decodes = 0
        for s in mb.seqs:
            if s.is_decode:
                decodes += 1
            else:
                prefill += len(s.token_ids)  # s.num_tokens
        self.prefill_ran += prefill
        self.last_tokens = prefill + decodes
        self.tokens_done += prefill + decodes
        stages, idle_before_s = self.stages, mb.idle_before_s
        for t in out.timings:  # bubbles.add_microbatch, without what it yields
            if t.tp_rank != 0:
                continue
            acc = stages.get(t.stage)
            if acc is None:
                acc = stages[t.stage] = StageAccumulator(t.stage)
            if acc.start_s is None:
                acc.take(t, idle_before_s)
                continue
            # `StageAccumulator.take` written out for a stage past its first call: the same
            # float operations in the same order (min and max as comparisons that pick the
            # same operand), without a call and its tuple (a deep probe does it 10^6 times)
            start, end, send_wait = t.compute_start_s, t.compute_end_s, t.send_wait_s
            gap = start - acc.prev_end_s
            if gap < -EPS:
                acc.take(t, idle_before_s)  # raises, as the rule does
            if gap < 0.0:  # max(gap, 0.0)
                gap = 0.0
            transfer_s, wait = t.transfer_s, t.wait_s
            transfer = transfer_s if transfer_s < gap else gap
            rest = gap - transfer
            upstream = rest if rest < wait else wait  # min(wait, rest)
            empty = rest - upstream  # gap - transfer - upstream
            idle = idle_before_s if idle_before_s < empty else empty
            acc.transfer_s += transfer
            acc.upstream_s += upstream
            acc.dependency_s += empty - idle
            acc.idle_s += idle
            acc.busy_s += end - start
            acc.downstream_s += send_wait
            acc.num_microbatches += 1
            acc.prev_end_s = end + send_wait
        self._tokens(out)

    def _tokens(self, out: SampledTokens) -> None:
        """RunRecorder._tokens, counting the slow times between tokens as it records them."""
        now, last, gaps, above = self.clock(), self._last_token_s, self.token_gaps_s, self.slow_above
        slow = 0
        for rid in out.tokens:
            if rid in last:
                gap = now - last[rid]
                gaps.append(gap)
                if gap > above:
                    slow += 1
            last[rid] = now
        self.slow += slow
        if self.on_tokens:
            self.on_tokens(len(out.tokens))


def summary(run: RunResult) -> dict:
    """build_report(run)["summary"]'s fields that a probe reports, from ProbeRecorders."""
    stats = [rec.stages[s].stats() for rec in run.replicas for s in sorted(rec.stages)]
    reqs = run.requests
    done = [r for r in reqs if r.finish_s is not None]
    makespan = max((r.finish_s for r in done), default=0.0)
    tokens = sum(rec.prefill_ran for rec in run.replicas) + sum(len(r.token_ids) for r in reqs)
    by_cause = fractions_by_cause(stats)
    gaps = np.concatenate([np.frombuffer(rec.token_gaps_s, dtype=float) for rec in run.replicas]) \
        if run.replicas else np.zeros(0)
    return {
        "num_requests": len(reqs), "makespan_s": makespan,
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "bubble_fraction": sum(by_cause.values()), "bubble_fraction_by_cause": by_cause,
        "ttft_s": percentiles([r.first_token_s - r.arrival_s for r in done
                               if r.first_token_s is not None], ("median", "p99")),
        "tbt_s": percentiles(gaps, ("median", "p99")),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in reqs))}
