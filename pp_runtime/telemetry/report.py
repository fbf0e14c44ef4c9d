"""A run's report: `report.json` (summary + one entry per request), `requests.csv`,
`microbatches.csv`, `timeline.csv` and the plots. The same for simulated and real runs.

Bubbles come from `telemetry.bubbles.account` (docs/bubbles.md), once per replica: each
replica is its own pipeline with its own clocks. Times are seconds from the run's start.
"""
from __future__ import annotations

import csv
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pp_runtime.config import Config
from pp_runtime.request import RequestOutput
from pp_runtime.telemetry.bubbles import account
from pp_runtime.telemetry.recorder import RunRecorder

TIMELINE_MBS = 300  # micro-batches of replica 0 kept for the per-stage timeline


@dataclass
class RunResult:
    """Everything a finished run leaves behind, before it is written."""

    cfg: Config
    executor: str  # "sim", "local", "ray", "torchrun"
    requests: list[RequestOutput]
    replicas: list[RunRecorder]  # one per data-parallel replica
    run_wall_s: float  # how long the run itself took (a simulation's own runtime)
    cost_sources: dict[str, str] | None = None  # simulator: which source priced each op


def _hardware(cfg: Config) -> str:
    hw = cfg.hardware
    return f"profile {hw.profile}" if hw.profile else hw.gpu


def _stats(values: Sequence[float], keys: Sequence[str] = ("median", "p90", "p99", "mean")) -> dict:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {k: None for k in keys}
    pick = {"median": lambda: np.median(a), "p90": lambda: np.percentile(a, 90),
            "p99": lambda: np.percentile(a, 99), "mean": lambda: a.mean()}
    return {k: float(pick[k]()) for k in keys}


def build_report(run: RunResult) -> tuple[dict[str, Any], list[list]]:
    """(report.json contents, microbatches.csv rows)."""
    cfg = run.cfg
    per_stage, request_bubble, mb_rows = [], Counter(), []
    num_mbs = Counter()
    for rec in run.replicas:
        mb_requests = {mb.mb_id: mb.request_ids for mb in rec.microbatches}
        acc = account((t for mb in rec.microbatches for t in mb.timings), mb_requests)
        request_bubble.update(acc.request_bubble_s)
        for s in acc.per_stage:
            per_stage.append({"replica": rec.replica, "stage": s.stage, "wall_s": s.wall_s,
                              "busy_s": s.busy_s, "transfer_s": s.transfer_s,
                              "bubble_s": s.bubble_s, "idle_s": s.idle_s,
                              "num_microbatches": s.num_microbatches})
        for mb in rec.microbatches:
            num_mbs.update(mb.request_ids)
            t0, t1 = mb.timings[0], mb.timings[-1]
            mb_rows.append([rec.replica, mb.mb_id, mb.prefill_tokens, mb.decodes,
                            mb.prefill_tokens + mb.decodes, len(mb.request_ids), t0.compute_start_s,
                            t1.compute_end_s, max(t.compute_s for t in mb.timings),
                            acc.mb_bubble_s.get(mb.mb_id, 0.0)])
    requests = []
    for r in run.requests:
        requests.append({"id": r.request_id, "prompt_tokens": len(r.prompt_token_ids),
                         "output_tokens": len(r.token_ids), "arrival_s": r.arrival_s,
                         "first_token_s": r.first_token_s, "finish_s": r.finish_s,
                         "bubble_s": request_bubble.get(r.request_id, 0.0),
                         "num_microbatches": num_mbs.get(r.request_id, 0),
                         "finish_reason": str(r.finish_reason)})
    done = [r for r in requests if r["finish_s"] is not None]
    makespan = max((r["finish_s"] for r in done), default=0.0)
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in requests)
    wall = sum(s["wall_s"] for s in per_stage)
    gaps = np.concatenate([np.frombuffer(rec.token_gaps_s, dtype=float) for rec in run.replicas]) \
        if run.replicas else np.zeros(0)
    m, p, pl = cfg.model, cfg.parallel, cfg.planner
    summary = {
        "planner": pl.planner, "executor": run.executor, "num_requests": len(requests),
        "makespan_s": makespan, "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "bubble_per_request_s": _stats([r["bubble_s"] for r in requests]),
        "bubble_fraction": sum(s["bubble_s"] for s in per_stage) / wall if wall > 0 else 0.0,
        "per_stage": per_stage,
        "ttft_s": _stats([r["first_token_s"] - r["arrival_s"] for r in done
                          if r["first_token_s"] is not None], ("median", "p99")),
        "tbt_s": _stats(gaps, ("median", "p99")),
        "num_microbatches": len(mb_rows),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in requests)),
        "deployment": {"model": m.name, "tp": p.tp, "pp": p.pp, "dp": p.dp,
                       "gpu": _hardware(cfg) if run.executor == "sim" else cfg.runtime.device,
                       "chunk_size": pl.chunk_size, "max_batch_size": pl.max_batch_size},
        "run_wall_s": run.run_wall_s,
    }
    if run.cost_sources:
        summary["cost_sources"] = run.cost_sources
    return {"summary": summary, "config": cfg.to_dict(), "requests": requests}, mb_rows


MB_COLUMNS = ["replica", "mb_id", "prefill_tokens", "decodes", "num_tokens", "num_requests",
              "start_s", "end_s", "compute_s", "bubble_s"]
REQUEST_COLUMNS = ["id", "prompt_tokens", "output_tokens", "arrival_s", "first_token_s",
                   "finish_s", "bubble_s", "num_microbatches", "finish_reason"]
TIMELINE_COLUMNS = ["mb_id", "stage", "compute_start_s", "compute_end_s", "wait_s", "transfer_s",
                    "prefill_tokens", "decodes"]


def _write_csv(path: Path, columns: list[str], rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)


def write_report(run: RunResult, out_dir: str | Path, plots: bool = True) -> dict[str, Any]:
    """Write every report file of a run into out_dir; returns report.json's contents."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report, mb_rows = build_report(run)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _write_csv(out / "requests.csv", REQUEST_COLUMNS,
               ([r[c] for c in REQUEST_COLUMNS] for r in report["requests"]))
    _write_csv(out / "microbatches.csv", MB_COLUMNS, mb_rows)
    with open(out / "outputs.jsonl", "w") as f:  # what each request generated
        for r in run.requests:
            f.write(json.dumps({"id": r.request_id, "token_ids": r.token_ids,
                                "finish_reason": str(r.finish_reason)}) + "\n")
    first = run.replicas[0].microbatches[:TIMELINE_MBS] if run.replicas else []
    _write_csv(out / "timeline.csv", TIMELINE_COLUMNS,
               ([t.mb_id, t.stage, t.compute_start_s, t.compute_end_s, t.wait_s, t.transfer_s,
                 mb.prefill_tokens, mb.decodes] for mb in first for t in mb.timings))
    if plots:
        from pp_runtime.telemetry.plots import plot_run
        plot_run(out)
    return report


def read_report(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out_dir}: no report.json (not a finished run directory)")
    return json.loads(path.read_text())


def format_summary(report: dict[str, Any]) -> str:
    s = report["summary"]
    d, b, ttft, tbt = s["deployment"], s["bubble_per_request_s"], s["ttft_s"], s["tbt_s"]
    lines = [
        f"{s['planner']} on {d['model']} tp={d['tp']} pp={d['pp']} dp={d['dp']} ({d['gpu']}, "
        f"{s['executor']}): {s['num_requests']} requests, {s['num_microbatches']} micro-batches",
        f"  makespan {_t(s['makespan_s'])}, throughput {s['throughput_tok_s']:.0f} tok/s, "
        f"bubble fraction {s['bubble_fraction']:.1%}",
        f"  bubble per request: median {_t(b['median'])}, p90 {_t(b['p90'])}, "
        f"p99 {_t(b['p99'])}, mean {_t(b['mean'])}",
        f"  TTFT median {_t(ttft['median'])}, p99 {_t(ttft['p99'])}; "
        f"time between tokens median {_t(tbt['median'])}, p99 {_t(tbt['p99'])}",
        f"  finish reasons: {s['finish_reasons']}",
    ]
    return "\n".join(lines)


def _t(x: float | None) -> str:
    """Seconds, in ms below one second."""
    if x is None:
        return "-"
    return f"{x:.2f} s" if abs(x) >= 1 else f"{x * 1e3:.2f} ms"
