"""Bubble accounting on schedules computed by hand (two stages, paper Fig. 5 shapes).

Times are in abstract units. A stage takes its next micro-batch call as soon as the
previous one ends (calls are queued ahead, as Ray actors do); `wait` is the time from
taking the call until the previous stage's activations arrive."""
import pytest

from pp_runtime.batch import StageTiming
from pp_runtime.telemetry.bubbles import account


def T(mb, stage, start, end, wait=0.0, transfer=0.0):  # noqa: N802
    return StageTiming(mb, stage, 0, wait, transfer, start, end)


def test_pb1_short_then_long_prefill():
    """A (cost 1), B (cost 4), C (cost 1) on both stages, all issued at 0.
    stage 0: A [0,1) B [1,5) C [5,6)
    stage 1: A [1,2) after waiting 1 (fill); B [5,9) after waiting 3 (PB1); C [9,10)."""
    timings = [T(0, 0, 0, 1), T(1, 0, 1, 5), T(2, 0, 5, 6),
               T(0, 1, 1, 2, wait=1), T(1, 1, 5, 9, wait=3), T(2, 1, 9, 10)]
    rep = account(timings, {0: [0], 1: [1, 2], 2: [0]}, stage_start_s={0: 0.0, 1: 0.0})
    s0, s1 = rep.per_stage
    assert (s0.wall_s, s0.busy_s, s0.bubble_s, s0.idle_s) == (6, 6, 0, 0)
    assert (s1.wall_s, s1.busy_s, s1.bubble_s, s1.idle_s) == (10, 6, 4, 0)
    assert rep.mb_bubble_s == {0: 1, 1: 3, 2: 0}
    assert rep.request_bubble_s == {0: 1, 1: 3, 2: 3}
    assert rep.bubble_fraction == pytest.approx(4 / 16)


def test_pb2_decode_then_prefill():
    """D1 (cost 1), P (cost 4), D2 (cost 1): stage 1 waits 3 for the prefill."""
    timings = [T(0, 0, 0, 1), T(1, 0, 1, 5), T(2, 0, 5, 6),
               T(0, 1, 1, 2, wait=1), T(1, 1, 5, 9, wait=3), T(2, 1, 9, 10)]
    rep = account(timings, {0: [7], 1: [8], 2: [7]}, stage_start_s={0: 0.0, 1: 0.0})
    assert rep.request_bubble_s == {7: 1, 8: 3}


def test_pb3_decodes_with_different_kv_lengths():
    """Costs 2, 3, 2, 3 on both stages (longer KV, longer decode batch).
    stage 0: [0,2) [2,5) [5,7) [7,10)
    stage 1: [2,4) wait 2 (fill); [5,8) wait 1 (PB3); [8,10); [10,13)."""
    timings = [T(0, 0, 0, 2), T(1, 0, 2, 5), T(2, 0, 5, 7), T(3, 0, 7, 10),
               T(0, 1, 2, 4, wait=2), T(1, 1, 5, 8, wait=1), T(2, 1, 8, 10), T(3, 1, 10, 13)]
    rep = account(timings, stage_start_s={0: 0.0, 1: 0.0})
    s1 = rep.per_stage[1]
    assert (s1.busy_s, s1.bubble_s, s1.idle_s, s1.wall_s) == (10, 3, 0, 13)
    assert rep.mb_bubble_s == {0: 2, 1: 1, 2: 0, 3: 0}


def test_idle_without_work_and_transfer_are_not_bubbles():
    """Micro-batch 1 is issued only at 5 (the planner had nothing before).
    stage 0: m0 [0,2); m1 [5,6): a gap of 3 with no call in hand: idle.
    stage 1: m0 [2,3) (wait 1.5 + transfer 0.5); idle 3..5; takes m1's call at 5,
             waits 1 for stage 0, then 0.5 transfer: m1 [6.5,7.5)."""
    timings = [T(0, 0, 0, 2), T(1, 0, 5, 6),
               T(0, 1, 2, 3, wait=1.5, transfer=0.5), T(1, 1, 6.5, 7.5, wait=1, transfer=0.5)]
    rep = account(timings, {0: [0], 1: [0]}, stage_start_s={0: 0.0, 1: 0.0})
    s0, s1 = rep.per_stage
    assert (s0.busy_s, s0.idle_s, s0.bubble_s) == (3, 3, 0)
    assert (s1.busy_s, s1.transfer_s, s1.bubble_s, s1.idle_s) == (2, 1, 2.5, 2)
    for s in rep.per_stage:  # the four kinds add up to the wall time of each stage
        assert s.busy_s + s.transfer_s + s.bubble_s + s.idle_s == pytest.approx(s.wall_s)
    assert rep.request_bubble_s == {0: 2.5}


def test_identical_costs_have_no_steady_state_bubble():
    """Three stages, cost 1 everywhere, ten micro-batches issued at once: only the pipeline
    fill is a bubble (stage s waits s units for its first micro-batch)."""
    stages, n = 3, 10
    timings, end = [], {}
    for s in range(stages):
        free = 0.0
        for k in range(n):
            ready = end.get((s - 1, k), 0.0)
            start = max(free, ready)
            timings.append(T(k, s, start, start + 1, wait=start - free))
            free = end[(s, k)] = start + 1
    rep = account(timings, stage_start_s={s: 0.0 for s in range(stages)})
    assert [s.bubble_s for s in rep.per_stage] == [0, 1, 2]
    assert all(rep.mb_bubble_s[k] == 0 for k in range(1, n))


def test_clock_domains_are_per_stage():
    """Stage 1's clock is 1000 units ahead of stage 0's: nothing changes."""
    base = [T(0, 0, 0, 1), T(1, 0, 1, 5), T(0, 1, 1, 2, wait=1), T(1, 1, 5, 9, wait=3)]
    shifted = [t if t.stage == 0 else T(t.mb_id, 1, t.compute_start_s + 1000,
                                         t.compute_end_s + 1000, t.wait_s) for t in base]
    a = account(base, stage_start_s={0: 0.0, 1: 0.0})
    b = account(shifted, stage_start_s={0: 0.0, 1: 1000.0})
    assert a == b


def test_overlapping_compute_on_one_stage_is_an_error():
    with pytest.raises(ValueError, match="stage 0: micro-batch 1 starts"):
        account([T(0, 0, 0, 2), T(1, 0, 1, 3)])
