"""Reports of a simulated run: the fields other tools rely on, written and read back."""
import csv
import json
import subprocess
import sys

import pytest

from pp_runtime.config import config_from_dict
from pp_runtime.engine.simulate import simulate
from pp_runtime.telemetry.compare import compare_runs
from pp_runtime.telemetry.report import build_report, read_report, write_report

SUMMARY_KEYS = {"planner", "num_requests", "makespan_s", "throughput_tok_s", "bubble_per_request_s",
                "bubble_fraction", "per_stage", "ttft_s", "tbt_s"}
REQUEST_KEYS = {"id", "prompt_tokens", "output_tokens", "arrival_s", "first_token_s", "finish_s",
                "bubble_s", "num_microbatches"}


class TokenCost:
    def __init__(self, pp):
        self.pp = pp

    def stage_times(self, prefills, decode_kv_lens):
        return [1e-3 + 1e-4 * (sum(n for _, n in prefills) + len(decode_kv_lens))] * self.pp

    def send_time(self, num_tokens, stage):
        return 1e-5 * num_tokens

    def sources(self):
        return {"everything": "a test's hand-made cost"}


def cfg(planner="sarathi", dp=1, pp=2):
    return config_from_dict({
        "model": {"preset": "gpt3-175b", "num_layers": 4}, "parallel": {"tp": 8, "pp": pp, "dp": dp},
        "planner": {"planner": planner, "chunk_size": 128, "max_batch_size": 4},
        "workload": {"num_requests": 24, "min_len": 100, "max_len": 400, "qps": 100.0}})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    c = cfg()
    out = tmp_path_factory.mktemp("run")
    return c, write_report(simulate(c, TokenCost(2), progress=False), out), out


def test_report_json_has_every_field_and_adds_up(run_dir):
    c, report, out = run_dir
    s = report["summary"]
    assert SUMMARY_KEYS <= set(s) and s["num_requests"] == 24
    assert set(s["bubble_per_request_s"]) == {"median", "p90", "p99", "mean"}
    assert set(s["ttft_s"]) == set(s["tbt_s"]) == {"median", "p99"}
    assert s["cost_sources"] == {"everything": "a test's hand-made cost"}
    for st in s["per_stage"]:  # the kinds of time add up to each stage's wall time
        parts = st["busy_s"] + st["bubble_s"] + st["idle_s"] + st["transfer_s"]
        assert parts == pytest.approx(st["wall_s"])
        assert set(st["bubble_by_cause_s"]) == {"upstream", "downstream", "dependency"}
        assert sum(st["bubble_by_cause_s"].values()) == pytest.approx(st["bubble_s"])
    wall = sum(st["wall_s"] for st in s["per_stage"])
    for cause, frac in s["bubble_fraction_by_cause"].items():
        assert frac == pytest.approx(sum(st["bubble_by_cause_s"][cause] for st in s["per_stage"]) / wall)
    assert sum(s["bubble_fraction_by_cause"].values()) == pytest.approx(s["bubble_fraction"])
    assert s["per_stage"][0]["bubble_by_cause_s"]["dependency"] > 0  # stage 0 stalls on tokens
    reqs = report["requests"]
    assert len(reqs) == 24 and all(REQUEST_KEYS <= set(r) for r in reqs)
    assert s["makespan_s"] == max(r["finish_s"] for r in reqs)
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in reqs)
    assert s["throughput_tok_s"] == pytest.approx(tokens / s["makespan_s"])
    # a request's bubble is the sum over the micro-batches that carried it
    with open(out / "microbatches.csv") as f:
        mbs = list(csv.DictReader(f))
    assert len(mbs) == s["num_microbatches"]
    charged = [st["bubble_by_cause_s"]["upstream"] + st["bubble_by_cause_s"]["downstream"]
               for st in s["per_stage"]]  # a micro-batch is charged these two causes
    assert sum(float(m["bubble_s"]) for m in mbs) == pytest.approx(sum(charged))
    assert sum(int(m["num_requests"]) for m in mbs) == sum(r["num_microbatches"] for r in reqs)
    assert json.loads((out / "report.json").read_text()) == read_report(out)


def test_csv_and_plots_are_written(run_dir):
    _, report, out = run_dir
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["id"]) for r in rows] == [r["id"] for r in report["requests"]]
    assert float(rows[3]["bubble_s"]) == pytest.approx(report["requests"][3]["bubble_s"])
    for name in ("bubble_cdf.png", "completions.png", "timeline.png", "stage_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_command_reprints_and_replots(run_dir):
    _, report, out = run_dir
    (out / "timeline.png").unlink()
    r = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "report", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"makespan {report['summary']['makespan_s'] * 1e3:.2f} ms" in r.stdout
    assert (out / "timeline.png").is_file()
    bad = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "report", str(out / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no report.json" in bad.stderr


def test_replicas_split_the_work_and_report_every_stage(tmp_path):
    one = simulate(cfg(pp=1), TokenCost(1), progress=False)
    two = simulate(cfg(pp=1, dp=2), TokenCost(1), progress=False)
    rep = write_report(two, tmp_path, plots=False)
    assert [(s["replica"], s["stage"]) for s in rep["summary"]["per_stage"]] == [(0, 0), (1, 0)]
    assert all(r["finish_reason"] == "length" for r in rep["requests"])
    assert {r.num_microbatches > 0 for r in two.replicas} == {True}
    assert rep["summary"]["makespan_s"] < max(r.finish_s for r in one.requests)


def test_a_failed_run_counts_only_the_tokens_that_ran(tmp_path):
    """A request that errored before its prompt ran adds nothing to the throughput."""
    from dataclasses import replace

    from pp_runtime.core.request import FinishReason, RequestOutput

    run = simulate(cfg(), TokenCost(2), progress=False)
    base = build_report(run)["summary"]
    failed = RequestOutput(999, [1] * 5000, [], FinishReason.ERROR, arrival_s=0.0,
                           first_token_s=None, finish_s=0.0)
    s = build_report(replace(run, requests=run.requests + [failed]))["summary"]
    assert s["finish_reasons"]["error"] == 1
    assert s["throughput_tok_s"] == pytest.approx(base["throughput_tok_s"])


def test_timeline_has_a_start_and_a_steady_window(monkeypatch, tmp_path):
    monkeypatch.setattr("pp_runtime.telemetry.recorder.TIMELINE_MBS", 20)
    write_report(simulate(cfg(), TokenCost(2), progress=False), tmp_path, plots=False)
    with open(tmp_path / "timeline.csv") as f:
        rows = list(csv.DictReader(f))
    windows = {w: sorted({int(r["mb_id"]) for r in rows if r["window"] == w}) for w in ("start", "steady")}
    n = read_report(tmp_path)["summary"]["num_microbatches"]
    assert windows["start"] == list(range(20))
    first = windows["steady"][0]  # the last window that opened by half-way: 20 * 2^k
    assert len(windows["steady"]) == 20 and first in (20, 40, 80, 160, 320) and first <= n // 2 < 2 * first
    for r in rows:  # each row's parts are the stage's own: gap split + compute + send wait
        assert float(r["upstream_s"]) <= float(r["wait_s"]) + 1e-12
        assert float(r["downstream_s"]) == float(r["send_wait_s"])


def test_compare_prints_ratios_to_the_first_run(tmp_path):
    dirs = []
    for planner in ("sarathi", "orca-best"):
        write_report(simulate(cfg(planner), TokenCost(2), progress=False), tmp_path / planner)
        dirs.append(tmp_path / planner)
    text = compare_runs(dirs, tmp_path)
    a, b = (read_report(d)["summary"] for d in dirs)
    assert f"orca-best / sarathi: makespan {b['makespan_s'] / a['makespan_s']:.2f}x" in text
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert saved["ratios_to_first"]["orca-best"]["makespan"] == pytest.approx(
        b["makespan_s"] / a["makespan_s"])
    assert (tmp_path / "bubble_cdf.png").is_file()
