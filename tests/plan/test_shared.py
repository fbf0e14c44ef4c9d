"""Replicas that share this machine's cores (plan/shared.py): their compute is priced by
the calibration of the replicas served side by side, measured as real stage compute over
the simulator's for the same streams; hand-computed on a stand-in for the real serve run."""
import json

import pytest

from pp_runtime.config import Config, load_model_config
from pp_runtime.costmodel import calibration
from pp_runtime.costmodel.calibration import Calibration, ComputeFit, HostCost
from pp_runtime.plan import calibrated, shared, space
from pp_runtime.plan.space import Layout


def cpu_config(profile) -> Config:
    """GPT-2 small, one replica of tp1 pp1 on this machine's CPU priced by `profile` (the
    shipped A100 tables stand in for a measured profile: the pricing is what is tested)."""
    cfg = Config(model=load_model_config("gpt2-small")).with_overrides(**{
        "hardware.gpu": "cpu", "hardware.profile": str(profile), "cache.paged": True,
        "cache.device_memory_gb": 1.0, "workload.num_requests": 8})
    return cfg


@pytest.fixture
def profile(tmp_path, monkeypatch):
    """A profile whose one-replica calibration (local/pp1) is known: x1.1 + 0.5 ms a layer
    + 0.2 ms a sampling row; the tables come from the default pricing (no files read)."""
    from pp_runtime.costmodel import model

    cal = Calibration("local", 1, ComputeFit(1.1, 5e-4, 2e-4), HostCost(plan_s=1e-4))
    calibration.save(tmp_path, cal)
    real = model.build_pricing
    monkeypatch.setattr(model, "build_pricing", lambda cfg: real(
        cfg.with_overrides(**{"hardware.profile": None, "hardware.gpu": "a100-80gb"})))
    space.forget()
    yield tmp_path
    space.forget()


def test_the_side_by_side_entry_scales_every_compute_term():
    base = Calibration("local", 1, ComputeFit(1.1, 5e-4, 2e-4), HostCost(plan_s=1e-4))
    got = calibrated.scaled(base, 1.25, 2)
    assert got.key == "local/pp1/x2"
    assert (got.compute.scale, got.compute.per_layer_s, got.compute.per_row_s) == pytest.approx(
        (1.375, 6.25e-4, 2.5e-4))
    assert got.host == base.host  # the host's share is in the measured compute already


def test_measured_side_by_side_compute_prices_the_replicas(profile, monkeypatch, tmp_path):
    """Two replicas served: 12 s and 13 s of stage compute for real where the simulator
    prices 10 s each: x1.25. The entry local/pp1/x2 is saved; a candidate of two replicas
    is priced 1.25 x a lone one (every stage, to the float), one replica as before."""
    cfg = cpu_config(profile)
    busy = iter([0.0, 0.0, 12.0, 13.0])  # each server's /metrics before and after
    monkeypatch.setattr(shared, "stage_busy_s", lambda url: next(busy))
    monkeypatch.setattr(shared, "simulated_busy_s", lambda c: 10.0)

    class Server:  # a started `pp-runtime serve`, stood in for
        def __init__(self, args, port, log):
            self.url = f"http://127.0.0.1:{port}"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    sent = []
    import pp_runtime.plan.validate as validate
    monkeypatch.setattr(validate, "ServerProcess", Server)  # what validate.serving starts
    monkeypatch.setattr(validate, "real_probe", lambda urls, c, slo, log: sent.append(
        (len(urls), c.workload.num_requests, slo.ttft_s)) or (lambda qps: None))
    lines = []
    assert calibrated.shared(cfg, 2) is None
    cal = shared.measure(cfg, 2, bound_qps=2.0, out=tmp_path / "out", log=lines.append)
    # each replica at 0.55 x 2 = 1.1 req/s for 40 s: 44 requests; real_probe's span 40 s
    assert sent == [(2, 44, pytest.approx(4.0))]
    assert "12.0 + 13.0 s for real, 10.0 + 10.0 s priced by local/pp1: x1.250" in lines[0]
    assert json.loads((profile / "calibration.json").read_text()).keys() == {"local/pp1", "local/pp1/x2"}
    assert calibrated.shared(cfg, 2) == cal and cal.compute.scale == pytest.approx(1.375)
    mb = ([(0, 200)], [300, 500])
    alone, two = space.cost_model(cfg, 1).stage_times(*mb), space.cost_model(cfg, 2).stage_times(*mb)
    assert two == pytest.approx([1.25 * t for t in alone], rel=1e-12)
    assert calibrated.shared(cfg, 3) is None  # three replicas were never measured: as alone
    assert space.cost_model(cfg, 3).stage_times(*mb) == alone
    lines.clear()
    assert shared.ensure({Layout(1, 1, 2): cfg}, None, 8, True, tmp_path, lines.append) == 0
    assert lines == [f"  calibration of tp1 pp1 x2: local/pp1/x2 in {profile} (its replicas "
                     "served side by side)"]


def test_a_probe_of_replicas_side_by_side_is_cached_apart(profile):
    """The probe cache keys a CPU probe by the replicas beside it (they price it); a GPU
    probe's key does not change with its replicas."""
    from pp_runtime.plan.probe import ProbeCache, Slo

    cache, slo, cfg = ProbeCache(None), Slo(5, 1), cpu_config(profile)
    assert cache.key(cfg, slo, 1) != cache.key(cfg, slo, 2)
    gpu = cfg.with_overrides(**{"hardware.gpu": "a100-80gb", "hardware.profile": None})
    assert cache.key(gpu, slo, 1) == cache.key(gpu, slo, 2)
