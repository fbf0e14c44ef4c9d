"""A stage actor killed while the compiled graph is idle (issue 23): the driver process
survives, and what the server and the engine do next names the dead stage. In Ray 2.60
this once crashed the driver (`experimental_mutable_object_provider.cc ... Check failed`
in the graph's teardown), so each case runs in a child process: a crash there fails the
test instead of taking pytest down. The child starts a local Ray of its own (2 CPUs
declared is too few for the graph's auto rule, so compiled_graph is set true)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import time
import ray
from pp_runtime import LLM, SamplingParams
from pp_runtime.config import load_config

cfg = load_config("tiny", pp={pp}, executor="ray", threads_per_worker=1, compiled_graph=True,
                  recovery_attempts=0)  # recovery off: the failure as reported
llm = LLM(cfg)
ex = llm.executor
assert ex.path == "graph" and ex.transport.dag is not None, ex.describe()
from pp_runtime.executors.ray_graph import graph_pays, local_cores  # the auto rule, this Ray
import os
assert local_cores(ray) == len(os.sched_getaffinity(0))  # the cluster is this machine
auto = cfg.with_overrides(compiled_graph="auto")
print("auto:", graph_pays(auto, "cpu", ray.cluster_resources(), local_cores(ray)), flush=True)
print("describe:", ex.describe(), flush=True)
llm.generate([[1 + i] * 20 for i in range(3)], SamplingParams(max_tokens=4, ignore_eos=True))
time.sleep(0.5)  # the graph idle
ray.kill(ex.actors[{victim}])
time.sleep(0.5)
"""

# serve's liveness probe (`serve/server._probe_until`), then its shutdown (`_own_workers`)
SERVER = """
try:
    ex.ping(5.0)
    print("ping: answered", flush=True)
except Exception as exc:
    print(f"ping: {{type(exc).__name__}}: {{exc}}", flush=True)
llm.shutdown()
print("SURVIVED", flush=True)
"""

# the engine's next micro-batch finds the dead rank; the failed run shuts the executor down
ENGINE = """
try:
    llm.generate([[5] * 10], SamplingParams(max_tokens=4, ignore_eos=True))
    print("generate: ran", flush=True)
except Exception as exc:
    print(f"generate: {{type(exc).__name__}}: {{exc}}", flush=True)
assert llm.executor is None  # torn down by the failed run
llm.shutdown()
print("SURVIVED", flush=True)
"""


def child(code: str, pp: int, victim: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get(
        "PYTHONPATH")])), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HF_HUB_OFFLINE="1")
    script = textwrap.dedent(PRELUDE.format(pp=pp, victim=victim)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)


def survived(r: subprocess.CompletedProcess) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"driver exited {r.returncode}:\n{out[-4000:]}"
    assert "Check failed" not in out and "SIGSEGV" not in out, out[-4000:]
    assert r.stdout.rstrip().endswith("SURVIVED"), out[-4000:]
    return r.stdout


@pytest.mark.slow
def test_the_probe_names_a_stage_killed_while_the_graph_is_idle_and_the_driver_survives():
    out = survived(child(SERVER.format(), pp=3, victim=1))
    assert "describe: ray (3 actors, gloo, compiled graph)" in out, out
    assert f"auto: {len(os.sched_getaffinity(0)) >= 4}" in out, out  # 3 stages and the driver
    assert "ping: WorkerFailed: stage 1 tp rank 0 is dead: ActorDiedError" in out, out


@pytest.mark.slow
def test_the_next_micro_batch_names_a_stage_killed_while_the_graph_is_idle():
    out = survived(child(ENGINE.format(), pp=2, victim=1))
    assert "generate: ExecutorFailed" in out and "stage 1 tp rank 0" in out, out
