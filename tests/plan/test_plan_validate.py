"""`pp-runtime plan --validate`: the plan's choice and a reference served for real (two
`pp-runtime serve` processes one after the other, the load generator probing each), with
predicted and measured capacity side by side. A tiny model and a profile measured here."""
import os
import subprocess
import sys

import pytest

# 242-272 s in CI's suite on 2 cores, a quarter of it: run apart (python -m pytest -m heavy)
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_validate_serves_the_choice_and_the_reference_for_real(tmp_path):
    cli = [sys.executable, "-m", "pp_runtime.cli"]
    prof = subprocess.run(cli + ["profile", "--config", "tiny", "--quick", "--quiet", "--out",
                                 str(tmp_path / "profile")], capture_output=True, text=True, timeout=600)
    assert prof.returncode == 0, prof.stderr[-2000:]
    done = subprocess.run(cli + [
        "plan", "--model", "tiny-gpt", "--gpus", "2", "--gpu", "cpu", "--profile", str(tmp_path / "profile"),
        "--memory-gb", "0.05", "--workload", "zipf:min_len=32,max_len=128", "--requests", "20",
        "--chunk-sizes", "64", "--ttft-slo", "0.5", "--tbt-slo", "0.5", "--quiet",
        "--validate", "1", "--validate-requests", "8", "--calibrate", "2",
        "--out", str(tmp_path / "plan")],
        # the two replicas' side-by-side calibration (plan/shared.py) serves 10 s of arrivals,
        # not 40 s: nothing below reads its factor (tests/plan/test_shared.py does)
        env={**os.environ, "PP_RUNTIME_SHARED_SPAN_S": "10"},
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the profile had no calibration: each layout's measured first, said in one line
    assert "calibration of tp1 pp" in done.stdout and "measuring it now" in done.stdout
    assert "2 replicas served side by side for 10 s" in done.stdout
    assert (tmp_path / "profile" / "calibration.json").is_file()
    table = done.stdout.split("pred/meas")[1].strip().splitlines()
    assert table[0].startswith("#1 tp1 ") and table[1].startswith("reference cpu/gpt2_pp2"), done.stdout
    for row in table[:2]:  # ... predicted lo-hi measured pred/meas within|below|above the draws
        predicted, draws, measured, _ = row.split()[-7:-3]
        lo, hi = (float(x) for x in draws.split("-"))
        assert 0 < lo <= float(predicted) <= hi and float(measured) > 0, row
        assert row.endswith(" the draws"), row
    assert "the plan's choice / the reference, measured:" in done.stdout
    assert (tmp_path / "plan" / "validate-1.yaml").is_file()
    assert (tmp_path / "plan" / "validate-reference.yaml").is_file()
