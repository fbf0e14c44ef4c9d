"""PNG plots of a run directory (and of several runs side by side), with matplotlib.

Everything is read back from the files `telemetry.report` wrote, so `pp-runtime report DIR`
re-plots a finished run exactly as the run did:

  bubble_cdf.png    CDF of pipeline bubble time per request (paper Fig. 12a)
  completions.png   requests completed over time (paper Fig. 12b)
  timeline.png      per-stage timeline of the first micro-batches (compute, wait, transfer)
  stage_time.png    busy / transfer / bubble / idle time of every stage
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

TIMELINE_PLOT_MBS = 120  # micro-batches drawn on the timeline (more are unreadable)


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    cols = {name: [r[i] for r in rows[1:]] for i, name in enumerate(rows[0])}
    out = {}
    for name, vals in cols.items():
        try:
            out[name] = np.array([float(v) if v not in ("", "None") else np.nan for v in vals])
        except ValueError:
            out[name] = np.array(vals)
    return out


def _label(run_dir: Path) -> str:
    s = json.loads((run_dir / "report.json").read_text())["summary"]
    d = s["deployment"]
    return f"{s['planner']} TP{d['tp']}xPP{d['pp']}" + (f", {d['dp']} replicas" if d["dp"] > 1 else "")


def plot_bubble_cdf(run_dirs: list[Path], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in run_dirs:
        b = np.sort(_read_csv(d / "requests.csv")["bubble_s"])
        ax.plot(b, np.arange(1, len(b) + 1) / len(b), label=_label(d))
    ax.set(xlabel="pipeline bubble time per request (s)", ylabel="fraction of requests",
           title="Bubble time per request (CDF)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_completions(run_dirs: list[Path], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in run_dirs:
        f = _read_csv(d / "requests.csv")["finish_s"]
        f = np.sort(f[~np.isnan(f)])
        ax.plot(f, np.arange(1, len(f) + 1), label=_label(d))
    ax.set(xlabel="time (s)", ylabel="requests completed", title="Requests completed over time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_timeline(run_dir: Path, out: Path) -> None:
    t = _read_csv(run_dir / "timeline.csv")
    if len(t["mb_id"]) == 0:
        return
    t = {k: v[t["mb_id"] < TIMELINE_PLOT_MBS] for k, v in t.items()}
    stages = int(t["stage"].max()) + 1
    fig, ax = plt.subplots(figsize=(11, 0.5 * stages + 1.6))
    start, end = t["compute_start_s"], t["compute_end_s"]
    prefill = t["prefill_tokens"] > 0
    for stage in range(stages):
        sel = t["stage"] == stage
        for mask, color in ((sel & prefill, "tab:orange"), (sel & ~prefill, "tab:blue")):
            ax.broken_barh(list(zip(start[mask], end[mask] - start[mask])), (stage - 0.4, 0.8),
                           facecolors=color, edgecolors="black", linewidth=0.2)
        w = sel & (t["wait_s"] > 0)  # the bubble right before each compute
        gap_start = start[w] - t["transfer_s"][w] - t["wait_s"][w]
        ax.broken_barh(list(zip(gap_start, t["wait_s"][w])), (stage - 0.4, 0.8),
                       facecolors="tab:red", alpha=0.35)
    ax.set(yticks=range(stages), yticklabels=[f"stage {s}" for s in range(stages)],
           xlabel="time (s, each stage's clock)", ylim=(stages - 0.5, -0.5),
           title=f"First {len(set(t['mb_id']))} micro-batches: orange = with prefill, "
                 "blue = decodes only, red = bubble")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_stage_time(run_dir: Path, out: Path) -> None:
    per_stage = json.loads((run_dir / "report.json").read_text())["summary"]["per_stage"]
    labels = [f"r{s['replica']}s{s['stage']}" for s in per_stage]
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(labels) + 2), 4))
    bottom = np.zeros(len(per_stage))
    for key, color in (("busy_s", "tab:green"), ("transfer_s", "tab:gray"),
                       ("bubble_s", "tab:red"), ("idle_s", "tab:blue")):
        vals = np.array([s[key] for s in per_stage])
        ax.bar(labels, vals, bottom=bottom, color=color, label=key[:-2])
        bottom += vals
    ax.set(ylabel="seconds", title="Time of each stage (replica r, stage s)")
    ax.tick_params(axis="x", labelrotation=90 if len(labels) > 16 else 0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_run(run_dir: str | Path) -> list[Path]:
    d = Path(run_dir)
    outs = [d / "bubble_cdf.png", d / "completions.png", d / "timeline.png", d / "stage_time.png"]
    plot_bubble_cdf([d], outs[0])
    plot_completions([d], outs[1])
    plot_timeline(d, outs[2])
    plot_stage_time(d, outs[3])
    return outs


def plot_comparison(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    outs = [out_dir / "bubble_cdf.png", out_dir / "completions.png"]
    plot_bubble_cdf(run_dirs, outs[0])
    plot_completions(run_dirs, outs[1])
    return outs
