"""`pp-runtime plan`: a search whose answer is known by hand, the inputs nothing can serve
(one line, exit 2), and the winner's config through `pp-runtime run`.

The hand-known search: GPT-2 small (124 M parameters, float32: 497 MB of weights) on two
devices of 0.5 GB (450 MB usable), one per node (tp = 1). Whole, it does not fit (pp = 1
is out for memory); cut in two (327 + 324 MB) it does. Its prompts of 512 tokens are cut
into chunks of 64 or 512: the cost model prices the slower stage of a micro-batch with a
512-token chunk at 3.5 ms and with a 64-token chunk at 1.1 ms (the first test checks the
figures), so with pp + 1 micro-batches in flight a decode waits about 3 x 3.5 = 10.5 ms
behind whole prompts and 3 x 1.1 = 3.3 ms behind small chunks: under a p99 TBT SLO of
6 ms, C = 64 carries the most traffic (a TTFT SLO of 100 ms keeps the probes short).
The search runs `sarathi`, whose budget is that reasoning; `uniform` spreads the prompt
tokens of this decode-heavy phase by predicted time (planner.spread), so its C = 512 meets
the SLO too (50.7 req/s).
"""
import json
import subprocess
import sys

import pytest
import yaml

from pp_runtime.config import load_config

PLAN = [sys.executable, "-m", "pp_runtime.cli", "plan"]
HAND = {"--model": "gpt2-small", "--gpus": "2", "--gpus-per-node": "1", "--memory-gb": "0.5",
        "--workload": "fixed:prompt_len=512,output_len=32", "--requests": "40",
        "--chunk-sizes": "64,512", "--planners": "sarathi", "--ttft-slo": "0.1", "--tbt-slo": "0.006", "--jobs": "1"}


def plan(flags: dict, tmp_path, timeout=300):
    argv = [x for k, v in flags.items() for x in (k, v)]
    return subprocess.run(PLAN + argv + ["--quiet", "--out", str(tmp_path), "--cache",
                                         str(tmp_path / "cache")], capture_output=True,
                          text=True, timeout=timeout)


def test_costmodel_times_behind_the_hand_reasoning():
    from pp_runtime.config import Config, load_model_config
    from pp_runtime.costmodel import build_cost_model

    cost = build_cost_model(Config(model=load_model_config("gpt2-small")).with_overrides(pp=2))
    big, small = (max(cost.stage_times([(0, c)], [300] * 3)) for c in (512, 64))
    assert big == pytest.approx(3.5e-3, rel=0.05) and small == pytest.approx(1.1e-3, rel=0.05)
    assert 3 * big > 0.006 > 1.5 * 3 * small  # the SLO sits between, with room


@pytest.fixture(scope="module")
def hand_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    done = plan(HAND, out)
    assert done.returncode == 0, done.stderr + done.stdout
    return out, done.stdout


def test_the_search_finds_the_deployment_known_by_hand(hand_plan):
    out, stdout = hand_plan
    best = json.loads((out / "plan.json").read_text())["best"]
    assert best.startswith("tp1 pp2 x1 sarathi C64 "), stdout
    assert "tp1 pp1 x2     out     memory: weights" in stdout, stdout
    rows = {r["deployment"]: r for r in json.loads((out / "plan.json").read_text())["results"]}
    best_qps = rows[best]["capacity_qps"]
    for name, r in rows.items():  # whole prompts miss the TBT SLO where small chunks meet it
        if " C512 " in name:
            assert r["outcome"] in ("lost at the layout's best", "searched", "bound"), (name, r)
            assert (r["capacity_qps"] or 0) < best_qps, (name, r)
    assert (out / "capacity_vs_latency.png").stat().st_size > 10_000


def test_the_winner_config_round_trips_through_run(hand_plan, tmp_path):
    out, _ = hand_plan
    cfg = load_config(out / "best.yaml")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.planner.chunk_size) == (1, 2, 64)
    assert cfg.cache.paged and cfg.cache.num_blocks == "auto" and cfg.cache.device_memory_gb == 0.5
    header = (out / "best.yaml").read_text().splitlines()[0]
    assert header.startswith("# pp-runtime plan's choice: tp1 pp2 x1 sarathi C64")
    small = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "vocab_size": 512,
             "max_positions": 256, "name": "tiny", "eos_token_id": None}
    data = yaml.safe_load((out / "best.yaml").read_text())
    data["model"] = {**data["model"], **small}  # the same file, a model this machine runs fast
    data["parallel"]["layer_split"] = None
    data["cache"]["max_seq_len"] = 256
    (tmp_path / "best.yaml").write_text(yaml.safe_dump(data))
    run = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "run", "--config",
                          str(tmp_path / "best.yaml"), "--set", "executor=local", "--max-tokens", "4",
                          "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["summary"]["deployment"]["pp"] == 2


@pytest.mark.parametrize("args, says", [
    (["--memory-gb", "0.2"], "no layout of 2 x a100-80gb holds the model"),
    (["--tbt-slo", "0.0001"], "no layout meets the TBT SLO"),
    (["--ttft-slo", "0.001"], "no deployment met the SLOs at any rate"),
    (["--gpus", "0"], "--gpus: must be >= 1"),
    (["--workload", "zipf:min_len"], "is not FIELD=VALUE"),
    (["--workload", "zipf:colour=3"], "unknown field(s) colour"),
    (["--planners", "fastest"], "--planners: unknown fastest"),
    (["--chunk-sizes", "0,512"], "--chunk-sizes: expected numbers >= 1"),
    (["--requests", "1"], "--requests"),
    (["--gpu", "tpu"], "--gpu: unknown device 'tpu'"),
])
def test_inputs_nothing_can_serve_are_one_line_and_exit_2(tmp_path, args, says):
    done = plan({**HAND, **dict(zip(args[::2], args[1::2]))}, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], done.stderr


def test_the_profile_calibration_is_said_in_one_line(tmp_path):
    from pp_runtime.cli.plan import calibration_line

    none = calibration_line(str(tmp_path))
    assert none.startswith("calibration: none in ") and "--calibrate" in none and "\n" not in none
    (tmp_path / "calibration.json").write_text('{"local/pp1": {}, "ray/pp2": {}}')
    found = calibration_line(str(tmp_path))
    assert "(local/pp1, ray/pp2)" in found and "\n" not in found


def test_a_layout_without_calibration_is_calibrated_first_with_a_line(tmp_path, monkeypatch):
    """--profile: each layout's calibration said; a missing one measured first on this
    machine (--gpu cpu), as `profile --calibrate N` does; never on a GPU profile or at 0."""
    from pp_runtime.config import Config, load_model_config
    from pp_runtime.costmodel import calibration
    from pp_runtime.plan import calibrated

    cfg = Config(model=load_model_config("gpt2-small")).with_overrides(
        **{"pp": 2, "hardware.profile": str(tmp_path)})
    ran = []

    def fake(c, profile, requests):  # the real run, stood in for: an entry saved
        ran.append((c.parallel.pp, requests))
        cal = calibration.Calibration("ray", c.parallel.pp)
        calibration.save(profile, cal)
        return cal

    monkeypatch.setattr(calibrated, "measure", fake)
    lines = []
    log = lambda line, **_: lines.append(line)  # noqa: E731
    assert calibrated.ensure([cfg], str(tmp_path), 0, True, log) == 0
    assert calibrated.ensure([cfg], str(tmp_path), 8, False, log) == 0
    assert not ran and all("none (ray/pp2)" in line and "uncalibrated" in line for line in lines)
    lines.clear()
    assert calibrated.ensure([cfg], str(tmp_path), 8, True, log) == 1
    assert ran == [(2, 8)] and "measuring it now" in lines[0] and "--calibrate 8" in lines[0]
    lines.clear()
    assert calibrated.ensure([cfg], str(tmp_path), 8, True, log) == 0  # found now: not again
    assert ran == [(2, 8)] and lines == [f"  calibration of tp1 pp2: ray/pp2 in {tmp_path}"]


def test_chunk_sizes_past_uniform_s_knee_share_their_probes():
    """uniform caps its chunks at the cost model's knee: C above it runs as the knee, so
    two such candidates are one simulation and one cache entry."""
    from pp_runtime.config import Config, load_model_config
    from pp_runtime.plan.probe import ProbeCache, Slo, _knee, as_run
    from pp_runtime.plan.space import cost_model

    base = Config(model=load_model_config("gpt3-175b")).with_overrides(
        **{"tp": 8, "pp": 4, "planner.planner": "uniform", "planner.max_batch_size": 16})
    knee = _knee(cost_model(base), base.planner.tile_size)
    key = lambda c: ProbeCache(None).key(base.with_overrides(chunk_size=c), Slo(5, 0.2))  # noqa: E731
    assert key(2 * knee) == key(4 * knee) == key(knee) != key(knee // 2)
    assert as_run(base.with_overrides(chunk_size=4 * knee)).planner.chunk_size == knee


def test_uniform_runs_a_chunk_size_past_its_knee_as_the_knee():
    """What `as_run` relies on: the same simulation, to the last bit."""
    from dataclasses import replace

    from pp_runtime.config import Config, load_model_config
    from pp_runtime.core.workload import WorkloadConfig
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.plan.probe import _knee
    from pp_runtime.plan.space import cost_model
    from pp_runtime.telemetry.report import build_report

    base = replace(Config(model=load_model_config("gpt2-small")).with_overrides(
        **{"pp": 2, "planner.planner": "uniform", "planner.max_batch_size": 8}),
        workload=WorkloadConfig(kind="zipf", num_requests=40, qps=30.0, min_len=256,
                                max_len=1024, pd_ratio=4))
    knee = _knee(cost_model(base), base.planner.tile_size)
    runs = [build_report(simulate(base.with_overrides(chunk_size=c), progress=False))["summary"]
            for c in (knee, 3 * knee)]
    for s in runs:
        s.pop("run_wall_s"), s.pop("deployment")
    assert runs[0] == runs[1]


def test_layouts_on_one_pricing_share_its_tables_and_price_as_if_alone():
    """The plan builds one cost model per layout; those of one (model, hardware, tp) share
    one pricing and its per-token tables (built once, grown once), and each prices every
    micro-batch exactly as a cost model built alone (`build_cost_model`) does."""
    from pp_runtime.config import Config, load_model_config
    from pp_runtime.costmodel import build_cost_model
    from pp_runtime.plan import space

    space.forget()
    base = Config(model=load_model_config("gpt3-175b")).with_overrides(tp=8)
    cfgs = [base.with_overrides(pp=pp) for pp in (2, 4, 8)]
    models = [space.cost_model(c) for c in cfgs]
    assert len({id(m.pricing) for m in models}) == 1
    assert models[0]._layer is models[2]._layer  # one table, not three
    other = space.cost_model(base.with_overrides(tp=4, pp=4))
    assert other.pricing is not models[0].pricing
    mbs = [([(0, 512)], []), ([(100, 37)], [300] * 20), ([], [9000] * 5), ([(0, 20000)], [1])]
    for c, m in zip([*cfgs, base.with_overrides(tp=4, pp=4)], [*models, other]):
        alone = build_cost_model(c)
        for mb in mbs:  # the last one grows the shared tables past what any model built
            assert m.stage_times(*mb) == alone.stage_times(*mb)
            assert [m.send_time(n, 1) for n in (1, 700, 30000)] == \
                [alone.send_time(n, 1) for n in (1, 700, 30000)]
    space.forget()
