"""`uniform` sizes micro-batches by predicted time: shrinks heavy ones, grows and packs light ones."""
import statistics

import pytest

from helpers import add, drive, planner


def test_the_planner_prices_with_the_simulators_cost_model():
    """One cost model: without one given, uniform builds the simulator's (costmodel/), so
    the real runtime and the simulator plan with the same prices."""
    from pp_runtime.costmodel import StageCostModel, build_cost_model
    p = planner("uniform", pp=2, target_ms=5.0)
    assert isinstance(p.cost, StageCostModel)
    ref = build_cost_model(p.cfg)
    assert p.cost.microbatch_time([(0, 100)], [50] * 3) == ref.microbatch_time([(0, 100)], [50] * 3)


def predicted(cost, mb):
    return cost.microbatch_time([(c.start, c.num_tokens) for c in mb.seqs if not c.is_decode],
                                [c.kv_len for c in mb.seqs if c.is_decode])


def run(name, **extra):
    """GPT-2-small shapes in fp16, 4 stages: decodes with long KV make SARATHI's equal-token
    micro-batches unequal in time (PB3)."""
    p = planner(name, dtype="float16", pp=4, max_batch_size=8, chunk_size=256, **extra)
    for rid in range(200):
        add(p, rid, 200 + 37 * (rid % 19), 20 + 13 * (rid % 7))
    log = drive(p, 4)
    chunked = [mb for mb in log if any(not c.is_decode and c.sampling is None for c in mb.seqs)]
    return p, log, chunked


def test_uniform_packs_tail_chunks_into_full_microbatches():
    """Default uniform: every micro-batch with prefill work carries C tokens unless prompts
    ran out (a prompt's last chunk is followed by the next prompt's first), so the run
    needs fewer micro-batches than SARATHI's and no more predicted work."""
    from pp_runtime.costmodel import build_cost_model
    uni, uni_log, _ = run("uniform")
    _, sar_log, _ = run("sarathi")
    packed = [mb for mb in uni_log if sum(not c.is_decode for c in mb.seqs) > 1]
    assert packed and all(mb.num_tokens == 256 for mb in packed[:-1])
    assert len(uni_log) < len(sar_log)
    cost = build_cost_model(uni.cfg)
    assert sum(predicted(cost, mb) for mb in uni_log) < sum(predicted(cost, mb) for mb in sar_log)


def test_the_time_cap_evens_microbatch_time_where_sarathi_does_not():
    uni, uni_log, uni_chunked = run("uniform", target_ms=0.095)
    _, sar_log, sar_chunked = run("sarathi")
    cost, target = uni.cost, uni.target_s
    uni_t = [predicted(cost, mb) for mb in uni_chunked]
    sar_t = [predicted(cost, mb) for mb in sar_chunked]
    assert max(uni_t) <= target < max(sar_t)  # SARATHI's heaviest batches exceed the target
    assert any(mb.num_tokens < 256 for mb in uni_chunked)  # heavy ones shrank to fit
    packed = [mb for mb in uni_log if sum(not c.is_decode for c in mb.seqs) > 1]
    assert packed and all(  # packing: a prompt's last chunk, then the next prompt's first
        mb.seqs[-1].start == 0 and mb.seqs[-2].sampling is not None for mb in packed)
    with_prefill = lambda log: [predicted(cost, mb) for mb in log  # noqa: E731
                                if any(not c.is_decode for c in mb.seqs)]
    cv = lambda ts: statistics.pstdev(ts) / statistics.mean(ts)  # noqa: E731
    assert cv(with_prefill(uni_log)) < 0.75 * cv(with_prefill(sar_log))
    # the price (docs/planner.md): cut chunks still pay for whole matmul tiles
    total = lambda log: sum(predicted(cost, mb) for mb in log)  # noqa: E731
    assert total(uni_log) <= total(sar_log) * 1.05


def test_packing_off_leaves_a_prompts_tail_chunk_alone():
    p = planner("uniform", chunk_size=64, max_batch_size=4, tile_size=64, pack_prefills=False)
    add(p, 0, 70, 1)
    add(p, 1, 70, 1)
    log = drive(p, 1)
    assert all(sum(not c.is_decode for c in mb.seqs) == 1 for mb in log)
    p = planner("uniform", chunk_size=64, max_batch_size=4, tile_size=64)
    add(p, 0, 70, 1)
    add(p, 1, 70, 1)
    assert any(sum(not c.is_decode for c in mb.seqs) == 2 for mb in drive(p, 1))


def test_uniform_with_an_explicit_target():
    p = planner("uniform", target_ms=1e-6, chunk_size=64, max_batch_size=4, tile_size=64)
    add(p, 0, 200, 2)
    log = drive(p, 1)
    assert log[0].seqs[0].num_tokens == 64 // 8  # nothing fits: the floor, C / 8
