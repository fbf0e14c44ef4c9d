"""The token hop (runtime.token_hop, docs/distributed.md "Tokens skip the driver"): the last
stage sends sampled ids straight to stage 0 and the driver plans decodes ahead with
placeholders. Greedy outputs equal transformers' at PP = 2 and 3 (the local executor
filling placeholders itself, and Ray's task path over gloo, where it is on by default),
seeded sampling equals the path without it, a request stopped by EOS with a decode
planned ahead ends as without it (the wasted slot dropped, its blocks back), and a stage
SIGKILLed while tokens are in transit ends every request, recovered or with an error."""
import os
import signal

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray port on 127.0.0.1

import pytest  # noqa: E402

from pp_runtime import LLM, SamplingParams  # noqa: E402
from pp_runtime.core.driver import ExecutorFailed  # noqa: E402

from test_hf_reference import hf_greedy, make_prompts  # noqa: E402

NEW = 12
PLAN = dict(chunk_size=8, max_batch_size=3, threads_per_worker=1)
# Ray's two ways to reach the stages: a task per actor, one compiled graph (auto on a GPU)
PATHS = {"tasks": dict(compiled_graph=False), "graph": dict(compiled_graph=True)}


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    from conftest import hf_model

    model = hf_model("gpt")
    path = tmp_path_factory.mktemp("ckpt-gpt-hop")
    model.save_pretrained(path)
    prompts = make_prompts(model.config.vocab_size)
    return model, path, prompts, [hf_greedy(model, p, NEW) for p in prompts]


def generate(path, prompts, params, **overrides):
    """(outputs, micro-batches in submission order, the LLM's executor and planner)."""
    mbs = []
    with LLM.from_pretrained(path, **PLAN, **overrides) as llm:
        outs = llm.generate(prompts, params, on_microbatch=lambda mb, _: mbs.append(mb))
        hop, planner = llm.executor.token_hop, llm.engine._planner
        free = planner.kv.pool.num_free == planner.kv.pool.num_blocks
    return outs, sorted(mbs, key=lambda mb: mb.mb_id), hop, free


@pytest.mark.parametrize("pp", [2, 3])
def test_local_token_hop_equals_transformers(gpt, pp):
    _, path, prompts, reference = gpt
    outs, mbs, hop, free = generate(path, prompts, SamplingParams(max_tokens=NEW, ignore_eos=True),
                                    pp=pp, executor="local", token_hop=True)
    assert hop and any(mb.placeholders for mb in mbs)  # decodes were planned ahead
    assert [o.token_ids for o in outs] == reference
    assert free


ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    # 8 logical CPUs: the module's PP = 2 pipeline (2) beside a TP2 x PP2 one (4)
    ray.init(address="local", num_cpus=8, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_pp2(gpt, local_ray):
    """One PP = 2 pipeline on Ray's task path, the token hop on by default (auto), for the
    tests below that run that deployment (one pipeline started instead of two)."""
    _, path, _, _ = gpt
    with LLM.from_pretrained(path, **PLAN, pp=2, executor="ray", compiled_graph=False) as llm:
        yield llm


def generate_on(llm, prompts, params):
    """`generate`'s answer, on a running LLM."""
    mbs = []
    outs = llm.generate(prompts, params, on_microbatch=lambda mb, _: mbs.append(mb))
    pool = llm.engine._planner.kv.pool
    return outs, sorted(mbs, key=lambda mb: mb.mb_id), llm.executor.token_hop, \
        pool.num_free == pool.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("via", PATHS)
@pytest.mark.parametrize("pp", [2, 3])
def test_ray_token_hop_equals_transformers(gpt, local_ray, pp, via, request):
    """On by default on Ray's task path and the compiled graph (token_hop: auto); the
    placeholders' ids came from the last stage, never from the driver."""
    _, path, prompts, reference = gpt
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    if pp == 2 and via == "tasks":
        outs, mbs, hop, free = generate_on(request.getfixturevalue("ray_pp2"), prompts, params)
    else:
        outs, mbs, hop, free = generate(path, prompts, params, pp=pp, executor="ray",
                                        **PATHS[via])
    assert hop and sum(len(mb.placeholders) for mb in mbs) > len(prompts)
    assert [o.token_ids for o in outs] == reference
    assert free


@pytest.mark.slow
@pytest.mark.parametrize("via", ["tasks", "relay", "graph"])
def test_ray_token_hop_at_tp2_equals_transformers(gpt, local_ray, via):
    """token_hop: true at TP = 2 (auto leaves it off there): each stage-0 TP rank receives
    its own copy of the ids."""
    _, path, prompts, reference = gpt
    outs, mbs, hop, free = generate(path, prompts, SamplingParams(max_tokens=NEW, ignore_eos=True),
                                    tp=2, pp=2, executor="ray", compiled_graph=via == "graph",
                                    tp_relay=via == "relay", token_hop=True)
    assert hop and any(mb.placeholders for mb in mbs)
    assert [o.token_ids for o in outs] == reference
    assert free


@pytest.mark.slow
def test_ray_stage_0_measures_its_wait_for_the_token_hop(gpt, ray_pp2):
    """Stage 0 times its wait for the hop's ids (`token_wait_s`), the last stage never
    does; a wait lies inside the gap before its call's compute, and the bubble rule counts
    it as the dependency on the token hop."""
    from pp_runtime.telemetry.bubbles import account

    _, _, prompts, _ = gpt
    got = []
    ray_pp2.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True),
                     on_microbatch=lambda mb, out: got.append((mb, out.timings)))
    timings = [t for _, ts in got for t in ts]
    first = sorted((t for t in timings if t.stage == 0), key=lambda t: t.compute_start_s)
    assert all(t.token_wait_s == 0 for t in timings if t.stage == 1)
    ahead = {mb.mb_id for mb, _ in got if mb.placeholders}
    assert sum(t.token_wait_s for t in first if t.mb_id in ahead) > 0
    for prev, t in zip(first, first[1:]):
        assert 0 <= t.token_wait_s <= t.compute_start_s - prev.compute_end_s - prev.send_wait_s + 1e-4
    s0 = account(timings).per_stage[0]
    assert 0 < s0.token_s <= s0.dependency_s


@pytest.mark.slow
def test_ray_token_hop_seeded_sampling_equals_the_path_without_it(gpt, ray_pp2):
    _, path, prompts, _ = gpt
    params = SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    off, _, hop_off, _ = generate(path, prompts, params, pp=2, executor="ray",
                                  compiled_graph=False, token_hop=False)
    on, mbs, hop_on, _ = generate_on(ray_pp2, prompts, params)  # token_hop auto: on
    assert not hop_off and hop_on and any(mb.placeholders for mb in mbs)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


@pytest.mark.slow
@pytest.mark.parametrize("via", PATHS)
def test_ray_eos_with_a_decode_planned_ahead(gpt, local_ray, via):
    """EOS is set to the 4th greedy token of prompt 0: every request stops at its first
    EOS, as transformers' tokens say; prompt 0's decode planned before its EOS came back
    was computed and dropped (it is in a later micro-batch), and every block is back."""
    _, path, prompts, reference = gpt
    eos = reference[0][3]
    expected = [ref[:ref.index(eos) + 1] if eos in ref else ref for ref in reference]
    outs, mbs, hop, free = generate(path, prompts, SamplingParams(max_tokens=NEW), pp=2,
                                    executor="ray", eos_token_id=eos, **PATHS[via])
    assert hop
    assert [o.token_ids for o in outs] == expected
    assert outs[0].finish_reason == "eos"
    rows = [mb.mb_id for mb in mbs for s in mb.seqs if s.request_id == outs[0].request_id
            and s.sampling is not None]
    assert len(rows) == len(expected[0]) + 1  # one decode past EOS: wasted, not two
    assert free


@pytest.mark.slow
@pytest.mark.parametrize("via", PATHS)
@pytest.mark.parametrize("stage", [0, 1], ids=["first", "last"])
def test_ray_a_stage_killed_with_tokens_in_transit_ends_every_request(gpt, local_ray, stage,
                                                                      via):
    """SIGKILL at the first result of a decode planned ahead (more in flight): with no recovery every
    request ends with an error at once, none hangs; with recovery every output equals
    transformers'."""
    _, path, prompts, reference = gpt
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for attempts in (0, 3):
        with LLM.from_pretrained(path, **PLAN, pp=2, executor="ray", **PATHS[via],
                                 step_timeout_s=10.0, recovery_attempts=attempts) as llm:
            assert llm.executor.token_hop
            pid = ray.get(llm.executor.actors[stage].pid.remote(), timeout=30)
            seen = []

            def kill(mb, out):  # once, at the first result of a planned-ahead decode:
                if mb.placeholders and not seen:  # later ones are in flight behind it
                    seen.append(mb)
                    os.kill(pid, signal.SIGKILL)

            if attempts == 0:
                with pytest.raises(ExecutorFailed) as err:
                    llm.generate(prompts, params, on_microbatch=kill)
                assert all(o.finish_reason == "error" for o in err.value.outputs)
            else:
                outs = llm.generate(prompts, params, on_microbatch=kill)
                assert [o.token_ids for o in outs] == reference
                assert len(llm.engine.recoveries) == 1
