"""Where a real pipeline's bubbles go when the machine has fewer cores than processes.

Runs a config's workload on the Ray executor (one actor per stage, one torch thread each)
and reads the kernel's scheduler statistics of every stage around the run
(`/proc/PID/task/TID/schedstat`, summed over the actor's threads: nanoseconds on a CPU,
nanoseconds runnable but waiting for one; a stage's calls run on one of them, Ray's own
threads mostly sleep). It prints, per stage, the report's busy and bubble shares of the
stage's wall time beside its threads' time on a CPU and waiting for one (as shares of the
wall time), the stage process's cores, and the machine's cores in use over the run
(`/proc/stat`). A stage that waits for a core is not computing, and the
stage after it then waits for it (an upstream or dependency bubble in the report) although
the runtime had handed it work: on such a machine the bubble's floor is set by the cores.

    python benchmarks/core_bound.py [--config tiny] [--pp 3,4] [--planner uniform]
        [--requests N] [--set FIELD=VALUE]
"""
from __future__ import annotations

import argparse
import os
import time

import yaml

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.engine.llm import run_workload  # noqa: E402
from pp_runtime.executors.ray_executor import RayExecutor  # noqa: E402
from pp_runtime.telemetry.report import build_report  # noqa: E402


def schedstat(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable waiting for a CPU) of every thread of process pid."""
    on_cpu = waiting = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                a, b, _ = map(int, f.read().split())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        on_cpu, waiting = on_cpu + a, waiting + b
    return on_cpu, waiting


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of process pid (`/proc/PID/stat` utime + stime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cores_busy() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot (`/proc/stat`'s first line)."""
    with open("/proc/stat") as f:
        fields = list(map(int, f.readline().split()[1:]))
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def measure(cfg) -> None:
    ex = RayExecutor(cfg)
    try:
        pids = ex.ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in ex.actors])
        procs = pids + [os.getpid()]  # the stages, then the driver
        before, cpu0, t0 = [schedstat(p) for p in pids], cores_busy(), time.perf_counter()
        cpu_before = [process_cpu(p) for p in procs]
        last, shutdown = {}, ex.shutdown

        def read_then_shutdown():  # the run ends by shutting the actors down: read first
            if not last:
                last.update(after=[schedstat(p) for p in pids], cpu=cores_busy(),
                            procs=[process_cpu(p) for p in procs],
                            wall=time.perf_counter() - t0)
            shutdown()

        ex.shutdown = read_then_shutdown
        run = run_workload(cfg, executor=ex)
    finally:
        ex.shutdown()
    after, cpu1, wall = last["after"], last["cpu"], last["wall"]
    used = [(b - a) / wall for a, b in zip(cpu_before, last["procs"])]  # cores, per process
    summary = build_report(run)["summary"]
    busy, total = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    print(f"\n{cfg.model.name} PP = {cfg.parallel.pp}, {cfg.planner.planner}: makespan "
          f"{summary['makespan_s']:.2f} s, bubble fraction {summary['bubble_fraction']:.1%}; "
          f"cores in use over the run {busy / total * os.cpu_count():.2f} of {os.cpu_count()}: "
          f"stage processes {sum(used[:-1]):.2f}, driver {used[-1]:.2f}, the rest (Ray's "
          f"raylet and GCS, anything else) {busy / total * os.cpu_count() - sum(used):.2f}")
    print(f"{'stage':<6}{'busy':>8}{'bubble':>8}   its threads: {'on a CPU':>9}"
          f"{'waiting for one':>17}   process: {'cores':>6}")
    for st, b, a, u in zip(summary["per_stage"], before, after, used):
        bubble = sum(st["bubble_by_cause_s"].values())
        on_cpu, waiting = ((a[i] - b[i]) / 1e9 / wall for i in (0, 1))
        print(f"{st['stage']:<6}{st['busy_s'] / st['wall_s']:>8.1%}{bubble / st['wall_s']:>8.1%}"
              f"{'':>16}{on_cpu:>9.1%}{waiting:>17.1%}{'':>12}{u:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--pp", default="3,4")
    ap.add_argument("--planner", default="uniform")
    ap.add_argument("--requests", type=int, default=None, help="default: the config's")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    args = ap.parse_args()
    sets = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    for pp in map(int, args.pp.split(",")):
        cfg = load_config(args.config, pp=pp, executor="ray", threads_per_worker=1,
                          planner=args.planner, **sets)
        if args.requests:
            cfg = cfg.with_overrides(**{"workload.num_requests": args.requests})
        measure(cfg)


if __name__ == "__main__":
    main()
