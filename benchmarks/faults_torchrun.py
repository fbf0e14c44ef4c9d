"""Faults under torchrun: the elastic agent restarts the group, rank 0 resumes from its
journal, and every output equals the fault-free run's.

Runs `python -m pp_runtime.cli.agent ... -m pp_runtime.cli.torchrun --config C` on
127.0.0.1 (gloo, `--max-restarts 1`) fault-free, then once per fault kind with the
launcher's test hook PP_RUNTIME_FAULT (rank --rank faults before its micro-batch
--after + 1, first attempt only): kill (SIGKILL), hang (sleeps forever; rank 0's step
timeout ends the attempt), stop (SIGSTOP; the agent's SIGKILL ends it). Prints, per
fault, the job's wall time and its extra over the fault-free run, how many tokens rank 0
resumed from, and whether the outputs are the fault-free ones (exit 1 when one is not).

    python benchmarks/faults_torchrun.py                      # tiny, PP = 2
    python benchmarks/faults_torchrun.py --config cpu/gpt2_pp2 --faults kill,hang
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pp_runtime.core.net import free_port

RESUMED = re.compile(r"rank 0: resuming from .*?: (\d+) tokens of (\d+) requests")


def job(out: Path, args, fault: str | None) -> tuple[float, str, int]:
    """(wall s, stderr, exit code) of one job under the agent."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env.pop("PP_RUNTIME_FAULT", None)
    if fault:
        env["PP_RUNTIME_FAULT"] = f"rank={args.rank},after_mb={args.after},mode={fault}"
    cmd = [sys.executable, "-m", "pp_runtime.cli.agent", "--nnodes", "1", "--nproc-per-node",
           str(args.pp), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--max-restarts", "1", "-m", "pp_runtime.cli.torchrun", "--out", str(out),
           "--config", args.config, "--quiet", "--requests", str(args.requests),
           "--set", f"pp={args.pp}", "--set", "threads_per_worker=1",
           "--set", f"step_timeout_s={args.step_timeout}", "--set", "workload.kind=fixed",
           "--set", f"prompt_len={args.prompt_len}", "--set", f"output_len={args.output_len}"]
    t0 = time.monotonic()
    # a session of its own: the agent's signals to its workers' group never reach this script
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                       start_new_session=True)
    return time.monotonic() - t0, r.stderr, r.returncode


def outputs(out: Path) -> list:
    path = out / "outputs.jsonl"
    return [json.loads(ln)["token_ids"] for ln in path.read_text().splitlines()] if path.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=1, help="the rank that faults")
    ap.add_argument("--after", type=int, default=8, help="micro-batches before the fault")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--step-timeout", type=float, default=5.0, help="runtime.step_timeout_s")
    ap.add_argument("--faults", default="kill,hang,stop")
    args = ap.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        base_s, err, code = job(Path(tmp) / "fault-free", args, None)
        reference = outputs(Path(tmp) / "fault-free")
        if code != 0 or not reference:
            print(err[-3000:], file=sys.stderr)
            return 1
        print(f"faults under torchrun: {args.config}, pp={args.pp}, {args.requests} requests of "
              f"{args.prompt_len} + {args.output_len} tokens, rank {args.rank} faults after "
              f"{args.after} micro-batches, step_timeout_s {args.step_timeout:g}, --max-restarts 1")
        print(f"{'fault':>10} {'exit':>5} {'wall':>8} {'extra':>8} {'resumed from':>22}  outputs")
        print(f"{'none':>10} {code:>5} {base_s:>7.1f}s {'':>8} {'':>22}  (the reference)")
        for fault in args.faults.split(","):
            out = Path(tmp) / fault
            wall, err, code = job(out, args, fault)
            m = RESUMED.search(err)
            resumed = f"{m[1]} tokens of {m[2]} req." if m else "(no resume)"
            same = outputs(out) == reference
            failed |= code != 0 or not same or m is None
            print(f"{fault:>10} {code:>5} {wall:>7.1f}s {wall - base_s:>+7.1f}s {resumed:>22}  "
                  f"{'= fault-free' if same else 'DIFFER'}", flush=True)
    print("PASS" if not failed else "FAIL", " every faulty job resumed and ended with the fault-free outputs")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
