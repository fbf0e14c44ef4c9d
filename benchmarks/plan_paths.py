"""`pp-runtime plan`: the fast path against the exhaustive one, side by side in one run.

Runs the same plan three times: fast with an empty probe cache, fast again on that cache
(it should simulate nothing), and `--exhaustive --no-cache --budget-minutes 120` (every
candidate searched to its capacity, probes stopped early as the fast path's are, which is
exact; a run the budget cut short is an error; `--full-probes` is passed on with
--full). Prints each one's wall time, probes, winner and
frontier, and whether the winners and frontiers are the same.

    python benchmarks/plan_paths.py --out runs/plan_paths/gpt3 -- \\
        --model gpt3-175b --gpus 64 --gpu a100-80gb --ttft-slo 5 --tbt-slo 0.2

--against DIR compares with the plan.json of an exhaustive run kept in DIR (an earlier
run of this script: DIR/exhaustive) instead of running it again (30 min for GPT-3 on
this machine); that run's code must price probes as this one's does (a change to the
search alone, not to the simulator, the planner or the cost model). The exhaustive run's
wall time then comes from its log, when kept beside it.

--before DIR runs the fast path of another checkout first (DIR: e.g. `git worktree add
--detach /tmp/before HEAD` before a change), on the same machine in the same call, and
prints both times and their ratio; --no-exhaustive leaves the exhaustive path out (a
before/after comparison of the fast path alone). Answers compared: the winner, the
frontier, and every layout's best deployment and capacity (plan.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def run(name: str, argv: list[str], out: Path, extra: list[str], code: str | None = None) -> dict:
    """One `pp-runtime plan` in a subprocess (code: the checkout whose package it runs)."""
    # -P: the working directory is not put before PYTHONPATH (it would import this
    # checkout's package for the other checkout's run); its workers inherit the path
    cmd = [sys.executable, *(["-P"] if code else []), "-m", "pp_runtime.cli", "plan", *argv,
           "--quiet", "--out", str(out / name), *extra]
    env = {**os.environ, "PYTHONPATH": str(Path(code).resolve())} if code else None
    t0, c0 = time.perf_counter(), _children_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if done.returncode:
        sys.exit(f"{name} failed: {done.stderr[-2000:]}")
    (out / f"{name.replace(' ', '_').replace(',', '')}.log").write_text(done.stdout)
    probes = next(line for line in done.stdout.splitlines() if " probes, " in line)
    left = next(line for line in done.stdout.splitlines() if line.startswith("searched "))
    if " 0 left by the budget" not in left:
        sys.exit(f"{name}: the time budget cut the search short: {left}")
    plan = json.loads((out / name / "plan.json").read_text())
    print(f"{name:<22} wall {wall:6.1f} s  cpu {cpu:6.1f} s  {probes.strip()}", flush=True)
    print(f"{'':<22} winner: {plan['best']}", flush=True)
    return {"wall": wall, "cpu": cpu, **answer(plan)}


def _children_cpu() -> float:
    """User + system CPU seconds of the finished subprocesses and their workers: the work
    a run did, which other load on the machine changes less than its wall time."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def answer(plan: dict) -> dict:
    """What two searches must agree on: the winner, the frontier, each layout's best."""
    front = [(f["deployment"], round(f["per_gpu"], 6)) for f in plan["frontier"]]
    best: dict[str, tuple] = {}
    for r in plan["results"]:  # a layout's best: the most per GPU, the earlier on a tie
        lay = " ".join(r["deployment"].split()[:3])
        if r["capacity_qps"] and (lay not in best or round(r["per_gpu"], 6) > best[lay][1]):
            best[lay] = (r["deployment"], round(r["per_gpu"], 6))
    return {"best": plan["best"], "frontier": front, "layouts": best}


def kept(where: Path, argv: list[str]) -> dict:
    """An earlier exhaustive run's answer (--against), checked to be the same plan."""
    plan = json.loads((where / "plan.json").read_text())
    if not plan["args"].get("exhaustive"):
        sys.exit(f"--against {where}: not an exhaustive run")
    mine = vars(_plan_args(argv))
    differ = [k for k, v in mine.items()
              if k not in SEARCH_ONLY and k in plan["args"] and plan["args"][k] != v]
    if differ:
        sys.exit(f"--against {where}: another plan ({', '.join(differ)} differ)")
    log = where.parent / "exhaustive.log"
    probes = next((line.strip() for line in log.read_text().splitlines() if " probes, " in line),
                  "") if log.is_file() else ""
    print(f"{'exhaustive (kept)':<22} {where}: {probes}", flush=True)
    print(f"{'':<22} winner: {plan['best']}", flush=True)
    return {"wall": None, **answer(plan)}


# flags that change how the plan searches or what it writes, not its answer
SEARCH_ONLY = {"exhaustive", "full_probes", "cache", "no_cache", "out", "quiet", "jobs",
               "budget_minutes", "func"}


def _plan_args(argv: list[str]):
    from pp_runtime.cli import plan as cli_plan

    ap = argparse.ArgumentParser()
    cli_plan.add_parser(ap.add_subparsers())
    return ap.parse_args(["plan", *argv])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/plan_paths")
    ap.add_argument("--full", action="store_true", help="the exhaustive path runs every probe in full")
    ap.add_argument("--against", help="a directory holding an earlier exhaustive run's plan.json: "
                                      "compare with it instead of running the exhaustive path")
    ap.add_argument("--before", help="another checkout (a directory holding pp_runtime/) whose fast "
                                      "path runs first, for a side-by-side time and answer")
    ap.add_argument("--no-exhaustive", action="store_true", help="leave the exhaustive path out")
    ap.add_argument("plan_args", nargs=argparse.REMAINDER, help="-- then `pp-runtime plan` flags")
    args = ap.parse_args()
    argv = [a for a in args.plan_args if a != "--"]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    cache = ["--cache", str(out / "cache")]
    before = (run("fast, before", argv, out, ["--cache", str(out / "cache-before")], args.before)
              if args.before else None)
    fast = run("fast", argv, out, cache)
    again = run("fast, cache warm", argv, out, cache)
    if args.against:
        full = kept(Path(args.against), argv)
    elif not args.no_exhaustive:
        full = run("exhaustive", argv, out, ["--exhaustive", "--no-cache", "--budget-minutes", "120"]
                   + (["--full-probes"] if args.full else []))
    else:
        full = None
    print()
    if before:
        print(f"before / after: wall {before['wall'] / fast['wall']:.2f}x "
              f"({before['wall']:.1f} s -> {fast['wall']:.1f} s), cpu {before['cpu'] / fast['cpu']:.2f}x "
              f"({before['cpu']:.1f} s -> {fast['cpu']:.1f} s); same answers as before: "
              f"{agree(before, fast)}")
    if full:
        print(f"same winner: {fast['best'] == full['best'] == again['best']}; same frontier: "
              f"{fast['frontier'] == full['frontier'] == again['frontier']}; every layout's best: "
              f"{fast['layouts'] == full['layouts']}; "
              + (f"exhaustive / fast wall: {full['wall'] / fast['wall']:.1f}x" if full["wall"] else
                 "exhaustive: kept from an earlier run"))
    for i, (name, per_gpu) in enumerate(fast["frontier"], 1):
        print(f"  {i:02d} {name:<44} {per_gpu:.4f} req/s/GPU")
    for other, what in ((full, "exhaustive"), (before, "before")):
        if other and other["frontier"] != fast["frontier"]:
            print(f"{what} frontier:")
            for i, (name, per_gpu) in enumerate(other["frontier"], 1):
                print(f"  {i:02d} {name:<44} {per_gpu:.4f} req/s/GPU")
        if other and other["layouts"] != fast["layouts"]:
            for lay in sorted(set(other["layouts"]) | set(fast["layouts"])):
                if other["layouts"].get(lay) != fast["layouts"].get(lay):
                    print(f"  {lay}: {what} {other['layouts'].get(lay)}, fast {fast['layouts'].get(lay)}")
    return 0


def agree(a: dict, b: dict) -> bool:
    return a["best"] == b["best"] and a["frontier"] == b["frontier"] and a["layouts"] == b["layouts"]

if __name__ == "__main__":
    sys.exit(main())
