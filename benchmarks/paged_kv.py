"""The paged KV cache against whole-context slots, at the same KV memory, side by side.

1. Requests in flight that one stage's KV memory holds, paged (blocks of 16 at the
   workload's mean request length) against whole contexts of max_seq_len: the paper's
   GPT-3 TP8 x PP8 on A100-80GB workload and cpu/gpt2_pp2 (`memory.kv_capacity`, what
   `pp-runtime memory` prints).
2. Simulated GPT-3 175B and LLaMA-3-70B, TP8 x PP8 on A100-80GB (configs/paper/
   gpt3_tp8_pp8, the model swapped for LLaMA), P:D 1 and 10, the `uniform` planner: the
   KV memory of pp x 27 whole contexts of 4K tokens either way; slots admit 27 requests
   per micro-batch (the paper), the paged pool admits what its blocks hold, with B = 27
   and B = 54 sequences per micro-batch. Makespan, throughput paged / slots,
   preemptions per 1000 requests.

    python benchmarks/paged_kv.py [--requests 3000] [--out runs/paged_kv]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from pp_runtime.config import load_config, load_model_config
from pp_runtime.costmodel.memory import kv_capacity
from pp_runtime.engine.simulate import simulate
from pp_runtime.telemetry.report import build_report, strict_json
from pp_runtime.core.workload import generate

MODELS = ("gpt3-175b", "llama3-70b")
VARIANTS = {  # label -> overrides; the KV memory is kv_slots = 8 x 27 contexts in every row
    "slots B=27": dict(paged=False, max_batch_size=27, kv_slots=216),
    "paged B=27": dict(paged=True, max_batch_size=27, kv_slots=216),
    "paged B=54": dict(paged=True, max_batch_size=54, kv_slots=216),
}


def in_flight_rows() -> list[str]:
    rows = []
    for name, gb in (("paper/gpt3_tp8_pp8", 80.0), ("cpu/gpt2_pp2", None)):
        cfg = load_config(name)
        lengths = [s.prompt_len + s.output_len for s in generate(cfg.workload)]
        cap = kv_capacity(cfg, lengths, gb)
        rows.append(f"{name:20s} {cap.blocks:>8} {cap.mean_tokens:>9.0f} {cap.slots:>8} "
                    f"{cap.in_flight:>10} {cap.in_flight / cap.slots:>7.2f}x")
    return rows


def simulated(requests: int, out: Path) -> list[dict]:
    rows = []
    for model in MODELS:
        base = replace(load_config("paper/gpt3_tp8_pp8"), model=load_model_config(model))
        for pd in (1, 10):
            for label, over in VARIANTS.items():
                cfg = base.with_overrides(planner="uniform", **over, **{
                    "workload.pd_ratio": pd, "workload.num_requests": requests})
                t0 = time.perf_counter()
                run = simulate(cfg, progress=False)
                rep = build_report(run)
                s = rep["summary"]
                preempt = sum(r.num_preemptions for r in run.requests)
                rows.append({"model": model, "pd": pd, "variant": label,
                             "makespan_s": s["makespan_s"], "throughput": s["throughput_tok_s"],
                             "preemptions_per_1k": 1000 * preempt / len(run.requests),
                             "bubble": s["bubble_fraction"], "sim_s": time.perf_counter() - t0})
                print(f"  {model:11s} P:D {pd:>2}  {label:11s} makespan {s['makespan_s']:8.1f} s  "
                      f"{s['throughput_tok_s']:7.0f} tok/s  preemptions/1k "
                      f"{rows[-1]['preemptions_per_1k']:6.1f}  ({rows[-1]['sim_s']:.0f} s)",
                      flush=True)
    (out / "simulated.json").write_text(json.dumps(strict_json(rows), indent=1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="simulated requests per row")
    ap.add_argument("--out", default="runs/paged_kv")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("1. requests in flight at the same KV memory (one stage)")
    print(f"{'config':20s} {'blocks':>8} {'mean len':>9} {'contexts':>8} {'paged':>10} {'ratio':>8}")
    for row in in_flight_rows():
        print(row)
    print(f"\n2. simulated, TP8 x PP8 on A100-80GB, uniform, {args.requests} requests, same KV memory")
    rows = simulated(args.requests, out)
    print(f"\n{'model':11s} {'P:D':>4} {'variant':11s} {'makespan':>10} {'paged/slots':>12} "
          f"{'preempt/1k':>11}")
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["pd"] == r["pd"]
                    and b["variant"] == "slots B=27")
        print(f"{r['model']:11s} {r['pd']:>4} {r['variant']:11s} {r['makespan_s']:>9.1f}s "
              f"{r['throughput'] / base['throughput']:>11.2f}x {r['preemptions_per_1k']:>11.1f}")


if __name__ == "__main__":
    main()
