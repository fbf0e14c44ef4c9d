"""The simulated executor and `simulate()`: hand-computed schedules and invariants.

The cost models here are hand-made on purpose: they make every stage time known, so the
simulator's timeline can be checked against a schedule computed by hand."""
import pytest

from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk
from pp_runtime.config import config_from_dict
from pp_runtime.executors.sim import SimExecutor, VirtualClock
from pp_runtime.engine.simulate import route, simulate
from pp_runtime.telemetry.bubbles import account
from pp_runtime.telemetry.recorder import TIMELINE_COLUMNS
from pp_runtime.core.workload import RequestSpec, generate


class TokenCost:
    """Every stage takes `per_token` per token (+ `base`); sends take `send`."""

    def __init__(self, pp, per_token=1.0, base=0.0, send=0.0):
        self.pp, self.per_token, self.base, self.send = pp, per_token, base, send

    def stage_times(self, prefills, decode_kv_lens):
        n = sum(k for _, k in prefills) + len(decode_kv_lens)
        return [self.base + self.per_token * n] * self.pp

    def send_time(self, num_tokens, stage):
        return self.send


class ConstantCost(TokenCost):
    def stage_times(self, prefills, decode_kv_lens):
        return [self.base] * self.pp


def mb(mb_id, tokens, rid=0):
    return MicroBatch(mb_id, (SeqChunk(rid, 0, 0, (0,) * tokens, Sampling(0.0, 1.0, 0)),))


@pytest.fixture
def whole_run_window(monkeypatch):
    """Timeline windows big enough to hold every micro-batch of these short runs."""
    monkeypatch.setattr("pp_runtime.telemetry.recorder.TIMELINE_MBS", 100_000)


def per_mb(rec):
    """The recorder's timeline rows of its first window (every micro-batch of a short run),
    as {mb_id: [row of stage 0, row of stage 1, ...]}, rows as dicts."""
    out = {}
    for row in rec.timeline()["start"]:
        out.setdefault(row[0], []).append(dict(zip(TIMELINE_COLUMNS, row)))
    assert len(out) == rec.num_microbatches  # the window holds the whole run
    return out


def test_pb1_schedule_matches_the_hand_computed_one():
    """Costs 1, 4, 1 on two stages, all submitted at 0 (the PB1 schedule of
    tests/telemetry/test_bubbles.py): stage 1 waits 1 (fill), then 3 before the long one."""
    clock = VirtualClock()
    ex = SimExecutor(TokenCost(2), 2, clock)
    handles = [ex.submit(mb(i, n)) for i, n in enumerate((1, 4, 1))]
    outs = [ex.wait(h) for h in handles]
    got = [(t.mb_id, t.stage, t.compute_start_s, t.compute_end_s, t.wait_s) for o in outs for t in o.timings]
    assert got == [(0, 0, 0, 1, 0), (0, 1, 1, 2, 1),
                   (1, 0, 1, 5, 0), (1, 1, 5, 9, 3),
                   (2, 0, 5, 6, 0), (2, 1, 9, 10, 0)]
    assert clock() == 10  # waiting for the last result advances the clock to its end
    rep = account([t for o in outs for t in o.timings], {0: [0], 1: [1], 2: [2]})
    assert [s.bubble_s for s in rep.per_stage] == [0, 4]


def test_transfer_delays_the_next_stage_and_is_not_bubble():
    clock = VirtualClock()
    ex = SimExecutor(TokenCost(3, send=0.5), 3, clock)
    out = ex.wait(ex.submit(mb(0, 2)))
    assert [(t.compute_start_s, t.compute_end_s, t.wait_s, t.transfer_s) for t in out.timings] == [
        (0, 2, 0, 0), (2.5, 4.5, 2, 0.5), (5, 7, 4.5, 0.5)]


def test_a_call_submitted_later_starts_no_earlier_than_its_submission():
    clock = VirtualClock()
    ex = SimExecutor(TokenCost(2), 2, clock)
    ex.wait(ex.submit(mb(0, 1)))  # clock -> 2
    clock.sleep(3)  # nothing to do until t = 5
    out = ex.wait(ex.submit(mb(1, 1)))
    assert [(t.compute_start_s, t.wait_s) for t in out.timings] == [(5, 0), (6, 1)]


def test_a_fast_stage_blocks_on_a_slow_receiver():
    """Stages costing 1, 1, 3; three micro-batches submitted at 0, then a fourth when the
    first result is back (at 5). Stage 2 takes m1's send only when it starts m1 (at 5), so
    stage 1, done with m2 at 4, is blocked until 5 (downstream), and with m3 from 7 to 8.
      stage 0: m0 [0,1) m1 [1,2) m2 [2,3) m3 [5,6)
      stage 1: m0 [1,2) m1 [2,3) m2 [3,4)+1 m3 [6,7)+1 (takes m3's call at 5, waits 1)
      stage 2: m0 [2,5) m1 [5,8) m2 [8,11) m3 [11,14)"""
    class Slow(TokenCost):
        def stage_times(self, prefills, decode_kv_lens):
            return [1.0, 1.0, 3.0]

    clock = VirtualClock()
    ex = SimExecutor(Slow(3), 3, clock)
    handles = [ex.submit(mb(i, 1)) for i in range(3)]
    outs = [ex.wait(handles[0])]
    handles.append(ex.submit(mb(3, 1)))
    outs += [ex.wait(h) for h in handles[1:]]
    got = {(t.mb_id, t.stage): (t.compute_start_s, t.compute_end_s, t.wait_s, t.send_wait_s)
           for o in outs for t in o.timings}
    assert [got[(k, 0)] for k in range(4)] == [(0, 1, 0, 0), (1, 2, 0, 0), (2, 3, 0, 0), (5, 6, 0, 0)]
    assert [got[(k, 1)] for k in range(4)] == [(1, 2, 1, 0), (2, 3, 0, 0), (3, 4, 0, 1), (6, 7, 1, 1)]
    assert [got[(k, 2)][:2] for k in range(4)] == [(2, 5), (5, 8), (8, 11), (11, 14)]
    rep = account([t for o in outs for t in o.timings], stage_start_s={0: 0, 1: 0, 2: 0})
    s1 = rep.per_stage[1]
    assert (s1.busy_s, s1.upstream_s, s1.downstream_s, s1.dependency_s, s1.wall_s) == (4, 2, 2, 0, 8)
    assert rep.per_stage[0].dependency_s == 2  # 3..5: the in-flight cap, waiting on m0


def paper_like(planner="sarathi", **workload):
    return config_from_dict({
        "model": {"preset": "gpt3-175b", "num_layers": 8},
        "parallel": {"tp": 8, "pp": 4}, "planner": {"planner": planner, "chunk_size": 128,
                                                     "max_batch_size": 4},
        "workload": {"num_requests": 30, "min_len": 200, "max_len": 600, **workload}})


def test_invariants_of_a_simulated_run(whole_run_window):
    """A stage never runs two micro-batches at once and runs them in order; micro-batch k
    starts on stage s no earlier than it ended on stage s-1 plus the transfer."""
    cfg = paper_like(qps=200.0)
    run = simulate(cfg, TokenCost(4, per_token=1e-4, base=1e-3, send=2e-4), progress=False)
    rows = per_mb(run.replicas[0])
    for stage in range(4):
        ts = [r[stage] for r in rows.values()]
        assert all(a["compute_end_s"] + a["send_wait_s"] <= b["compute_start_s"] + 1e-12
                   for a, b in zip(ts, ts[1:]))
        assert [t["mb_id"] for t in ts] == sorted(t["mb_id"] for t in ts)
    for m in rows.values():  # the stages all start at the first arrival: one time axis
        for prev, t in zip(m, m[1:]):
            assert t["compute_start_s"] >= prev["compute_end_s"] + t["transfer_s"] - 1e-12
    for r in run.requests:  # every request ran to its workload length, after it arrived
        assert r.finish_reason == "length" and r.first_token_s > r.arrival_s
    specs = generate(cfg.workload)
    assert [(len(r.prompt_token_ids), len(r.token_ids)) for r in run.requests] == [
        (s.prompt_len, s.output_len) for s in specs]


def test_identical_microbatch_costs_leave_only_the_pipeline_fill_as_bubble():
    """Steady state: pp micro-batches always in flight, each costing T on every stage.
    Stage s waits s*T once (the fill) and never again."""
    T, pp = 0.01, 4
    clock, outs, in_flight = VirtualClock(), [], []
    ex = SimExecutor(ConstantCost(pp, base=T), pp, clock)
    for i in range(100):
        if len(in_flight) == pp:
            outs.append(ex.wait(in_flight.pop(0)))
        in_flight.append(ex.submit(mb(i, 1 + i % 7)))
    outs += [ex.wait(h) for h in in_flight]
    rep = account([t for o in outs for t in o.timings])
    assert [s.bubble_s for s in rep.per_stage] == pytest.approx([0, T, 2 * T, 3 * T])
    assert [s.idle_s for s in rep.per_stage] == pytest.approx([0] * pp)
    assert clock() == pytest.approx((100 + pp - 1) * T)


def test_with_identical_costs_only_a_refilled_pipeline_has_bubbles(whole_run_window):
    """Through the planner and driver: a micro-batch has a bubble only when the pipeline ran
    dry before it (stage 0 idled: fewer ready requests than stages), never otherwise."""
    T = 0.01
    rec = simulate(paper_like(), ConstantCost(4, base=T), progress=False).replicas[0]
    rep = rec.bubbles()
    prev_end = None
    for mb_id, m in per_mb(rec).items():
        refilled = prev_end is None or m[0]["compute_start_s"] > prev_end + 1e-12
        if not refilled:
            assert rep.mb_bubble_s.get(mb_id, 0.0) == 0.0
        else:
            assert rep.mb_bubble_s[mb_id] <= (1 + 2 + 3) * T + 1e-12
        prev_end = m[0]["compute_end_s"]
    assert sum(s.downstream_s for s in rep.per_stage) == 0  # equal costs: no back-pressure


def test_uneven_microbatches_make_bubbles_that_sarathi_avoids():
    cost = TokenCost(4, per_token=1e-4, base=1e-3)
    frac = {}
    for planner in ("orca-best", "sarathi"):
        cfg = paper_like(planner, num_requests=100).with_overrides(max_batch_size=8)
        rec = simulate(cfg, cost, progress=False).replicas[0]
        frac[planner] = rec.bubbles().bubble_fraction
    assert frac["orca-best"] > 1.3 * frac["sarathi"]


def test_route_sends_each_request_to_the_least_loaded_replica():
    specs = [RequestSpec(0, p, 10) for p in (100, 50, 40, 30, 20)]
    # loads (tokens): r0 110 | r1 60 -> r1 100 | tie 110/100? no: r1 60+50=110 after request 2;
    # request 3 ties 110/110 -> r0 (150); request 4 -> r1 (140)
    assert route(specs, 2) == [[0, 3], [1, 2, 4]]


@pytest.mark.slow
def test_ten_thousand_simulated_requests_with_preemptions_each_end_once_whole():
    """10K decode-heavy requests on a pool of 4 contexts with 16 sequences per micro-batch:
    requests are preempted thousands of times, and every one still ends once, with
    exactly its output length, and the report counts the preemptions."""
    from pp_runtime.config import load_config
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import build_report

    cfg = load_config("paper/gpt3_tp8_pp8", planner="sarathi", paged=True, kv_slots=4,
                      max_batch_size=16, max_seq_len=256, **{
                          "workload.num_requests": 10_000, "workload.pd_ratio": 1,
                          "workload.min_len": 16, "workload.max_len": 256})
    run = simulate(cfg, progress=False)
    specs = generate(cfg.workload)
    assert [r.request_id for r in run.requests] == list(range(10_000))
    assert all(r.finish_reason == "length" for r in run.requests)
    assert [len(r.token_ids) for r in run.requests] == [s.output_len for s in specs]
    preempted = sum(r.num_preemptions for r in run.requests)
    assert preempted > 1000
    assert build_report(run)["summary"]["preemptions"] == preempted


class Host:
    """Host costs as `costmodel.calibration.HostCost` carries them (hand-picked)."""
    plan_s, submit_s, dispatch_s, return_s = 0.5, 0.25, 1.0, 1.0

    def between_calls(self, stage):
        return 0.5


def test_host_costs_show_as_dependency_in_a_hand_computed_schedule():
    """Two stages costing 2 each, host costs plan 0.5, submit 0.25, dispatch 1, 0.5
    between calls, return 1. mb0 reaches the stages at 0 + 0.5 + 1 = 1.5: stage 0 runs
    1.5-3.5, stage 1 3.5-5.5, the driver has it at 6.5. mb1 is submitted at 0.75 (after
    the first turn), reaches them at 2.25, but stage 0 takes it only at 3.5 + 0.5 = 4 and
    stage 1 at 5.5 + 0.5 = 6 (its input came at 6 too): 4-6 and 6-8, the driver has it at
    9. Each stage's 0.5 between the calls is dependency, not busy or upstream."""
    cost = ConstantCost(2, base=2.0)
    cost.host = Host()
    clock = VirtualClock()
    ex = SimExecutor(cost, 2, clock)
    h0 = ex.submit(mb(0, 1, rid=0))
    assert clock() == 0.75  # the driver's turn: plan + submit
    h1 = ex.submit(mb(1, 1, rid=1))
    assert clock() == 1.5
    o0 = ex.wait(h0)
    assert clock() == 6.5  # stage 1 ended at 5.5, the result's return trip 1
    o1 = ex.wait(h1)
    assert clock() == 9.0
    got = [(t.mb_id, t.stage, t.compute_start_s, t.compute_end_s, t.wait_s)
           for o in (o0, o1) for t in o.timings]
    assert got == [(0, 0, 1.5, 3.5, 0), (0, 1, 3.5, 5.5, 2.0), (1, 0, 4.0, 6.0, 0), (1, 1, 6.0, 8.0, 0)]
    rep = account([t for o in (o0, o1) for t in o.timings], {0: [0], 1: [1]})
    assert [s.bubble_by_cause_s["dependency"] for s in rep.per_stage] == [0.5, 0.5]
    assert [s.bubble_by_cause_s["upstream"] for s in rep.per_stage] == [0.0, 2.0]  # the fill
    # without host costs the same two micro-batches run back to back: no dependency
    plain = SimExecutor(ConstantCost(2, base=2.0), 2, VirtualClock())
    outs = [plain.wait(h) for h in [plain.submit(mb(i, 1, rid=i)) for i in range(2)]]
    rep = account([t for o in outs for t in o.timings], {0: [0], 1: [1]})
    assert [s.bubble_by_cause_s["dependency"] for s in rep.per_stage] == [0.0, 0.0]


def test_token_hop_placeholders_wait_for_their_token_on_stage_0():
    """Two stages costing 2 each, sends 0.5 (the hop prices one token as a send, 0.5).
    mb0 (request 0) runs 0-2 on stage 0 and 2.5-4.5 on stage 1; its token reaches stage 0
    at 4.5 + 0.5 = 5. mb1 (request 1) runs 2-4, then 5-7 on stage 1 (taken at 4.5, the 0.5
    send after). mb2 carries request 0's decode planned ahead (a placeholder of mb0):
    stage 0 is free at 4 but starts it at 5, the 1 s between a dependency gap; stage 1
    takes it at 7: 7.5-9.5."""
    cost = ConstantCost(2, base=2.0, send=0.5)
    ex = SimExecutor(cost, 2, VirtualClock(), token_hop=True)
    assert ex.hop == 0.5
    h = [ex.submit(mb(0, 1, rid=0)), ex.submit(mb(1, 1, rid=1))]
    decode = MicroBatch(2, (SeqChunk(0, 0, 1, (-1,), Sampling(0.0, 1.0, 0), is_decode=True),),
                        placeholders=((0, 0),))
    h.append(ex.submit(decode))
    outs = [ex.wait(x) for x in h]
    got = [(t.mb_id, t.stage, t.compute_start_s, t.compute_end_s) for o in outs for t in o.timings]
    assert got == [(0, 0, 0, 2), (0, 1, 2.5, 4.5), (1, 0, 2, 4), (1, 1, 5, 7),
                   (2, 0, 5, 7), (2, 1, 7.5, 9.5)]
    rep = account([t for o in outs for t in o.timings], {0: [0], 1: [1], 2: [0]})
    assert rep.per_stage[0].bubble_by_cause_s["dependency"] == 1.0
    # all of it on the token hop: the timing carries it as the real stage measures it
    assert [t.token_wait_s for o in outs for t in o.timings] == [0, 0, 0, 0, 1, 0]
    assert rep.per_stage[0].token_s == 1.0
    # the same micro-batch without the hop's wait (its token given): stage 0 takes it at 4
    plain = SimExecutor(cost, 2, VirtualClock())
    outs = [plain.wait(x) for x in [plain.submit(mb(0, 1, rid=0)), plain.submit(mb(1, 1, rid=1)),
                                    plain.submit(mb(2, 1, rid=0))]]
    assert outs[2].timings[0].compute_start_s == 4


def test_a_calibrated_simulation_plans_ahead_with_the_hop(tmp_path):
    """simulate() runs the hop where the cost carries a calibration of a real executor on
    which runtime.token_hop resolves on (auto: ray tasks or the compiled graph, tp = 1),
    and not without one or with token_hop false; planning ahead, the tokens are the same
    ones."""
    from pp_runtime.costmodel.calibration import Calibration, HostCost
    from pp_runtime.engine.simulate import sim_token_hop

    cfg = config_from_dict({"model": {"preset": "gpt2-small"}, "parallel": {"pp": 2},
                            "hardware": {"gpu": "a100-80gb"},
                            "workload": {"num_requests": 20, "prompt_len": 64, "output_len": 16}})
    from pp_runtime.costmodel import build_cost_model

    cost = build_cost_model(cfg)
    assert not sim_token_hop(cfg, cost)  # no calibration: nothing to skip
    cost.calibration = Calibration("ray", 2, host=HostCost(0.001, 0.001, 0.001, (0.0005,) * 2, 0.002))
    cost.host = cost.calibration.host
    assert sim_token_hop(cfg, cost)
    assert not sim_token_hop(cfg.with_overrides(token_hop=False), cost)
    tasks, cost.calibration = cost.calibration, Calibration("ray", 2, host=cost.host, path="graph")
    assert sim_token_hop(cfg, cost)  # the compiled graph runs it too
    cost.calibration = Calibration("ray", 2, host=cost.host, path="relay")
    assert not sim_token_hop(cfg, cost)  # the TP relay does not (auto)
    cost.calibration = tasks
    hop = simulate(cfg, cost, progress=False)
    off = simulate(cfg.with_overrides(token_hop=False), cost, progress=False)
    assert [len(o.token_ids) for o in hop.requests] == [len(o.token_ids) for o in off.requests]
    done = [max(o.finish_s for o in r.requests) for r in (hop, off)]
    assert done[0] < done[1]  # decodes no longer wait for the driver's return
