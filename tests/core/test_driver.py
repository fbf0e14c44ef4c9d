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


class Hooks:
    """`driver.run`'s on_submit / on_collect, as a list of events."""

    def __init__(self):
        self.events = []

    def submit(self, mb):
        self.events.append(("submit", mb.mb_id))

    def collect(self, mb, out):
        self.events.append(("collect", mb.mb_id, None if out is None else out.mb_id))

    def balanced(self) -> bool:
        """Every micro-batch submitted was collected once, after its submit."""
        submitted = [e[1] for e in self.events if e[0] == "submit"]
        collected = [e[1] for e in self.events if e[0] == "collect"]
        return sorted(submitted) == sorted(collected) and len(set(collected)) == len(collected)


def test_the_hooks_see_each_submit_before_the_executor_and_each_result_once():
    clock = VirtualClock()
    p = planner("sarathi")
    for rid in range(3):
        add(p, rid, prompt_len=40, max_tokens=3)
    hooks, seen = Hooks(), []

    class Seen(SimExecutor):
        def submit(self, mb):
            seen.append(hooks.events[-1])  # on_submit ran just before
            return super().submit(mb)

    driver.run(p, Seen(UnitCost(2), 2, clock), 2, clock, sleep=clock.sleep,
               on_submit=hooks.submit, on_collect=hooks.collect)
    assert seen and all(e[0] == "submit" for e in seen)
    assert hooks.balanced()
    assert all(e[1] == e[2] for e in hooks.events if e[0] == "collect")  # each its own result


@pytest.mark.parametrize("fails", ["wait", "submit"])
def test_micro_batches_lost_in_a_failure_are_collected_with_none(fails):
    """Three in flight when the executor fails: every one submitted is collected (the
    in-flight gauge goes back to 0), the lost ones with None."""
    clock = VirtualClock()
    p = planner("sarathi")
    for rid in range(4):
        add(p, rid, prompt_len=300, max_tokens=4)
    hooks, calls = Hooks(), {"submit": 0, "wait": 0}

    class Dies(SimExecutor):
        def submit(self, mb):
            calls["submit"] += 1
            if fails == "submit" and calls["submit"] == 5:
                raise RuntimeError("stage 1 died")
            return super().submit(mb)

        def wait(self, handle):
            calls["wait"] += 1
            if fails == "wait" and calls["wait"] == 2:
                raise RuntimeError("stage 1 died")
            return super().wait(handle)

    with pytest.raises(driver.ExecutorFailed):
        driver.run(p, Dies(UnitCost(2), 2, clock), 3, clock, sleep=clock.sleep,
                   keep_on_failure=True, on_submit=hooks.submit, on_collect=hooks.collect)
    assert hooks.balanced()
    lost = [e[1] for e in hooks.events if e[0] == "collect" and e[2] is None]
    assert len(lost) == 3, hooks.events  # the failed one and the two behind it


def test_a_callback_bug_collects_the_micro_batches_in_flight_with_their_results():
    clock = VirtualClock()
    p = planner("sarathi")
    for rid in range(3):
        add(p, rid, prompt_len=300, max_tokens=4)
    hooks = Hooks()

    def bad(mb, out):
        raise Boom("a bug in a report")

    with pytest.raises(Boom):
        driver.run(p, SimExecutor(UnitCost(2), 2, clock), 2, clock, bad, sleep=clock.sleep,
                   on_submit=hooks.submit, on_collect=hooks.collect)
    assert hooks.balanced()
    assert all(e[2] is not None for e in hooks.events if e[0] == "collect")  # drained, not lost
