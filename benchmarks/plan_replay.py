"""A plan's probes replayed in one process: for a before/after timing of the probe's hot
path in one call, and a profile of it (py-spy or cProfile) without the search around it.

    # the search in one process, every simulated probe's config pickled
    python benchmarks/plan_replay.py --capture /tmp/gpt3.pkl -- --model gpt3-175b --gpus 64 \\
        --gpu a100-80gb --ttft-slo 5 --tbt-slo 0.2 --no-cache --quiet --out /tmp/plan0
    # every 4th of them (from the first), timed; each probe's result pickled to compare
    PYTHONPATH=<checkout> python -P benchmarks/plan_replay.py --replay /tmp/gpt3.pkl --every 4 \\
        --results /tmp/r1.pkl [--prof /tmp/p.prof]
    python benchmarks/plan_replay.py --compare /tmp/r0.pkl /tmp/r1.pkl

Probes run in the capture's order; each one's cost model is built before the timing
(`plan.space.cost_model`, as a search process keeps them).
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time


def capture(out: str, plan_args: list[str]) -> int:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import plan_one_process
    import pp_runtime.plan.probe as probe
    import pp_runtime.plan.runner as runner
    from pp_runtime.cli.main import main

    calls, simulate = [], probe.simulate_probe

    def kept(one, cost, slo, replicas, stop_early):
        calls.append((one, slo, replicas, stop_early))
        return simulate(one, cost, slo, replicas, stop_early)

    probe.simulate_probe, runner.ProcessPoolExecutor = kept, plan_one_process.InProcess
    rc = main(["plan", *plan_args])
    with open(out, "wb") as f:
        pickle.dump(calls, f)
    print(f"{len(calls)} probes captured in {out}")
    return rc


def replay(path: str, every: int, first: int, results: str | None, prof: str | None) -> None:
    import pp_runtime
    from pp_runtime.plan.probe import simulate_probe
    from pp_runtime.plan.space import cost_model

    with open(path, "rb") as f:
        calls = pickle.load(f)[first::every]
    for one, _, replicas, _ in calls:
        cost_model(one, replicas)
    got = []

    def run() -> None:
        for one, slo, replicas, stop_early in calls:
            got.append(simulate_probe(one, cost_model(one, replicas), slo, replicas, stop_early))

    t0, c0 = time.perf_counter(), time.process_time()
    if prof:
        import cProfile
        cProfile.runctx("run()", globals(), {"run": run}, prof)
    else:
        run()
    print(f"{pp_runtime.__file__}: {len(calls)} probes wall {time.perf_counter() - t0:.2f} s "
          f"cpu {time.process_time() - c0:.2f} s")
    if results:
        with open(results, "wb") as f:
            pickle.dump(got, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", help="run the plan (the flags after --), pickle its probes here")
    ap.add_argument("--replay", help="a --capture file: replay its probes")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--results", help="pickle each replayed probe's result here")
    ap.add_argument("--prof", help="cProfile the replay into this file")
    ap.add_argument("--compare", nargs=2, help="two --results files: every probe's result equal?")
    ap.add_argument("plan_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.compare:
        a, b = (pickle.load(open(p, "rb")) for p in args.compare)
        print(f"every probe's result equal: {a == b} ({len(a)} and {len(b)} probes)")
        return 0 if a == b else 1
    if args.capture:
        return capture(args.capture, [a for a in args.plan_args if a != "--"])
    replay(args.replay, args.every, args.first, args.results, args.prof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
