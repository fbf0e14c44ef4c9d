"""What lets the simulator hold 100K requests: prompts as `RepeatedTokens` (O(1) memory)
plan exactly as lists do; requests compare by identity (a finished request leaves the
running list without a field-by-field comparison of every request before it)."""
import pytest

from pp_runtime.core.batch import SampledTokens
from pp_runtime.config import Config
from pp_runtime.planner import make_planner
from pp_runtime.core.request import RepeatedTokens, Request, SamplingParams


def test_repeated_tokens_acts_like_the_list():
    r, ref = RepeatedTokens(0, 5), [0] * 5
    assert len(r) == 5 and list(r) == ref and r == ref and ref == r and r == tuple(ref)
    assert r[1:3] == (0, 0) and r[3:99] == (0, 0) and r[::2] == (0, 0, 0) and r[-1] == 0
    assert r != [0] * 4 and r != [0, 0, 0, 0, 1] and r != RepeatedTokens(1, 5)
    with pytest.raises(IndexError):
        r[5]
    req = Request(0, r, SamplingParams(max_tokens=2), seed=0)
    assert req.prompt_len == 5 and req.token_at(4) == 0


def test_a_repeated_prompt_plans_the_same_as_a_list():
    def plan(prompt):
        p = make_planner(Config().with_overrides(planner="sarathi", chunk_size=16, tile_size=16, max_batch_size=3))
        for rid in range(4):
            p.add(Request(rid, prompt(20 + rid), SamplingParams(max_tokens=3, ignore_eos=True), seed=0))
        mbs = []
        while (mb := p.schedule(0.0)) is not None:
            mbs.append(mb)
            p.on_result(mb, SampledTokens(mb.mb_id, {s.request_id: 0 for s in mb.seqs if s.sampling}), 0.0)
        return mbs
    assert plan(lambda n: [0] * n) == plan(lambda n: RepeatedTokens(0, n))


def test_requests_compare_by_identity():
    a = Request(1, [1, 2], SamplingParams(), seed=0)
    b = Request(1, [1, 2], SamplingParams(), seed=0)
    assert a == a and a != b and [a, b].index(b) == 1
