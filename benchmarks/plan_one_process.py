"""`pp-runtime plan` with its worker tasks run in this process, one after the other.

For profiling the search (cProfile, py-spy see one process) and for checking that a change
to the simulator's hot path keeps every probe: the tasks run in the order the pool would
start them, so two trees' `plan.json` (every candidate's probes and outcomes; `seconds`
aside) compare exactly.

    python benchmarks/plan_one_process.py --model gpt3-175b --gpus 64 --gpu a100-80gb \\
        --ttft-slo 5 --tbt-slo 0.2 --no-cache --quiet --out /tmp/plan1
    python benchmarks/plan_one_process.py --compare /tmp/plan0/plan.json /tmp/plan1/plan.json
"""
from __future__ import annotations

import sys
from concurrent.futures import Future

import pp_runtime.plan.runner as runner


class InProcess:
    """A ProcessPoolExecutor's submit and shutdown, run at submit in this process."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed over as the pool would
            done.set_exception(exc)
        return done

    def shutdown(self, **kwargs) -> None:
        pass


def same_plan(a: str, b: str) -> bool:
    """Two plan.json the same: winner, frontier, and every candidate's outcome, capacity,
    bound, deciding probe and probes (each candidate's `seconds` left out)."""
    import json

    def answer(path: str) -> dict:
        plan = json.loads(open(path).read())
        results = [{k: v for k, v in r.items() if k != "seconds"} for r in plan["results"]]
        return {"best": plan["best"], "frontier": plan["frontier"], "results": results}

    return answer(a) == answer(b)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        same = same_plan(sys.argv[2], sys.argv[3])
        print(f"identical results/probes/frontier: {same}")
        sys.exit(0 if same else 1)
    runner.ProcessPoolExecutor = InProcess
    from pp_runtime.cli.main import main

    sys.exit(main(["plan", *sys.argv[1:]]))
