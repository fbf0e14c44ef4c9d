"""The Grafana dashboard's bubble queries, evaluated by Prometheus itself (`promtool test
rules`, Debian's `prometheus` package): they must run (no "vector cannot contain metrics
with the same labelset") and give the shares a hand computation gives.

Input: two stages of one deployment over 2 minutes. Stage 0: per second 0.5 s busy,
0.3 s dependency, 0.2 s downstream; stage 1: 0.6 s busy, 0.4 s upstream. Each stage's
wall counter grows 1 s per second. Expected bubble shares: stage 0 0.3 + 0.2, stage 1 0.4.
"""
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pp_runtime.json"
LABELS = 'deployment="d-tp1xpp2"'


def _series(name: str, labels: str, per_s: float) -> dict:
    # a counter sampled every 15 s for 2 minutes (9 samples), growing per_s every second
    return {"series": f"{name}{{{labels}}}", "values": f"0+{per_s * 15:g}x8"}


def _dashboard_exprs() -> dict[str, str]:
    """legendFormat -> expr of every bubble-share target, with Grafana's variables filled."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    out = {}
    for t in (t for p in panels for t in p.get("targets", [])):
        if "bubble" in t["expr"] and "wall" in t["expr"]:
            out[t["legendFormat"]] = (t["expr"].replace("$deployment", ".*")
                                      .replace("$__rate_interval", "1m"))
    return out


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus)")
def test_dashboard_bubble_shares_evaluate_in_prometheus(tmp_path):
    exprs = _dashboard_exprs()
    assert exprs, "the dashboard has no bubble-share query"
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"share_{i}", "expr": e} for i, e in enumerate(exprs.values())]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    b, w = "ray_pp_runtime_stage_bubble_seconds_total", "ray_pp_runtime_stage_wall_seconds_total"
    series = [
        _series(b, f'{LABELS},stage="0",cause="dependency"', 0.3),
        _series(b, f'{LABELS},stage="0",cause="downstream"', 0.2),
        _series(b, f'{LABELS},stage="1",cause="upstream"', 0.4),
        _series(w, f'{LABELS},stage="0"', 1.0),
        _series(w, f'{LABELS},stage="1"', 1.0),
        _series("ray_pp_runtime_stage_busy_seconds_total", f'{LABELS},stage="0"', 0.5),
        _series("ray_pp_runtime_stage_busy_seconds_total", f'{LABELS},stage="1"', 0.6),
    ]
    expected = {  # per cause, as the dashboard's "(window)" target groups them
        ("0", "dependency"): 0.3, ("0", "downstream"): 0.2, ("1", "upstream"): 0.4}
    tests = []
    for i, expr in enumerate(exprs.values()):
        by_cause = "cause" in expr.split("/")[0]
        samples = ([{"labels": f'share_{i}{{{LABELS},stage="{s}",cause="{c}"}}', "value": v}
                    for (s, c), v in expected.items()] if by_cause else
                   [{"labels": f'share_{i}{{{LABELS},stage="0"}}', "value": 0.5},
                    {"labels": f'share_{i}{{{LABELS},stage="1"}}', "value": 0.4}])
        tests.append({"expr": f"share_{i}", "eval_time": "2m", "exp_samples": samples})
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}]}))
    r = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_old_name_regex_query_fails_in_prometheus(tmp_path):
    """What the dashboard did before: rate() over a __name__ regex. Prometheus rejects it
    once two of the matched counters share their other labels (the reason it is gone)."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    expr = ('sum by (deployment, stage) (rate({__name__=~"ray_pp_runtime_stage_(busy|wall)'
            '_seconds_total"}[1m]))')
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(
        {"groups": [{"name": "g", "rules": [{"record": "old", "expr": expr}]}]}))
    series = [_series("ray_pp_runtime_stage_busy_seconds_total", f'{LABELS},stage="0"', 0.5),
              _series("ray_pp_runtime_stage_wall_seconds_total", f'{LABELS},stage="0"', 1.0)]
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": [
            {"expr": "old", "eval_time": "2m",
             "exp_samples": [{"labels": f'old{{{LABELS},stage="0"}}', "value": 1.5}]}]}]}))
    r = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "same labelset" in r.stdout + r.stderr
