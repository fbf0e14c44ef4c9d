"""The driver loop (`driver.run`): wall-clock races, idle time handed to the stages, which
errors end a run as ExecutorFailed. A real planner and the simulated executor, with costs
and clocks chosen so every time is known by hand."""
import time

import pytest

from pp_runtime.core import driver
from pp_runtime.executors.sim import SimExecutor, VirtualClock
from pp_runtime.core.request import FinishReason
from pp_runtime.telemetry.recorder import RunRecorder
from planner.helpers import add, planner


class UnitCost:
    """Every stage takes 1 per micro-batch; sends are free."""

    def __init__(self, pp):
        self.pp = pp

    def stage_times(self, prefills, decode_kv_lens):
        return [1.0] * self.pp

    def send_time(self, num_tokens, stage):
        return 0.0


@pytest.mark.parametrize("arrival", [0.5, 0.7])
def test_a_request_arriving_between_clock_reads_does_not_abort_the_run(arrival):
    """The driver's clock moves 0.3 per read (a wall clock between two reads: 0.3, 0.6,
    0.9, ...); the request arrives just after the first read (0.5) or the second (0.7).
    Reading the clock three times in the idle branch saw "not arrived" and then "arrived"
    (planner has work but scheduled nothing) or slept a negative time (ValueError from
    time.sleep); one reading per decision does neither."""
    p = planner("sarathi")
    add(p, 0, prompt_len=4, max_tokens=2, arrival=arrival)
    reads, slept = [0.0], []

    def clock():
        reads[0] += 0.3
        return reads[0]

    ex = SimExecutor(UnitCost(2), 2, VirtualClock())
    driver.run(p, ex, 2, clock, sleep=lambda s: slept.append(s) if s >= 0 else time.sleep(s))
    assert p.requests[0].finish_reason == FinishReason.LENGTH
    assert all(s >= 0 for s in slept)


def test_the_idle_gap_before_a_late_arrival_reaches_every_stage():
    """Two stages costing 1; r0 (arrives at 0) is a 4-token prompt and one decode, r1
    arrives at 10 with the same shape.
      stage 0: m0 [0,1)  m1 [2,3)  m2 [10,11)  m3 [12,13)
      stage 1: m0 [1,2)  m1 [3,4)  m2 [11,12)  m3 [13,14)
    r0's last result is back at 4; nothing arrived until 10: idle 6 on both stages. The
    rest of stage 0's gaps (1..2, 3..4, 11..12) wait for sampled tokens: dependency."""
    clock = VirtualClock()
    p = planner("sarathi")
    add(p, 0, prompt_len=4, max_tokens=2, arrival=0.0)
    add(p, 1, prompt_len=4, max_tokens=2, arrival=10.0)
    rec, mbs = RunRecorder(clock), []
    driver.run(p, SimExecutor(UnitCost(2), 2, clock), 2, clock,
               lambda mb, out: (mbs.append(mb), rec(mb, out)), sleep=clock.sleep)
    assert [mb.idle_before_s for mb in mbs] == [0.0, 0.0, 6.0, 0.0]
    s0, s1 = rec.bubbles().per_stage
    assert (s0.busy_s, s0.dependency_s, s0.idle_s, s0.upstream_s, s0.wall_s) == (4, 3, 6, 0, 13)
    assert (s1.busy_s, s1.dependency_s, s1.idle_s, s1.upstream_s, s1.wall_s) == (4, 0, 6, 4, 14)


class Boom(Exception):
    pass


def test_a_callback_bug_is_not_an_executor_failure():
    """A reporting callback that raises: its own exception comes out (not ExecutorFailed),
    the micro-batches still in flight are collected, the requests end with error."""
    clock = VirtualClock()
    p = planner("sarathi")
    for rid in range(3):
        add(p, rid, prompt_len=300, max_tokens=4)
    ex = SimExecutor(UnitCost(2), 2, clock)

    def bad(mb, out):
        raise Boom("a bug in a report")

    with pytest.raises(Boom):
        driver.run(p, ex, 2, clock, bad, sleep=clock.sleep)
    assert not ex._done  # nothing left in flight: the executor can run again
    assert {r.finish_reason for r in p.requests.values()} == {FinishReason.ERROR}


def test_an_executor_error_ends_the_run_as_executor_failed():
    clock = VirtualClock()
    p = planner("sarathi")
    add(p, 0, prompt_len=8, max_tokens=4)

    class Dies(SimExecutor):
        def wait(self, handle):
            raise RuntimeError("stage 1 died")

    with pytest.raises(driver.ExecutorFailed, match="RuntimeError: stage 1 died"):
        driver.run(p, Dies(UnitCost(2), 2, clock), 2, clock, sleep=clock.sleep)
    assert p.requests[0].finish_reason == FinishReason.ERROR
