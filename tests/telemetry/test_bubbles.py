"""Bubble accounting by cause on schedules computed by hand (paper Fig. 5 shapes and more).

Times are in abstract units. A stage takes its next micro-batch call as soon as the
previous one ends (calls are queued ahead, as Ray actors do); `wait` is the time from
taking the call until the previous stage's activations arrive (upstream), `send_wait` the
time after computing until the next stage took the previous send (downstream)."""
import pytest

from pp_runtime.core.batch import StageTiming
from pp_runtime.telemetry.bubbles import CAUSES, account


def T(mb, stage, start, end, wait=0.0, transfer=0.0, send_wait=0.0):  # noqa: N802
    return StageTiming(mb, stage, 0, wait, transfer, start, end, send_wait)


def parts(s):
    """(busy, transfer, upstream, downstream, dependency, idle, wall) of one stage."""
    return (s.busy_s, s.transfer_s, s.upstream_s, s.downstream_s, s.dependency_s, s.idle_s, s.wall_s)


def assert_adds_up(rep):
    for s in rep.per_stage:  # the parts add up to the wall time of each stage
        assert s.busy_s + s.transfer_s + s.bubble_s + s.idle_s == pytest.approx(s.wall_s)
        assert min(parts(s)) >= 0
        assert s.bubble_s == pytest.approx(sum(s.bubble_by_cause_s.values()))


def test_pb1_short_then_long_prefill():
    """A (cost 1), B (cost 4), C (cost 1) on both stages, all issued at 0.
    stage 0: A [0,1) B [1,5) C [5,6)
    stage 1: A [1,2) after waiting 1 (fill); B [5,9) after waiting 3 (PB1); C [9,10)."""
    timings = [T(0, 0, 0, 1), T(1, 0, 1, 5), T(2, 0, 5, 6),
               T(0, 1, 1, 2, wait=1), T(1, 1, 5, 9, wait=3), T(2, 1, 9, 10)]
    rep = account(timings, {0: [0], 1: [1, 2], 2: [0]}, stage_start_s={0: 0.0, 1: 0.0})
    s0, s1 = rep.per_stage
    assert parts(s0) == (6, 0, 0, 0, 0, 0, 6)
    assert parts(s1) == (6, 0, 4, 0, 0, 0, 10)
    assert rep.mb_bubble_s == {0: 1, 1: 3, 2: 0}
    assert rep.request_bubble_s == {0: 1, 1: 3, 2: 3}
    assert rep.bubble_fraction == pytest.approx(4 / 16)
    assert rep.bubble_fraction_by_cause == pytest.approx({"upstream": 4 / 16, "downstream": 0,
                                                          "dependency": 0})


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
    assert parts(rep.per_stage[1]) == (10, 0, 3, 0, 0, 0, 13)
    assert rep.mb_bubble_s == {0: 2, 1: 1, 2: 0, 3: 0}


def test_ring_stall_is_a_dependency_bubble_on_stage_0():
    """Two stages, two micro-batches in flight, every cost 1 but m1 costs 4 on stage 1.
    stage 0: m0 [0,1) m1 [1,2) m2 [2,3) ... m3 only once m1's result is back at 6: [6,7).
      3..6 stage 0 holds nothing while m1's requests are unfinished: dependency 3
      (the old rule called this idle, so stage 0 could never show a bubble).
    stage 1: m0 [1,2) after the fill (upstream 1), m1 [2,6), m2 [6,7), m3 [7,8)."""
    timings = [T(0, 0, 0, 1), T(1, 0, 1, 2), T(2, 0, 2, 3), T(3, 0, 6, 7),
               T(0, 1, 1, 2, wait=1), T(1, 1, 2, 6), T(2, 1, 6, 7), T(3, 1, 7, 8)]
    rep = account(timings, {k: [k] for k in range(4)}, stage_start_s={0: 0.0, 1: 0.0})
    s0, s1 = rep.per_stage
    assert parts(s0) == (4, 0, 0, 0, 3, 0, 7)
    assert parts(s1) == (7, 0, 1, 0, 0, 0, 8)
    assert s0.bubble_by_cause_s == {"upstream": 0, "downstream": 0, "dependency": 3}
    # a micro-batch is charged only the stalls it suffered while it existed
    assert rep.mb_bubble_s == {0: 1, 1: 0, 2: 0, 3: 0}
    assert_adds_up(rep)


def test_a_wait_for_the_token_hop_is_the_dependency_it_names():
    """The token hop: stage 0 holds m2's call from 2.5 and waits until 4 for the ids its
    decodes need (`token_wait_s` 1.5). Its gap 2..4 is all dependency (2), of it 1.5 on the
    token hop; the 0.5 before the call came is the rest. A wait longer than the gap (the
    two clocks' rounding) is cut to the gap; an idle stretch comes out of what is left."""
    timings = [T(0, 0, 0, 1), T(1, 0, 1, 2), StageTiming(2, 0, 0, 0.0, 0.0, 4, 5, 0.0, 1.5)]
    s0 = account(timings, stage_start_s={0: 0.0}).per_stage[0]
    assert (s0.dependency_s, s0.token_s, s0.idle_s) == (2, 1.5, 0)
    assert_adds_up(account(timings, stage_start_s={0: 0.0}))
    longer = timings[:2] + [StageTiming(2, 0, 0, 0.0, 0.0, 4, 5, 0.0, 2.5)]
    assert account(longer, stage_start_s={0: 0.0}).per_stage[0].token_s == 2
    idle = account(timings, stage_start_s={0: 0.0}, idle_before_s={2: 1.0}).per_stage[0]
    assert (idle.dependency_s, idle.token_s, idle.idle_s) == (1.5, 1.5, 0.5)


def test_back_pressure_is_a_downstream_bubble():
    """Three stages costing 1, 1, 3; m0..m2 issued at 0 (the schedule SimExecutor makes:
    tests/executors/test_sim.py). Stage 1 computes m2 in [3,4) but stage 2 takes m1's
    send only when it starts m1 at 5: stage 1 is blocked 4..5 (downstream 1)."""
    timings = [T(0, 0, 0, 1), T(1, 0, 1, 2), T(2, 0, 2, 3),
               T(0, 1, 1, 2, wait=1), T(1, 1, 2, 3), T(2, 1, 3, 4, send_wait=1),
               T(0, 2, 2, 5, wait=2), T(1, 2, 5, 8), T(2, 2, 8, 11)]
    rep = account(timings, {0: [0], 1: [1], 2: [2]}, stage_start_s={s: 0.0 for s in range(3)})
    s0, s1, s2 = rep.per_stage
    assert parts(s0) == (3, 0, 0, 0, 0, 0, 3)
    assert parts(s1) == (3, 0, 1, 1, 0, 0, 5)  # the wall ends when the blocked call returns
    assert parts(s2) == (9, 0, 2, 0, 0, 0, 11)
    assert rep.mb_bubble_s == {0: 1 + 2, 1: 0, 2: 1}  # m2 is charged the block after it
    assert_adds_up(rep)


def test_a_poisson_gap_is_idle_and_the_drain_before_it_is_dependency():
    """Micro-batch 1's request arrives at 5, after m0 finished everywhere (its result is
    back at 3): the driver was idle 3..5 and hands `idle_before_s = 2` with m1.
    stage 0: m0 [0,2); 2..3 m0 still on stage 1 (dependency 1); 3..5 idle 2; m1 [5,6).
    stage 1: m0 [2,3) (wait 1.5 + transfer 0.5); 3..5 idle 2; takes m1's call at 5,
             waits 1 for stage 0, then 0.5 transfer: m1 [6.5,7.5)."""
    timings = [T(0, 0, 0, 2), T(1, 0, 5, 6),
               T(0, 1, 2, 3, wait=1.5, transfer=0.5), T(1, 1, 6.5, 7.5, wait=1, transfer=0.5)]
    rep = account(timings, {0: [0], 1: [1]}, stage_start_s={0: 0.0, 1: 0.0},
                  idle_before_s={1: 2.0})
    s0, s1 = rep.per_stage
    assert parts(s0) == (3, 0, 0, 0, 1, 2, 6)
    assert parts(s1) == (2, 1, 2.5, 0, 0, 2, 7.5)
    assert rep.request_bubble_s == {0: 1.5, 1: 1}
    assert_adds_up(rep)
    # without the driver's word, the same gap is a dependency bubble
    assert account(timings, stage_start_s={0: 0.0, 1: 0.0}).per_stage[0].dependency_s == 3


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
    assert [s.upstream_s for s in rep.per_stage] == [0, 1, 2]
    assert all(rep.mb_bubble_s[k] == 0 for k in range(1, n))


def test_clock_domains_are_per_stage():
    """Stage 1's clock is 1000 units ahead of stage 0's: nothing changes, causes included."""
    base = [T(0, 0, 0, 1), T(1, 0, 1, 5, send_wait=0.5), T(2, 0, 9, 10),
            T(0, 1, 1, 2, wait=1), T(1, 1, 5.5, 9, wait=3), T(2, 1, 10, 11, wait=0.5)]
    shifted = [t if t.stage == 0 else T(t.mb_id, 1, t.compute_start_s + 1000, t.compute_end_s + 1000,
                                         t.wait_s, t.transfer_s, t.send_wait_s) for t in base]
    idle = {2: 2.0}
    a = account(base, stage_start_s={0: 0.0, 1: 0.0}, idle_before_s=idle)
    b = account(shifted, stage_start_s={0: 0.0, 1: 1000.0}, idle_before_s=idle)
    assert a == b
    assert all(getattr(a.per_stage[0], f"{c}_s") > 0 for c in ("downstream", "dependency", "idle"))


def test_overlapping_compute_on_one_stage_is_an_error():
    with pytest.raises(ValueError, match="stage 0: micro-batch 1 starts"):
        account([T(0, 0, 0, 2), T(1, 0, 1, 3)])
    with pytest.raises(ValueError, match="before the previous call ended"):  # blocked until 3
        account([T(0, 0, 0, 2, send_wait=1), T(1, 0, 2.5, 3)])


def test_causes_are_the_report_keys():
    assert CAUSES == ("upstream", "downstream", "dependency")
