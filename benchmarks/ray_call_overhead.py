"""The host cost of reaching every stage actor once per micro-batch, without the model:
one Ray task per actor (`.remote(mb)` on each, the plan inlined, then `ray.get`: what the
Ray executor does by default; and with one `ray.put` of the plan first, as it did before
issue 23) against one Ray Compiled Graph execution (`runtime.compiled_graph`), one at a
time and with 3 in flight; and the tasks on plain actors against the same calls on actors
with the TP relay's concurrency groups (a threaded actor: only the relay's actors have
them), alternated over three rounds. Calls that only read the plan's id, CPU actors on
127.0.0.1.

    python benchmarks/ray_call_overhead.py [--actors 3] [--calls 300]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

import ray  # noqa: E402
from ray.dag import InputNode, MultiOutputNode  # noqa: E402

from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk  # noqa: E402
from pp_runtime.executors.ray_actor import CONCURRENCY_GROUPS  # noqa: E402


class _Stage:
    def execute(self, mb):
        return mb.mb_id


Stage = ray.remote(num_cpus=0)(_Stage)
Grouped = ray.remote(num_cpus=0, concurrency_groups=CONCURRENCY_GROUPS)(_Stage)


def plan(k: int) -> MicroBatch:
    """A decode micro-batch of 4 sequences, 17 blocks each (the tiny config's shape)."""
    greedy = Sampling(0.0, 1.0, 0)
    return MicroBatch(k, tuple(SeqChunk(r, list(range(17 * r, 17 * r + 17)), 100, (5,), greedy,
                                        is_decode=True) for r in range(4)))


def per_call(actors: list, calls: int) -> float:
    """Seconds per micro-batch: the plan by value to every actor, then `ray.get` of all."""
    t0 = time.perf_counter()
    for k in range(calls):
        mb = plan(k)
        ray.get([a.execute.remote(mb) for a in actors])
    return (time.perf_counter() - t0) / calls


def plain_vs_grouped(n: int, calls: int) -> str:
    """The tasks path on plain actors and on actors with concurrency groups, alternated."""
    sets = {"plain": [Stage.remote() for _ in range(n)],
            "grouped": [Grouped.remote() for _ in range(n)]}
    for actors in sets.values():
        per_call(actors, 20)
    seen = {name: [] for name in sets}
    for _ in range(3):
        for name, actors in sets.items():
            seen[name].append(per_call(actors, calls) * 1e3)
    for actors in sets.values():
        for a in actors:
            ray.kill(a)
    return "; ".join(f"{name} actors {' '.join(f'{t:.3f}' for t in ts)} ms per micro-batch"
                     for name, ts in seen.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actors", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    actors = [Stage.remote() for _ in range(args.actors)]
    ray.get([a.execute.remote(plan(0)) for a in actors])
    t0 = time.perf_counter()
    for k in range(args.calls):
        ref = ray.put(plan(k))
        ray.get([a.execute.remote(ref) for a in actors])
    put = (time.perf_counter() - t0) / args.calls
    tasks = per_call(actors, args.calls)  # what the Ray executor does: the plan by value
    with InputNode() as inp:
        dag = MultiOutputNode([a.execute.bind(inp) for a in actors]).experimental_compile(
            _max_inflight_executions=4)
    for k in range(10):
        ray.get(dag.execute(plan(k)))
    t0 = time.perf_counter()
    for k in range(args.calls):
        ray.get(dag.execute(plan(k)))
    one = (time.perf_counter() - t0) / args.calls
    t0 = time.perf_counter()
    refs = [dag.execute(plan(k)) for k in range(3)]
    for k in range(3, args.calls):
        ray.get(refs.pop(0))
        refs.append(dag.execute(plan(k)))
    for r in refs:
        ray.get(r)
    three = (time.perf_counter() - t0) / args.calls
    dag.teardown()
    groups = plain_vs_grouped(args.actors, args.calls)
    ray.shutdown()
    print(f"{args.actors} actors, {args.calls} micro-batches: one Ray task per actor "
          f"{tasks * 1e3:.2f} ms per micro-batch ({put * 1e3:.2f} ms with one ray.put of the "
          f"plan); compiled graph {one * 1e3:.2f} ms "
          f"({tasks / one:.1f}x), {three * 1e3:.2f} ms with 3 in flight\n"
          f"tasks, three rounds each: {groups}")


if __name__ == "__main__":
    main()
