"""The paper's pipeline experiment (§5.3, Fig. 12) on the simulator, timed on this machine.

Runs, in one process and on one workload (GPT-3 175B, 10K requests, Zipf(0.4) lengths in
[1K, 4K], P:D = 10, chunk 256, A100-80GB profiles):
  1. SARATHI on TP8 x PP8 alone, timed: the speed target is <= 30 s for this run;
  2. the paper's three deployments (SARATHI-PP, Orca-PP, 8 x TP8 with Orca) plus what this
     project adds (uniform-PP), timed as a whole: target <= 2 minutes for the three;
and prints the paper's ratios side by side with ours and the peak memory of the process
(target < 2 GB). Reports and plots land in --out.

    python benchmarks/simulate_paper.py [--requests 10000] [--out runs/paper]
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from pp_runtime.config import load_config
from pp_runtime.engine.simulate import simulate
from pp_runtime.telemetry.compare import compare_runs
from pp_runtime.telemetry.report import format_summary, write_report

PAPER_RULES = {"chunk_pipelining": False, "in_flight": 8}  # the paper's: pp in flight, one
#                                                           chunk of a prompt at a time
RUNS = [  # (directory name, config, planner, overrides)
    ("sarathi-pp", "paper/gpt3_tp8_pp8", "sarathi", PAPER_RULES),
    ("orca-pp", "paper/gpt3_tp8_pp8", "orca-best", PAPER_RULES),
    ("tp-only", "paper/gpt3_tp8", "orca-best", {}),
    ("uniform-pp", "paper/gpt3_tp8_pp8", "uniform", {}),  # this project's defaults
]
PAPER = {"orca-pp / sarathi-pp bubble": 6.29, "orca-pp / sarathi-pp makespan": 1.91,
         "tp-only / sarathi-pp makespan": 1.48, "orca-pp / tp-only makespan": 1.28}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--out", default="runs/paper")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    summaries, times = {}, {}
    t_all = time.perf_counter()
    for name, config, planner, overrides in RUNS:
        cfg = load_config(config, planner=planner, **{"workload.num_requests": args.requests},
                          **overrides)
        t0 = time.perf_counter()
        run = simulate(cfg, progress=not args.no_progress)
        t1 = time.perf_counter()
        report = write_report(run, out / name)
        times[name] = (t1 - t0, time.perf_counter() - t1)
        summaries[name] = report["summary"]
        print(format_summary(report))
        print(f"  simulated in {times[name][0]:.1f} s, reports + plots in {times[name][1]:.1f} s\n",
              flush=True)
        if name == "tp-only":
            three = time.perf_counter() - t_all
    print(compare_runs([out / name for name, *_ in RUNS], out))

    def ratio(a, b, key):
        get = (lambda s: s["makespan_s"]) if key == "makespan" else \
            (lambda s: s["bubble_per_request_s"]["median"])
        return get(summaries[a]) / get(summaries[b])

    ours = {"orca-pp / sarathi-pp bubble": ratio("orca-pp", "sarathi-pp", "bubble"),
            "orca-pp / sarathi-pp makespan": ratio("orca-pp", "sarathi-pp", "makespan"),
            "tp-only / sarathi-pp makespan": ratio("tp-only", "sarathi-pp", "makespan"),
            "orca-pp / tp-only makespan": ratio("orca-pp", "tp-only", "makespan")}
    print(f"\n{'ratio':<32}{'paper':>8}{'ours':>8}")
    for k, v in ours.items():
        print(f"{k:<32}{PAPER[k]:>7.2f}x{v:>7.2f}x")
    print(f"{'uniform-pp / sarathi-pp makespan':<32}{'-':>8}{ratio('uniform-pp', 'sarathi-pp', 'makespan'):>7.2f}x")
    print(f"{'uniform-pp / sarathi-pp bubble':<32}{'-':>8}{ratio('uniform-pp', 'sarathi-pp', 'bubble'):>7.2f}x")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sim = times["sarathi-pp"]
    print(f"\nspeed: one {args.requests}-request SARATHI-PP run simulated in {sim[0]:.1f} s "
          f"(+ {sim[1]:.1f} s reports and plots; target <= 30 s)")
    print(f"speed: the three paper deployments in {three:.1f} s (target <= 120 s)")
    print(f"memory: peak RSS {peak_mb:.0f} MB (target < 2048 MB)")


if __name__ == "__main__":
    main()
