"""Capacity: the highest request rate a deployment sustains within a latency SLO.

Sarathi-Serve's metric: the highest QPS at which the p99 time between tokens (TBT) stays
under an SLO, with the median TTFT (the scheduling delay) kept bounded as well, so that an
overloaded system that merely queues requests does not count. The search:

  1. probe `start`; while it meets the SLOs, double the rate (the bracket's low end
     rises); once one fails, that rate is the high end (while the first probes fail,
     halve the rate, down to `min_qps`: a slower probe of N requests takes N / QPS s);
  2. bisect [low, high] until high / low - 1 <= rel_tol or `max_probes` are spent;
  3. capacity = the highest rate probed that met the SLOs (0 if none did).

Each probe is a run of the same N requests (same seed, so the same lengths; Poisson
arrivals at the probed rate) against a real server (`server_probe`, through the load
generator) or on the simulator (`sim_probe`, the same planner and driver on the cost
model). `ServerProcess` starts and stops `pp-runtime serve` for a benchmark, and
`latency_figure` draws p99 TBT and the median (or p99) TTFT against QPS for each planner.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from pp_runtime.config import Config
from pp_runtime.core.workload import RequestSpec, generate, workload_prompts


@dataclass(frozen=True)
class Probe:
    qps: float
    tbt_p99_s: float | None  # None: no token gaps (every request failed or had one token)
    ttft_p50_s: float | None
    ok: bool  # met every SLO (and no request failed)
    detail: dict = field(default_factory=dict, compare=False)  # the run's summary


@dataclass(frozen=True)
class Capacity:
    qps: float  # the highest rate probed that met the SLOs; 0.0 if none did
    probes: list[Probe]  # in the order run

    @property
    def curve(self) -> list[Probe]:
        return sorted(self.probes, key=lambda p: p.qps)


def meets(tbt_p99_s: float | None, ttft_p50_s: float | None, tbt_slo: float,
          ttft_slo: float | None, failed: int = 0) -> bool:
    return (not failed and tbt_p99_s is not None and tbt_p99_s <= tbt_slo
            and (ttft_slo is None or (ttft_p50_s is not None and ttft_p50_s <= ttft_slo)))


def capacity_search(probe: Callable[[float], Probe], start: float, rel_tol: float = 0.1,
                    max_probes: int = 8, max_qps: float = 1e4, min_qps: float = 0.0) -> Capacity:
    """Search the highest rate whose probe is ok (module docstring); probe(qps) -> Probe.
    Capacity 0 when no rate from start down to min_qps met the SLOs."""
    probes: list[Probe] = []

    def run(q: float) -> bool:
        p = probe(q)
        probes.append(p)
        return p.ok

    lo, hi, q = 0.0, None, start
    while len(probes) < max_probes:  # bracket: double while ok, halve while the first fails
        if run(q):
            lo = q
            if hi is not None or q >= max_qps:
                break
            q = min(2 * q, max_qps)
        else:
            hi = q
            if lo > 0 or q / 2 < min_qps:
                break
            q /= 2
    while hi is not None and lo > 0 and hi / lo - 1 > rel_tol and len(probes) < max_probes:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run(mid) else (lo, mid)
    return Capacity(max((p.qps for p in probes if p.ok), default=0.0), probes)


def poisson_specs(cfg: Config, qps: float) -> list[RequestSpec]:
    """The config's workload with Poisson arrivals at qps (same seed: same lengths for
    every rate, arrival gaps scaled by 1/qps)."""
    return generate(replace(cfg.workload, qps=qps))


def sim_probe(cfg: Config, tbt_slo: float, ttft_slo: float | None,
              ttft_key: str = "median") -> Callable[[float], Probe]:
    """probe(qps) on the simulator: cfg's planner, cost model and workload at that rate;
    the TTFT SLO bounds the median (Sarathi-Serve's scheduling delay) or, with ttft_key
    "p99", the p99 (the goodput benchmark's). The probe's `ttft_p50_s` holds that one."""
    from pp_runtime.costmodel import build_cost_model
    from pp_runtime.costmodel.balance import resolve_layer_split
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import build_report

    cfg = resolve_layer_split(cfg)  # one split for every rate probed
    cost = build_cost_model(cfg)

    def probe(qps: float) -> Probe:
        c = cfg.with_overrides(**{"workload.qps": qps})
        s = build_report(simulate(c, cost, progress=False))["summary"]
        tbt, ttft = s["tbt_s"]["p99"], s["ttft_s"][ttft_key]
        failed = s["num_requests"] - s["finish_reasons"].get("length", 0)
        return Probe(qps, tbt, ttft, meets(tbt, ttft, tbt_slo, ttft_slo, failed),
                     {"makespan_s": s["makespan_s"], "throughput_tok_s": s["throughput_tok_s"],
                      "bubble_fraction": s["bubble_fraction"], "tbt_p50_s": s["tbt_s"]["median"],
                      "ttft_p99_s": s["ttft_s"]["p99"]})

    return probe


def server_probe(url: str, cfg: Config, tbt_slo: float, ttft_slo: float | None,
                 api_key: str | None = None, progress: bool = True,
                 vocab_size: int | None = None, ttft_key: str = "median") -> Callable[[float], Probe]:
    """probe(qps) against the server at url: cfg's workload at that rate, streamed
    (prompt ids below vocab_size, default the config model's); the TTFT SLO bounds the
    median or the p99 (`ttft_key`), as `sim_probe`'s."""
    from pp_runtime.bench.loadgen import load_test

    def probe(qps: float) -> Probe:
        specs = poisson_specs(cfg, qps)
        prompts = workload_prompts(specs, vocab_size or cfg.model.vocab_size, cfg.workload.seed)
        s, _ = load_test(url, specs, prompts, api_key=api_key, ttft_slo=ttft_slo,
                         tbt_slo=tbt_slo, progress=progress, desc=f"{qps:.3g} req/s")
        tbt, ttft = s["tbt_s"]["p99"], s["ttft_s"][ttft_key]  # the run report's keys, as sim_probe
        return Probe(qps, tbt, ttft, meets(tbt, ttft, tbt_slo, ttft_slo, s["failed"]), s)

    return probe


class ServerProcess:
    """`pp-runtime serve ARGS --host 127.0.0.1 --port PORT` as a subprocess, output to log;
    `with` waits for /health (200) and stops the server (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, args: list[str], port: int, log: Path, ready_timeout_s: float = 300):
        self.cmd = [sys.executable, "-m", "pp_runtime.cli", "serve", *args,
                    "--host", "127.0.0.1", "--port", str(port)]
        self.url, self.log, self.ready_timeout_s = f"http://127.0.0.1:{port}", Path(log), ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        from pp_runtime.bench.loadgen import wait_healthy

        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray stays on 127.0.0.1
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        try:
            self.ready_s = wait_healthy(self.url, self.ready_timeout_s, lambda: self.proc.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{exc}; {' '.join(self.cmd)}; its log ({self.log}):\n{tail}") from None
        except BaseException:  # Ctrl-C while it starts: __exit__ will not run
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and its children
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def latency_figure(curves: dict[str, list[Probe]], tbt_slo: float, ttft_slo: float | None,
                   title: str = "", ttft_key: str = "median"):
    """Two panels against QPS: p99 TBT and the TTFT the SLO bounds (`ttft_key`: the median
    or the p99, what the probes hold), one line per curve (label -> probes),
    SLOs dashed grey; hollow markers for probes that missed an SLO. Labels "NAME (where)"
    share NAME's colour and marker; each `where` has its own line style."""
    import matplotlib.pyplot as plt

    from pp_runtime.telemetry.plots import line_styles

    names = list(dict.fromkeys(label.split(" (")[0] for label in curves))
    wheres = list(dict.fromkeys(label.partition(" (")[2] for label in curves))
    by_name = dict(zip(names, line_styles(len(names))))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, probes in curves.items():
        name, _, where = label.partition(" (")
        style = {**by_name[name], "linestyle": ("-", "--", ":", "-.")[wheres.index(where) % 4]}
        pts = sorted(probes, key=lambda p: p.qps)
        x = [p.qps for p in pts]
        for ax, key in zip(axes, ("tbt_p99_s", "ttft_p50_s")):
            y = [getattr(p, key) if getattr(p, key) is not None else float("nan") for p in pts]
            ax.plot(x, y, lw=1.6, markersize=0, label=label, color=style["color"],
                    linestyle=style["linestyle"])
            for xi, yi, p in zip(x, y, pts):
                ax.plot(xi, yi, marker=style["marker"], color=style["color"], markersize=6,
                        markerfacecolor=style["color"] if p.ok else "white")
    for ax, slo, name in ((axes[0], tbt_slo, "p99 time between tokens"),
                          (axes[1], ttft_slo, f"{ttft_key} TTFT")):
        latency_axis(ax, slo, name, "request rate (QPS, Poisson)")
    axes[0].set_title("p99 TBT (filled: probe met the SLOs)", fontsize=10)
    axes[1].set_title(f"{ttft_key} TTFT", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def latency_axis(ax, slo: float | None, name: str, xlabel: str, fontsize: int = 8) -> None:
    """One latency-against-rate panel's frame: the SLO dashed grey, a log scale, labels."""
    if slo is not None:
        ax.axhline(slo, color="#555555", lw=1, linestyle="--", label=f"SLO {slo * 1e3:.0f} ms")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{name} (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=fontsize, loc="best")


def plot_latency(curves: dict[str, list[Probe]], tbt_slo: float, ttft_slo: float | None,
                 path: Path, title: str = "", ttft_key: str = "median") -> Path:
    from pp_runtime.telemetry.plots import _save

    return _save(latency_figure(curves, tbt_slo, ttft_slo, title, ttft_key), Path(path))
