"""Warm-up, steady state and tail (telemetry/windows.py, docs/bubbles.md) on schedules
computed by hand. Times in abstract units; both stages start at 0 on their own clocks.

The schedule used by most tests: requests A (id 10), B (11), C (12) arrive at 0, 3, 6 on the
driver's clock; A finishes at 2.5 (the first finish), so B is the first to arrive after it:
the micro-batch that first carries B opens the steady window, the one that first carries C
(the last to arrive) opens the tail.

  mb  requests  stage 0                         stage 1
  0   A         [0,1)                           [1,2)  wait 1 (fill: upstream 1)
  1   B         [3,4)  gap 1..3: idle 1, dep 1  [4,5)  wait 2 (upstream 2)
  2   A B       [4,6)                           [6,8)  wait 1 (upstream 1)
  3   C         [6,7)  send blocked 1 (down 1)  [8,9)
  4   C         [9,10) gap 8..9: dependency 1   [10,12) wait 1 (upstream 1)

  window   stage 0 (wall, parts)               stage 1               bubble / wall
  warm-up  1: busy 1                           2: busy 1, up 1       1 / 3
  steady   5: busy 3, idle 1, dep 1            6: busy 3, up 3       4 / 11 (idle 1 / 11)
  tail     4: busy 2, down 1, dep 1            4: busy 3, up 1       3 / 8
  whole    10                                  12                    8 / 22
"""
import pytest

from pp_runtime.core.batch import StageTiming
from pp_runtime.telemetry.bubbles import account
from pp_runtime.telemetry.windows import account_windows, format_windows

A, B, C = 10, 11, 12
ARRIVAL = {A: 0.0, B: 3.0, C: 6.0}
FINISH = {A: 2.5, B: 9.0, C: 12.5}
MB_REQUESTS = {0: [A], 1: [B], 2: [A, B], 3: [C], 4: [C]}
IDLE_BEFORE = {1: 1.0}


def T(mb, stage, start, end, wait=0.0, send_wait=0.0):  # noqa: N802
    return StageTiming(mb, stage, 0, wait, 0.0, start, end, send_wait)


SCHEDULE = [T(0, 0, 0, 1), T(1, 0, 3, 4), T(2, 0, 4, 6), T(3, 0, 6, 7, send_wait=1), T(4, 0, 9, 10),
            T(0, 1, 1, 2, wait=1), T(1, 1, 4, 5, wait=2), T(2, 1, 6, 8, wait=1), T(3, 1, 8, 9),
            T(4, 1, 10, 12, wait=1)]


def cut(arrival=ARRIVAL, finish=FINISH, mb_requests=MB_REQUESTS, schedule=SCHEDULE):
    return account_windows(schedule, mb_requests, arrival, finish, IDLE_BEFORE)


def test_three_windows_by_hand():
    w = cut()
    wu, st, tl = w["warmup"], w["steady"], w["tail"]
    assert (wu["stage_wall_s"], wu["bubble_s"], wu["duration_s"]) == (3, 1, 1.5)
    assert wu["bubble_fraction_by_cause"] == pytest.approx(
        {"upstream": 1 / 3, "downstream": 0, "dependency": 0})
    assert (st["stage_wall_s"], st["bubble_s"], st["duration_s"]) == (11, 4, 5.5)
    assert st["bubble_fraction_by_cause"] == pytest.approx(
        {"upstream": 3 / 11, "downstream": 0, "dependency": 1 / 11})
    assert st["idle_fraction"] == pytest.approx(1 / 11)
    assert st["busy_fraction"] == pytest.approx(6 / 11)
    assert (tl["stage_wall_s"], tl["bubble_s"], tl["duration_s"]) == (8, 3, 4)
    assert tl["bubble_fraction_by_cause"] == pytest.approx(
        {"upstream": 1 / 8, "downstream": 1 / 8, "dependency": 1 / 8})
    assert (wu["requests"], st["requests"], tl["requests"]) == ([A], [B], [C])


def test_windows_add_up_to_the_whole_run():
    w = cut()
    whole = account(SCHEDULE, MB_REQUESTS, {0: 0.0, 1: 0.0}, IDLE_BEFORE)
    wall = sum(s.wall_s for s in whole.per_stage)
    assert sum(w[n]["stage_wall_s"] for n in w) == pytest.approx(wall) == 22
    assert sum(w[n]["bubble_s"] for n in w) == pytest.approx(sum(s.bubble_s for s in whole.per_stage))
    assert whole.bubble_fraction == pytest.approx(8 / 22)


def test_a_later_first_finish_moves_the_warm_up_end():
    # A finishes at 4: B (arrived at 3) no longer opens the steady window; C is the first to
    # arrive after it and the last: steady is empty, the warm-up runs until C enters
    w = cut(finish={**FINISH, A: 4.0})
    assert w["steady"]["stage_wall_s"] == 0 and w["steady"]["requests"] == []
    assert w["warmup"]["stage_wall_s"] == 3 + 11 and w["warmup"]["requests"] == [A, B]
    assert w["tail"]["stage_wall_s"] == 8


def test_every_request_at_once_has_no_steady_state():
    w = cut(arrival={A: 0.0, B: 0.0, C: 0.0})
    assert w["steady"]["stage_wall_s"] == 0
    assert w["warmup"]["stage_wall_s"] + w["tail"]["stage_wall_s"] == 22
    lines = format_windows({**w, "steady": {**w["steady"], "arrivals_s": None}}, 8 / 22)
    assert lines[0].startswith("  no steady state") and "whole run 36.4%" in lines[0]


def test_unfinished_requests_leave_the_steady_window_empty():
    # an interrupted run: nobody finished, the pipeline never left its warm-up
    w = cut(finish={A: None, B: None, C: None})
    assert w["steady"]["stage_wall_s"] == 0 and w["tail"]["stage_wall_s"] == 8


def test_the_printed_lines():
    w = cut()
    w = {n: {**v, "arrivals_s": [ARRIVAL[v["requests"][0]]] * 2} for n, v in w.items()}
    steady, cost = format_windows(w, 8 / 22)
    assert steady == ("  steady state: bubble fraction 36.4% (upstream 27.3%, downstream 0.0%, "
                      "dependency 9.1%), 5.5 s (arrivals 3.0-3.0 s, idle 9.1%)")
    assert cost == "  warm-up 1.5 s at 33.3%, tail 4.0 s at 37.5%; whole run 36.4% (+0.0 points)"
    assert format_windows(None, 0.1) == []  # a report from before the windows


@pytest.mark.parametrize("dp", [1, 2])
def test_a_simulated_poisson_run_reports_windows_that_add_up(dp):
    # the simulator's records go through the same recorder: the report's windows add up to
    # its per-stage table (every replica's stages), and the warm-up ends at the first finish
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import build_report, format_summary
    from tests.telemetry.test_report import TokenCost, cfg

    c = cfg(dp=dp).with_overrides(**{"workload.qps": 20.0, "workload.num_requests": 40})
    report = build_report(simulate(c, TokenCost(2), progress=False))
    s, w = report["summary"], report["summary"]["windows"]
    wall = sum(st["wall_s"] for st in s["per_stage"])
    bubble = sum(st["bubble_s"] for st in s["per_stage"])
    assert sum(w[n]["stage_wall_s"] for n in ("warmup", "steady", "tail")) == pytest.approx(wall)
    assert sum(w[n]["bubble_s"] for n in ("warmup", "steady", "tail")) == pytest.approx(bubble)
    assert sum(w[n]["requests_entered"] for n in ("warmup", "steady", "tail")) == 40
    assert w["steady"]["requests_entered"] > 0 and w["tail"]["requests_entered"] == dp
    first_finish = min(r["finish_s"] for r in report["requests"])
    assert w["steady"]["arrivals_s"][0] > first_finish >= w["warmup"]["arrivals_s"][1]
    assert "  steady state: bubble fraction" in format_summary(report)
