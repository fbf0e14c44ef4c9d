"""`core.batch.assemble`: the one place a micro-batch's SampledTokens is built from the
ranks' `RankResult`s (local, Ray's three paths, torchrun)."""
from pp_runtime.core.batch import RankResult, SampledTokens, StageTiming, assemble


def _timing(stage: int, tp_rank: int) -> StageTiming:
    return StageTiming(3, stage, tp_rank, 0.0, 0.0, float(stage), stage + 0.5)


def test_the_sampling_ranks_tokens_and_every_timing_in_rank_order():
    ranks = [(s, r) for s in range(2) for r in range(2)]  # tp 2 x pp 2, rank order
    results = [RankResult(_timing(s, r), {5: 9, 6: 1} if (s, r) == (1, 0) else None)
               for s, r in ranks]
    out = assemble(3, results)
    assert out == SampledTokens(3, {5: 9, 6: 1}, tuple(r.timing for r in results))
    assert [(t.stage, t.tp_rank) for t in out.timings] == ranks


def test_a_micro_batch_that_samples_nothing_has_no_tokens():
    out = assemble(3, (RankResult(_timing(s, 0), None if s == 0 else {}) for s in range(2)))
    assert out.tokens == {} and len(out.timings) == 2
