"""Faults in an offline run: `pp-runtime run` finishes every request, unchanged, while its
stage actors die.

Runs `pp-runtime run --config cpu/gpt2_pp2` (random prompts, greedy) twice with the same
seed: fault-free, then with one stage actor process killed with SIGKILL (--hang: SIGSTOP,
a real hang, with runtime.step_timeout_s=5) --every seconds after the first micro-batch,
stages in turn, --faults times. Checks (exit 1 when one fails): both runs end with exit 0,
every request with finish reason length, each output equal to the fault-free run's
(outputs.jsonl), report.json lists one recovery per fault. Prints each recovery (stage,
seconds, requests and tokens computed again) and both makespans.

    python benchmarks/faults_offline.py                 # 2 SIGKILLs, 10 s apart
    python benchmarks/faults_offline.py --hang --faults 1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

STAGE = re.compile(r"ray::stage(\d+)-tp0\.execute")


def stage_pids(root: int) -> dict[int, int]:
    """Stage -> pid of its TP rank 0 actor while it runs a micro-batch (`ray::stage1-tp0.execute`)."""
    found = {}
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for p in procs:
        try:
            m = STAGE.match(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        if m:
            found[int(m.group(1))] = p.pid
    return found


def run(out: Path, args, faults: int) -> tuple[int, list[str]]:
    """`pp-runtime run` into `out`, injecting `faults` faults; (exit code, what was done)."""
    cmd = [sys.executable, "-m", "pp_runtime.cli", "run", "--config", args.config,
           "--requests", str(args.requests), "--max-tokens", str(args.max_tokens), "--seed", "0",
           "--quiet", "--out", str(out)]
    if args.hang:
        cmd += ["--set", "runtime.step_timeout_s=5"]
    if args.attempts is not None:
        cmd += ["--set", f"runtime.recovery_attempts={args.attempts}"]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done, log = [], []
    t_next, stage = None, 1
    while proc.poll() is None and len(done) < faults:
        pids = stage_pids(proc.pid)
        if pids and t_next is None:
            t_next = time.monotonic() + args.every  # from the first micro-batch
        if t_next is not None and time.monotonic() >= t_next and stage in pids:
            os.kill(pids[stage], signal.SIGSTOP if args.hang else signal.SIGKILL)
            done.append(f"{'SIGSTOP' if args.hang else 'SIGKILL'} stage {stage} pid {pids[stage]}")
            stage, t_next = (stage + 1) % args.pp, time.monotonic() + args.every
        time.sleep(0.05)
    for line in proc.stdout:
        log.append(line)
    code = proc.wait()
    for line in log:
        if "recovered in" in line:
            print("  log:", line.split("WARNING")[-1].strip()[:200])
    if code:
        print("".join(log[-40:]), file=sys.stderr)
    return code, done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cpu/gpt2_pp2")
    ap.add_argument("--pp", type=int, default=2, help="stages of --config (faults go round them)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--faults", type=int, default=2)
    ap.add_argument("--every", type=float, default=10.0)
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--attempts", type=int, help="runtime.recovery_attempts (default: the config's)")
    ap.add_argument("--out", default="runs/faults-offline")
    args = ap.parse_args()
    base = Path(args.out)
    ref_code, _ = run(base / "fault-free", args, 0)
    code, done = run(base / ("hang" if args.hang else "kill"), args, args.faults)
    ref = [json.loads(x) for x in open(base / "fault-free" / "outputs.jsonl")]
    got = [json.loads(x) for x in open(base / ("hang" if args.hang else "kill") / "outputs.jsonl")]
    rep = json.load(open(base / ("hang" if args.hang else "kill") / "report.json"))["summary"]
    ref_rep = json.load(open(base / "fault-free" / "report.json"))["summary"]
    same = sum(a == b for a, b in zip(ref, got))
    print(f"faults: {'; '.join(done) or 'none'}")
    for i, r in enumerate(rep["recoveries"], 1):
        print(f"  recovery {i} at {r['at_s']:.1f} s: stage {r['stage']} ({r['cause'][:60]}...), "
              f"back in {r['seconds']:.1f} s, {r['requests']} requests computed {r['tokens']} tokens again")
    print(f"makespan fault-free {ref_rep['makespan_s']:.1f} s, with faults {rep['makespan_s']:.1f} s; "
          f"finish reasons {rep['finish_reasons']}")
    checks = [("both runs exit 0", ref_code == 0 and code == 0),
              (f"{args.faults} faults injected", len(done) == args.faults),
              ("one recovery per fault", len(rep["recoveries"]) == len(done)),
              (f"outputs equal the fault-free run's ({same}/{len(ref)})", same == len(ref) == len(got)),
              ("every request ends length", rep["finish_reasons"] == {"length": len(got)})]
    for name, ok in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
