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
    micro-batches unequal in time (PB3). Packing and the time cap alone (spread off: its
    own tests are below)."""
    extra.setdefault("spread", 0)
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
    p = planner("uniform", chunk_size=64, max_batch_size=4, tile_size=64, pack_prefills=False,
                spread=0)
    add(p, 0, 70, 1)
    add(p, 1, 70, 1)
    log = drive(p, 1)
    assert all(sum(not c.is_decode for c in mb.seqs) == 1 for mb in log)
    p = planner("uniform", chunk_size=64, max_batch_size=4, tile_size=64, spread=0)
    add(p, 0, 70, 1)
    add(p, 1, 70, 1)
    assert any(sum(not c.is_decode for c in mb.seqs) == 2 for mb in drive(p, 1))


def test_uniform_with_an_explicit_target():
    p = planner("uniform", target_ms=1e-6, chunk_size=64, max_batch_size=4, tile_size=64)
    add(p, 0, 200, 2)
    log = drive(p, 1)
    assert log[0].seqs[0].num_tokens == 64 // 8  # nothing fits: the floor, C / 8


# ---- spread: uniform in predicted time when prompt tokens are scarce --------------------
class Toy:
    """A cost model to compute schedules by hand: a prefill token costs 1, a decode 1/10 of
    its KV length (long KV is slow: the paper's PB3)."""
    def microbatch_time(self, prefills, decode_kv_lens):
        return sum(n for _, n in prefills) + sum(decode_kv_lens) / 10


def toy_planner(spread, **extra):
    """pp 2 (3 micro-batches in flight), C 64 without tile alignment, B 8."""
    from pp_runtime.config import Config
    from pp_runtime.planner.uniform import UniformPlanner
    cfg = Config().with_overrides(planner="uniform", pp=2, chunk_size=64, max_batch_size=8,
                                  tile_align=False, paged=False, spread=spread, **extra)
    return UniformPlanner(cfg, Toy())


def decoding(p, prompts):
    """Requests 0.. with these prompts, prefilled and each with its first token: their
    decodes attend to prompt + 1 tokens."""
    from pp_runtime.core.batch import SampledTokens
    for rid, n in enumerate(prompts):
        add(p, rid, n, 100)
    sent = []  # every prompt's chunks in flight at once (chunk pipelining), then the results
    while (mb := p.schedule(0.0)) is not None:
        sent.append(mb)
    for mb in sent:
        p.on_result(mb, SampledTokens(mb.mb_id, {s.request_id: 1 for s in mb.seqs if s.sampling}), 0.0)
    assert all(r.num_computed == r.prefill_len for r in p.requests.values())
    return p


def shape(mb):
    return [(s.request_id, "d" if s.is_decode else f"{s.start}:{s.start + s.num_tokens}",
             s.kv_len) for s in mb.seqs]


def test_scarce_prefill_is_sized_so_every_microbatch_takes_the_same_time():
    """Four requests decode, two with short KV (11) and two with long (51); a 30-token
    prompt arrives. R = 4 decoding -> ceil(4 / pp) = 2 decodes a micro-batch; 30 prompt
    tokens < 3 micro-batches x C: scarce, an even share over spread (1) round of 3
    micro-batches is 10 tokens, at mean KV (11 + 11 + 51 + 51) // 4 + 1 = 32:
    T = 10 + 2 x 32 / 10 = 16.4. Micro-batch 1: decodes 0, 1 (2.2) + 14 prompt tokens
    (16.2 <= 16.4, 15 would be 17.2). Micro-batch 2: decodes 2, 3 (10.2); 16 tokens left,
    T = ceil(16 / 3) + 6.4 = 12.4 leaves 2 < C / 8 = 8 tokens: no chunk, the long-KV
    decodes alone. By hand; without spread all four decodes and the whole prompt go into
    micro-batch 1 (time 42.4) and micro-batch 2 is empty."""
    p = decoding(toy_planner(spread=0), [10, 10, 50, 50])
    p.spread = 1  # switched on with the decodes in place (the same rule from the start below)
    add(p, 4, 30, 10, arrival=1.0)
    first, second = p.schedule(1.0), p.schedule(1.0)
    assert shape(first) == [(0, "d", 11), (1, "d", 11), (4, "0:14", 14)]
    assert shape(second) == [(2, "d", 51), (3, "d", 51)]
    q = decoding(toy_planner(spread=0), [10, 10, 50, 50])
    add(q, 4, 30, 10, arrival=1.0)
    assert shape(q.schedule(1.0)) == [(0, "d", 11), (1, "d", 11), (2, "d", 51), (3, "d", 51),
                                      (4, "0:30", 30)]
    assert q.schedule(1.0) is None


def test_plentiful_prefill_keeps_full_chunks():
    """Prompt tokens enough to fill the next round (>= 3 micro-batches x C): full chunks,
    packed, as SARATHI's budget (the even time applies only when they are scarce)."""
    p = decoding(toy_planner(spread=0), [10, 10, 50, 50])
    p.spread = 1
    add(p, 4, 300, 10, arrival=1.0)
    mb = p.schedule(1.0)
    assert shape(mb) == [(0, "d", 11), (1, "d", 11), (4, "0:64", 64)]


def test_decodes_spread_over_pp_microbatches():
    """Eight requests decoding on pp = 2, no prompt: ceil(8 / 2) = 4 decodes a micro-batch,
    the rest wait for the next (SARATHI would put all eight, up to B, in the first)."""
    p = decoding(toy_planner(spread=0), [4] * 8)
    p.spread = 1
    a, b, c = p.schedule(0.0), p.schedule(0.0), p.schedule(0.0)
    assert [s.request_id for s in a.seqs] == [0, 1, 2, 3]
    assert [s.request_id for s in b.seqs] == [4, 5, 6, 7]
    assert c is None


def test_spread_evens_microbatch_time_on_the_simulated_pipeline():
    """GPT-3 TP8 x PP8 at P:D 1 (decode-heavy; prompt tokens are scarce once the first
    prompts are in): the predicted times of the micro-batches of the busy part of the run
    vary less with spread than without (coefficient of variation 0.068 against 0.174)."""
    from pp_runtime.config import load_config
    times = {}
    for spread in (0, 4):
        cfg = load_config("paper/gpt3_tp8_pp8", planner="uniform", spread=spread, **{"workload.num_requests": 300,
                          "workload.pd_ratio": 1, "workload.min_len": 256, "workload.max_len": 1024})
        p, cost = make_planner_for(cfg)
        for rid, spec in enumerate(specs_of(cfg)):
            add(p, rid, spec.prompt_len, spec.output_len)
        log = drive(p, cfg.in_flight)
        times[spread] = [predicted(cost, mb) for mb in log[len(log) // 10: len(log) // 2]]
    cv = lambda ts: statistics.pstdev(ts) / statistics.mean(ts)  # noqa: E731
    assert cv(times[4]) < 0.6 * cv(times[0])


def make_planner_for(cfg):
    from pp_runtime.costmodel import build_cost_model
    from pp_runtime.planner import make_planner
    cost = build_cost_model(cfg)
    return make_planner(cfg, cost), cost


def specs_of(cfg):
    from pp_runtime.core.workload import generate
    return generate(cfg.workload)
