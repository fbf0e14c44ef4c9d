"""Every Grafana panel (docs/grafana/pp_runtime.json) and every example query of
docs/monitoring.md, evaluated by a real Prometheus that scrapes a real PP=2 Ray run.

The module starts its own Ray on 127.0.0.1 (dashboard, fixed metrics export port, metrics
reported every second) and Debian's `prometheus` on 127.0.0.1 with one scrape job (that
port, every second) and its storage in a temp dir, runs the tiny model with PP=2 on the Ray
executor (requests arriving over a few seconds, so the counters grow across scrapes), waits
until Prometheus holds the run's final values, and then evaluates every query through
Prometheus's HTTP API (`/api/v1/query`): each must succeed and return data, the counters
must equal the run's report.json (per stage busy / transfer / idle / wall and bubble by
cause, the bubble-fraction gauge, histogram counts) and the windowed panels must agree with
it (the same series, values within the report's range).

Prometheus missing: as root with apt-get, the module installs Debian's (`apt-get install
--no-install-recommends prometheus`, its service kept from starting: the one Prometheus
here is the test's, on 127.0.0.1), as tests/launch/test_slurm.py installs Slurm; where that
is impossible (not root, no apt-get, the install fails) it skips, saying why.
Run with `-s` to see one line per panel and query (for pasting into an issue).
"""
import json
import math
import os
import re
import shutil
import subprocess
import time
import types
import urllib.parse
import urllib.request
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray port on 127.0.0.1

import pytest  # noqa: E402
import yaml  # noqa: E402

from pp_runtime.telemetry.metrics import SPECS, Metric  # noqa: E402
from pp_runtime.core.net import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "pp_runtime.json"
MONITORING = ROOT / "docs" / "monitoring.md"
DEP = "tiny-gpt-tp1xpp2"
WINDOW = "1m"  # for Grafana's $__rate_interval (>= 4 scrape intervals) and the run inside it
STAGE_KINDS = ("busy", "transfer", "idle", "wall", "dependency_token")  # report: {kind}_s


# ---- the dashboard's and the docs' queries --------------------------------------------

def dashboard_targets() -> list[tuple[str, str, str]]:
    """(panel title, legendFormat, expr) of every target, Grafana's variables filled."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$deployment", ".*").replace("$__rate_interval", WINDOW)
            assert "$" not in expr, expr  # a variable this test does not know
            out.append((panel["title"], t["legendFormat"], expr))
    return out


def doc_queries() -> list[tuple[str, str]]:
    """(comment, query) of monitoring.md's ```promql block: a `# ...` line names the query
    that follows, which may span lines."""
    blocks = re.findall(r"```promql\n(.*?)```", MONITORING.read_text(), re.S)
    assert len(blocks) == 1, "monitoring.md has one ```promql block of example queries"
    out = []
    for line in blocks[0].splitlines():
        if line.startswith("#"):
            out.append([line.lstrip("# ").strip(), ""])
        elif line.strip():
            assert out, "a query needs a `# what it shows` line above it"
            out[-1][1] += " " + line.strip()
    assert out and all(q for _, q in out)
    return [(c, q.strip()) for c, q in out]


# ---- Prometheus ---------------------------------------------------------------------------


APT_INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]


def install_prometheus() -> str:
    """`prometheus` on PATH, apt-get installed when missing; skip (not fail) when that is
    impossible."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("prometheus is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        pytest.skip("prometheus is not installed and there is no apt-get to install it")
    # no Recommends (node exporter), and no service started: Debian's would listen on every
    # interface (the policy-rc.d convention of containers, removed again afterwards)
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        r = subprocess.run(APT_INSTALL, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:  # a stale package list: update it, then try once more
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
            r = subprocess.run(APT_INSTALL, env=env, capture_output=True, text=True, timeout=900)
    finally:
        if ours:
            policy.unlink()
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip(f"could not install prometheus ({' '.join(APT_INSTALL)}): "
                    f"{(r.stderr or r.stdout)[-500:]}")
    return found


class Prometheus:
    """A prometheus process on 127.0.0.1 scraping one target every second."""

    def __init__(self, binary: str, target: str, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                  "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [target]}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir)
        self.workdir = workdir

    def get(self, path: str, **params) -> dict:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready:\n"
                             + (self.workdir / "prometheus.log").read_text()[-3000:])

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict, float]]:
        """An instant query: [(labels, value)]; fails unless Prometheus says success."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        try:
            body = self.get("/api/v1/query", **params)
        except urllib.error.HTTPError as e:  # a bad query: 400 with the error in the body
            raise AssertionError(f"{expr}: {e.read().decode()}") from None
        assert body["status"] == "success", (expr, body)
        assert body["data"]["resultType"] == "vector", (expr, body["data"]["resultType"])
        return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self.log.close()


# ---- the run ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A PP=2 Ray run scraped by Prometheus: the Prometheus, the report, the run's values."""
    binary = install_prometheus()
    ray = pytest.importorskip("ray")
    from pp_runtime import LLM
    from pp_runtime.config import load_config
    from pp_runtime.core.request import FinishReason, SamplingParams
    from pp_runtime.telemetry.recorder import RunRecorder
    from pp_runtime.telemetry.report import RunResult, build_report

    if ray.is_initialized():  # another module's Ray: this one must hold only this run's series
        ray.shutdown()
    metrics_port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=free_port(), _metrics_export_port=metrics_port,
             _node_ip_address="127.0.0.1", log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    prom = Prometheus(binary, f"127.0.0.1:{metrics_port}", tmp_path_factory.mktemp("prometheus"))
    try:
        prom.wait_ready()
        deadline = time.monotonic() + 30  # scraping the metrics agent before the run starts
        while [v for _, v in prom.query('up{job="ray"}')] != [1.0]:
            assert time.monotonic() < deadline, prom.query('up{job="ray"}')
            time.sleep(0.5)

        # requests arriving over ~3.5 s with different lengths: the counters and histograms
        # grow across several exports and scrapes, so rate() over the window sees them grow
        lens = (37, 9, 52, 20, 3, 45, 14, 28)
        prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lens)]
        params = [SamplingParams(max_tokens=4 + i % 4, ignore_eos=True) for i in range(len(lens))]
        arrivals = [0.5 * i for i in range(len(lens))]
        rec = RunRecorder(time.perf_counter)
        with LLM(load_config("tiny", pp=2, executor="ray", threads_per_worker=1)) as llm:
            assert llm.executor.name == "ray" and llm.config.runtime.metrics
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, on_microbatch=rec, arrival_s=arrivals)
            run_wall_s = time.perf_counter() - t0
            report = build_report(RunResult(llm.config, "ray", outs, [rec], run_wall_s))
        assert all(o.finish_reason == FinishReason.LENGTH for o in outs)
        summary = report["summary"]
        n, gaps = len(outs), sum(len(o.token_ids) - 1 for o in outs)
        walls = {str(s["stage"]): s["wall_s"] for s in summary["per_stage"]}

        def final() -> bool:  # Ray exports a second or two after recording; then a scrape
            ttft = prom.query(f'sum(ray_pp_runtime_request_ttft_seconds_count{{deployment="{DEP}"}})')
            wall = {lab["stage"]: v for lab, v in prom.query(
                f'sum by (stage) (ray_pp_runtime_stage_wall_seconds_total{{deployment="{DEP}"}})')}
            return ([v for _, v in ttft] == [n] and wall.keys() == walls.keys()
                    and all(wall[s] == pytest.approx(walls[s], rel=1e-6) for s in walls))

        deadline = time.monotonic() + 60
        while not final():
            assert time.monotonic() < deadline, "Prometheus never saw the run's final values"
            time.sleep(0.5)
        yield types.SimpleNamespace(
            prom=prom, at=time.time(), report=report, rec=rec, outs=outs, n=n, gaps=gaps,
            run_wall_s=run_wall_s)
    finally:
        prom.stop()
        ray.shutdown()


# ---- what each query must give -----------------------------------------------------------

def _fmt(result: list[tuple[dict, float]]) -> str:
    def labels(lab):
        keep = {k: v for k, v in lab.items() if k != "deployment"} or lab
        return " ".join(f"{k}={v}" for k, v in sorted(keep.items()))
    return ", ".join(f"{labels(lab)} {v:.6g}" for lab, v in sorted(
        result, key=lambda r: sorted(r[0].items())))


def _bucket(metric: Metric, lo: float, hi: float) -> tuple[float, float]:
    """The range histogram_quantile can give for observations in [lo, hi]: from the lower
    bound of lo's bucket (0 for the first) to the upper bound of hi's (the largest finite
    bound when hi is beyond it)."""
    bounds = SPECS[metric].boundaries
    below = [b for b in bounds if b < lo * (1 - 1e-3)]
    above = [b for b in bounds if b >= hi * (1 + 1e-3)]
    return (below[-1] if below else 0.0), (above[0] if above else bounds[-1])


def _observed(run, metric: Metric, kind: str | None = None) -> list[float]:
    """What the run observed into a histogram, from the report and the recorder."""
    if metric is Metric.REQUEST_TTFT:
        return [r["first_token_s"] - r["arrival_s"] for r in run.report["requests"]]
    if metric is Metric.REQUEST_BUBBLE:
        return [r["bubble_s"] for r in run.report["requests"]]
    if metric is Metric.REQUEST_TBT:
        return list(run.rec.token_gaps_s)
    return [float(v) for v in run.rec.mb_columns["prefill_tokens" if kind == "prefill" else "decodes"]]


def _metric_of(expr: str) -> Metric:
    names = {re.sub(r"_(total|bucket|count|sum)$", "", n)[len("ray_"):]
             for n in re.findall(r"ray_pp_runtime_\w+", expr)}
    if names == {Metric.STAGE_BUBBLE.value, Metric.STAGE_WALL.value}:
        return Metric.STAGE_BUBBLE_FRACTION  # the share over the window
    assert len(names) == 1, expr
    return Metric(names.pop())


KV_COUNTERS = {Metric.PREEMPTIONS: "preemptions", Metric.PREFIX_HIT_TOKENS: "prefix_cache_hit_tokens"}
# series a recovery writes first (engine/recovery.py): none without one
RECOVERY_SERIES = (Metric.RECOVERIES, Metric.RECOMPUTED_TOKENS, Metric.RECOVERING)


def check(run, expr: str, result: list[tuple[dict, float]]) -> None:
    """`result` of `expr` (evaluated at the end of the run, the run inside its window)
    agrees with the run's report."""
    metric = _metric_of(expr)
    if metric in KV_COUNTERS:  # Ray exports a counter once it has counted: none, no series
        total = run.report["summary"][KV_COUNTERS[metric]]
        assert bool(result) == (total > 0), (expr, result, KV_COUNTERS[metric], total)
        assert all(lab.get("deployment") == DEP and v >= 0 for lab, v in result), (expr, result)
        return
    if metric in RECOVERY_SERIES:  # this run recovered nothing (tests/executors/test_recovery.py)
        assert not run.report["summary"]["recoveries"] and not result, (expr, result)
        return
    assert result, f"no data: {expr}"
    assert all(math.isfinite(v) and v >= 0 for _, v in result), (expr, result)
    assert all(lab.get("deployment") == DEP for lab, _ in result), (expr, result)
    per_stage = {str(s["stage"]): s for s in run.report["summary"]["per_stage"]}
    causes = {(st, c) for st, s in per_stage.items() for c, v in s["bubble_by_cause_s"].items() if v > 0}
    windowed = "rate(" in expr
    by_cause = "cause" in expr.split("/")[0]
    if "histogram_quantile" in expr:
        kinds = ("prefill", "decode") if metric is Metric.MB_TOKENS else (None,)
        assert sorted(lab.get("kind") for lab, _ in result) == sorted(kinds, key=str), result
        for lab, v in result:
            obs = _observed(run, metric, lab.get("kind"))
            lo, hi = _bucket(metric, min(obs), max(obs))
            assert lo <= v <= hi, (expr, lab, v, (lo, hi), obs)
    elif metric is Metric.MB_TOKENS:  # the mean from _sum / _count, Ray's _sum approximate
        assert sorted(lab["kind"] for lab, _ in result) == ["decode", "prefill"], result
    elif metric is Metric.REQUEST_BUBBLE:  # requests finished per second over the window
        assert [v for _, v in result] and result[0][1] > 0, result
    elif metric in (Metric.IN_FLIGHT, Metric.QUEUE_DEPTH):  # the run is over: nothing left
        assert [v for _, v in result] == [0], result
    elif metric is Metric.STAGE_BUBBLE_FRACTION and not windowed:  # the gauge: the report's
        got = {(lab["stage"], lab["cause"]): v for lab, v in result}
        want = {(st, c): v / s["wall_s"] for st, s in per_stage.items()
                for c, v in s["bubble_by_cause_s"].items()}
        assert got.keys() == want.keys(), (got, want)
        for key, v in want.items():
            assert got[key] == pytest.approx(v, rel=1e-6, abs=1e-12), key
    elif metric is Metric.STAGE_BUBBLE_FRACTION:  # a share over the window
        assert all(v <= 1 + 1e-9 for _, v in result), result
        if by_cause:
            assert {(lab["stage"], lab["cause"]) for lab, _ in result} == causes, result
        else:
            assert {lab["stage"] for lab, _ in result} == {st for st, _ in causes}, result
    elif metric is Metric.STAGE_BUBBLE:  # seconds per second by cause: the report's causes
        assert {(lab["stage"], lab["cause"]) for lab, _ in result} == causes, result
        assert all(v <= 1 + 1e-9 for _, v in result), result
    else:  # busy / transfer / idle seconds per second: the report's stages with any
        kind = metric.value[len("pp_runtime_stage_"):-len("_seconds")]
        assert kind in STAGE_KINDS, expr
        assert {lab["stage"] for lab, _ in result} == {
            st for st, s in per_stage.items() if s[f"{kind}_s"] > 0}, result
        assert all(v <= 1 + 1e-9 for _, v in result), result
        if kind == "busy":
            assert all(v > 0 for _, v in result), result


# ---- the tests ---------------------------------------------------------------------------

def test_every_grafana_panel_returns_data_that_agrees_with_the_report(scraped):
    targets = dashboard_targets()
    assert len(targets) >= 20
    failures = []
    for title, legend, expr in targets:
        result = scraped.prom.query(expr, at=scraped.at)
        print(f'panel "{title}" [{legend}]: {_fmt(result) or "NO DATA"}')
        try:
            check(scraped, expr, result)
        except AssertionError as e:
            failures.append(f'"{title}" [{legend}]: {e}')
    assert not failures, "\n".join(failures)


def test_every_documented_query_returns_data_that_agrees_with_the_report(scraped):
    queries = doc_queries()
    failures = []
    for comment, expr in queries:
        result = scraped.prom.query(expr, at=scraped.at)
        print(f'query "{comment}": {_fmt(result) or "NO DATA"}')
        try:
            check(scraped, expr, result)
        except AssertionError as e:
            failures.append(f'"{comment}": {e}')
    assert not failures, "\n".join(failures)


def test_counters_in_prometheus_equal_the_report(scraped):
    """The raw series (Ray's own labels summed away) hold report.json's numbers exactly."""
    q = lambda e: scraped.prom.query(e, at=scraped.at)  # noqa: E731
    sel = f'{{deployment="{DEP}"}}'
    per_stage = scraped.report["summary"]["per_stage"]
    assert [s["stage"] for s in per_stage] == [0, 1]
    for kind in STAGE_KINDS:
        got = {lab["stage"]: v for lab, v in q(f"sum by (stage) (ray_pp_runtime_stage_{kind}_seconds_total{sel})")}
        want = {str(s["stage"]): s[f"{kind}_s"] for s in per_stage if s[f"{kind}_s"] > 0}
        print(f"report {kind}_s per stage: " + ", ".join(f"stage={st} prometheus {got.get(st)} report {v}"
                                                         for st, v in want.items()))
        assert got.keys() == want.keys(), (kind, got, want)
        for st, v in want.items():
            assert got[st] == pytest.approx(v, rel=1e-6), (kind, st)
    bubble = {(lab["stage"], lab["cause"]): v for lab, v in
              q(f"sum by (stage, cause) (ray_pp_runtime_stage_bubble_seconds_total{sel})")}
    fraction = {(lab["stage"], lab["cause"]): v for lab, v in
                q(f"max by (stage, cause) (ray_pp_runtime_stage_bubble_fraction{sel})")}
    for s in per_stage:  # bubble by cause per stage, and the gauge = cause / wall
        st = str(s["stage"])
        print(f"report stage {st} bubble_by_cause_s: " + ", ".join(
            f"{c} prometheus {bubble.get((st, c), 0.0):.6g} report {v:.6g} fraction "
            f"{fraction.get((st, c))}" for c, v in s["bubble_by_cause_s"].items()))
        for cause, v in s["bubble_by_cause_s"].items():
            if v > 0:
                assert bubble[(st, cause)] == pytest.approx(v, rel=1e-6), (st, cause)
            else:
                assert (st, cause) not in bubble  # a counter appears once it grows
            assert fraction[(st, cause)] == pytest.approx(v / s["wall_s"], rel=1e-6, abs=1e-12)
        assert sum(s["bubble_by_cause_s"].values()) == pytest.approx(s["bubble_s"])
    assert bubble[("1", "upstream")] > 0 and bubble[("0", "dependency")] > 0
    assert sum(v for (st, _), v in bubble.items()) == pytest.approx(
        sum(s["bubble_s"] for s in per_stage), rel=1e-6)

    one = lambda e: [v for _, v in q(e)]  # noqa: E731
    n, mbs = scraped.n, scraped.rec.num_microbatches
    assert one(f"sum(ray_pp_runtime_request_ttft_seconds_count{sel})") == [n]
    assert one(f"sum(ray_pp_runtime_request_bubble_seconds_count{sel})") == [n]
    assert one(f'sum(ray_pp_runtime_request_ttft_seconds_bucket{{deployment="{DEP}",le="+Inf"}})') == [n]
    assert one(f"sum(ray_pp_runtime_request_tbt_seconds_count{sel})") == [scraped.gaps]
    assert one(f"sum by (kind) (ray_pp_runtime_microbatch_tokens_count{sel})") == [mbs, mbs]
    assert scraped.report["summary"]["num_microbatches"] == mbs
    print(f"report: {n} requests, {scraped.gaps} token gaps, {mbs} micro-batches, run "
          f"{scraped.run_wall_s:.2f} s; Prometheus counts agree")
