"""Scheduling must not change results: every policy gives the same greedy tokens, on a
real model with two pipeline stages; and an executor failure ends requests with `error`."""
import pytest

from pp_runtime import LLM, SamplingParams
from pp_runtime.core.driver import ExecutorFailed
from pp_runtime.planner import PLANNERS

PROMPTS = [[(7 * i + j) % 512 for j in range(n)] for i, n in enumerate((40, 5, 90, 17, 33, 64))]


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny", planner="sarathi", chunk_size=16, max_batch_size=3, tile_size=16)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))]


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_gives_the_same_greedy_tokens(name, reference):
    llm = LLM("tiny", planner=name, chunk_size=16, max_batch_size=3, tile_size=16, pp=2,
              executor="local")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)


def test_from_pretrained_takes_the_planner(hf_checkpoint):
    _, _, path = hf_checkpoint
    llm = LLM.from_pretrained(path, planner="orca-best", max_batch_size=2)
    assert type(llm.config.planner.planner) is str and llm.config.planner.planner == "orca-best"
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_executor_failure_ends_every_unfinished_request_with_error():
    llm = LLM("tiny", chunk_size=16, max_batch_size=2, tile_size=16)
    worker = llm.executor.workers[-1]
    calls = {"n": 0}
    real = worker.execute

    def failing(mb, *args, **kwargs):  # the stage dies on its 4th micro-batch
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("stage 0 rank 0 died")
        return real(mb, *args, **kwargs)

    worker.execute = failing
    with pytest.raises(ExecutorFailed, match="stage 0 rank 0 died") as err:
        llm.generate([[1] * 10, [2] * 40, [3] * 5], SamplingParams(max_tokens=8))
    outs = err.value.outputs
    assert len(outs) == 3 and all(o.finish_reason == "error" for o in outs)
    assert all("stage 0 rank 0 died" in o.error for o in outs)
    assert llm.executor is None  # torn down: a failed executor is never reused
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
