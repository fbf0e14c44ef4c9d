"""The distributed runtime on CPU: Ray actors per (stage, TP rank), gloo, 127.0.0.1 only.

Greedy generation on TP2 x PP2 and PP2 must equal single-process generation token for
token, with chunked prefills and piggybacked decodes in the micro-batches, after every
stage pair and TP group warmed its communicators up, each plan sent by value (no `ray.put`);
a killed or hung actor must end the run with an error naming it, within a bounded time;
the device is decided once on the driver, and `device: cuda:N` is refused; every actor and
its calls carry their stage and TP rank in the dashboard's state API."""
import os
import socket
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray port on 127.0.0.1

import pytest  # noqa: E402

ray = pytest.importorskip("ray")

from pp_runtime import LLM, SamplingParams  # noqa: E402
from pp_runtime.core.batch import MicroBatch  # noqa: E402
from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.core.driver import ExecutorFailed  # noqa: E402
from pp_runtime.core.errors import ConfigError, WorkerFailed  # noqa: E402
from pp_runtime.executors.ray_executor import ray_device  # noqa: E402
from pp_runtime.engine.llm import run_requests, run_workload  # noqa: E402
from pp_runtime.telemetry.report import build_report  # noqa: E402
from pp_runtime.core.net import free_port  # noqa: E402

PLAN = dict(chunk_size=16, max_batch_size=4, tile_size=16, threads_per_worker=1)
PROMPTS = [[(7 * i + 3 * j) % 290 + 1 for j in range(n)] for i, n in enumerate((37, 9, 52, 20, 3))]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # the dashboard serves the state API (`ray list actors`, `list_tasks`); 127.0.0.1 only
    ctx = ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
                   dashboard_port=free_port(), _node_ip_address="127.0.0.1", log_to_driver=False)
    yield f"http://{ctx.dashboard_url}"
    ray.shutdown()


def generate(path, results=None, **overrides):
    """(token ids per prompt, the micro-batches, the executor); each micro-batch's
    SampledTokens appended to `results` if given."""
    seen, results = [], [] if results is None else results
    with LLM.from_pretrained(path, **PLAN, **overrides) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True),
                            on_microbatch=lambda mb, out: (seen.append(mb), results.append(out)))
        executor = llm.executor
    return [o.token_ids for o in outs], seen, executor


# every path on gpt; llama (grouped-query KV heads split across the TP ranks) on the default
# one, TP2 x PP2 on the graph: the transports (tasks, relay) and the pipeline depth do not
# depend on the family, and each case is a Ray pipeline started (the suite's time)
@pytest.mark.parametrize("hf_checkpoint, tp, pp, graph, relay", [
    ("gpt", 2, 2, True, False), ("gpt", 1, 2, True, False), ("gpt", 1, 3, True, False),
    ("gpt", 2, 2, False, False), ("gpt", 2, 2, False, True), ("llama", 2, 2, True, False)],
    ids=["gpt-tp2-pp2-graph", "gpt-tp1-pp2-graph", "gpt-tp1-pp3-graph", "gpt-tp2-pp2-tasks",
         "gpt-tp2-pp2-relay", "llama-tp2-pp2-graph"], indirect=["hf_checkpoint"])
def test_distributed_greedy_equals_single_process(hf_checkpoint, tp, pp, graph, relay,
                                                  monkeypatch):
    from ray.dag.compiled_dag_node import CompiledDAG

    family, _, path = hf_checkpoint
    reference, _, ex = generate(path, executor="local", pp=1)
    assert ex.name == "local"
    from pp_runtime.executors.ray_ranks import Ranks

    put, stored, puts = ray.put, [], []
    monkeypatch.setattr(ray, "put", lambda obj, **kw: (stored.append(obj), put(obj, **kw))[1])
    execute = CompiledDAG.execute  # the compiled graph: one execute per micro-batch, for all ranks
    monkeypatch.setattr(CompiledDAG, "execute", lambda dag, mb: (puts.append(mb), execute(dag, mb))[1])
    call, calls = Ranks.call, []  # tasks: one execute(mb) per stage, the plan by value
    monkeypatch.setattr(Ranks, "call", lambda ranks, i, method, *args: (
        calls.append((i, method)), method == "execute" and puts.append(args[0]),
        call(ranks, i, method, *args))[2])
    results = []
    tokens, mbs, ex = generate(path, results, tp=tp, pp=pp, compiled_graph=graph,
                               tp_relay=relay)
    assert ex.name == "ray" and ex.device in ("cpu", "cuda")  # set once the actors are up
    assert tokens == reference
    # every rank's timing of that micro-batch, in rank order (the relay brings TP peers')
    assert [[(t.mb_id, t.stage, t.tp_rank) for t in out.timings] for out in results] == [
        [(mb.mb_id, r // tp, r % tp) for r in range(tp * pp)] for mb in mbs]
    # the plans really mixed chunked prefills and piggybacked decodes
    assert any(mb.num_decodes and mb.num_prefill_tokens for mb in mbs)
    assert any(s.start > 0 and not s.is_decode for mb in mbs for s in mb.seqs)
    # each micro-batch went to Ray as one graph execution for all tp * pp actors, or by value
    # in one task per actor, or (relay) one per stage, to its TP rank 0, which relays it to
    # its TP peers (inlined: never through the object store)
    per = 1 if graph else pp if relay else tp * pp
    assert [mb.mb_id for mb in puts if isinstance(mb, MicroBatch)] == [
        mb.mb_id for mb in mbs for _ in range(per)]
    assert not [obj for obj in stored if isinstance(obj, MicroBatch)]
    execs = [i for i, method in calls if method == "execute"]
    follows = sorted(i for i, method in calls if method == "follow")
    if relay:  # pp task calls per micro-batch, not tp * pp; one follow per other TP rank
        assert execs == [s * tp for _ in mbs for s in range(pp)]
        assert follows == [i for i in range(tp * pp) if i % tp]
    elif not graph:
        assert execs == [i for _ in mbs for i in range(tp * pp)] and follows == []
    # before the first micro-batch: one all-reduce per TP group, one exchange per stage pair
    assert ex.warm_ups == [
        [f"all_reduce tp={tp}"] + ([f"recv from {r - tp}"] if r >= tp else [])
        + ([f"send to {r + tp}"] if r < (pp - 1) * tp else []) for r in range(tp * pp)]


@pytest.mark.parametrize("hf_checkpoint", ["llama"], indirect=True)
def test_tp2_pp2_greedy_survives_preemption(hf_checkpoint):
    """TP2 x PP2 with a pool of one context (16 blocks of 4) for five requests: they are
    preempted and recomputed, every stage reads the planner's block tables, and the tokens
    are the single-process run's. On llama (its KV heads split across the TP ranks); the
    block tables do not depend on the family.

    The preemption is certain, whatever the timing: the first two prompts (24 tokens, 6
    blocks each) are admitted together (6 + 0.3 x 3 blocks of growth each fit in 16) and
    end at 24 + 11 positions, 9 blocks each, 18 > 16; the one ahead needs its 9th block
    while the other, at most a round behind, still runs."""
    family, _, path = hf_checkpoint
    prompts = [[(5 * i + 11 * j) % 290 + 1 for j in range(24)] for i in range(2)] + PROMPTS[1:]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM.from_pretrained(path, **PLAN, executor="local", pp=1) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM.from_pretrained(path, **PLAN, tp=2, pp=2, max_seq_len=64, block_size=4,
                             num_blocks=16) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.num_preemptions for o in outs) >= 1


@pytest.mark.parametrize("hf_checkpoint", ["gpt", "llama"], indirect=True)
def test_an_uneven_layer_split_is_token_exact_against_transformers(hf_checkpoint):
    """parallel.layer_split on Ray PP=2, 3 layers cut 0.5 + 2.5 (uneven, and inside a layer:
    stage 0 holds layer 0's attention half, stage 1 its MLP half and layers 1-2): each actor
    built, loaded from the checkpoint and cached exactly its halves (KV: one layer per
    attention half), the report's split is the one that ran, and greedy generation equals
    transformers' token for token."""
    import torch

    family, model, path = hf_checkpoint
    split = [0.5, 2.5]
    with LLM.from_pretrained(path, **PLAN, pp=2, layer_split=split) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
        held = ray.get([actor.__ray_call__.remote(
            lambda a: (a.worker.lo, a.worker.hi, len(a.worker.model.layers), len(a.worker.cache.k),
                       hasattr(a.worker.model.layers[0], "fc1")))
            for actor in llm.executor.actors])
        assert llm.executor.layer_split == split
    assert held == [(0, 1, 1, 1, False), (0, 3, 3, 2, True)]
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def tiny(**overrides):
    return load_config("tiny", pp=2, executor="ray", threads_per_worker=1, **overrides)


def test_real_and_simulated_runs_split_every_stage_by_cause():
    """The same tiny workload on the real Ray pipeline and on the simulator: both reports
    carry every cause on every stage, the parts add up to each stage's wall time, and both
    see the same kinds of stall: stage 1 waits for stage 0 (upstream, the fill at least),
    stage 0 waits for sampled tokens (dependency: decodes need the last stage's token)."""
    from pp_runtime.engine.simulate import simulate

    # pp micro-batches in flight, not the default pp + 1 (which hides stage 0's wait)
    cfg = tiny(**{"workload.kind": "fixed", "workload.num_requests": 6, "prompt_len": 40,
                  "output_len": 5, "in_flight": 2})
    t0 = time.perf_counter()
    run = run_workload(cfg)
    wall = time.perf_counter() - t0
    reports = {"real": build_report(run), "sim": build_report(simulate(cfg, progress=False))}
    assert reports["real"]["summary"]["executor"] == "ray"
    assert reports["real"]["summary"]["deployment"]["gpu"] == "cpu"  # resolved, not "auto"
    for kind, report in reports.items():
        s = report["summary"]
        assert s["finish_reasons"] == {"length": 6}, kind
        assert all(r["num_microbatches"] > 0 for r in report["requests"])
        assert [st["stage"] for st in s["per_stage"]] == [0, 1]
        assert set(s["bubble_fraction_by_cause"]) == {"upstream", "downstream", "dependency"}
        for st in s["per_stage"]:  # busy + transfer + bubble by cause + idle = wall time
            causes = st["bubble_by_cause_s"]
            assert set(causes) == {"upstream", "downstream", "dependency"}
            assert st["busy_s"] + st["transfer_s"] + sum(causes.values()) + st["idle_s"] == \
                pytest.approx(st["wall_s"])
        s0, s1 = s["per_stage"]
        assert s1["bubble_by_cause_s"]["upstream"] > 0, kind
        assert s0["bubble_by_cause_s"]["dependency"] > 0, kind
        assert s0["bubble_by_cause_s"]["upstream"] == 0  # stage 0 has no previous stage
        assert s1["bubble_by_cause_s"]["downstream"] == 0  # the last stage sends nothing
    assert all(0 < st["wall_s"] <= wall for st in reports["real"]["summary"]["per_stage"])


def test_every_stage_actor_and_call_is_named_in_the_state_api(local_ray):
    """What the dashboard's Actors and Tasks views show: two LLMs on one Ray, each actor
    named by deployment, executor id, stage and TP rank (no clash), described by its repr
    (stage, TP rank, layers, node), its calls named by stage; gone after shutdown."""
    from ray.util.state import list_actors, list_tasks

    llms = [LLM(tiny()) for _ in range(2)]  # tiny-gpt: 4 layers
    for llm in llms:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    names = [llm.executor.actor_names for llm in llms]
    for ns in names:
        assert [n.rsplit("-", 2)[1:] for n in ns] == [["s0", "tp0"], ["s1", "tp0"]]
        assert ns[0].startswith("pp-tiny-gpt-tp1xpp2-")
    assert not set(names[0]) & set(names[1])  # each executor has its own id
    # the state API lists actors and task events late on a loaded machine (30 s was too
    # short once at load ~5): a poll that ends as soon as they are there
    deadline, want = time.monotonic() + 120, set(names[0] + names[1])
    api = dict(address=local_ray)  # this Ray's dashboard, not a head another run left behind
    while True:  # task events reach the state API within about a second
        alive = list_actors(filters=[("state", "=", "ALIVE")], detail=True, **api)
        actors = {a.name: a for a in alive}
        tasks = {t.name for t in list_tasks(filters=[("func_or_class_name", "=",
                                                      "StageActor.execute")], **api)}
        if want <= set(actors) and {"stage0-tp0.execute", "stage1-tp0.execute"} <= tasks:
            break
        assert time.monotonic() < deadline, (sorted(actors), sorted(tasks))
        time.sleep(0.5)
    for ns in names:
        assert [(actors[n].class_name, actors[n].ray_namespace, actors[n].repr_name)
                for n in ns] == [
            ("StageActor", "pp_runtime", "stage=0 tp_rank=0 layers [0, 2) node 127.0.0.1"),
            ("StageActor", "pp_runtime", "stage=1 tp_rank=0 layers [2, 4) node 127.0.0.1")]
    for llm in llms:
        llm.shutdown()
    for n in want:  # a named actor does not outlive its executor
        with pytest.raises(ValueError):
            ray.get_actor(n, namespace="pp_runtime")


def _run_with_fault(inject, **overrides):
    """With recovery off (tests/executors/test_recovery.py: with it on), through the
    partial-result rule (`run_requests`): the failed run's result, every request ended."""
    llm = LLM(tiny(recovery_attempts=0, **overrides))
    actors = list(llm.executor.actors)
    prompts = [[1 + i] * 30 for i in range(4)]
    calls = []

    def on_microbatch(mb, out):
        calls.append(mb.mb_id)
        if len(calls) == 3:
            inject(actors)

    t0 = time.perf_counter()
    run = run_requests(llm, prompts, SamplingParams(max_tokens=40, ignore_eos=True),
                       on_microbatch=on_microbatch)
    elapsed = time.perf_counter() - t0
    assert isinstance(run.failure, ExecutorFailed) and run.interrupted_by == "worker failure"
    assert llm.executor is None  # torn down
    llm.shutdown()
    outs = run.requests
    assert len(outs) == 4 and all(o.finish_reason is not None for o in outs)
    assert any(o.finish_reason == "error" and o.error for o in outs)
    return str(run.failure), elapsed, actors


@pytest.mark.parametrize("graph", [False, True], ids=["tasks", "graph"])
def test_a_killed_actor_ends_the_run_with_an_error_naming_it(graph):
    msg, elapsed, actors = _run_with_fault(lambda actors: ray.kill(actors[1]), compiled_graph=graph)
    assert "stage 1 tp rank 0 failed during micro-batch" in msg, msg
    assert "ActorDied" in msg or "RayActorError" in msg, msg
    assert elapsed < 60
    time.sleep(1)
    with pytest.raises(ray.exceptions.RayActorError):  # the other actor was killed too
        ray.get(actors[0].sleep.remote(0), timeout=30)


def test_a_hung_rank_ends_the_run_after_the_step_timeout():
    """Under the compiled graph (the tasks path: tests/executors/test_recovery.py, where
    the hung rank is named the same way and replaced)."""
    msg, elapsed, _ = _run_with_fault(lambda actors: actors[1].sleep.remote(120), step_timeout_s=4.0,
                                      compiled_graph=True)
    assert "stage 1 tp rank 0 did not finish micro-batch" in msg, msg
    assert elapsed < 60


def _injected(fault, at: list):
    """`fault(actors)`, its time noted in `at`."""
    return lambda actors: (at.append(time.perf_counter()), fault(actors))


@pytest.mark.slow
def test_a_killed_follower_ends_the_run_with_an_error_naming_it_at_once():
    """TP2 x PP2 on the relay: stage 1's TP rank 1 (which only follows its TP rank 0) is
    killed; its follow call fails and the error names it within seconds, not after the
    step timeout."""
    at = []
    msg, _, actors = _run_with_fault(_injected(lambda actors: ray.kill(actors[3]), at), tp=2,
                                     tp_relay=True, step_timeout_s=120.0)
    since = time.perf_counter() - at[0]
    assert "stage 1 tp rank 1 failed during micro-batch" in msg, msg
    assert "ActorDied" in msg or "RayActorError" in msg, msg
    assert since < 20, since
    time.sleep(1)
    for actor in actors[:3]:  # the others were killed too
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)


@pytest.mark.slow
def test_a_hung_follower_ends_the_run_after_the_step_timeout_naming_it():
    """TP2 x PP2 on the relay: stage 1's TP rank 1 stalls; its TP rank 0 waits for it in
    their collectives, and after the step timeout the error names the follower."""
    at = []
    msg, _, _ = _run_with_fault(_injected(lambda actors: actors[3].sleep.remote(120), at),
                                tp=2, tp_relay=True, step_timeout_s=4.0)
    since = time.perf_counter() - at[0]
    assert "stage 1 tp rank 1 did not finish micro-batch" in msg, msg
    assert since < 30, since


@pytest.mark.slow
def test_the_liveness_probe_reaches_busy_followers_and_names_a_dead_one():
    """TP2 x PP2 on the relay, idle: every follower answers a ping while its follow loop
    holds its thread; one killed is named by the probe, and shutdown kills the rest."""
    llm = LLM(tiny(tp=2, tp_relay=True))
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        ex, actors = llm.executor, list(llm.executor.actors)
        assert len(ex.transport.follows) == 2 and ex.ping(10)
        ray.kill(actors[1])  # asynchronous: a probe may find it busy (False) before dead
        with pytest.raises(WorkerFailed, match="stage 0 tp rank 1 is dead"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                ex.ping(10)
        t0 = time.perf_counter()
        llm.shutdown()
        assert time.perf_counter() - t0 < 10
    finally:
        llm.shutdown()  # a failure here leaves no actor holding the next test's CPUs
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)


def test_the_device_is_decided_once_on_the_driver():
    """What every actor is given (the actors themselves never look at runtime.device)."""
    four_gpus, none = {"CPU": 8, "GPU": 4}, {"CPU": 8}
    assert ray_device(tiny(device="auto", tp=2), four_gpus) == "cuda"  # a GPU per worker
    assert ray_device(tiny(device="auto", tp=4), four_gpus) == "cpu"  # 8 workers, 4 GPUs
    assert ray_device(tiny(device="auto"), none) == "cpu"
    assert ray_device(tiny(device="cuda", tp=2), four_gpus) == "cuda"
    with pytest.raises(ConfigError, match=r"runtime.device: cuda needs a GPU per worker \(2\), "
                                          r"but the Ray cluster has 0"):
        ray_device(tiny(device="cuda"), none)  # a clear error, not a placement time-out
    assert ray_device(tiny(device="cpu"), four_gpus) == "cpu"


def test_a_numbered_cuda_device_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"runtime.device: 'cuda:1' .*each Ray actor sees its "
                                          r"GPU as cuda:0; use device: cuda or auto"):
        LLM(tiny(device="cuda:1"))


def test_a_failed_rendezvous_names_the_rank():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(WorkerFailed, match="stage 0 tp rank 0 failed during joining"):
            LLM(tiny(dist_port=taken.getsockname()[1], startup_timeout_s=60.0))
