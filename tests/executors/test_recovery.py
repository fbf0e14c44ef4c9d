"""Recovery in place on a real Ray PP = 3 pipeline (engine/recovery.py, RayExecutor.recover):
a stage worker killed with SIGKILL (first, middle, last stage) or hung past the step
timeout mid-generation is replaced, and every request ends with the tokens of a fault-free
run; streams go on with no token twice or missing; requests that arrive meanwhile are all
served; a stage whose weights fail to load every time spends the budget and ends every
request with an error."""
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402

from pp_runtime import LLM, SamplingParams  # noqa: E402
from pp_runtime.core.driver import ExecutorFailed  # noqa: E402
from pp_runtime.engine.online import Finished, Token  # noqa: E402

pytestmark = pytest.mark.slow  # Ray actors (pytest.ini)

PROMPTS = [[(7 * i + j) % 300 for j in range(n)] for i, n in enumerate((40, 5, 90, 17, 33, 64))]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SHAPE = dict(pp=3, chunk_size=32, tile_size=16, max_batch_size=4)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray for the file, started as a pipeline starts its own (`start_ray`: every
    port on 127.0.0.1, a killed actor's SIGKILL 1 s after its SIGTERM); each pipeline
    below joins it instead of starting and stopping a Ray of its own (the suite's time)."""
    from pp_runtime.executors.local_ray import shutdown_ray, start_ray

    start_ray(None, 8)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def reference():
    with LLM("tiny", executor="local", **SHAPE) as llm:
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert len(set(map(tuple, outs))) == len(outs)  # distinct: a mix-up would show
    return outs


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", executor="ray", threads_per_worker=1, compiled_graph=False,
             step_timeout_s=5.0, recovery_attempts=50, **SHAPE) as llm:
        yield llm


def kill(llm, stage: int) -> None:
    """SIGKILL the stage's worker process (what a crash or the OOM killer does)."""
    os.kill(ray.get(llm.executor.actors[stage].pid.remote(), timeout=30), signal.SIGKILL)


def after(n: int, fault):
    """An on_microbatch callback that runs `fault()` once, after the n-th micro-batch."""
    seen = []

    def callback(mb, out):
        seen.append(mb.mb_id)
        if len(seen) == n:
            fault()
    return callback


def test_weights_that_fail_to_load_every_time_spend_the_budget_and_end_every_request(tmp_path):
    """First in the file: its pipeline starts before the module's holds Ray's CPUs."""
    from conftest import hf_model

    hf_model("gpt").save_pretrained(tmp_path)
    llm = LLM.from_pretrained(tmp_path, executor="ray", threads_per_worker=1, pp=2,
                              compiled_graph=False, recovery_attempts=2, recovery_window_s=600.0)
    try:
        def break_weights_and_kill():
            for f in Path(tmp_path).glob("*.safetensors"):
                f.write_bytes(b"not a checkpoint")
            kill(llm, 1)

        with pytest.raises(ExecutorFailed, match="not recovered: 2 recovery attempts") as err:
            llm.generate([[1 + i] * 12 for i in range(3)], SamplingParams(max_tokens=30, ignore_eos=True),
                         on_microbatch=after(3, break_weights_and_kill))
        outs = err.value.outputs
        assert all(o.finish_reason == "error" and o.error for o in outs), outs
        assert "not recovered" in outs[0].error
    finally:
        llm.shutdown()


def test_a_killed_stage_under_the_compiled_graph_is_replaced(reference):
    """The compiled graph (torn down broken, compiled again on the new actors); before the
    module's pipeline holds Ray's CPUs."""
    with LLM("tiny", executor="ray", threads_per_worker=1, compiled_graph=True,
             step_timeout_s=5.0, recovery_attempts=5, **SHAPE) as g:
        assert g.executor.path == "graph"
        got = g.generate(PROMPTS, GREEDY, on_microbatch=after(4, lambda: kill(g, 1)))
        assert [o.token_ids for o in got] == reference
        r = g.engine.recoveries
        assert len(r) == 1 and r[0].stage == 1 and r[0].attempts == 1, r
        assert g.executor.path == "graph" and g.executor.transport.dag is not None


@pytest.mark.parametrize("stage", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_killed_stage_is_replaced_and_every_output_equals_a_fault_free_run(llm, reference, stage):
    before = len(llm.engine.recoveries)
    old = list(llm.executor.actors)
    got = llm.generate(PROMPTS, GREEDY, on_microbatch=after(4, lambda: kill(llm, stage)))
    assert [o.token_ids for o in got] == reference
    assert all(o.finish_reason == "length" for o in got)
    r = llm.engine.recoveries[before:]
    assert len(r) == 1 and r[0].stage == stage and r[0].attempts == 1, r
    assert r[0].requests == len(PROMPTS) and r[0].tokens > 0
    assert not set(llm.executor.actors) & set(old)  # every worker replaced


def _stop(llm, stage: int):
    """SIGSTOP the stage's process (a real hang: it answers nothing, not even a probe)."""
    pid = ray.get(llm.executor.actors[stage].pid.remote(), timeout=30)
    return lambda: os.kill(pid, signal.SIGSTOP)


def test_the_diagnosis_names_a_stopped_rank_where_another_result_is_late(llm):
    """Stage 0 stopped after it returned a micro-batch whose activations stage 1 has not
    taken (a send in flight): stage 1's result is the late one, but stage 0 is the hang."""
    pid = ray.get(llm.executor.actors[0].pid.remote(), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert llm.executor.ranks.behind(1, [1, 2]) == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert llm.executor.ranks.behind(1, [1, 2]) == 1  # all answer, none ahead: the late one


@pytest.mark.parametrize("how,stage", [("stall", 1), ("SIGSTOP", 0)])
def test_a_hung_stage_is_named_killed_after_the_step_timeout_and_replaced(llm, reference, how,
                                                                          stage):
    """A stall (its next micro-batch sleeps) or a stopped process (killed from Ray while
    stopped)."""
    before = len(llm.engine.recoveries)
    if how == "stall":
        fault = lambda: llm.executor.actors[stage].sleep.remote(600)  # noqa: E731
    else:
        fault = _stop(llm, stage)
    t0 = time.monotonic()
    got = llm.generate(PROMPTS, GREEDY, on_microbatch=after(3, fault))
    assert [o.token_ids for o in got] == reference
    r = llm.engine.recoveries[before:]
    assert len(r) == 1 and r[0].stage == stage and "did not finish" in r[0].cause, r
    assert time.monotonic() - t0 < 120  # not the 600 s stall


def test_a_stream_across_a_recovery_gets_every_token_once_and_arrivals_meanwhile_are_served(
        llm, reference):
    """One request streamed through the engine while the others arrive over 4 s, during
    the replacement: the stream's tokens are the fault-free ones, each once, in order."""
    events, before = [], len(llm.engine.recoveries)
    got = {}

    def listener(event):
        events.append(event)

    engine = llm.engine
    watcher = engine.watch(after(2, lambda: kill(llm, 0)))
    try:
        t0 = engine.now()
        handles = [engine.add_request(p, GREEDY, seed=0, watcher=watcher, arrival_s=t0 + at,
                                      listener=listener if i == 2 else None)
                   for i, (p, at) in enumerate(zip(PROMPTS, [0.0, 0.0, 0.0, 2.0, 3.0, 4.0]))]
        got = [h.result(120).output.token_ids for h in handles]
    finally:
        engine.unwatch(watcher)
    assert got == reference
    assert len(engine.recoveries) == before + 1
    tokens = [e.token_id for e in events if isinstance(e, Token)]
    assert tokens == reference[2] and isinstance(events[-1], Finished)
