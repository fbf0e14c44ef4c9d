"""issue 23, docs/distributed.md: a stage actor killed while the compiled graph is idle.
Repro: compiled graph idle, one stage actor killed, then what the server does: ping, shutdown.
argv: pp victim wait_s ping(0/1) own(0/1: the executor starts Ray itself)"""
import os, sys, time
T0 = time.perf_counter()
def say(*a): print(f"[{time.perf_counter() - T0:6.2f}]", *a, flush=True)
import ray
from pp_runtime.config import load_config
from pp_runtime.engine.llm import LLM
from pp_runtime import SamplingParams

pp, victim, wait_s, do_ping, own = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                    int(sys.argv[4]), int(sys.argv[5]))
if not own:
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
cfg = load_config("tiny", pp=pp, executor="ray", threads_per_worker=1, compiled_graph=True)
llm = LLM(cfg)
ex = llm.executor
say("started")
outs = llm.generate([[1 + i] * 20 for i in range(3)], SamplingParams(max_tokens=4, ignore_eos=True))
say("generated", [len(o.token_ids) for o in outs])
time.sleep(0.5)  # the graph idle
ray.kill(ex.actors[victim])
say("killed", victim)
time.sleep(wait_s)
if do_ping:
    try:
        say("ping ->", ex.ping(5.0))
    except Exception as e:
        say("ping raised:", type(e).__name__, e)
try:
    llm.shutdown()
    say("shutdown ok")
except Exception as e:
    say("shutdown raised:", type(e).__name__, e)
if not own:
    ray.shutdown()
say("SURVIVED")
