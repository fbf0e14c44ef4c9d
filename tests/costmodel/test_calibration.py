"""Calibration (costmodel/calibration.py, calibrate.py): what a short real run adds to a
quiet profile, read back by the cost model and the default split. Hand-computed cases."""
import pytest

from pp_runtime.core.batch import StageTiming
from pp_runtime.config import Config
from pp_runtime.costmodel import balance, calibration
from pp_runtime.profile.calibrate import host_costs
from pp_runtime.costmodel.calibration import Calibration, ComputeFit, HostCost
from pp_runtime.costmodel.model import StageCostModel, build_pricing, find_calibration


def test_host_costs_of_a_hand_made_run():
    """Three micro-batches submitted at 0, 0.2, 0.4 (0.1 each); stage 0 takes the first 1.0
    after its submit (idle: dispatch), then each next call 0.3 after freeing (queued), stage
    1 0.2 after; the driver holds results 0.2, 0.3, 0.3 after the last stage ends."""
    times = {0: [0.0, 0.1, 0.5, 3.2], 1: [0.2, 0.3, 3.2, 5.3], 2: [0.4, 0.5, 5.3, 7.3]}
    t = StageTiming
    timings = {0: [t(0, 0, 0, 0.0, 0.0, 1.0, 2.0), t(0, 1, 0, 0.9, 0.1, 2.1, 3.0)],
               1: [t(1, 0, 0, 0.0, 0.0, 2.3, 3.3), t(1, 1, 0, 0.1, 0.1, 3.4, 5.0)],
               2: [t(2, 0, 0, 0.0, 0.0, 3.6, 4.6), t(2, 1, 0, 0.0, 0.1, 5.3, 7.0)]}
    h = host_costs(times, timings, 2)
    assert h.submit_s == pytest.approx(0.1) and h.plan_s == pytest.approx(0.1)
    assert h.dispatch_s == pytest.approx(1.0) and h.return_s == pytest.approx(0.3)
    assert h.call_s == pytest.approx((0.3, 0.2))


def test_saved_calibration_is_found_by_executor_and_depth(tmp_path):
    cal = Calibration("ray", 2, ComputeFit(1.5, 0.001, 0.0), HostCost(call_s=(0.002, 0.003)),
                      (7, 5), 100, 0.1)
    calibration.save(tmp_path, cal)
    calibration.save(tmp_path, Calibration("torchrun", 2))
    assert calibration.load(tmp_path, "ray", 2) == cal
    assert calibration.load(tmp_path, "ray", 3) is None
    cfg = Config().with_overrides(pp=2, **{"hardware.profile": str(tmp_path)})
    assert calibration.executor_kind(cfg.runtime.executor, 1, 2) == "ray"  # auto at pp 2
    assert find_calibration(cfg) == cal
    assert find_calibration(cfg.with_overrides(executor="torchrun")).key == "torchrun/pp2"
    assert find_calibration(Config().with_overrides(pp=2)) is None  # no profile


def test_each_ray_path_and_tp_finds_its_own_calibration(tmp_path):
    """A task per actor, the compiled graph and the TP relay cost the host differently, and
    tp 2 puts twice the processes on the cores: each is kept under its path and tp;
    `compiled_graph: auto` finds what auto chose where it was calibrated, or else a
    calibration from before paths were kept (a task per actor)."""
    tasks, graph = (Calibration("ray", 2, host=HostCost(dispatch_s=d), path=path)
                    for d, path in ((1.6e-3, ""), (0.5e-3, "graph")))
    relay = Calibration("ray", 2, host=HostCost(dispatch_s=1e-3), path="relay")  # tp 1
    cfg = Config().with_overrides(pp=2, **{"hardware.profile": str(tmp_path)})
    calibration.save(tmp_path, tasks)
    assert find_calibration(cfg) == tasks  # auto, nothing saved under auto: the old entry
    assert find_calibration(cfg.with_overrides(compiled_graph=True)) is None
    calibration.save(tmp_path, graph, auto=True)  # a run under auto that chose the graph
    calibration.save(tmp_path, relay)
    assert find_calibration(cfg) == graph and find_calibration(cfg).key == "ray/pp2/graph"
    assert find_calibration(cfg.with_overrides(compiled_graph=False)) == tasks
    assert find_calibration(cfg.with_overrides(compiled_graph=True)) == graph
    relayed = cfg.with_overrides(compiled_graph=False, tp_relay=True)
    assert find_calibration(relayed) == tasks  # tp 1: no relay runs
    assert find_calibration(relayed.with_overrides(tp=2)) is None  # calibrated at tp 1
    relay = Calibration("ray", 2, host=HostCost(dispatch_s=1e-3), path="relay", tp=2)
    calibration.save(tmp_path, relay)
    assert find_calibration(relayed.with_overrides(tp=2)) == relay
    assert relay.key == "ray/tp2/pp2/relay" and find_calibration(relayed) == tasks
    assert calibration.load(tmp_path, "ray", 2, calibration.AUTO).path == "graph"


def test_the_cost_model_prices_a_calibrated_stage_by_the_fit():
    """stage s: scale * (its price) + per_layer_s * layers + per_row_s * rows (last only)."""
    cfg = Config().with_overrides(pp=2, layer_split=[7, 5])
    pricing = build_pricing(cfg)
    plain = StageCostModel(cfg, pricing)
    fit = ComputeFit(scale=1.25, per_layer_s=0.002, per_row_s=0.0005)
    cal = StageCostModel(cfg, pricing, Calibration("ray", 2, fit, HostCost(return_s=0.01)))
    prefills, decodes = [(0, 120)], [300] * 7  # 8 sampling rows
    raw, got = plain.stage_times(prefills, decodes), cal.stage_times(prefills, decodes)
    assert got[0] == pytest.approx(1.25 * raw[0] + 7 * 0.002)
    assert got[1] == pytest.approx(1.25 * raw[1] + 5 * 0.002 + 8 * 0.0005)
    assert cal.host.return_s == 0.01 and plain.host is None
    assert sum(cal.breakdown(prefills, decodes).values()) == pytest.approx(got[0])
    assert "calibration" in cal.sources()


class MadeUpCost:
    def attention_half(self, prefills, decode_kv_lens):
        return 0.5  # half the layer: whole layers balance these stages as well as halves

    def parts(self, prefills, decode_kv_lens):
        return 1.0, 0.0, 2.0  # an LM head as costly as 2 layers


def test_the_split_is_balanced_by_default_where_a_profile_exists(monkeypatch, tmp_path):
    from pp_runtime.costmodel import model

    monkeypatch.setattr(balance, "_CHOSEN", {})
    monkeypatch.setattr(model, "build_cost_model", lambda cfg: MadeUpCost())
    base = Config().with_overrides(num_layers=12, pp=2)
    assert base.layers_per_stage() == [6, 6]  # no profile: even
    profiled = base.with_overrides(**{"hardware.profile": str(tmp_path)})
    assert profiled.parallel.layer_split is None and profiled.layer_split_pending
    assert balance.resolve_layer_split(profiled).parallel.layer_split == [7, 5]
    assert profiled.with_overrides(layer_split="even").layers_per_stage() == [6, 6]
    assert profiled.with_overrides(layer_split=[5, 7]).layers_per_stage() == [5, 7]  # honoured


def test_the_compute_fit_recovers_a_known_contention():
    """Stage compute made up as 1.3 x the profile's price + 2 ms a layer + 0.5 ms a sampling
    row on the last stage: the fit finds those three numbers."""
    from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk
    from pp_runtime.profile.calibrate import WARM_UP, fit_compute

    cfg = Config().with_overrides(pp=2, layer_split=[7, 5])
    cost = StageCostModel(cfg, build_pricing(cfg))
    mbs, timings, greedy = {}, {}, Sampling(0.0, 1.0, 0)
    for i in range(WARM_UP * 2 + 12):
        decodes = tuple(SeqChunk(r, r, 100 + 37 * i, (1,), greedy, True) for r in range(i % 8))
        chunk = (SeqChunk(9, 9, 0, tuple(range(16 * (i % 5))), greedy),) if i % 5 else ()
        mbs[i] = MicroBatch(i, decodes + chunk)
        per_layer, emb, head = cost.parts([(0, len(c.token_ids)) for c in chunk],
                                          [d.start + 1 for d in decodes])
        rows = len(decodes) + len(chunk)
        times = [7 * per_layer + emb, 5 * per_layer + head]
        real = [1.3 * times[0] + 7 * 0.002, 1.3 * times[1] + 5 * 0.002 + 0.0005 * rows]
        timings[i] = [StageTiming(i, s, 0, 0.0, 0.0, 10.0 * i, 10.0 * i + real[s]) for s in (0, 1)]
    fit, points, rms = fit_compute(cfg, mbs, timings)
    assert points == 24 and rms < 1e-6
    assert (fit.scale, fit.per_layer_s, fit.per_row_s) == pytest.approx((1.3, 0.002, 0.0005))


def test_a_calibration_runs_the_path_the_simulator_prices(monkeypatch, tmp_path):
    """The simulator prices tokens back through the driver, not the token hop's waits on
    stage 0: the calibration's real run has the hop off whatever the config says."""
    from pp_runtime.profile import calibrate as cal

    seen = []

    def stop(cfg, executor):
        seen.append(cfg)
        raise RuntimeError("stop here")

    monkeypatch.setattr(cal, "_run", stop)
    cfg = Config().with_overrides(pp=2, executor="ray", token_hop="auto", layer_split="even")
    try:
        cal.calibrate(cfg, tmp_path, requests=2, save=False)
    except RuntimeError:
        pass
    assert seen and seen[0].runtime.token_hop is False


def test_each_stage_keeps_its_own_factor_over_the_shared_fit():
    """Hand-made: the shared fit prices stage 0 at 10 + 10 and stage 1 at 20 + 30; stage 0
    measured 22 in all, stage 1 45: factors 22 / 20 and 45 / 50."""
    import numpy as np

    from pp_runtime.profile.calibrate import stage_factors

    fitted, measured = np.array([10.0, 20.0, 10.0, 30.0]), np.array([11.0, 18.0, 11.0, 27.0])
    stage = np.array([0, 1, 0, 1])
    assert stage_factors(fitted, measured, stage, 2) == pytest.approx([1.1, 0.9])
    assert stage_factors(fitted, measured, stage, 3)[2] == 1.0  # a stage never timed


def test_stage_factors_scale_each_stage_and_travel_through_the_file(tmp_path):
    cfg = Config().with_overrides(pp=2, layer_split=[7, 5])
    pricing = build_pricing(cfg)
    fit = ComputeFit(scale=1.25, per_layer_s=0.002, per_row_s=0.0005)
    shared = StageCostModel(cfg, pricing, Calibration("ray", 2, fit))
    own = Calibration("ray", 2, ComputeFit(1.25, 0.002, 0.0005, (1.1, 0.9)), tp=1)
    mine = StageCostModel(cfg, pricing, own)
    prefills, decodes = [(0, 120)], [300] * 7
    base, got = shared.stage_times(prefills, decodes), mine.stage_times(prefills, decodes)
    assert got == pytest.approx([1.1 * base[0], 0.9 * base[1]])
    assert sum(mine.breakdown(prefills, decodes).values()) == pytest.approx(got[0])
    # the planner's fast path prices the same floats, to the bit
    times = mine.with_chunk([], decodes)
    assert times is not None
    first, _, last = times(0, 120)
    assert [first, last] == mine.stage_times([(0, 120)], decodes)
    calibration.save(tmp_path, own)
    back = calibration.load(tmp_path, "ray", 2)
    assert back == own and back.compute.stage_factors(2) == [1.1, 0.9]
    assert back.compute.stage_factors(3) is None  # fitted at another depth: not applied
    assert "stages x1.100 / x0.900" in calibration.describe(back)


def test_a_calibration_adds_whole_prompts_and_a_served_load(monkeypatch, tmp_path):
    """Three real runs join the compute fit: the burst (`requests` at once), `requests` // 2
    whole prompts, and the same requests as Poisson at PACED_LOAD x the burst's offline
    rate (8 requests in 4 s here: 1.6 req/s); each later run without its warm-up."""
    from pp_runtime.profile import calibrate as cal

    runs, merged = [], []

    class Inner:
        name, path = "ray", "tasks"

    def fake_run(cfg, executor):
        k = len(runs)
        runs.append(cfg)
        timed = cal.TimedExecutor(Inner())
        timed.times = {0: [0.5, 0.6, 0.7, 1.0], 1: [1.0, 1.1, 1.2, 4.5]}  # 0.5 .. 4.5 s
        ids = range(100 * k, 100 * k + 6)
        return timed, {i: f"mb{i}" for i in ids}, {i: [] for i in ids}

    monkeypatch.setattr(cal, "_run", fake_run)
    monkeypatch.setattr(cal, "fit_compute",
                        lambda cfg, m, t: merged.append(sorted(m)) or (ComputeFit(), len(m), 0.0))
    monkeypatch.setattr(cal, "host_costs", lambda *a: HostCost())
    cfg = Config().with_overrides(pp=2, executor="ray", layer_split="even")
    cal.calibrate(cfg, tmp_path, requests=8, save=False)
    assert [c.workload.qps for c in runs] == [None, None, pytest.approx(cal.PACED_LOAD * 8 / 4.0)]
    assert runs[1].planner.planner == "orca-best" and runs[1].workload.num_requests == 4
    assert runs[2].planner.planner == cfg.planner.planner and runs[2].workload.num_requests == 8
    warm = cal.WARM_UP * 2  # the later runs' first micro-batches: their new actors' warm-up
    assert merged == [[0, 1, 2, 3, 4, 5, *(6 + 100 + i for i in range(warm, 6)),
                       *(112 + 200 + i for i in range(warm, 6))]]  # after 111
    runs.clear()
    cal.calibrate(cfg, tmp_path, requests=8, save=False, paced=False)
    assert [c.workload.qps for c in runs] == [None, None]
