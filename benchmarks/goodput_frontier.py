"""Goodput's Pareto figure and its frontier check (benchmarks/goodput.py).

A planner's frontier: every probe that met the TTFT target, its throughput against its p99
TBT, the best throughput at or below each TBT. The anchors' knobs (chunk sizes, maxp) put
points between the table's targets; `uniform`'s knob is its TBT target, which the table
sets to three values, so its frontier has three steps. The check gives `uniform` what the
anchors get: for each point of an anchor's frontier that `uniform`'s probes do not already
match (a point of its own at or below that p99 TBT with at least that throughput),
`uniform`'s capacity with that p99 TBT as its target (the setting's TTFT target kept);
its frontier lies above the anchor's where each such capacity's throughput is at least the
point's. Points below the table's tightest target are left out (`lowest`), and so are
targets `uniform` refuses (below one decode per micro-batch in flight: its one-line error).
"""
from __future__ import annotations

import json
from pathlib import Path

from pp_runtime.config import ConfigError


def points(st, planner: str) -> list[tuple[float, float]]:
    """(p99 TBT, throughput) of `planner`'s probes that met the TTFT target, by TBT."""
    return sorted((v["tbt_p99"], v["throughput_tok_s"]) for k, v in st.runs.items()
                  if json.loads(k)[0] == planner and v["qps"] is not None
                  and v["ttft_p99"] <= st.ttft_slo and not v["failed"])


def front(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no point at a lower or equal TBT beats on throughput (TBT-sorted input)."""
    out, top = [], 0.0
    for tbt, thr in pts:
        if thr > top:
            out.append((tbt, thr))
            top = thr
    return out


def best_at(pts: list[tuple[float, float]], tbt: float) -> float:
    return max((thr for t, thr in pts if t <= tbt), default=0.0)


def lowest(st) -> float:
    """The lowest p99 TBT checked: the table's tightest target (below it every planner
    carries a small fraction of what it carries there, and `uniform` sized to such a target
    makes micro-batches of a few tokens: a probe of LLaMA-2 at 1.02x the unloaded TBT took
    two minutes against ten seconds at 2x)."""
    return min(st.tbt_unloaded * m for m in st.multiples)


def check(st, refine) -> list[dict]:
    """`uniform` at each anchor frontier point it does not match yet, that point's p99 TBT
    as its target: one row per such point (the anchor, its TBT and throughput, `uniform`'s
    capacity there and the throughput it carried)."""
    rows, low = [], lowest(st)
    for planner in ("sarathi-serve", "gllm"):
        for tbt, thr in front(points(st, planner)):
            if tbt < low or best_at(points(st, "uniform"), tbt) >= thr:
                continue
            knobs = {"tbt_slo_ms": tbt * 1e3, "ttft_slo_ms": st.ttft_slo * 1e3}
            try:
                grid = st.capacity("uniform", knobs, tbt)[0]
            except ConfigError:  # under uniform's floor: one decode per micro-batch in flight
                continue
            qps, run = refine("uniform", knobs, tbt, grid) if grid > 0 else (0.0, None)
            rows.append({"anchor": planner, "tbt_p99": tbt, "throughput_tok_s": thr,
                         "uniform_qps": qps, "uniform_tok_s": run["throughput_tok_s"] if run else 0.0,
                         "uniform_tbt_p99": run["tbt_p99"] if run else None})
    return rows


def summary(st, rows: list[dict]) -> str:
    """One line: how many anchor frontier points `uniform`'s frontier lies at or above."""
    pts = points(st, "uniform")
    low = lowest(st)
    fronts = [(p, t, thr) for p in ("sarathi-serve", "gllm") for t, thr in front(points(st, p))
              if t >= low]
    below = [(p, t, thr, best_at(pts, t)) for p, t, thr in fronts if best_at(pts, t) < thr]
    line = (f"frontier: uniform at or above {len(fronts) - len(below)} of the anchors' "
            f"{len(fronts)} frontier points at p99 TBT >= {low * 1e3:.1f} ms ({len(rows)} checked "
            "with that p99 TBT as its target)")
    if below:
        line += "; below at " + ", ".join(f"{p} {t * 1e3:.1f} ms ({u:.0f} < {thr:.0f} tok/s)"
                                          for p, t, thr, u in below)
    return line


def pareto(st, res: dict, path: Path) -> None:
    """Throughput against p99 TBT of every probe that met the TTFT target; each planner's
    frontier as a step line; the table's targets dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for planner, color in (("uniform", "C0"), ("sarathi-serve", "C1"), ("gllm", "C2")):
        pts = points(st, planner)
        if pts:
            line = front(pts)
            ax.scatter([p[0] * 1e3 for p in pts], [p[1] for p in pts], s=10, color=color, alpha=0.3)
            ax.step([p[0] * 1e3 for p in line], [p[1] for p in line], where="post",
                    color=color, label=f"{planner} frontier")
    for c in res["cells"]:
        ax.axvline(c["tbt_slo_s"] * 1e3, color="#999999", lw=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set_xlabel("p99 time between tokens (ms; dashed: the TBT targets)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(f"{res['setting']}: probes meeting p99 TTFT <= {st.ttft_slo:.2f} s", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
