"""How the simulator's cost grows with the number of requests (the paper's GPT-3 workload).

For each size N and planner, one fresh process (so the peak RSS is that run's alone)
simulates `workload.num_requests = N` on --config, then builds and writes its report
(no plots), and prints: micro-batches, simulate seconds, report seconds, their sum in
wall and in CPU seconds (CPU time is what to compare when other processes share the
machine), peak RSS, the share of time in Python's garbage collector, and microseconds of
simulation per micro-batch. Then the growth of time per request from one size to the
next (linear cost: x1.0 per request, x10 in total for 10x the requests), and whether the
100K runs meet the target: <= 120 s (simulate + report, wall clock) and <= 2048 MB.

    python benchmarks/sim_scale.py [--sizes 1000,10000,100000] [--planners sarathi,orca-best]
                                   [--config paper/gpt3_tp8_pp8] [--out DIR]
    python benchmarks/sim_scale.py --sizes 10000 --planners sarathi --profile

--profile runs each planner at the first size under cProfile (in this process) and prints
the top 25 functions by cumulative and by own time instead of the table.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_N, TARGET_S, TARGET_MB = 100_000, 120.0, 2048.0
RESULT_TAG = "SIM_SCALE_RESULT "  # the line a child process prints its measurements on


class GcTimer:
    """Seconds spent in the garbage collector (gc.callbacks brackets each collection)."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def load(config: str, planner: str, n: int):
    from pp_runtime.config import load_config
    return load_config(config, planner=planner, **{"workload.num_requests": n})


def measure(config: str, planner: str, n: int, out: Path) -> dict:
    """One run in this process: simulate, then the report, timed separately."""
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import write_report
    cfg = load(config, planner, n)
    gc_timer = GcTimer()
    t0, c0 = time.perf_counter(), time.process_time()
    run = simulate(cfg, progress=False)
    t1 = time.perf_counter()
    report = write_report(run, out, plots=False)
    t2, c2 = time.perf_counter(), time.process_time()
    return {"n": n, "planner": planner, "microbatches": report["summary"]["num_microbatches"],
            "makespan_s": report["summary"]["makespan_s"], "simulate_s": t1 - t0,
            "report_s": t2 - t1, "cpu_s": c2 - c0, "gc_s": gc_timer.seconds,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_child(config: str, planner: str, n: int, out: Path) -> dict:
    """`measure` in a fresh interpreter; its result comes back on a tagged stdout line."""
    cmd = [sys.executable, __file__, "--child", "--config", config, "--planners", planner,
           "--sizes", str(n), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        sys.exit(f"{planner} N={n} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def print_table(rows: list[dict]) -> None:
    head = (f"{'N':>7} {'planner':<10} {'micro-batches':>13} {'simulate s':>10} {'report s':>9} "
            f"{'total s':>8} {'cpu s':>7} {'peak MB':>8} {'GC %':>5} {'sim us/mb':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        total = r["simulate_s"] + r["report_s"]
        print(f"{r['n']:>7} {r['planner']:<10} {r['microbatches']:>13} {r['simulate_s']:>10.2f} "
              f"{r['report_s']:>9.2f} {total:>8.2f} {r['cpu_s']:>7.2f} {r['peak_mb']:>8.0f} "
              f"{100 * r['gc_s'] / total:>5.1f} {1e6 * r['simulate_s'] / r['microbatches']:>9.1f}")


def print_growth(rows: list[dict]) -> None:
    """Ratios between consecutive sizes of each planner: total time and time per request."""
    print("\ngrowth (linear cost: time per request x1.0)")
    for planner in dict.fromkeys(r["planner"] for r in rows):
        runs = sorted((r for r in rows if r["planner"] == planner), key=lambda r: r["n"])
        for a, b in zip(runs, runs[1:]):
            ta, tb = a["simulate_s"] + a["report_s"], b["simulate_s"] + b["report_s"]
            per_req = (tb / b["n"]) / (ta / a["n"])
            per_mb = (b["simulate_s"] / b["microbatches"]) / (a["simulate_s"] / a["microbatches"])
            print(f"  {planner:<10} {a['n']:>7} -> {b['n']:<7}: requests x{b['n'] / a['n']:.0f}, "
                  f"total time x{tb / ta:.2f}, time per request x{per_req:.2f}, "
                  f"memory x{b['peak_mb'] / a['peak_mb']:.2f}, "
                  f"simulate time per micro-batch x{per_mb:.2f}")


def print_targets(rows: list[dict]) -> None:
    big = [r for r in rows if r["n"] == TARGET_N]
    if not big:
        print(f"\ntarget: no {TARGET_N}-request run (add it to --sizes)")
        return
    print(f"\ntarget: {TARGET_N} requests in <= {TARGET_S:.0f} s and <= {TARGET_MB:.0f} MB")
    for r in big:
        total = r["simulate_s"] + r["report_s"]
        ok = total <= TARGET_S and r["peak_mb"] <= TARGET_MB
        print(f"  {r['planner']:<10} {total:6.1f} s ({'ok' if total <= TARGET_S else 'MISSED'}), "
              f"{r['peak_mb']:6.0f} MB ({'ok' if r['peak_mb'] <= TARGET_MB else 'MISSED'}): "
              f"{'met' if ok else 'NOT met'}")


def profile(config: str, planners: list[str], n: int, out: Path) -> None:
    for planner in planners:
        print(f"\n==== cProfile: {planner}, {n} requests (simulate + report, no plots) ====")
        prof = cProfile.Profile()
        prof.runcall(measure, config, planner, n, out / f"{planner}-{n}")
        for key, what in (("cumulative", "cumulative time"), ("tottime", "own time")):
            print(f"---- top 25 by {what} ----")
            pstats.Stats(prof, stream=sys.stdout).sort_stats(key).print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000", help="numbers of requests, comma-separated")
    ap.add_argument("--planners", default="sarathi,orca-best")
    ap.add_argument("--config", default="paper/gpt3_tp8_pp8")
    ap.add_argument("--out", help="where the reports go (default: a temporary directory)")
    ap.add_argument("--profile", action="store_true", help="cProfile the first size instead")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measured run
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    planners = args.planners.split(",")
    if args.child:
        print(RESULT_TAG + json.dumps(measure(args.config, planners[0], sizes[0], Path(args.out))))
        return
    with tempfile.TemporaryDirectory(prefix="sim_scale-") as tmp:
        out = Path(args.out or tmp)
        if args.profile:
            profile(args.config, planners, sizes[0], out)
            return
        print(f"{args.config}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
              "each run in a fresh process\n", flush=True)
        rows = []
        for n in sizes:
            for planner in planners:
                rows.append(run_child(args.config, planner, n, out / f"{planner}-{n}"))
                r = rows[-1]
                print(f"  done: {planner} N={n}: {r['simulate_s'] + r['report_s']:.1f} s, "
                      f"{r['peak_mb']:.0f} MB", file=sys.stderr, flush=True)
    print_table(rows)
    print_growth(rows)
    print_targets(rows)


if __name__ == "__main__":
    main()
