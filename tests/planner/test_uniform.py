"""`uniform` fills micro-batches to a budget from the latency target: hand-computed budgets on
a toy cost model, rows bounded by pages and time, the TBT target held on the simulator."""
from collections import deque

import pytest

from helpers import add, drive, planner

from pp_runtime.config import Config, ConfigError, load_config
from pp_runtime.core.batch import SampledTokens
from pp_runtime.core.request import Request, SamplingParams
from pp_runtime.planner.blocks import GrowthReserve
from pp_runtime.planner.budget import TimeBudget, decode_floor, knee
from pp_runtime.planner.order import SlackOrder
from pp_runtime.planner.uniform import UniformPlanner


class Toy:
    """Seconds by hand: a micro-batch costs 1 ms to read the weights, 0.01 ms per token
    (prefill tokens and decodes), and 0.001 ms per KV position a decode attends to."""
    def microbatch_time(self, prefills, decode_kv_lens):
        tokens = sum(n for _, n in prefills) + len(decode_kv_lens)
        return 1e-3 + 1e-5 * tokens + 1e-6 * sum(decode_kv_lens)


def toy(pp=2, **extra):
    """A uniform planner on the toy cost model, pp 2 (3 in flight unless in_flight is set)."""
    cfg = Config().with_overrides(planner="uniform", pp=pp, paged=True, **extra)
    return UniformPlanner(cfg, Toy())


def beside_a_decode(p, now=0.0):
    """Request 0 (100 prompt tokens) computed alone, its first token back at 0; request 1's
    5000-token prompt arrives: (request, tokens, is_decode) of the micro-batch composed at
    `now`."""
    add(p, 0, 100, 50)
    first = p.schedule(0.0)  # the prompt, alone
    p.on_result(first, SampledTokens(first.mb_id, {0: 7}), 0.0)
    add(p, 1, 5000, 4)
    return [(s.request_id, s.num_tokens, s.is_decode) for s in p.schedule(now).seqs]


def test_the_knee_is_where_time_per_token_stops_falling():
    """Per token: 1/n ms + 0.01 ms; the best up to 16384 tokens is 0.0100610 ms; within 5 %
    (0.0105641 ms) needs 1/n <= 0.0005641, n >= 1773: the next whole tile of 128 is 1792."""
    n, t = knee(Toy(), 128)
    assert n == 1792
    assert t == pytest.approx(1e-3 + 1792e-5)


def test_the_period_comes_from_the_tbt_target():
    """T = 0.95 x S / depth: S = 300 ms over 3 in flight -> 95 ms; no target: unbounded."""
    b = TimeBudget(Toy(), depth=3, tile=128, tbt_slo_s=0.3)
    assert b.base_s == pytest.approx(0.095)
    assert TimeBudget(Toy(), depth=3, tile=128).period_s == float("inf")
    assert TimeBudget(Toy(), 3, 128, 0.3, target_s=0.02).base_s == 0.02  # target_ms by hand


def test_with_the_token_hop_the_round_between_tokens_is_pp_microbatches():
    """S = 300 ms at pp 2: through the driver a token's round is pp + 1 = 3 micro-batches
    (T = 0.95 x 0.3 / 3 = 95 ms); with the token hop (planning ahead) the next decode
    enters stage 0 as the token leaves the last stage, pp = 2 micro-batches later
    (T = 142.5 ms). Off again: back to 3."""
    p = toy(tbt_slo_ms=300.0)
    assert (p.depth, p.budget.base_s) == (3, pytest.approx(0.095))
    assert p.plan_ahead(True)
    assert (p.depth, p.budget.base_s) == (2, pytest.approx(0.1425))
    p.plan_ahead(False)
    assert (p.depth, p.budget.base_s) == (3, pytest.approx(0.095))
    offline = toy()  # no target: the queue's round (longest first) follows the depth too
    offline.plan_ahead(True)
    assert offline.order.round_s == pytest.approx(2 * offline.budget.knee_s)


def test_a_target_below_one_decode_through_the_pipeline_is_refused_naming_the_floor():
    """One decode alone: 1 ms + 0.01 ms + 0.001 ms = 1.011 ms per micro-batch, 3 in flight:
    the floor is 3.033 ms."""
    assert decode_floor(Toy(), 3) == pytest.approx(3.033e-3)
    with pytest.raises(ConfigError, match=r"below one decode through the pipeline .*3\.03 ms"):
        TimeBudget(Toy(), 3, 128, tbt_slo_s=0.003)
    with pytest.raises(ConfigError, match="planner.tbt_slo_ms: must be > 0"):
        Config().with_overrides(tbt_slo_ms=0)
    with pytest.raises(ConfigError, match="planner.ttft_slo_ms: must be > 0"):
        Config().with_overrides(ttft_slo_ms=-5)


def test_plentiful_prefill_fills_the_knee():
    """No target, no decodes, prompts of 4 x K tokens waiting: every micro-batch takes K."""
    p = toy()
    for rid in range(2):
        add(p, rid, 4 * 1792, 4)
    mb = p.schedule(0.0)
    assert [s.num_tokens for s in mb.seqs] == [1792]


def test_scarce_prefill_is_shared_evenly_over_the_round():
    """Prompt tokens fewer than the round can take (900 < 3 x 1792): a micro-batch gets its
    even share of the round's prompt tokens (3 in flight), held for the round and never
    under K / 8 = 224: ceil(900 / 3) = 300 three times; not one full micro-batch and two
    empty ones, nor each a third of what the one before left (300, 224, 224, 152). A new
    prompt raises the share at once and holds it for a round of its own."""
    p = toy()
    add(p, 0, 1500, 4)
    assert [p.schedule(0.0).seqs[0].num_tokens for _ in range(3)] == [500, 500, 500]
    q = toy()
    add(q, 0, 900, 4)
    assert [q.schedule(0.0).seqs[0].num_tokens for _ in range(3)] == [300, 300, 300]
    r = toy()
    add(r, 0, 900, 4)
    assert r.schedule(0.0).seqs[0].num_tokens == 300
    add(r, 1, 1500, 4)  # 600 + 1500 left: ceil(2100 / 3) = 700 > 300: request 0's last 600
    sizes = [[s.num_tokens for s in r.schedule(0.0).seqs] for _ in range(3)]  # and 100 of 1's
    assert sizes == [[600, 100], [700], [700]]
    assert r.schedule(0.0) is None  # all scheduled in the round


def test_a_packed_chunk_is_whatever_the_room_holds_even_below_k_over_8():
    """A prompt's chunk beside another prompt's last one is not held to K / 8 = 224: the
    micro-batch is already large, so its size is what counts (as a chunk beside decodes,
    below). No target, 3 in flight: a micro-batch takes up to K = 1792 tokens (the even
    share, ceil(6600 / 3) = 2200, does not bind): request 0's 1600-token prompt whole,
    then the 192 tokens of request 1's that are left (before 2026-11-28 they waited for
    the next micro-batch: 1600, then 1792)."""
    p = toy()
    add(p, 0, 1600, 4)
    add(p, 1, 5000, 4)
    assert [(s.request_id, s.num_tokens) for s in p.schedule(0.0).seqs] == [(0, 1600), (1, 192)]


class TileToy:
    """1 ms, plus 1 ms per tile of 128 tokens begun, plus 0.001 ms a token: a partly filled
    tile costs nearly a whole one (as measured GPUs do)."""
    def microbatch_time(self, prefills, decode_kv_lens):
        tokens = sum(n for _, n in prefills) + len(decode_kv_lens)
        return 1e-3 + 1e-3 * -(-tokens // 128) + 1e-6 * tokens


def test_a_partly_filled_last_tile_waits_for_the_next_microbatch():
    """Per token at k whole tiles: 1 / (128 k) + 0.0088125 ms; the best (k = 128) is
    0.0088736, within 5 % from k = 16: K = 2048, K / 8 = 256. The even share of a 900-token
    prompt over 3 in flight is 300 tokens: the 44 past two tiles cost (4.3 - 3.256) / 44 =
    0.024 ms a token, more than the micro-batch's 4.3 / 300 = 0.014: 256 go. Then K / 8 =
    256 twice; the prompt's last 132 tokens end it and go whole (its first token is not
    delayed). Without the rule: 300, 256, 256, 88."""
    cfg = Config().with_overrides(planner="uniform", pp=2, paged=True)
    p = UniformPlanner(cfg, TileToy())
    assert (p.top, p.tile) == (2048, 128)
    add(p, 0, 900, 4)
    sizes = [p.schedule(0.0).seqs[0].num_tokens for _ in range(4)]
    assert sizes == [256, 256, 256, 132]


def test_the_tbt_target_cuts_the_chunk_by_the_round():
    """S = 30 ms, pp 2, 2 in flight: the micro-batch must come back by 0.95 x 30 = 28.5 ms
    after its decode's last token (at 0), crossing 2 stages of the toy's time each. The
    decode alone: 2 x (1 + 0.01 + 0.101) = 2.222 ms; it takes half of the slack
    (SLACK_SHARE): 2.222 + 0.5 x 26.278 = 15.361 ms >= 2 x (1.101 + 0.01 (n + 1)) ms
    -> n + 1 <= 657.95: n = 656."""
    p = toy(in_flight=2, tbt_slo_ms=30.0)
    assert beside_a_decode(p) == [(0, 1, True), (1, 656, False)]


def test_prompts_waiting_fill_a_microbatch_to_the_level_of_those_in_flight():
    """S = 30 ms, pp 2, 2 in flight; requests 0 and 2 decode (their first tokens back at 0),
    request 1's 5000-token prompt waits. Micro-batch B carries request 0's decode and 656
    tokens (half of the slack, as above): 1 + 0.01 x 657 + 0.101 = 7.671 ms a stage. C, composed
    at 0 behind it, carries request 2's decode: it starts on stage 1 when B leaves it (15.342
    ms) and the decode alone ends at 16.453 ms; half of the slack before 28.5 ms would take
    15.342 + 1.111 + 0.01 n <= 22.4765 -> n = 602. The prompt waits, so C fills to B's level
    (within T = 14.25 ms and within all of the slack, n <= 1204): 1.111 + 0.01 n <= 7.671
    -> n = 656, and the round's two micro-batches cost the same."""
    p = toy(in_flight=2, tbt_slo_ms=30.0)
    add(p, 0, 100, 50)
    add(p, 2, 100, 50)
    first = p.schedule(0.0)  # both prompts, packed
    p.on_result(first, SampledTokens(first.mb_id, {0: 7, 2: 7}), 0.0)
    add(p, 1, 5000, 4)
    b, c = p.schedule(0.0), p.schedule(0.0)
    assert [(s.request_id, s.num_tokens) for s in b.seqs] == [(0, 1), (1, 656)]
    assert [(s.request_id, s.num_tokens) for s in c.seqs] == [(2, 1), (1, 656)]
    assert p.predicted[c.mb_id] == p.predicted[b.mb_id]


@pytest.mark.parametrize("ttft_ms,chunk", [(None, 406), (110.0, 1079)])
def test_an_admitted_prompt_near_its_ttft_target_takes_up_to_t(ttft_ms, chunk):
    """S = 30 ms, pp 2, 2 in flight; request 0 decodes (its last token at 0), request 1's
    5000-token prompt is admitted (the queue is empty) and the micro-batch is composed at
    10 ms. The round's deadline: 0.95 x 30 = 28.5 ms; the decode alone ends at 10 + 2 x
    1.111 = 12.222 ms; half of the slack: 20.361 ms >= 10 + 2 x (1.111 + 0.01 n) -> n = 406.
    With a TTFT target of 110 ms the prompt needs 5000 tokens over the micro-batches left
    before its deadline, planned to 0.95 of the target as the TBT's is: 104.5 - 10 - 2 x T
    (T = 14.25 ms) = 66 ms, 4.63 of them: 1079 a micro-batch; that much goes, past the
    round's deadline (all of the slack would be 813) but within T (1 + 0.01 (n + 1) + 0.101
    <= 14.25 ms -> n <= 1313)."""
    extra = {} if ttft_ms is None else {"ttft_slo_ms": ttft_ms}
    p = toy(in_flight=2, tbt_slo_ms=30.0, **extra)
    assert beside_a_decode(p, 0.010) == [(0, 1, True), (1, chunk, False)]


def test_beside_a_decode_the_chunk_is_what_fits_even_below_k_over_8():
    """As above with S = 10 ms: the bound is 2.222 + 0.5 x (9.5 - 2.222) = 5.861 ms >=
    2 x (1.101 + 0.01 (n + 1)) ms -> n + 1 <= 182.95: n = 181, under K / 8 = 224 (a
    chunk of K / 8 beside the decode would break its time between tokens)."""
    p = toy(in_flight=2, tbt_slo_ms=10.0)
    assert beside_a_decode(p) == [(0, 1, True), (1, 181, False)]


def test_a_token_on_its_way_bounds_the_prompt_chunk_ahead_of_its_next_decode():
    """S = 30 ms, pp 2, 2 in flight. Request 0's prompt (100 tokens, 2 ms a stage) is in
    flight: its first token is due back at 4 ms, its next one by 4 + 28.5 = 32.5 ms, and that
    decode will follow the chunk composed now. The chunk alone would end at 5 ms (stage 0
    free at 2 ms, 1 ms a stage); it takes half of the 27.5 ms slack: 2 + 2 x (1 + 0.01 n)
    <= 18.75 ms -> n = 737, not the 1792 tokens of the knee."""
    p = toy(in_flight=2, tbt_slo_ms=30.0)
    add(p, 0, 100, 50)
    assert p.schedule(0.0).seqs[0].num_tokens == 100
    add(p, 1, 5000, 4)
    assert [(s.request_id, s.num_tokens) for s in p.schedule(0.0).seqs] == [(1, 737)]


@pytest.mark.parametrize("ttft_ms,chunk", [(None, None), (96.8, 209)])
def test_alone_a_chunk_under_k_over_8_waits_unless_a_first_token_needs_it(ttft_ms, chunk):
    """As above with S = 7.5 ms: request 0's next token is due by 4 + 7.125 = 11.125 ms; half
    of the slack: 5 + 3.0625 = 8.0625 ms >= 2 + 2 x (1 + 0.01 n) -> n = 203, under K / 8 =
    224. Alone (no decode aboard) such a chunk would take one of the pipeline's slots for a
    few tokens, and the decode behind it would wait for a slot: nothing is planned. With a
    TTFT target of 96.8 ms the prompt needs 5000 x T / (0.95 x 96.8 - 2 T) = 209.9 tokens a
    micro-batch (T = 0.95 x 7.5 / 2 = 3.5625 ms): 209 go."""
    extra = {} if ttft_ms is None else {"ttft_slo_ms": ttft_ms}
    p = toy(in_flight=2, tbt_slo_ms=7.5, **extra)
    add(p, 0, 100, 50)
    assert p.schedule(0.0).seqs[0].num_tokens == 100
    add(p, 1, 5000, 4)
    mb = p.schedule(0.0)
    assert (None if mb is None else [(s.request_id, s.num_tokens) for s in mb.seqs]
            ) == (None if chunk is None else [(1, chunk)])


@pytest.mark.parametrize("prompt,rows", [(100, 238), (900, 28)])
def test_rows_under_a_target_are_the_decodes_the_period_holds(prompt, rows):
    """S = 30 ms, 2 in flight: T = 0.95 x 30 / 2 = 14.25 ms. d decodes at KV prompt + 1
    fit in T alone when 1 + 0.01 d + 0.001 (prompt + 1) d <= 14.25: prompt 100 -> 0.111 d
    <= 13.25, d = 119, 2 x 119 = 238 rows; prompt 900 -> 0.911 d <= 13.25, d = 14, 28
    rows. The prompts they bring do not lower it (at 100 output tokens each, d x 9 prompt
    tokens beside d decodes would give 26 at prompt 900): a burst is admitted, not queued.
    Pages hold far more."""
    p = toy(in_flight=2, tbt_slo_ms=30.0, kv_slots=400, watermark=0.0)
    for rid in range(300):
        add(p, rid, prompt, 100)
    p.admit(0.0)
    assert len(p.running) == rows


def test_rows_are_bounded_by_pages_not_by_a_hand_count():
    """16-token pages, a pool of 64 (4 contexts of 256): prompts of 100 tokens and 20
    output (8 pages each, with 30 % of the 1-page growth kept free) -> 8 run at once; no B."""
    p = planner("uniform", paged=True, kv_slots=4, max_seq_len=256, watermark=0.0)
    assert p.max_batch > 1000  # no row cap
    for rid in range(12):
        add(p, rid, 100, 20)
    p.admit(0.0)
    assert len(p.running) == 8


def test_the_growth_reserve_falls_per_microbatch_to_none_and_rises_after_a_preemption():
    """0.3 at the start, 0.002 less per micro-batch planned without a preemption (0.1 after
    100, none after 150), 0.05 more after one that preempted, at most all of the growth."""
    r = GrowthReserve()
    assert r.share == pytest.approx(0.3)
    for _ in range(100):
        r.step(0)
    assert r.share == pytest.approx(0.1)
    for _ in range(60):
        r.step(0)
    assert r.share == 0.0
    r.step(3)  # three preempted while planning this micro-batch: one rise
    assert r.share == pytest.approx(0.05)
    r.step(3)  # none since
    assert r.share == pytest.approx(0.048)
    for n in range(4, 40):
        r.step(n)
    assert r.share == 1.0


def test_with_the_reserve_at_none_admission_counts_only_the_prompts_pages():
    """The pool of the test above after 150 micro-batches without a preemption: 7 pages of
    prompt each and no growth kept free -> 64 // 7 = 9 run at once, not 8."""
    p = planner("uniform", paged=True, kv_slots=4, max_seq_len=256, watermark=0.0)
    for _ in range(150):
        p.reserve.step(0)
    for rid in range(12):
        add(p, rid, 100, 20)
    p.admit(0.0)
    assert len(p.running) == 9


def test_uniform_finishes_every_request_with_caps_and_without():
    """Every prompt token once, every request to its length: the planner's own contract."""
    for extra in ({}, {"chunk_size": 64, "max_batch_size": 4}, {"tbt_slo_ms": 1e6}):
        p = planner("uniform", pp=2, paged=True, **extra)
        for rid in range(30):
            add(p, rid, 50 + 17 * (rid % 5), 3 + rid % 4)
        drive(p, 3)
        assert all(r.finish_reason == "length" and len(r.output_token_ids) == 3 + r.request_id % 4
                   for r in p.requests.values())
        if extra.get("chunk_size"):
            assert p.top == 64
        assert p.num_preemptions or p.reserve.share < GrowthReserve.START  # it fell as it ran


@pytest.mark.parametrize("slo_ms", [100.0, 200.0])
def test_the_tbt_target_holds_on_the_simulated_pipeline(slo_ms):
    """GPT-3 TP8 x PP8 under Poisson load with lulls and bursts of prompts: the p99 time
    between tokens stays within the target (the same run without one goes past 100 ms)."""
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import build_report
    over = {"workload.num_requests": 300, "workload.qps": 1.0, "workload.pd_ratio": 1,
            "cache.kv_slots": 216, "planner": "uniform", "paged": True, "chunk_size": None,
            "max_batch_size": None}  # the paper config's C, B and slots are sarathi's
    cfg = load_config("paper/gpt3_tp8_pp8", tbt_slo_ms=slo_ms, **over)
    s = build_report(simulate(cfg, progress=False))["summary"]
    assert s["tbt_s"]["p99"] <= slo_ms / 1e3
    assert s["finish_reasons"] == {"length": 300}
    if slo_ms == 100.0:
        free = build_report(simulate(load_config("paper/gpt3_tp8_pp8", **over), progress=False))
        assert free["summary"]["tbt_s"]["p99"] > 0.100


def test_target_ms_caps_each_microbatch_by_hand():
    """target_ms = 5: 1 ms + 0.01 ms x n <= 5 ms -> a prompt's chunk of n = 400 tokens."""
    p = toy(target_ms=5.0)
    add(p, 0, 10_000, 4)
    assert [s.num_tokens for s in p.schedule(0.0).seqs] == [400]


def test_with_no_target_requests_arriving_together_start_longest_first():
    """No latency target: the makespan. Of four prompts arriving at once, the ones that will
    decode longest are admitted (and prefilled) first; equal ones keep their arrival order."""
    p = toy()
    for rid, max_tokens in enumerate([3, 10, 10, 5]):
        add(p, rid, 40, max_tokens)
    p.admit(0.0)
    assert [r.request_id for r in p.running] == [1, 2, 3, 0]


def test_a_later_arrival_passes_an_earlier_one_only_by_more_rounds_than_its_delay():
    """Least slack first, by arrival_s - rounds x round_s (round_s 1 s here): A (t 0, 10
    rounds, key -10) goes before B (t 5, 14 rounds, key -9), after C (t 5, 16 rounds, key
    -11); a preempted request at the head stays first; requests not arrived are not moved."""
    waiting = deque()
    order = SlackOrder(waiting, lambda r: r.params.max_tokens, 1.0)
    reqs = {name: Request(i, [1] * 8, SamplingParams(max_tokens=m), seed=0, arrival_s=t)
            for i, (name, m, t) in enumerate([("A", 10, 0.0), ("B", 14, 5.0), ("C", 16, 5.0),
                                              ("D", 99, 9.0)])}
    for r in reqs.values():
        waiting.append(r)
        order.add(r)
    back = Request(9, [1] * 8, SamplingParams(max_tokens=1), seed=0)
    back.num_preemptions = 1
    waiting.appendleft(back)
    order.order(5.0)
    names = {id(r): n for n, r in reqs.items()} | {id(back): "preempted"}
    assert [names[id(r)] for r in waiting] == ["preempted", "C", "A", "B", "D"]


@pytest.mark.parametrize("target", [{"tbt_slo_ms": 1e3}, {"ttft_slo_ms": 1e3}])
def test_with_a_latency_target_the_queue_stays_first_come_first_served(target):
    p = toy(**target)
    assert p.order is None
    for rid, max_tokens in enumerate([3, 10, 10, 5]):
        add(p, rid, 40, max_tokens)
    p.admit(0.0)
    assert [r.request_id for r in p.running] == [0, 1, 2, 3]


def test_a_late_round_with_a_backlog_still_fills_to_the_level_of_those_in_flight():
    """As the level test above, but C is composed at 27 ms: request 2's decode alone would
    end at 27 + 2 x 1.111 = 29.2 ms, past its round's deadline (28.5 ms), so no slack is
    left, and before it C carried the decode alone. With a round's worth of prompt tokens
    waiting (4344 >= depth x K = 3584) the round is late under load, not a quiet pipeline:
    C fills to B's level, 656 tokens (1.111 + 0.01 n <= 7.671 ms). With the prompt short
    (3000 tokens: 2344 left < 3584) it stays a decode alone."""
    for prompt, expect in ((5000, [(2, 1), (1, 656)]), (3000, [(2, 1)])):
        p = toy(in_flight=2, tbt_slo_ms=30.0)
        add(p, 0, 100, 50)
        add(p, 2, 100, 50)
        first = p.schedule(0.0)
        p.on_result(first, SampledTokens(first.mb_id, {0: 7, 2: 7}), 0.0)
        add(p, 1, prompt, 4)
        b = p.schedule(0.0)
        assert [(s.request_id, s.num_tokens) for s in b.seqs] == [(0, 1), (1, 656)]
        c = p.schedule(0.027)
        assert [(s.request_id, s.num_tokens) for s in c.seqs] == expect
