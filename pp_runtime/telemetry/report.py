"""A run's report: `report.json` (summary + one entry per request), `requests.csv`,
`microbatches.csv`, `timeline.csv` and the plots. The same for simulated and real runs.

Bubbles by cause come from the rule of `telemetry.bubbles` (docs/bubbles.md), applied by
each replica's `RunRecorder`: each replica is its own pipeline with its own clocks. Request
times are seconds from the run's start on the driver's clock; stage times (micro-batch rows,
timeline) are seconds from each stage's own start.
"""
from __future__ import annotations

import csv
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pp_runtime.config import Config
from pp_runtime.core.errors import ConfigError
from pp_runtime.core.request import RequestOutput
from pp_runtime.telemetry.bubbles import CAUSES, fractions_by_cause
from pp_runtime.telemetry.recorder import MB_COLUMNS, TIMELINE_COLUMNS, RunRecorder
from pp_runtime.telemetry.windows import format_windows, summarize, token_part


@dataclass
class RunResult:
    """Everything a finished run leaves behind, before it is written."""

    cfg: Config
    executor: str  # "sim", "local", "ray", "torchrun"
    requests: list[RequestOutput]
    replicas: list[RunRecorder]  # one per data-parallel replica
    run_wall_s: float  # how long the run itself took (a simulation's own runtime)
    cost_sources: dict[str, str] | None = None  # simulator: which source priced each op
    device: str | None = None  # real runs: the device the stages ran on (cpu, cuda)
    # why the run stopped before every request finished ("SIGINT", "SIGTERM", "worker
    # failure"); None when it ran to the end. Unfinished requests then end in error.
    interrupted_by: str | None = None
    # each recovery in place (engine/recovery.Recovery.as_dict, at_s from the run's start)
    recoveries: list[dict] | None = None
    # the executor's failure, not written: `pp-runtime run` raises it after the report
    failure: BaseException | None = None


def _hardware(cfg: Config) -> str:
    hw = cfg.hardware
    return f"profile {hw.profile}" if hw.profile else hw.gpu


def percentiles(values: Sequence[float], keys: Sequence[str] = ("median", "p90", "p99", "mean")) -> dict:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {k: None for k in keys}
    pick = {"median": lambda: np.median(a), "p90": lambda: np.percentile(a, 90),
            "p99": lambda: np.percentile(a, 99), "mean": lambda: a.mean()}
    return {k: float(pick[k]()) for k in keys}


def _stage_row(replica: int, s) -> dict[str, Any]:
    return {"replica": replica, "stage": s.stage, "wall_s": s.wall_s, "busy_s": s.busy_s,
            "transfer_s": s.transfer_s, "bubble_s": s.bubble_s,
            "bubble_by_cause_s": s.bubble_by_cause_s, "idle_s": s.idle_s,
            "num_microbatches": s.num_microbatches,
            "dependency_token_s": s.token_s}  # of the dependency: waiting for the token hop


def _windows(replicas: list[RunRecorder], requests: list[dict]) -> dict:
    """summary.windows: warm-up, steady state, tail (windows.py); a request that ended in
    error did not finish."""
    arrival = {r["id"]: r["arrival_s"] for r in requests}
    finish = {r["id"]: r["finish_s"] for r in requests if r["finish_reason"] != "error"}
    return summarize([rec.run_windows(arrival, finish) for rec in replicas], arrival)


def build_report(run: RunResult) -> dict[str, Any]:
    """report.json's contents: the summary, the config and one entry per request."""
    cfg = run.cfg
    per_stage, stats, request_bubble, num_mbs = [], [], Counter(), Counter()
    prefill_ran = 0
    for rec in run.replicas:
        rep = rec.bubbles()
        stats += rep.per_stage
        per_stage += [_stage_row(rec.replica, s) for s in rep.per_stage]
        request_bubble.update(rep.request_bubble_s)
        num_mbs.update(rec.request_mbs)
        prefill_ran += sum(rec.mb_columns["prefill_tokens"])
    requests = []
    for r in run.requests:
        requests.append({"id": r.request_id, "prompt_tokens": len(r.prompt_token_ids),
                         "output_tokens": len(r.token_ids), "arrival_s": r.arrival_s,
                         "first_token_s": r.first_token_s, "finish_s": r.finish_s,
                         "bubble_s": request_bubble.get(r.request_id, 0.0),
                         "num_microbatches": num_mbs.get(r.request_id, 0),
                         "finish_reason": str(r.finish_reason),
                         "cached_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions,
                         "recomputed_tokens": r.num_recomputed_tokens})
    done = [r for r in requests if r["finish_s"] is not None]
    makespan = max((r["finish_s"] for r in done), default=0.0)
    # tokens that ran: prompt tokens that went through the pipeline (all of them unless the
    # run failed part-way) and tokens sampled
    tokens = prefill_ran + sum(r["output_tokens"] for r in requests)
    by_cause = fractions_by_cause(stats)
    wall = sum(s.wall_s for s in stats)
    gaps = np.concatenate([np.frombuffer(rec.token_gaps_s, dtype=float) for rec in run.replicas]) \
        if run.replicas else np.zeros(0)
    m, p, pl = cfg.model, cfg.parallel, cfg.planner
    summary = {
        "planner": pl.planner, "executor": run.executor, "num_requests": len(requests),
        "makespan_s": makespan, "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "bubble_per_request_s": percentiles([r["bubble_s"] for r in requests]),
        "bubble_fraction": sum(by_cause.values()),
        "bubble_fraction_by_cause": by_cause,
        # of the dependency: stage 0 holding a call whose decodes' tokens were on the token hop
        "dependency_token_fraction": sum(s.token_s for s in stats) / wall if wall > 0 else 0.0,
        "per_stage": per_stage,
        # warm-up, steady state, tail (telemetry/windows.py, docs/bubbles.md)
        "windows": _windows(run.replicas, requests),
        "ttft_s": percentiles([r["first_token_s"] - r["arrival_s"] for r in done
                          if r["first_token_s"] is not None], ("median", "p99")),
        "tbt_s": percentiles(gaps, ("median", "p99")),
        "num_microbatches": sum(rec.num_microbatches for rec in run.replicas),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in requests)),
        "preemptions": sum(r["preemptions"] for r in requests),  # KV taken back, recomputed
        # tokens computed again after a preemption: compute time that is not first-time work
        "recomputed_tokens": sum(r["recomputed_tokens"] for r in requests),
        "prefix_cache_hit_tokens": sum(r["cached_tokens"] for r in requests),
        "deployment": {"model": m.name, "tp": p.tp, "pp": p.pp, "dp": p.dp,
                       "gpu": _hardware(cfg) if run.executor == "sim" else (run.device or cfg.runtime.device),
                       "chunk_size": pl.chunk_size, "max_batch_size": pl.max_batch_size,
                       "layer_split": cfg.layers_per_stage()},  # resolved: what ran
        "run_wall_s": run.run_wall_s,
        "partial": run.interrupted_by is not None,  # stopped early: see interrupted_by
        "interrupted_by": run.interrupted_by,
        "recoveries": run.recoveries or [],
    }
    if run.cost_sources:
        summary["cost_sources"] = run.cost_sources
    return {"summary": summary, "config": cfg.to_dict(), "requests": requests}


REQUEST_COLUMNS = ["id", "prompt_tokens", "output_tokens", "arrival_s", "first_token_s",
                   "finish_s", "bubble_s", "num_microbatches", "finish_reason", "cached_tokens",
                   "preemptions", "recomputed_tokens"]


def _write_csv(path: Path, columns: list[str], rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def write_report(run: RunResult, out_dir: str | Path, plots: bool = True) -> dict[str, Any]:
    """Write every report file of a run into out_dir; returns report.json's contents."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(run)
    report = strict_json(report)  # NaN / inf (a run with no tokens) become null
    (out / "report.json").write_text(json.dumps(report, indent=1, allow_nan=False))
    _write_csv(out / "requests.csv", REQUEST_COLUMNS,
               ([r[c] for c in REQUEST_COLUMNS] for r in report["requests"]))
    _write_csv(out / "microbatches.csv", ["replica", *MB_COLUMNS],
               ([rec.replica, *row] for rec in run.replicas
                for row in zip(*(rec.mb_columns[c] for c in MB_COLUMNS))))
    with open(out / "outputs.jsonl", "w") as f:  # what each request generated
        for r in run.requests:
            f.write(json.dumps({"id": r.request_id, "token_ids": r.token_ids,
                                "finish_reason": str(r.finish_reason)}) + "\n")
    windows = run.replicas[0].timeline() if run.replicas else {}
    _write_csv(out / "timeline.csv", ["window", *TIMELINE_COLUMNS],
               ([name, *row] for name, rows in windows.items() for row in rows))
    if plots:
        from pp_runtime.telemetry.plots import plot_run
        plot_run(out)
    return report


def strict_json(obj: Any) -> Any:
    """obj with every non-finite float replaced by None: report.json is strict JSON (RFC
    8259 has no NaN or Infinity), so any parser reads it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


REPORT_KEYS = ("summary", "config", "requests")


def read_report(out_dir: str | Path) -> dict[str, Any]:
    """report.json of a run directory; ConfigError (naming the file) when it is missing,
    not JSON, or lacks the report's sections (a run cut off while writing it)."""
    path = Path(out_dir) / "report.json"
    if not path.is_file():
        raise ConfigError(f"{out_dir}: no report.json (not a finished run directory)")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a report: not valid JSON ({exc}); re-run to write "
                          "it again") from exc
    missing = [k for k in REPORT_KEYS if k not in report] if isinstance(report, dict) else REPORT_KEYS
    if missing:
        raise ConfigError(f"{path}: not a complete report: no {', '.join(missing)}; re-run "
                          "to write it again")
    return report


def format_summary(report: dict[str, Any]) -> str:
    s = report["summary"]
    d, b, ttft, tbt = s["deployment"], s["bubble_per_request_s"], s["ttft_s"], s["tbt_s"]
    causes = s.get("bubble_fraction_by_cause", {})
    lines = [
        f"{s['planner']} on {d['model']} tp={d['tp']} pp={d['pp']} dp={d['dp']} ({d['gpu']}, "
        f"{s['executor']}): {s['num_requests']} requests, {s['num_microbatches']} micro-batches"
        + (", layer_split " + "|".join(map(str, d["layer_split"])) if d.get("layer_split") else ""),
        f"  makespan {_t(s['makespan_s'])}, throughput {s['throughput_tok_s']:.0f} tok/s, "
        f"bubble fraction {s['bubble_fraction']:.1%}"
        + (" (" + ", ".join(f"{c} {causes[c]:.1%}" for c in CAUSES if c in causes)
           + token_part(s.get("dependency_token_fraction")) + ")" if causes else ""),
        *format_windows(s.get("windows"), s["bubble_fraction"]),  # older reports: none
        f"  bubble per request: median {_t(b['median'])}, p90 {_t(b['p90'])}, "
        f"p99 {_t(b['p99'])}, mean {_t(b['mean'])}",
        f"  TTFT median {_t(ttft['median'])}, p99 {_t(ttft['p99'])}; "
        f"time between tokens median {_t(tbt['median'])}, p99 {_t(tbt['p99'])}",
        f"  finish reasons: {s['finish_reasons']}",
    ]
    if s.get("preemptions") or s.get("prefix_cache_hit_tokens"):  # older reports: neither key
        lines.append(f"  KV cache: {s['preemptions']} preemptions ({s['recomputed_tokens']} tokens "
                     f"computed again), {s['prefix_cache_hit_tokens']} prompt tokens from the "
                     "prefix cache")
    for i, r in enumerate(s.get("recoveries") or (), 1):
        who = "a stage" if r["stage"] is None else f"stage {r['stage']} tp rank {r['tp_rank']}"
        lines.append(f"  recovery {i} at {_t(r['at_s'])}: {who} failed; workers replaced in "
                     f"{_t(r['seconds'])} ({r['attempts']} attempt(s)), {r['requests']} requests "
                     f"computed {r['tokens']} tokens again")
    if s.get("partial"):  # reports before these keys have neither
        lines.insert(1, f"  PARTIAL: interrupted by {s['interrupted_by']}; the unfinished "
                        "requests ended with finish reason error")
    return "\n".join(lines + stage_table(s["per_stage"]))


STAGE_TABLE_ROWS = 16  # stages printed; report.json has every one


def stage_table(per_stage: list[dict], indent: str = "  ") -> list[str]:
    """Per stage: busy / transfer / bubble by cause / idle, time and share of the stage's wall."""
    cols = ["busy", "transfer", *CAUSES, "idle"]
    head = f"{indent}{'stage':>7} {'wall':>10}" + "".join(f" {c:>18}" for c in cols)
    lines = [head]
    replicas = any(st.get("replica") for st in per_stage)
    for st in per_stage[:STAGE_TABLE_ROWS]:
        by = st.get("bubble_by_cause_s", {})
        vals = [st["busy_s"], st["transfer_s"], *(by.get(c, 0.0) for c in CAUSES), st["idle_s"]]
        wall = st["wall_s"]
        name = f"r{st['replica']} s{st['stage']}" if replicas else str(st["stage"])
        lines.append(f"{indent}{name:>7} {_t(wall):>10}" + "".join(
            f" {_t(v):>10} {v / wall if wall > 0 else 0.0:>6.1%}" for v in vals))
    if len(per_stage) > STAGE_TABLE_ROWS:
        lines.append(f"{indent}... {len(per_stage) - STAGE_TABLE_ROWS} more stages in report.json")
    return lines


def _t(x: float | None) -> str:
    """Seconds, in ms below one second."""
    if x is None:
        return "-"
    return f"{x:.2f} s" if abs(x) >= 1 else f"{x * 1e3:.2f} ms"
