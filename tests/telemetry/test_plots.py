"""Plots of run directories made by hand in report.py's file formats (no run needed)."""
import csv
import json

import numpy as np
import pytest
from matplotlib.colors import to_hex

from pp_runtime.telemetry import plots
from pp_runtime.telemetry.plots import (COLORS, STAGE_PARTS, bubble_cdf_figure, cdf_points,
                                        completions_figure, line_styles, plot_comparison,
                                        plot_run, stage_fractions, stage_time_figure,
                                        timeline_figure, timeline_segments, timeline_windows)

TIMELINE = ["window", "mb_id", "stage", "compute_start_s", "compute_end_s", "wait_s", "transfer_s",
            "send_wait_s", "upstream_s", "dependency_s", "idle_s", "downstream_s",
            "prefill_tokens", "decodes"]
OLD_TIMELINE = ["mb_id", "stage", "compute_start_s", "compute_end_s", "wait_s", "transfer_s",
                "prefill_tokens", "decodes"]
REQUESTS = ["id", "prompt_tokens", "output_tokens", "arrival_s", "first_token_s", "finish_s",
            "bubble_s", "num_microbatches", "finish_reason"]


def _write_csv(path, columns, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def _timeline_rows(n_stages, mbs, window, t0, seed):
    """A plausible schedule: prefill chunks (long) among decode-only micro-batches (short)."""
    rng = np.random.default_rng(seed)
    free = np.full(n_stages, t0)  # when each stage is done with its previous micro-batch
    rows = []
    for k in mbs:
        prefill = 256 * (k % 3 == 0)
        cost, arrival = (0.02 if prefill else 0.006), None
        for s in range(n_stages):
            dep = 0.004 * (rng.random() < 0.05)
            idle = 0.03 * (s == 0 and rng.random() < 0.02)
            tr = 0.0005 * (s > 0)
            holding = free[s] + dep + idle
            up = 0.0 if arrival is None else max(0.0, arrival - holding)
            start = holding + up + tr
            down = 0.003 * (s < n_stages - 1 and rng.random() < 0.1)
            rows.append([window, k, s, start, start + cost, up + tr, tr, down, up, dep, idle, down,
                         prefill, 7])
            free[s], arrival = start + cost + down, start + cost
    return rows


def write_run(path, planner="sarathi", pp=2, dp=1, n_requests=60, zeros=10, old=False, seed=0):
    """A run directory in report.py's formats (old=True: before bubble causes existed)."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per_stage = []
    for r in range(dp):
        for s in range(pp):
            busy, tr, up, down, dep, idle = rng.uniform([5, 0, 0, 0, 0, 0], [8, .3, 2, 1, .5, 1])
            st = {"replica": r, "stage": s, "busy_s": busy, "transfer_s": tr,
                  "bubble_s": up + down + dep, "idle_s": idle, "num_microbatches": 500,
                  "wall_s": busy + tr + up + down + dep + idle}
            if not old:
                st["bubble_by_cause_s"] = {"upstream": up, "downstream": down, "dependency": dep}
            per_stage.append(st)
    summary = {"planner": planner, "executor": "sim", "bubble_fraction": 0.2,
               "per_stage": per_stage,
               "deployment": {"model": "gpt3", "tp": 8, "pp": pp, "dp": dp, "gpu": "a100",
                              "chunk_size": 256, "max_batch_size": 8}}
    if not old:
        summary["bubble_fraction_by_cause"] = {"upstream": 0.12, "downstream": 0.05,
                                               "dependency": 0.03}
    report = {"summary": summary, "config": {}, "requests": []}
    (path / "report.json").write_text(json.dumps(report))
    bubbles = np.concatenate([np.zeros(zeros), rng.lognormal(-3, 1.5, n_requests - zeros)])
    _write_csv(path / "requests.csv", REQUESTS,
               [[i, 300, 40, 0.1 * i, 0.1 * i + 0.5, "" if i == 3 else 0.1 * i + 4, b, 50, "length"]
                for i, b in enumerate(bubbles)])
    if old:
        rows = [r[1:7] + r[12:] for r in _timeline_rows(pp, range(300), "start", 0.0, seed)]
        _write_csv(path / "timeline.csv", OLD_TIMELINE, rows)
    else:
        rows = _timeline_rows(pp, range(300), "start", 0.0, seed)
        rows += _timeline_rows(pp, range(2000, 2300), "steady", 40.0, seed + 1)
        _write_csv(path / "timeline.csv", TIMELINE, rows)
    return path


def test_timeline_segments_of_one_row_are_where_the_format_puts_them():
    row = {"compute_start_s": np.array([10.0]), "compute_end_s": np.array([12.0]),
           "transfer_s": np.array([0.5]), "upstream_s": np.array([1.0]),
           "dependency_s": np.array([2.0]), "idle_s": np.array([0.5]),
           "downstream_s": np.array([0.25]), "prefill_tokens": np.array([0.0]),
           "wait_s": np.array([99.0])}
    segs = {k: (float(s[0]), float(s[0] + w[0])) for k, (s, w) in timeline_segments(row).items()}
    assert segs["transfer"] == (9.5, 10.0)
    assert segs["upstream"] == (8.5, 9.5)  # [start - transfer - upstream, start - transfer)
    assert segs["idle"] == (8.0, 8.5)
    assert segs["dependency"] == (6.0, 8.0)
    assert segs["downstream"] == (12.0, 12.25)
    assert segs["decode"] == (10.0, 12.0) and segs["prefill"][1] == segs["prefill"][0]


def test_old_timeline_draws_wait_as_upstream_and_the_rest_as_zero():
    row = {"compute_start_s": np.array([5.0]), "compute_end_s": np.array([6.0]),
           "wait_s": np.array([1.5]), "transfer_s": np.array([0.5]),
           "prefill_tokens": np.array([128.0])}
    segs = timeline_segments(row)
    assert (segs["upstream"][0][0], segs["upstream"][1][0]) == (3.0, 1.5)
    assert segs["downstream"][1][0] == segs["idle"][1][0] == segs["dependency"][1][0] == 0
    assert segs["prefill"][1][0] == 1.0 and segs["decode"][1][0] == 0


def test_stage_fractions_are_percent_of_wall_by_cause():
    new = {"replica": 0, "stage": 0, "wall_s": 10.0, "busy_s": 5.0, "transfer_s": 1.0,
           "bubble_s": 3.0, "idle_s": 1.0,
           "bubble_by_cause_s": {"upstream": 1.5, "downstream": 1.0, "dependency": 0.5}}
    old = {"replica": 0, "stage": 1, "wall_s": 4.0, "busy_s": 2.0, "transfer_s": 0.0,
           "bubble_s": 1.0, "idle_s": 1.0}
    f = stage_fractions([new, old])
    assert {k: list(v) for k, v in f.items()} == {
        "busy": [50, 50], "transfer": [10, 0], "upstream": [15, 25], "downstream": [10, 0],
        "dependency": [5, 0], "idle": [10, 25]}
    assert list(sum(f[p] for p in STAGE_PARTS)) == [100, 100]


def test_windows_keep_start_and_steady_and_limit_micro_batches(tmp_path):
    t = plots.read_csv(write_run(tmp_path / "r", pp=3) / "timeline.csv")
    wins = timeline_windows(t)
    assert [w for w, _ in wins] == ["start", "steady"]
    for name, mask in wins:
        assert len(np.unique(t["mb_id"][mask])) == plots.TIMELINE_PLOT_MBS
        assert set(t["window"][mask]) == {name} and mask.sum() == 3 * plots.TIMELINE_PLOT_MBS
    assert t["mb_id"][wins[1][1]].min() == 2000


def test_cdf_puts_zero_bubbles_at_the_floor_and_says_how_many(tmp_path):
    x, y = cdf_points(np.array([0.0, 0.2, 0.0, 0.1]), floor=0.01)
    assert list(x) == [0.01, 0.01, 0.01, 0.1, 0.2] and list(y) == [0, 0.25, 0.5, 0.75, 1.0]
    fig = bubble_cdf_figure([write_run(tmp_path / "r", n_requests=60, zeros=10)])
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and min(ax.lines[0].get_xdata()) > 0
    assert "10/60 with 0 bubble" in ax.get_legend().get_texts()[0].get_text()


def test_identical_runs_in_a_comparison_are_told_apart(tmp_path):
    a, b = write_run(tmp_path / "uniform"), write_run(tmp_path / "sarathi")
    for fig in (bubble_cdf_figure([a, b]), completions_figure([a, b])):
        l0, l1 = [ln for ln in fig.axes[0].lines if not ln.get_label().startswith("_")]
        assert np.array_equal(l0.get_xdata(), l1.get_xdata())  # the lines coincide ...
        assert l0.get_color() != l1.get_color() and l0.get_linestyle() != l1.get_linestyle()
        assert l0.get_marker() != l1.get_marker()  # ... and are still told apart
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert labels[0] != labels[1] and "uniform" in labels[0]
    styles = line_styles(12)
    assert len({(s["color"], s["linestyle"], s["marker"]) for s in styles}) == 12


def test_stage_time_uses_the_cause_colours_and_reads_with_64_stages(tmp_path):
    fig = stage_time_figure(write_run(tmp_path / "r", pp=8, dp=8))
    ax = fig.axes[0]
    assert len(ax.patches) == 64 * len(STAGE_PARTS)
    colors = {to_hex(p.get_facecolor()) for p in ax.patches}
    assert colors == {COLORS[p] for p in STAGE_PARTS}
    assert [t.get_text() for t in ax.get_legend().get_texts()][3] == "bubble: upstream"
    assert sum("replica" in t.get_text() for t in ax.texts) == 8
    assert ax.get_ylim() == (0, 100)


def test_timeline_has_a_panel_per_window_and_a_patch_legend(tmp_path):
    fig = timeline_figure(write_run(tmp_path / "r", pp=4))
    assert len(fig.axes) == 2 and "Steady" in fig.axes[1].get_title()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"bubble: upstream", "bubble: downstream", "bubble: dependency", "idle (no work)",
            "compute, with prefill", "compute, decodes only"} <= set(legend)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [f"stage {s}" for s in range(4)]


def test_plot_run_and_comparison_write_pngs(tmp_path):
    run = write_run(tmp_path / "r", pp=2)
    paths = plot_run(run)
    assert [p.name for p in paths] == ["bubble_cdf.png", "completions.png", "stage_time.png",
                                       "timeline.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    other = write_run(tmp_path / "o", planner="orca-best", pp=2, seed=1)
    out = plot_comparison([run, other], tmp_path)
    assert {p.name for p in out} == {"bubble_cdf.png", "completions.png", "bubble_by_cause.png"}
    assert all(p.is_file() and p.stat().st_size > 10_000 for p in out)


@pytest.mark.parametrize("pp", [1, 4])
def test_old_run_directory_still_plots(tmp_path, pp):
    run = write_run(tmp_path / "old", pp=pp, old=True)
    assert all(p.stat().st_size > 5_000 for p in plot_run(run))
    plot_comparison([run, write_run(tmp_path / "new", pp=pp)], tmp_path)
    fig = timeline_figure(run)
    assert len(fig.axes) == 1  # one window: the run's start


def test_empty_run_directory_does_not_crash(tmp_path):
    run = write_run(tmp_path / "r", n_requests=0, zeros=0)
    _write_csv(run / "timeline.csv", TIMELINE, [])
    assert all(p.is_file() for p in plot_run(run))


def test_read_csv_gives_numeric_and_string_columns(tmp_path):
    """`csv` reads the cells (quotes, a comma inside one, a short row); numpy the numbers."""
    path = tmp_path / "t.csv"
    path.write_text('a,b,c\n1,x,"2,5"\n,y\n2.5,"z, w",None\n')
    t = plots.read_csv(path)
    assert set(t) == {"a", "b", "c"}
    assert t["a"].dtype == float and np.isnan(t["a"][1]) and list(t["a"][[0, 2]]) == [1.0, 2.5]
    assert list(t["b"]) == ["x", "y", "z, w"]
    assert list(t["c"]) == ["2,5", "", "None"]  # not every value a number: strings
    empty = tmp_path / "e.csv"
    empty.write_text("")
    assert plots.read_csv(empty) == {}
    empty.write_text("a,b\n")
    assert {k: len(v) for k, v in plots.read_csv(empty).items()} == {"a": 0, "b": 0}
