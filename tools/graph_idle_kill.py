"""A stage actor killed while the compiled graph is idle, then what a server does: ping the
stages, shut down (issue 23; docs/distributed.md, "runtime.compiled_graph").

    python tools/graph_idle_kill.py PP VICTIM WAIT_S PING OWN

PING 1: ping before shutting down; OWN 1: the executor starts Ray itself (0: this script
does). The last line is SURVIVED unless the driver process crashed."""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

import ray  # noqa: E402

from pp_runtime import SamplingParams  # noqa: E402
from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.engine.llm import LLM  # noqa: E402

T0 = time.perf_counter()


def say(*parts) -> None:
    print(f"[{time.perf_counter() - T0:6.2f}]", *parts, flush=True)


def main(pp: int, victim: int, wait_s: float, ping: bool, own: bool) -> None:
    if not own:
        ray.init(address="local", num_cpus=4, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)
    cfg = load_config("tiny", pp=pp, executor="ray", threads_per_worker=1, compiled_graph=True)
    llm = LLM(cfg)
    ex = llm.executor
    say("started")
    outs = llm.generate([[1 + i] * 20 for i in range(3)],
                        SamplingParams(max_tokens=4, ignore_eos=True))
    say("generated", [len(o.token_ids) for o in outs])
    time.sleep(0.5)  # the graph idle
    ray.kill(ex.actors[victim])
    say("killed", victim)
    time.sleep(wait_s)
    if ping:
        try:
            say("ping ->", ex.ping(5.0))
        except Exception as exc:
            say("ping raised:", type(exc).__name__, exc)
    try:
        llm.shutdown()
        say("shutdown ok")
    except Exception as exc:
        say("shutdown raised:", type(exc).__name__, exc)
    if not own:
        ray.shutdown()
    say("SURVIVED")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), float(a[2]), a[3] == "1", a[4] == "1")
