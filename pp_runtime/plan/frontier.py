"""The Pareto frontier of a plan: what each layout carries per GPU against its latency.

Each layout (tp x pp x replicas) contributes one point: its best deployment at its
capacity, with the p99 TBT and p99 TTFT the simulator measured there. A point is on the
frontier when no other layout's point carries at least as much per GPU with a p99 TBT and
a p99 TTFT at least as low (and is better in one). The SLO's winner, the most per GPU, is
always on it; the others trade throughput for latency. Each frontier point is written as a
config (`frontier/NN.yaml`, NN from 01, the most throughput first) that `pp-runtime run`
and `serve` take, and the frontier is drawn beside every layout's point.
"""
from __future__ import annotations

from pathlib import Path

from pp_runtime.plan.report import _ms, dump_config, layout_points, rank_key
from pp_runtime.plan.search import Result, Slo

__all__ = ["layout_points", "pareto", "table", "write_configs", "plot"]


def _lat(r: Result) -> tuple[float, float]:
    return r.detail.get("tbt_p99_s") or 0.0, r.detail.get("ttft_p99_s") or 0.0


def dominates(a: Result, b: Result) -> bool:
    """a carries at least as much per GPU at no higher p99 TBT and TTFT, better in one."""
    (ta, fa), (tb, fb) = _lat(a), _lat(b)
    no_worse = a.per_gpu >= b.per_gpu and ta <= tb and fa <= fb
    return no_worse and (a.per_gpu > b.per_gpu or ta < tb or fa < fb)


def pareto(points: list[Result]) -> list[Result]:
    """The points no other dominates, the most per GPU first."""
    return sorted((p for p in points if not any(dominates(q, p) for q in points)), key=rank_key)


def table(front: list[Result], win: Result) -> str:
    head = (f"{'NN':>2}  {'deployment':<44} {'req/s/GPU':>9} {'TBT p99':>8} {'TTFT p99':>9}  config")
    out = [head, "-" * len(head)]
    for i, r in enumerate(front, 1):
        tbt, ttft = _lat(r)
        mark = "  <- the SLO's winner" if r is win else ""
        out.append(f"{i:02d}  {r.candidate.name:<44} {r.per_gpu:>9.4f} {_ms(tbt):>8} "
                   f"{_ms(ttft):>9}  frontier/{i:02d}.yaml{mark}")
    return "\n".join(out)


def write_configs(front: list[Result], configs: dict, slo: Slo, out: Path) -> list[Path]:
    """frontier/NN.yaml: each point as a config, its rate as workload.qps (one replica's)."""
    paths = []
    for i, r in enumerate(front, 1):
        c, (tbt, ttft) = r.candidate, _lat(r)
        cfg = configs[c].with_overrides(**{"workload.qps": round(r.qps / c.layout.replicas, 6)})
        paths.append(dump_config(cfg, c.layout.replicas, out / "frontier" / f"{i:02d}.yaml", (
            f"pp-runtime plan frontier point {i:02d}: {c.name}\n"
            f"{r.qps:.4f} req/s ({r.per_gpu:.5f} per GPU) at p99 TBT {_ms(tbt)}, p99 TTFT "
            f"{_ms(ttft)} (simulated; SLOs p99 TTFT <= {_ms(slo.ttft_s)}, TBT <= {_ms(slo.tbt_s)})\n"
            f"{c.layout.replicas} replica(s) of tp {c.layout.tp} x pp {c.layout.pp}: one "
            "`pp-runtime serve` per replica; workload.qps is one replica's share")))
    return paths


def plot(points: list[Result], front: list[Result], win: Result, slo: Slo, path: Path,
         title: str) -> Path:
    """Throughput per GPU against p99 TBT (left) and p99 TTFT (right): every layout's point,
    the frontier joined and numbered as its configs, the winner starred."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pp_runtime.telemetry.plots import _save

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, i, limit, what in ((axes[0], 0, slo.tbt_s, "p99 time between tokens (ms)"),
                               (axes[1], 1, slo.ttft_s, "p99 time to first token (s)")):
        scale = 1e3 if i == 0 else 1.0
        for r in points:
            ax.plot(_lat(r)[i] * scale, r.per_gpu, "o", color="#bbbbbb", ms=5)
            ax.annotate(r.candidate.layout.name, (_lat(r)[i] * scale, r.per_gpu), fontsize=6,
                        color="#888888", xytext=(3, -8), textcoords="offset points")
        xs = [_lat(r)[i] * scale for r in front]
        ax.plot(xs, [r.per_gpu for r in front], "o", color="C0", ms=7, label="frontier")
        for n, r in enumerate(front, 1):
            ax.annotate(f"{n:02d}", (_lat(r)[i] * scale, r.per_gpu), fontsize=8, color="C0",
                        xytext=(4, 3), textcoords="offset points")
        ax.plot(_lat(win)[i] * scale, win.per_gpu, "*", color="C3", ms=16,
                label=f"the SLO's winner: {win.candidate.layout.name}")
        ax.axvline(limit * scale, color="#999999", lw=0.8, ls="--", label="SLO")
        ax.set_xlabel(what)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("capacity per GPU (req/s, within both SLOs)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))
