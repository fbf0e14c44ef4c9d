"""The host cost of reaching every stage actor once per micro-batch, without the model:
one Ray task per actor (`ray.put` + `.remote()` on each + `ray.get`, what the Ray executor
does by default) against one Ray Compiled Graph execution (`runtime.compiled_graph`),
one at a time and with 3 in flight. Empty calls on CPU actors on 127.0.0.1.

    python benchmarks/ray_call_overhead.py [--actors 3] [--calls 300]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

import ray  # noqa: E402
from ray.dag import InputNode, MultiOutputNode  # noqa: E402


@ray.remote(num_cpus=0)
class Stage:
    def execute(self, mb):
        return mb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actors", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    actors = [Stage.remote() for _ in range(args.actors)]
    ray.get([a.execute.remote(0) for a in actors])
    t0 = time.perf_counter()
    for k in range(args.calls):
        ref = ray.put(k)
        ray.get([a.execute.remote(ref) for a in actors])
    tasks = (time.perf_counter() - t0) / args.calls
    with InputNode() as inp:
        dag = MultiOutputNode([a.execute.bind(inp) for a in actors]).experimental_compile(
            _max_inflight_executions=4)
    for k in range(10):
        ray.get(dag.execute(k))
    t0 = time.perf_counter()
    for k in range(args.calls):
        ray.get(dag.execute(k))
    one = (time.perf_counter() - t0) / args.calls
    t0 = time.perf_counter()
    refs = [dag.execute(k) for k in range(3)]
    for k in range(3, args.calls):
        ray.get(refs.pop(0))
        refs.append(dag.execute(k))
    for r in refs:
        ray.get(r)
    three = (time.perf_counter() - t0) / args.calls
    dag.teardown()
    ray.shutdown()
    print(f"{args.actors} actors, {args.calls} micro-batches: one Ray task per actor "
          f"{tasks * 1e3:.2f} ms per micro-batch; compiled graph {one * 1e3:.2f} ms "
          f"({tasks / one:.1f}x), {three * 1e3:.2f} ms with 3 in flight")


if __name__ == "__main__":
    main()
