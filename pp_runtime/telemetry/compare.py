"""Side-by-side comparison of finished runs: one table, ratios to the first run, plots.

Runs are compared on the same workload (the same `workload` section and seed), so the
ratios are of one run against another in the same process, not against numbers from
another day. The table has the bubble fraction, its split by cause and the steady window's (docs/bubbles.md).
Writes `comparison.json`, `bubble_cdf.png`, `completions.png` and `bubble_by_cause.png`.
"""
from __future__ import annotations

import json
from pathlib import Path

from pp_runtime.telemetry.plots import plot_comparison
from pp_runtime.telemetry.report import read_report

COLUMNS = [  # (header, summary getter, format)
    ("makespan s", lambda s: s["makespan_s"], "{:.1f}"),
    ("tok/s", lambda s: s["throughput_tok_s"], "{:.0f}"),
    ("bubble/req median s", lambda s: s["bubble_per_request_s"]["median"], "{:.3f}"),
    ("bubble/req p99 s", lambda s: s["bubble_per_request_s"]["p99"], "{:.3f}"),
    ("bubble frac", lambda s: s["bubble_fraction"], "{:.1%}"),
    ("upstream", lambda s: s.get("bubble_fraction_by_cause", {}).get("upstream", 0.0), "{:.1%}"),
    ("downstream", lambda s: s.get("bubble_fraction_by_cause", {}).get("downstream", 0.0), "{:.1%}"),
    ("dependency", lambda s: s.get("bubble_fraction_by_cause", {}).get("dependency", 0.0), "{:.1%}"),
    ("steady frac", lambda s: _steady(s), "{:.1%}"),  # the steady window's (windows.py)
    ("TTFT median s", lambda s: s["ttft_s"]["median"], "{:.2f}"),
    ("TBT median ms", lambda s: s["tbt_s"]["median"] * 1e3, "{:.1f}"),
]


def compare_runs(run_dirs: list[Path], out_dir: Path) -> str:
    """The comparison table (also written as comparison.json) of runs in run_dirs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {d.name: read_report(d)["summary"] for d in run_dirs}
    names = list(summaries)
    width = max(len(n) for n in names)
    lines = ["  ".join([f"{'run':<{width}}"] + [f"{h:>{max(len(h), 9)}}" for h, _, _ in COLUMNS])]
    for n, s in summaries.items():
        cells = [f"{_cell(fmt, get(s)):>{max(len(h), 9)}}" for h, get, fmt in COLUMNS]
        lines.append("  ".join([f"{n:<{width}}"] + cells))
    base = names[0]
    ratios = {}
    for n in names[1:]:
        a, b = summaries[n], summaries[base]
        ratios[n] = {
            "makespan": a["makespan_s"] / b["makespan_s"],
            "median_bubble": _ratio(a["bubble_per_request_s"]["median"],
                                    b["bubble_per_request_s"]["median"]),
        }
        lines.append(f"{n} / {base}: makespan {ratios[n]['makespan']:.2f}x, "
                     f"median bubble per request {_fmt_ratio(ratios[n]['median_bubble'])}")
    pairs = [(a, b) for a in names for b in names if a != b]
    makespan_pairs = {f"{a} / {b}": summaries[a]["makespan_s"] / summaries[b]["makespan_s"]
                      for a, b in pairs}
    (out_dir / "comparison.json").write_text(json.dumps(
        {"runs": [str(d) for d in run_dirs], "summaries": summaries, "ratios_to_first": ratios,
         "makespan_ratios": makespan_pairs}, indent=1))
    for path in plot_comparison(run_dirs, out_dir):
        lines.append(f"wrote {path}")
    return "\n".join(lines)


def _steady(s: dict) -> float:
    """The steady window's bubble fraction; nan for a report without windows, or with an
    empty steady window (every request at once)."""
    st = (s.get("windows") or {}).get("steady") or {}
    return st["bubble_fraction"] if st.get("stage_wall_s") else float("nan")


def _cell(fmt: str, value: float) -> str:
    """A table cell; "-" where there is no value (nan: no steady window)."""
    return "-" if value != value else fmt.format(value)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _fmt_ratio(r: float | None) -> str:
    return "n/a (baseline has none)" if r is None else f"{r:.2f}x"
