"""The torch-free rules of a recovery (engine/recovery.py, Planner.adopt, the report's
line): the budget's sliding window, the stage a failure names, requests handed to a fresh
planner in order with their KV dropped, the report's recovery line."""
import pytest

from pp_runtime.config import load_config
from pp_runtime.core.errors import WorkerFailed
from pp_runtime.core.request import Request, SamplingParams
from pp_runtime.engine.recovery import Budget, named_rank
from pp_runtime.planner import make_planner
from pp_runtime.telemetry.report import format_summary


def test_the_budget_holds_at_most_n_attempts_in_any_window():
    b = Budget(2, 60.0)
    assert b.take(0.0) and b.take(10.0)
    assert not b.take(59.9)  # two in (-0.1, 59.9]
    assert b.take(60.0)  # the attempt at 0 left the window
    assert not b.take(69.9) and b.take(70.0)
    assert not Budget(0, 60.0).take(0.0)


def test_the_stage_is_read_from_the_failure_or_its_causes():
    inner = WorkerFailed("stage 2 tp rank 1 did not finish micro-batch 7 within 10 s")
    try:
        raise RuntimeError("WorkerFailed: the pipeline failed") from inner
    except RuntimeError as outer:
        assert named_rank(outer) == (2, 1)
    assert named_rank(RuntimeError("no rank named")) == (None, None)


def test_a_fresh_planner_takes_the_requests_first_in_line_with_their_kv_gone():
    cfg = load_config("tiny", chunk_size=16, tile_size=16, max_batch_size=4, pp=2)
    old = make_planner(cfg)
    reqs = [Request(i, [1 + i] * 20, SamplingParams(max_tokens=5), 0, arrival_s=0.0) for i in range(3)]
    for r in reqs:
        old.add(r)
    mb = old.schedule(0.0)  # some prompt tokens in flight; their result never comes
    assert mb is not None and any(r.num_scheduled for r in reqs)
    reqs[0].output_token_ids.append(42)  # as if it had sampled before the failure
    moved = old.unfinished()
    assert moved[:1] == [reqs[0]] and set(moved) == set(reqs)
    new = make_planner(cfg)
    late = Request(9, [5] * 4, SamplingParams(max_tokens=5), 0, arrival_s=1.0)
    new.add(late)
    new.adopt(moved)
    assert list(new.waiting) == moved + [late]  # before anything that waited there
    for r in moved:
        assert r.blocks is None and r.num_scheduled == r.num_computed == 0
        assert r.prefill_len == r.prompt_len + len(r.output_token_ids)
        assert r.num_preemptions == 0  # a recovery is not a preemption
    assert reqs[0].prefill_len == 21  # the token it had is computed again, not sampled again
    new.schedule(0.0)  # and the pool admits them again
    assert all(r.blocks is not None for r in moved)


def test_the_report_lists_each_recovery():
    summary = {"planner": "uniform", "executor": "ray", "num_requests": 2, "num_microbatches": 9,
               "deployment": {"model": "m", "tp": 1, "pp": 2, "dp": 1, "gpu": "cpu"},
               "makespan_s": 3.0, "throughput_tok_s": 10.0, "bubble_fraction": 0.1,
               "bubble_per_request_s": dict(median=0.1, p90=0.1, p99=0.1, mean=0.1),
               "ttft_s": dict(median=0.1, p99=0.2), "tbt_s": dict(median=0.01, p99=0.02),
               "finish_reasons": {"length": 2}, "per_stage": [],
               "recoveries": [dict(at_s=1.5, stage=1, tp_rank=0, cause="x", seconds=6.8,
                                   attempts=1, requests=2, tokens=92)]}
    text = format_summary({"summary": summary})
    assert ("recovery 1 at 1.50 s: stage 1 tp rank 0 failed; workers replaced in 6.80 s "
            "(1 attempt(s)), 2 requests computed 92 tokens again") in text


@pytest.mark.parametrize("attempts", [2, 0], ids=["recovered", "failed"])
def test_the_in_flight_gauge_returns_to_zero_after_a_failure(attempts):
    """An engine on the simulator whose executor fails one wait with micro-batches in
    flight, then recovers (or, with no recovery attempts, fails): the lost micro-batches
    leave the gauge (driver.run collects them with None), and it ends at 0."""
    from pp_runtime.engine.online import Engine
    from pp_runtime.executors.sim import SimExecutor, VirtualClock
    from pp_runtime.telemetry.metrics import Metric

    class Free:
        def stage_times(self, prefills, decodes):
            return [1e-3, 1e-3]

        def send_time(self, num_tokens, stage):
            return 0.0

    class FailsOnce(SimExecutor):
        waits, recovered = 0, 0

        def wait(self, handle):
            self.waits += 1
            if self.waits == 3:
                raise WorkerFailed("stage 1 tp rank 0 failed during micro-batch 2")
            return super().wait(handle)

        def recover(self):
            self.recovered += 1
            self._done.clear()

    class Gauges:
        def __init__(self):
            self.in_flight = []

        def record(self, metric, value, tags):
            if metric is Metric.IN_FLIGHT:
                self.in_flight.append(value)

    cfg = load_config("tiny", chunk_size=16, tile_size=16, max_batch_size=4, pp=2,
                      recovery_attempts=attempts)
    clock, sink = VirtualClock(), Gauges()
    ex = FailsOnce(Free(), 2, clock)
    engine = Engine(cfg, ex, sink=sink, clock=clock, sleep=clock.sleep)
    try:
        handles = [engine.add_request([1 + i] * 40, SamplingParams(max_tokens=4, ignore_eos=True))
                   for i in range(3)]
        outs = [h.result(timeout=30).output for h in handles]
    finally:
        engine.close()
    assert ex.recovered == len(engine.recoveries) == (1 if attempts else 0)
    assert all(o.finish_reason == ("length" if attempts else "error") for o in outs)
    assert max(sink.in_flight) >= 2  # several were in flight when the wait failed
    assert engine.metrics.in_flight == 0 and sink.in_flight[-1] == 0
