"""Every planner on the workloads of issue 11, simulated, printed as one table.

Workloads (all TP8 x PP8, chunk 256, Zipf lengths, P:D 10 unless said):
  a  the paper's: GPT-3 175B on A100-80GB, 10K requests in [1K, 4K] tokens, B 27, at once
  b  LLaMA-2-70B on H100-80GB, same shape, B 128 (configs/paper/llama2_70b_tp8_pp8_h100)
  c  long prompts: LLaMA-2-70B with a 32K context, 200 requests in [8K, 32K] tokens, P:D 50,
     B 32, Poisson arrivals at half of SARATHI's all-at-once rate (a request often finds
     the pipeline empty: what chunk pipelining is for)
  d  (a) with Poisson arrivals at 80 % of SARATHI's capacity on (a)
Rows: every planner, then what each mechanism of `uniform` buys (one switched off at a
time) and in-flight depth pp + 1. Columns: makespan, throughput, bubble per request
(median, p99), bubble fraction and its causes, TTFT and TBT (p50, p99), and makespan
relative to the best of sarathi, sarathi-serve and gllm on the same workload.

    python benchmarks/planners.py [--requests 10000] [--only a,b] [--out runs/planners]

`--requests` scales (a), (b) and (d); (c) keeps 200. The targets (issue 11) are checked
at the end and each miss is printed with its size.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pp_runtime.config import load_config
from pp_runtime.engine.simulate import simulate
from pp_runtime.telemetry.report import build_report, strict_json

PLANNERS = ["sarathi", "sarathi-serve", "gllm", "uniform", "orca-best", "orca-worst", "vllm",
            "request-level"]
ANCHORS = ["sarathi", "sarathi-serve", "gllm"]  # uniform must beat the best of these
# The anchors run as published: pp micro-batches in flight, a prompt's next chunk only
# after its previous one came back (SARATHI, Sarathi-Serve and gLLM; vLLM's async
# scheduling and SGLang add one micro-batch, SGLang and Medha pipeline chunks). `uniform`
# runs with this project's defaults (pp + 1 in flight, chunk pipelining, packing). The
# variants give the anchors our mechanisms too, and switch uniform's off one at a time.
PUBLISHED = {"in_flight": 8, "chunk_pipelining": False}
PLANNER_OVERRIDES = {p: PUBLISHED for p in PLANNERS if p != "uniform"}
VARIANTS = {  # label -> (planner, overrides)
    "sarathi +ours": ("sarathi", {"in_flight": 9, "chunk_pipelining": True}),
    "sarathi-serve +ours": ("sarathi-serve", {"in_flight": 9, "chunk_pipelining": True}),
    "gllm +ours": ("gllm", {"in_flight": 9, "chunk_pipelining": True}),
    "uniform pp": ("uniform", {"in_flight": 8}),
    "uniform strict": ("uniform", {"chunk_pipelining": False}),
    "uniform no-pack": ("uniform", {"pack_prefills": False}),
    "uniform time-cap": ("uniform", {}),  # target_ms: a full SARATHI micro-batch (time_cap_ms)
    "uniform C=512": ("uniform", {"chunk_size": 512}),
    "uniform C=1024": ("uniform", {"chunk_size": 1024}),
}
LONG = {"max_positions": 32768, "max_batch_size": 32, "workload.num_requests": 200,
        "workload.min_len": 8192, "workload.max_len": 32768, "workload.pd_ratio": 50}


def workloads(requests: int) -> dict[str, tuple[str, dict]]:
    n = {"workload.num_requests": requests}
    return {"a": ("paper/gpt3_tp8_pp8", n), "b": ("paper/llama2_70b_tp8_pp8_h100", n),
            "c": ("paper/llama2_70b_tp8_pp8_h100", LONG), "d": ("paper/gpt3_tp8_pp8", n)}


def time_cap_ms(config: str, overrides: dict) -> float:
    """A full SARATHI micro-batch's predicted time, its B - 1 decodes at half the KV length:
    the time cap of the "uniform time-cap" rows."""
    from pp_runtime.costmodel import build_cost_model
    cfg = load_config(config, **overrides)
    d = cfg.batch_rows - 1
    return 1e3 * build_cost_model(cfg).microbatch_time(
        [(0, cfg.chunk_tokens - d)], [cfg.seq_len // 2] * d)


def run(config: str, planner: str, overrides: dict) -> dict:
    if planner in PLANNER_OVERRIDES:
        overrides = {**PLANNER_OVERRIDES[planner], **overrides}
    cfg = load_config(config, planner=planner, **overrides)
    t0 = time.perf_counter()
    summary = build_report(simulate(cfg, progress=False))["summary"]
    summary["sim_wall_s"] = time.perf_counter() - t0
    return summary


def row(label: str, s: dict, best: float | None) -> str:
    b, ttft, tbt, causes = (s["bubble_per_request_s"], s["ttft_s"], s["tbt_s"],
                            s["bubble_fraction_by_cause"])
    rel = f"{s['makespan_s'] / best:6.3f}" if best else "     -"
    return (f"| {label:<19} | {s['makespan_s']:9.1f} | {rel} | {s['throughput_tok_s']:8.0f} | "
            f"{_ms(b['median'])} | {_ms(b['p99'])} | {s['bubble_fraction']:6.2%} | "
            f"{causes.get('upstream', 0):6.2%} | {causes.get('downstream', 0):6.2%} | "
            f"{causes.get('dependency', 0):6.2%} | {_s(ttft['median'])} | {_s(ttft['p99'])} | "
            f"{_ms(tbt['median'])} | {_ms(tbt['p99'])} |")


HEADER = ("| planner             | makespan s | ÷best | tok/s    | bubble p50 | bubble p99 | "
          "bubble | upstr. | downst.| depend.| TTFT p50 | TTFT p99 | TBT p50 | TBT p99 |\n"
          "| ------------------- | ---------: | ----: | -------: | ---------: | ---------: | "
          "-----: | -----: | -----: | -----: | -------: | -------: | ------: | ------: |")


def _ms(x) -> str:
    return "      -   " if x is None else f"{x * 1e3:8.1f}ms"


def _s(x) -> str:
    return "     -  " if x is None else f"{x:7.2f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--only", default="a,b,c,d", help="workloads to run, e.g. a,c")
    ap.add_argument("--out", default="runs/planners")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {}
    t_all = time.perf_counter()
    for name, (config, base) in workloads(args.requests).items():
        if name not in args.only.split(","):
            continue
        base = dict(base)
        if name in ("c", "d"):  # arrivals as a share of SARATHI's all-at-once rate
            at_once = run(config, "sarathi", base)  # as published: pp in flight
            share = 0.5 if name == "c" else 0.8
            base["workload.qps"] = share * at_once["num_requests"] / at_once["makespan_s"]
        res = results[name] = {}
        for planner in PLANNERS:
            res[planner] = run(config, planner, base)
        for label, (planner, extra) in VARIANTS.items():
            if label.endswith("time-cap"):
                extra = {"target_ms": time_cap_ms(config, base)}
            res[label] = run(config, planner, {**base, **extra})
        best = min(res[p]["makespan_s"] for p in ANCHORS)
        qps = f", Poisson {base['workload.qps']:.3g} req/s" if "workload.qps" in base else ""
        print(f"\n### ({name}) {config} {json.dumps({k: v for k, v in base.items() if k != 'workload.qps'})}{qps}\n")
        print(HEADER)
        for label, s in res.items():
            print(row(label, s, best))
        print(flush=True)
    (out / "planners.json").write_text(json.dumps(strict_json(results), indent=1))
    print(f"simulated in {time.perf_counter() - t_all:.0f} s; every summary in {out}/planners.json")
    check_targets(results)


def check_targets(results: dict) -> None:
    """Issue 11's simulated targets: met or missed, by how much."""
    print("\ntargets:")

    def say(ok: bool, what: str) -> None:
        print(f"  {'met ' if ok else 'MISS'} {what}")
    for name, res in results.items():
        uni, best = res["uniform"], min(res[p]["makespan_s"] for p in ANCHORS)
        ratio = uni["makespan_s"] / best
        limit = 0.97 if name in ("a", "b") else 1.0
        say(ratio <= limit, f"({name}) uniform makespan {ratio:.3f} x the best anchor (<= {limit})")
        if name in ("a", "b"):
            say(uni["bubble_fraction"] <= 0.01,
                f"({name}) uniform bubble fraction {uni['bubble_fraction']:.2%} (<= 1 %)")
            med, sar = uni["bubble_per_request_s"]["median"], res["sarathi"]["bubble_per_request_s"]["median"]
            say(med <= 0.5 * sar, f"({name}) uniform median bubble {med / sar:.2f} x SARATHI's (<= 0.5)")
        if name == "c" and "uniform strict" in res:
            p, s = uni["ttft_s"]["median"], res["uniform strict"]["ttft_s"]["median"]
            say(p <= s / 4, f"(c) TTFT p50 pipelined / strict = {p / s:.2f} (<= 0.25)")


if __name__ == "__main__":
    main()
