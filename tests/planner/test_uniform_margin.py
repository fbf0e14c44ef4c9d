"""`uniform`'s time budget against what the pipeline measured: the residual (measured /
priced) and the TBT margin from how much longer than planned the tokens' gaps came out,
by hand on test_uniform's toy cost model."""
from collections import deque

import pytest

from helpers import add
from test_uniform import Toy, beside_a_decode, toy

from pp_runtime.core.batch import MicroBatch, Sampling, SampledTokens, SeqChunk
from pp_runtime.planner.budget import TimeBudget
from pp_runtime.planner.due import TokensDue


def test_the_residual_shrinks_the_period_when_the_pipeline_is_slower_than_priced():
    b = TimeBudget(Toy(), 3, 128, tbt_slo_s=0.3)
    for _ in range(200):
        b.observe(predicted_s=0.01, measured_s=0.02)  # twice as slow as priced
    assert b.residual == pytest.approx(2.0, rel=1e-3)
    assert b.period_s == pytest.approx(0.095 / 2, rel=1e-3)


def excess(budget, each_s, returns=32, per_return=8):
    """`returns` micro-batches come back, each with `per_return` tokens whose gaps came out
    `each_s` longer than planned (a list: one value per token, in order)."""
    values = each_s if isinstance(each_s, list) else [each_s] * (returns * per_return)
    for r in range(returns):
        budget.unplanned(values[r * per_return:(r + 1) * per_return])


def slowed(budget, margin):
    """One reading of unplanned excess whose p99 takes the margin to `margin`."""
    excess(budget, (1 - margin) * budget.tbt_slo_s)
    assert budget.margin == pytest.approx(margin)


def test_gaps_longer_than_planned_take_their_p99_out_of_the_margin():
    """S = 300 ms, 3 in flight. Every 32 returns, with 256 tokens kept, the margin is
    min(0.95, 1 - p99 / S) of how much longer than planned the last 2048 gaps came out.
    15 ms longer (the room 0.95 leaves) changes nothing; 250 tokens 1 ms and 6 tokens
    40 ms longer: the p99 (the 253rd of 256, sorted) is 40 ms -> margin 1 - 0.04 / 0.3 =
    0.8667, T = 0.8667 x 0.3 / 3 = 86.67 ms. Fewer than 256 kept: no reading. Once the long
    ones leave the window (2048 shorter than planned), 0.95 again."""
    b = TimeBudget(Toy(), 3, 128, tbt_slo_s=0.3)
    excess(b, 0.015)
    assert (b.margin, b.base_s) == (0.95, pytest.approx(0.095))
    b = TimeBudget(Toy(), 3, 128, tbt_slo_s=0.3)
    excess(b, [0.04 if i % 40 == 39 else 0.001 for i in range(248)], returns=31)
    assert b.margin == 0.95  # 31 returns, 248 kept: no reading yet
    excess(b, [0.001] * 8, returns=1)
    assert b.margin == pytest.approx(1 - 0.04 / 0.3)
    assert b.base_s == pytest.approx((1 - 0.04 / 0.3) * 0.1)
    excess(b, -0.002, returns=256)  # shorter than planned
    assert (b.margin, b.base_s) == (0.95, pytest.approx(0.095))
    hand = TimeBudget(Toy(), 3, 128, 0.3, target_s=0.02)  # target_ms: T stays, the deadline moves
    excess(hand, 0.2)
    assert (hand.margin, hand.base_s) == (0.5, 0.02)  # at most half the target


def test_a_gap_is_planned_from_the_previous_token_as_then_known():
    """Request 7's token comes back at 1.0 s. Micro-batch 1, planned to come back at
    1.2 s, brings its next token: planned gap 0.2 s; micro-batch 2, planned ahead (before
    1's return) to come back at 1.5 s, the one after: planned gap 1.5 - 1.2 = 0.3 s.
    Micro-batch 1 comes back at 1.26 s: 60 ms longer than planned; micro-batch 2 at 1.56 s,
    as late as the token before it: its gap came out as planned (0.3 s), excess 0."""
    due = TokensDue()
    seq = SeqChunk(7, [], 10, (1,), Sampling(0.0, 1.0, 0), is_decode=True)
    due.last_s[7] = 1.0
    done = {1: 1.2}
    due.bring(MicroBatch(1, (seq,)), done)
    done[2] = 1.5
    due.bring(MicroBatch(2, (seq,)), done)
    assert due.back(MicroBatch(1, (seq,)), {7: 3}, 1.26) == [pytest.approx(0.06)]
    assert due.back(MicroBatch(2, (seq,)), {7: 4}, 1.56) == [pytest.approx(0.0)]


def test_the_planner_reads_how_much_longer_than_planned_its_tokens_came():
    """S = 30 ms. 16 prompts computed at once, then 8 decodes a micro-batch (ceil(16 / pp)),
    kept 2 ahead: a request rides every second micro-batch, so its gap spans two returns.
    Every micro-batch back when the clock predicts it: nothing unplanned, the margin stays
    0.95. Every second one 9 ms later than predicted: each gap spans one of them, 9 ms
    longer than planned, and at the 64th return (504 kept) the margin is 1 - 9 / 30 = 0.7."""
    def back(p, mb, now):
        p.on_result(mb, SampledTokens(mb.mb_id, {s.request_id: 7 for s in mb.seqs
                                                  if s.sampling is not None}), now)
    for late_s, margin in (((0.0,), 0.95), ((0.0, 0.009), 0.7)):
        p = toy(tbt_slo_ms=30.0)
        for rid in range(16):
            add(p, rid, 4, 1000)
        first = p.schedule(0.0)
        back(p, first, p.clock.done[first.mb_id])
        flight = deque([p.schedule(0.0), p.schedule(0.0)])
        for i in range(63):
            mb = flight.popleft()
            now = p.clock.done[mb.mb_id] + late_s[i % len(late_s)]
            back(p, mb, now)
            flight.append(p.schedule(now))
        assert len(p.budget.excess) == 504
        assert max(p.budget.excess) == pytest.approx(late_s[-1], abs=1e-9)
        assert p.budget.margin == pytest.approx(margin)


def test_a_late_pipeline_plans_its_rounds_to_a_smaller_margin():
    """As test_the_tbt_target_cuts_the_chunk_by_the_round, after gaps 6 ms longer than
    planned took the margin to 0.8 (`slowed`): the deadline is 0.8 x 30 = 24
    ms, half of the slack 2.222 + 0.5 x 21.778 = 13.111 ms >= 2 x (1.101 + 0.01 (n + 1))
    ms -> n + 1 <= 545.5: n = 544 (656 with the margin 0.95)."""
    p = toy(in_flight=2, tbt_slo_ms=30.0)
    slowed(p.budget, 0.8)
    assert beside_a_decode(p) == [(0, 1, True), (1, 544, False)]


def test_a_smaller_margin_leaves_the_rows_at_the_targets_pace():
    """As above at prompt 100, after gaps 6 ms longer than planned took the margin to 0.8:
    rounds are planned to 0.8 x 30 = 24 ms, but the rows stay priced at 0.95: 238 (at
    T = 12 ms: 0.111 d <= 11, d = 99, 198 rows). Late returns are noise added to each
    round, not a cost of each row: on the real CPU pipeline a row count priced at the
    margin's floor admitted 3-6 requests and arrivals queued for admission."""
    p = toy(in_flight=2, tbt_slo_ms=30.0, kv_slots=400, watermark=0.0)
    slowed(p.budget, 0.8)
    for rid in range(300):
        add(p, rid, 100, 100)
    p.admit(0.0)
    assert len(p.running) == 238
