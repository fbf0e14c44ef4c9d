"""A request resumed with the tokens it already produced (`generated`: a journal replayed
after a restart, `Request.resume`) ends with the output of an uninterrupted run: the
known tokens are computed with the prompt, and sampling goes on after them."""
import pytest

from pp_runtime import LLM, SamplingParams
from pp_runtime.core.request import InvalidRequestError

PROMPTS = [[(5 * i + j) % 300 for j in range(n)] for i, n in enumerate((30, 7, 50))]
TINY = dict(chunk_size=16, max_batch_size=4, tile_size=16, pp=2, executor="local")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_resumed_request_ends_as_an_uninterrupted_one(temperature):
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=temperature, seed=3)
    with LLM("tiny", **TINY) as llm:
        whole = [o.token_ids for o in llm.generate(PROMPTS, params)]
        resumed = llm.generate(PROMPTS, params, generated={0: whole[0][:3], 2: whole[2][:7]})
    assert [o.token_ids for o in resumed] == whole
    assert len(set(map(tuple, whole))) == 3  # the prompts' outputs differ: a mix-up shows


def test_nothing_left_to_generate_is_refused_before_anything_runs():
    with LLM("tiny", **TINY) as llm:
        with pytest.raises(InvalidRequestError, match="nothing is left of max_tokens 2"):
            llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), generated=[4, 5])
