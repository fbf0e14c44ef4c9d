"""`pp-runtime simulate / compare / profile` end to end, with the shipped cost model."""
import json
import subprocess
import sys


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pp_runtime.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_simulate_the_paper_setting_writes_a_report_priced_by_profiles(tmp_path):
    r = cli("simulate", "--config", "paper/gpt3_tp8_pp8", "--requests", "60", "--seed", "1",
            "--quiet", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "sarathi on gpt3-175b tp=8 pp=8 dp=1 (a100-80gb, sim): 60 requests" in r.stdout
    s = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert s["num_requests"] == 60 and s["finish_reasons"] == {"length": 60}
    assert "scaled to n_embd=12288" in s["cost_sources"]["qkv_proj"]  # GPT-3 is not profiled
    assert "inter_node" in s["cost_sources"]["send_inter_node"]
    assert len(s["per_stage"]) == 8 and s["makespan_s"] > 0


def test_compare_runs_every_deployment_on_one_workload(tmp_path):
    r = cli("compare", "--simulate", "--config", "paper/gpt3_tp8_pp8", "--planners",
            "sarathi,orca-best", "--config", "paper/gpt3_tp8@orca-best", "--requests", "80",
            "--quiet", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    runs = ["gpt3_tp8_pp8-sarathi", "gpt3_tp8_pp8-orca-best", "gpt3_tp8-orca-best"]
    for run in runs:
        assert (tmp_path / run / "report.json").is_file()
    reports = [json.loads((tmp_path / run / "report.json").read_text()) for run in runs]
    lengths = [[(q["prompt_tokens"], q["output_tokens"]) for q in rep["requests"]] for rep in reports]
    assert lengths[0] == lengths[1] == lengths[2]  # the same workload for every run
    assert reports[2]["summary"]["deployment"]["dp"] == 8
    assert "gpt3_tp8_pp8-orca-best / gpt3_tp8_pp8-sarathi: makespan" in r.stdout
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert set(saved["ratios_to_first"]) == set(runs[1:])


def test_bad_workloads_and_hardware_are_clear_errors(tmp_path):
    r = cli("simulate", "--config", "tiny", "--set", "workload.max_len=1000", "--quiet",
            "--out", str(tmp_path))
    assert r.returncode == 2 and "exceeds the 256 KV tokens" in r.stderr, r.stderr
    r = cli("simulate", "--config", "tiny", "--set", "hardware.gpu=tpu", "--out", str(tmp_path))
    assert r.returncode == 2 and "hardware.gpu" in r.stderr and "Traceback" not in r.stderr


def test_simulator_never_imports_torch():
    code = ("import sys; from pp_runtime.config import load_config; "
            "from pp_runtime.engine.simulate import simulate; "
            "from pp_runtime.telemetry.report import build_report; "
            "cfg = load_config('paper/gpt3_tp8_pp8', **{'workload.num_requests': 20}); "
            "build_report(simulate(cfg, progress=False)); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_profile_measured_here_drives_the_simulator(tmp_path):
    """`pp-runtime profile` writes a profile of this machine; the simulator prices with it."""
    prof = tmp_path / "profile"
    prof.mkdir()
    (prof / "calibration.json").write_text("{}")  # an earlier calibration, of other tables
    r = cli("profile", "--config", "tiny", "--quick", "--quiet", "--out", str(prof))
    assert r.returncode == 0, r.stderr
    assert not (prof / "calibration.json").exists() and (prof / "calibration.json.old").is_file()
    assert "calibration fitted to the previous tables moved to" in r.stdout
    assert {"mlp.csv", "attention.csv", "send_recv.csv", "device.json"} <= {p.name for p in prof.iterdir()}
    out = tmp_path / "run"
    r = cli("simulate", "--config", "tiny", "--set", f"hardware.profile={prof}", "--set", "pp=2",
            "--requests", "10", "--quiet", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "report.json").read_text())["summary"]
    for op in ("qkv_proj", "attn_prefill", "attn_decode", "send_inter_node"):
        assert s["cost_sources"][op].startswith(f"profile {prof}/"), s["cost_sources"][op]
    assert s["deployment"]["gpu"] == f"profile {prof}"
    assert s["finish_reasons"] == {"length": 10}
