"""Chunk pipelining on real Ray pipelines (issue 11): a prompt's next prefill chunk enters
the pipeline while its previous one is still in flight, and the tokens stay exactly those
of Hugging Face `transformers` on the same checkpoint, at PP=2 and PP=3."""
import os

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray port on 127.0.0.1

from conftest import hf_model  # noqa: E402
from test_hf_reference import hf_greedy  # noqa: E402

from pp_runtime import LLM, SamplingParams  # noqa: E402

PROMPT_LENS = (41, 23, 60, 9, 33)  # 2 to 8 chunks of 8 tokens
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    model = hf_model("gpt")  # 3 layers: PP=3 puts one on each stage
    path = tmp_path_factory.mktemp("gpt-pipelined")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the file, started as a pipeline starts its own (`start_ray`); both
    pipelines join it instead of starting and stopping a Ray each (the suite's time)."""
    from pp_runtime.executors.local_ray import shutdown_ray, start_ray

    start_ray(None, 4)
    yield
    shutdown_ray()


@pytest.mark.parametrize("pp, planner", [(2, "uniform"), (3, "gllm")])  # every planner,
# pipelined or not, gives the same tokens at PP=2 in one process: tests/engine/test_planners_e2e.py
@pytest.mark.slow
def test_pipelined_chunks_on_ray_equal_transformers(gpt, local_ray, pp, planner):
    model, path = gpt
    prompts = [[(13 * i + 7 * j) % 299 + 1 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    llm = LLM.from_pretrained(path, planner=planner, chunk_size=8, max_batch_size=3,
                              tile_size=8, pp=pp, executor="ray", threads_per_worker=1)
    assert llm.config.planner.chunk_pipelining and llm.config.in_flight == pp + 1
    batches = []
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                            on_microbatch=lambda mb, _: batches.append(mb))
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), (planner, pp)
    # pipelined for real: some prompt's chunks sit in consecutive micro-batches, which the
    # strict rule forbids (its next chunk waits for the previous one to come back, pp + 1
    # micro-batches later)
    chunks = {}
    for mb in batches:
        for s in mb.seqs:
            if not s.is_decode:
                chunks.setdefault(s.request_id, []).append(mb.mb_id)
    assert any(b - a < pp + 1 for ids in chunks.values() for a, b in zip(ids, ids[1:]))
