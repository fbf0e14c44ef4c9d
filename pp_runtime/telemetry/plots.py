"""PNG plots of a run directory (and of several runs side by side), with matplotlib.

Everything is read back from the files `telemetry.report` wrote (report.json,
requests.csv, timeline.csv), so `pp-runtime report DIR` re-plots a finished run exactly as
the run did. `plot_run(dir)` writes into the run directory:

  bubble_cdf.png    CDF of pipeline bubble time per request, log x axis (paper Fig. 12a);
                    requests with no bubble sit on a dotted line at the left, counted in the legend
  completions.png   requests completed over time (paper Fig. 12b)
  stage_time.png    every stage's wall time in percent: busy, transfer, bubble by cause
                    (upstream, downstream, dependency), idle; stages grouped by replica
  timeline.png      per-stage timeline, one panel per window of timeline.csv: `start` (the
                    run's first micro-batches) and, when present, `steady` (the middle of the
                    run); compute coloured prefill vs decode-only, gaps coloured by cause

`plot_comparison(dirs, out_dir)` writes bubble_cdf.png and completions.png with one line per
run (each its own colour, line style and marker) and bubble_by_cause.png (one stacked bar
per run). Every plot uses the colours of `COLORS`. Older run directories (no `window` or
cause columns, no `bubble_by_cause_s`) still plot: their bubble (`wait_s`, `bubble_s`) is
drawn as upstream and missing causes as zero.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

TIMELINE_PLOT_MBS = 120  # micro-batches drawn per timeline window (more are unreadable)
BUBBLE_CAUSES = ("upstream", "downstream", "dependency")
STAGE_PARTS = ("busy", "transfer") + BUBBLE_CAUSES + ("idle",)
COLORS = {  # one colour per kind of time, in every plot
    "busy": "#4878b0", "prefill": "#2f5f98", "decode": "#9cc3e8", "transfer": "#8c8c8c",
    "upstream": "#d62728", "downstream": "#ff9f1c", "dependency": "#9467bd", "idle": "#dcdcdc",
}
LABELS = {"busy": "busy (compute)", "prefill": "compute, with prefill",
          "decode": "compute, decodes only", "idle": "idle (no work)",
          **{c: f"bubble: {c}" for c in BUBBLE_CAUSES}}
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P")
RUN_COLORS = plt.get_cmap("tab10").colors


def read_csv(path: Path) -> dict[str, np.ndarray]:
    """Columns of a CSV file (`csv.DictReader`; a short row's missing cells are empty):
    floats where numpy parses every value (empty or None = nan), else strings."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f, restval="")
        names, rows = reader.fieldnames or [], list(reader)
    out = {}
    for name in names:
        col = np.array([r[name] for r in rows], dtype=str)
        try:
            out[name] = np.where(np.isin(col, ("", "None")), "nan", col).astype(float)
        except ValueError:
            out[name] = col
    return out


def _col(t: dict[str, np.ndarray], name: str, fallback: str | None = None) -> np.ndarray:
    """A numeric column, else the fallback column, else zeros (older run directories)."""
    n = len(next(iter(t.values()), ()))
    for key in (name, fallback):
        if key in t:
            return np.nan_to_num(np.asarray(t[key], dtype=float))
    return np.zeros(n)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())["summary"]


def run_labels(run_dirs: list[Path]) -> list[str]:
    """One legend label per run: planner and shape; the directory's name where they clash."""
    labels = []
    for d in run_dirs:
        s = _summary(d)
        dep = s.get("deployment", {})
        dp = dep.get("dp", 1)
        labels.append(f"{s.get('planner', d.name)} TP{dep.get('tp', '?')}xPP{dep.get('pp', '?')}"
                      + (f", {dp} replicas" if dp > 1 else ""))
    return [f"{lab} ({d.name})" if labels.count(lab) > 1 else lab
            for lab, d in zip(labels, run_dirs)]


def _markevery(i: int, n_runs: int, n_points: int) -> tuple[int, int]:
    """Markers every ~1/8 of a line, staggered per run so coinciding lines all show theirs."""
    step = max(1, n_points // 8)
    return (step // 2 + i * step // max(n_runs, 1)) % step, step


def line_styles(n: int) -> list[dict]:
    """Plot keywords for n overlaid runs: no two share colour, line style and marker."""
    return [{"color": RUN_COLORS[i % len(RUN_COLORS)], "linestyle": LINE_STYLES[i % 4],
             "marker": MARKERS[i % len(MARKERS)]} for i in range(n)]


def stage_fractions(per_stage: list[dict]) -> dict[str, np.ndarray]:
    """Percent of wall time of each stage in each of STAGE_PARTS (they add up to 100)."""
    wall = np.array([s.get("wall_s", 0.0) for s in per_stage], dtype=float)
    scale = np.divide(100.0, wall, out=np.zeros_like(wall), where=wall > 0)
    out = {}
    for part in STAGE_PARTS:
        if part in BUBBLE_CAUSES:  # older reports: one bubble_s, the wait for input = upstream
            vals = [s["bubble_by_cause_s"].get(part, 0.0) if "bubble_by_cause_s" in s
                    else (s.get("bubble_s", 0.0) if part == "upstream" else 0.0)
                    for s in per_stage]
        else:
            vals = [s.get(f"{part}_s", 0.0) for s in per_stage]
        out[part] = np.array(vals, dtype=float) * scale
    return out


def timeline_segments(t: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(start, width) per row of timeline.csv for compute ("prefill"/"decode") and each gap.

    Before compute, going back from compute_start: transfer, upstream, idle, dependency;
    after compute_end: downstream. Rows not of a kind get width 0.
    """
    cs, ce = _col(t, "compute_start_s"), _col(t, "compute_end_s")
    tr, up = _col(t, "transfer_s"), _col(t, "upstream_s", fallback="wait_s")
    idle, dep = _col(t, "idle_s"), _col(t, "dependency_s")
    prefill = _col(t, "prefill_tokens") > 0
    return {
        "prefill": (cs, np.where(prefill, ce - cs, 0.0)),
        "decode": (cs, np.where(prefill, 0.0, ce - cs)),
        "transfer": (cs - tr, tr),
        "upstream": (cs - tr - up, up),
        "idle": (cs - tr - up - idle, idle),
        "dependency": (cs - tr - up - idle - dep, dep),
        "downstream": (ce, _col(t, "downstream_s")),
    }


def timeline_windows(t: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(window, row mask) for `start` and `steady`, each its first TIMELINE_PLOT_MBS mbs."""
    if not len(t.get("mb_id", ())):
        return []
    names = t["window"] if "window" in t else np.full(len(t["mb_id"]), "start")
    out = []
    for name in ("start", "steady"):
        sel = names == name
        if sel.any():
            keep = np.unique(t["mb_id"][sel])[:TIMELINE_PLOT_MBS]
            out.append((name, sel & np.isin(t["mb_id"], keep)))
    return out


def cdf_points(bubbles: np.ndarray, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """Step CDF of per-request bubble time, zeros (and nan) clipped up to floor."""
    b = np.sort(np.maximum(np.nan_to_num(bubbles), floor))
    if not len(b):
        return b, b
    y = np.arange(1, len(b) + 1) / len(b)
    return np.concatenate([b[:1], b]), np.concatenate([[0.0], y])


def _save(fig, path: Path) -> Path:
    """Draw to a new file beside `path`, then rename it over `path`: a symlink (or any
    file) already at `path` is replaced itself, never written through (`pp-runtime report`
    re-plots directories that may come from elsewhere)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _run_lines(ax, run_dirs: list[Path], series: list[tuple]) -> None:
    """One step line per run, series[i] = (x, y, legend note); coinciding runs stay apart."""
    for i, ((x, y, note), label, style) in enumerate(
            zip(series, run_labels(run_dirs), line_styles(len(series)))):
        ax.plot(x, y, drawstyle="steps-post", lw=1.8, markersize=5, label=label + note,
                markevery=_markevery(i, len(series), len(x)), **style)
    ax.legend(fontsize=8, loc="upper left")


def bubble_cdf_figure(run_dirs: list[Path]):
    data = [np.nan_to_num(read_csv(d / "requests.csv").get("bubble_s", np.zeros(0)))
            for d in run_dirs]
    positive = np.concatenate([b[b > 0] for b in data] + [np.zeros(0)])
    floor = positive.min() / 3 if positive.size else 1e-6  # where 0 is drawn on the log axis
    zeros = [int(np.sum(b <= 0)) for b in data]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    notes = [f" — {z}/{len(b)} with 0 bubble" if z else "" for b, z in zip(data, zeros)]
    _run_lines(ax, run_dirs, [(*cdf_points(b, floor), n) for b, n in zip(data, notes)])
    xlabel = "pipeline bubble time per request (s, log scale)"
    if any(zeros):
        ax.axvline(floor, color="grey", ls=":", lw=1)
        xlabel += f"\nrequests with 0 bubble are drawn on the dotted line ({floor:.2g} s)"
    right = positive.max() * 1.5 if positive.size else floor * 10  # all zero: a visible span
    ax.set_xlim(floor / 1.5, right)  # before the log scale: one point autoscales to a singular span
    ax.set(xscale="log", xlim=(floor / 1.5, right), ylim=(0, 1.02), xlabel=xlabel,
           ylabel="fraction of requests", title="Bubble time per request (CDF)")
    ax.grid(alpha=0.3, which="both")
    return fig


def completions_figure(run_dirs: list[Path]):
    series = []
    for d in run_dirs:
        f = read_csv(d / "requests.csv").get("finish_s", np.zeros(0))
        done = np.sort(f[~np.isnan(f)])
        note = f" ({len(f) - len(done)} unfinished)" if len(done) < len(f) else ""
        series.append((np.concatenate([[0.0], done]), np.arange(len(done) + 1), note))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _run_lines(ax, run_dirs, series)
    ax.set(xlabel="time since the run's start (s)", ylabel="requests completed",
           title="Requests completed over time")
    ax.grid(alpha=0.3)
    return fig


def _patch_legend(owner, keys, **where) -> None:
    """A legend of colour patches on an Axes or Figure, by default right of the axes."""
    where = where or {"loc": "center left", "bbox_to_anchor": (1.01, 0.5)}
    owner.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="#555555", lw=0.4,
                                label=LABELS.get(k, k)) for k in keys],
                 fontsize=8, frameon=False, **where)


def _bubble_title(s: dict) -> str:
    by = s.get("bubble_fraction_by_cause") or {}
    causes = ", ".join(f"{c} {by[c]:.1%}" for c in BUBBLE_CAUSES if c in by)
    total = f"bubble {s.get('bubble_fraction', 0.0):.1%} of stage time"
    return f"{total} ({causes})" if causes else total


def _stage_positions(per_stage: list[dict]) -> tuple[np.ndarray, list[str], dict[int, float]]:
    """x of each stage's bar (replicas apart), its tick label, and each replica's centre."""
    replicas = np.array([st.get("replica", 0) for st in per_stage], dtype=int)
    x = np.arange(len(per_stage)) + 0.8 * np.unique(replicas, return_inverse=True)[1]
    short = len(set(replicas)) > 1 or len(x) > 8
    ticks = [f"{'s' if short else 'stage '}{st.get('stage', 0)}" for st in per_stage]
    centres = {int(r): x[replicas == r].mean() for r in np.unique(replicas)}
    return x, ticks, centres if len(centres) > 1 else {}


def stage_time_figure(run_dir: Path):
    s = _summary(run_dir)
    parts = stage_fractions(s.get("per_stage", []))
    x, ticks, centres = _stage_positions(s.get("per_stage", []))
    fig, ax = plt.subplots(figsize=(max(4.5, 0.2 * len(x) + 2), 4.4))
    bottom = np.zeros(len(x))
    for part in STAGE_PARTS:
        ax.bar(x, parts[part], bottom=bottom, width=0.85, color=COLORS[part],
               edgecolor="white", linewidth=0.3)
        bottom += parts[part]
    ax.set_xticks(x, ticks, fontsize=7 if len(x) > 24 else 9)
    for r, centre in centres.items():
        ax.text(centre, -0.09, f"replica {r}", transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=8)
    if len(x):
        ax.set_xlim(x.min() - 0.7, x.max() + 0.7)
    ax.set(ylabel="% of the stage's wall time", ylim=(0, 100))
    ax.set_title(f"Where each stage's time goes\n{_bubble_title(s)}", fontsize=10)
    _patch_legend(ax, STAGE_PARTS[::-1])  # top of the stack first
    return fig


def _draw_window(ax, t: dict[str, np.ndarray], mask: np.ndarray, title: str) -> None:
    segs = timeline_segments({k: v[mask] for k, v in t.items()})
    stage = t["stage"][mask]
    stages = np.unique(stage)
    for row, st in enumerate(stages):
        on = stage == st
        for kind, (start, width) in segs.items():
            keep = on & (width > 0)
            full = kind in ("prefill", "decode")  # compute full height, gaps a bit thinner
            ax.broken_barh(list(zip(start[keep], width[keep])),
                           (row - (0.4 if full else 0.3), 0.8 if full else 0.6),
                           facecolors=COLORS[kind], edgecolors="white" if full else "none",
                           linewidth=0.25)
    ids = t["mb_id"][mask]
    ax.set(yticks=range(len(stages)), yticklabels=[f"stage {int(s)}" for s in stages],
           ylim=(len(stages) - 0.5, -0.5), xlabel="time (s, each stage's own clock)",
           title=f"{title}: micro-batches {int(ids.min())}–{int(ids.max())}")


def timeline_figure(run_dir: Path):
    t = read_csv(run_dir / "timeline.csv") if (run_dir / "timeline.csv").is_file() else {}
    windows = timeline_windows(t)
    if not windows:
        fig, ax = plt.subplots(figsize=(8, 1.5))
        ax.axis("off")
        ax.text(0.5, 0.5, "no micro-batches recorded", ha="center", va="center")
        return fig
    n_stages = len(np.unique(t["stage"]))
    fig, axes = plt.subplots(len(windows), 1, squeeze=False,
                             figsize=(12, len(windows) * (0.45 * n_stages + 1.3) + 0.6))
    titles = {"start": "Start of the run", "steady": "Steady state (middle of the run)"}
    for ax, (name, mask) in zip(axes[:, 0], windows):
        _draw_window(ax, t, mask, titles[name])
    keys = ("prefill", "decode", "transfer") + BUBBLE_CAUSES + ("idle",)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    _patch_legend(fig, keys, ncol=7, loc="upper center", bbox_to_anchor=(0.5, 1.0))
    return fig


def bubble_by_cause_figure(run_dirs: list[Path]):
    sums = [_summary(d) for d in run_dirs]
    labels = run_labels(run_dirs)
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(sums) + 2), 4.2))
    bottom = np.zeros(len(sums))
    for cause in BUBBLE_CAUSES:
        vals = 100 * np.array([_by_cause(s)[cause] for s in sums])
        ax.bar(labels, vals, bottom=bottom, color=COLORS[cause], width=0.6)
        bottom += vals
    for i, top in enumerate(bottom):
        ax.text(i, top, f"{top:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="bubble, % of stage time", ylim=(0, max(bottom.max(initial=0) * 1.15, 1)),
           title="Pipeline bubble by cause")
    ax.tick_params(axis="x", labelrotation=20 if len(sums) > 3 else 0, labelsize=8)
    _patch_legend(ax, BUBBLE_CAUSES[::-1])
    return fig


def _by_cause(s: dict) -> dict[str, float]:
    by = s.get("bubble_fraction_by_cause")
    if by is None:  # older reports: the whole bubble was the wait for input
        by = {"upstream": s.get("bubble_fraction", 0.0)}
    return {c: by.get(c, 0.0) for c in BUBBLE_CAUSES}


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write a run directory's plots into it; returns their paths."""
    d = Path(run_dir)
    return [_save(bubble_cdf_figure([d]), d / "bubble_cdf.png"),
            _save(completions_figure([d]), d / "completions.png"),
            _save(stage_time_figure(d), d / "stage_time.png"),
            _save(timeline_figure(d), d / "timeline.png")]


def plot_comparison(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Plots of several runs side by side in out_dir; returns their paths."""
    dirs, out = [Path(d) for d in run_dirs], Path(out_dir)
    return [_save(bubble_cdf_figure(dirs), out / "bubble_cdf.png"),
            _save(completions_figure(dirs), out / "completions.png"),
            _save(bubble_by_cause_figure(dirs), out / "bubble_by_cause.png")]
