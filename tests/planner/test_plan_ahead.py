"""Planning ahead with placeholders (the token hop's planner side, planner/base.py), pure
Python: a scripted pipeline that fills each placeholder from the ids it sampled itself, as
stage 0 does from the last stage's messages. Every placeholder names a micro-batch still in
flight at least pp before, in which that request sampled; a request has at most one decode
planned ahead, never past max_tokens; a request that stops on EOS with a decode in flight
ends with the same tokens, that decode's result is dropped and its blocks come back; a
placeholder decode never preempts; the outputs equal planning without placeholders."""
from dataclasses import replace

import pytest

from pp_runtime.core.batch import PLACEHOLDER, SampledTokens, fill_placeholders
from pp_runtime.core.driver import run
from pp_runtime.core.request import Request, SamplingParams

from helpers import planner

EOS = 0  # the config's eos_token_id (`generate` sets it)


def next_token(rid: int, token: int, pos: int) -> int:
    """The scripted model: the next id from the input id and its position (never EOS)."""
    return (token * 7 + pos * 3 + rid) % 40 + 1


class Stage0Pipeline:
    """`depth` deep: `submit` fills placeholders (from its own samples, like stage 0) and
    samples at once; `wait` hands results back in order. It checks the placeholder rules
    against what is in flight at each submit."""

    name, device, path = "scripted", "none", ""

    def __init__(self, pp: int, eos_at: dict[int, int] | None = None, eos: int | None = None):
        self.pp, self.eos_at, self.eos = pp, eos_at or {}, eos  # eos_at: request -> output index
        self.sampled: dict[int, dict[int, int]] = {}  # mb id -> request -> id
        self.in_flight: list[int] = []
        self.position_out: dict[tuple[int, int], int] = {}  # (request, position) -> id
        self.placeholders = 0
        self.now = 0.0

    def submit(self, mb):
        for i, src in mb.placeholders:
            rid = mb.seqs[i].request_id
            assert src in self.in_flight, f"mb {mb.mb_id}: source {src} not in flight"
            assert mb.mb_id - src >= self.pp, f"mb {mb.mb_id}: source {src} under pp before"
            assert rid in self.sampled[src], f"request {rid} did not sample in mb {src}"
        self.placeholders += len(mb.placeholders)
        filled = fill_placeholders(mb, lambda src, rid: self.sampled[src][rid])
        assert all(PLACEHOLDER not in s.token_ids for s in filled.seqs)
        out = {}
        for s in filled.seqs:
            if s.sampling is None:
                continue
            pos = s.kv_len  # the position of the token sampled
            n = pos - len(self.prompts[s.request_id])  # its index in the output
            tok = self.eos if self.eos_at.get(s.request_id) == n else next_token(
                s.request_id, s.token_ids[-1], pos)
            out[s.request_id] = tok
        self.sampled[mb.mb_id] = out
        self.in_flight.append(mb.mb_id)
        return mb.mb_id

    def wait(self, mb_id):
        assert self.in_flight[0] == mb_id
        self.in_flight.pop(0)
        self.now += 1.0
        return SampledTokens(mb_id, self.sampled[mb_id])

    def clock(self):
        return self.now

    def describe(self):
        return "scripted"

    def shutdown(self):
        pass


PROMPTS = {rid: [rid + 1] * n for rid, n in enumerate((9, 3, 17, 5, 12, 6))}


def generate(name: str, ahead: bool, pp: int = 2, eos_at=None, max_tokens=8, **overrides):
    """(outputs by request, the planner, the pipeline, the micro-batches submitted)."""
    overrides.setdefault("max_batch_size", len(PROMPTS) // pp)  # pp groups of decodes
    p = planner(name, pp=pp, eos_token_id=EOS, chunk_size=8, tile_align=False, **overrides)
    assert p.plan_ahead(ahead) == ahead
    ex = Stage0Pipeline(pp, eos_at, p.eos)
    ex.prompts = PROMPTS
    for rid, prompt in PROMPTS.items():
        p.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens), seed=0))
    log, seen = [], {}
    depth = p.cfg.in_flight + (1 if ahead else 0)

    def on_microbatch(mb, out):  # what the callbacks see (streams, journal) = the outputs
        for rid, tok in out.tokens.items():
            seen.setdefault(rid, []).append(tok)

    run(p, ex, depth, clock=ex.clock, on_submit=lambda mb: log.append(mb),
        on_microbatch=on_microbatch)
    outputs = {rid: r.output_token_ids for rid, r in p.requests.items()}
    assert seen == outputs  # a wasted decode's token reaches no callback
    return outputs, p, ex, log


@pytest.mark.parametrize("name", ["uniform", "vllm", "sarathi-serve"])
@pytest.mark.parametrize("pp", [2, 3])
def test_planning_ahead_gives_the_same_tokens(name, pp):
    before, _, ex0, _ = generate(name, False, pp)
    after, p, ex, log = generate(name, True, pp)
    assert ex0.placeholders == 0 and ex.placeholders > 0  # the new path really ran
    assert after == before
    assert all(len(t) == 8 for t in after.values())  # max_tokens, never more
    assert p.kv.pool.num_free == p.kv.pool.num_blocks  # every block back


def test_at_most_one_decode_ahead_and_never_past_max_tokens():
    _, p, _, log = generate("vllm", True, 2, max_tokens=5)
    scheduled: dict[int, int] = {}  # request -> decodes + last prefill chunk (sampling rows)
    for mb in log:
        for s in mb.seqs:
            if s.sampling is not None:
                scheduled[s.request_id] = scheduled.get(s.request_id, 0) + 1
    assert scheduled == {rid: 5 for rid in PROMPTS}  # one sampling row per token, no more
    # a placeholder's source is the request's previous sampling row (never two ahead)
    last_sample: dict[int, int] = {}
    for mb in log:
        holes = dict(mb.placeholders)
        for i, s in enumerate(mb.seqs):
            if i in holes:
                assert holes[i] == last_sample[s.request_id]
            if s.sampling is not None:
                last_sample[s.request_id] = mb.mb_id


def test_eos_with_a_decode_in_flight_wastes_one_slot_and_frees_it():
    """Request 2 samples EOS as its 3rd token: its decode planned ahead in a later micro-
    batch is computed and dropped; its output ends at EOS, as without planning ahead, and
    every block comes back."""
    before, _, _, _ = generate("vllm", False, 2, eos_at={2: 2})
    after, p, ex, log = generate("vllm", True, 2, eos_at={2: 2})
    assert after == before and after[2][-1] == EOS and len(after[2]) == 3
    assert p.requests[2].finish_reason == "eos"
    rows = [mb.mb_id for mb in log for s in mb.seqs if s.request_id == 2 and s.sampling]
    eos_mb = next(k for k in rows if ex.sampled[k][2] == EOS)
    wasted = [k for k in rows if k > eos_mb]
    assert len(wasted) == 1  # planned before the EOS came back: one slot, no more
    assert not p._draining and not p.has_work()
    assert p.kv.pool.num_free == p.kv.pool.num_blocks


def test_a_placeholder_decode_waits_for_its_token_rather_than_preempt():
    """A pool with no spare block: planning ahead never preempts a request (it would drop
    its in-flight token); the outputs are those of planning without placeholders."""
    kw = dict(paged=True, num_blocks=20, block_size=4, max_seq_len=32, watermark=0.0)
    before, p0, _, _ = generate("vllm", False, 2, **kw)
    after, p, ex, _ = generate("vllm", True, 2, **kw)
    assert after == before
    assert p.num_preemptions <= p0.num_preemptions + len(PROMPTS)
    assert p0.num_preemptions > 0  # the pool was short
    assert p.kv.pool.num_free == 20


def test_a_policy_that_reads_more_counters_does_not_plan_ahead():
    assert not planner("gllm", pp=2).plan_ahead(True)
    assert not planner("request-level", pp=2).plan_ahead(True)
    assert planner("uniform", pp=2).plan_ahead(True)


def test_fill_placeholders_refuses_a_row_that_is_not_one():
    from pp_runtime.core.batch import MicroBatch, SeqChunk

    mb = MicroBatch(3, (SeqChunk(0, [0], 5, (PLACEHOLDER,), None, True),
                        SeqChunk(1, [1], 2, (9,), None, True)), placeholders=((0, 1),))
    filled = fill_placeholders(mb, lambda src, rid: 40 + src)
    assert filled.seqs[0].token_ids == (41,) and filled.placeholders == ()
    with pytest.raises(ValueError, match="not a placeholder"):
        fill_placeholders(replace(mb, placeholders=((1, 1),)), lambda src, rid: 0)


def test_an_abort_lands_while_a_decode_is_planned_ahead():
    """A request decoding with a decode ahead is nearly always in flight: the abort ends it
    at once (not 'try again once back', which would never come), its in-flight results
    are dropped and its blocks come back."""
    p = planner("vllm", pp=2, eos_token_id=EOS, chunk_size=8, max_batch_size=3,
                tile_align=False)
    p.plan_ahead(True)
    ex = Stage0Pipeline(2, {}, p.eos)
    ex.prompts = PROMPTS
    for rid, prompt in PROMPTS.items():
        p.add(Request(rid, prompt, SamplingParams(max_tokens=30), seed=0))
    aborted = []

    def on_microbatch(mb, out):
        r = p.requests[1]
        if mb.placeholders and not aborted and r.in_flight:
            assert p.abort(r, "aborted", ex.now)
            aborted.append(len(r.output_token_ids))

    run(p, ex, p.cfg.in_flight + 1, clock=ex.clock, on_microbatch=on_microbatch)
    r = p.requests[1]
    assert aborted and r.finish_reason == "aborted" and len(r.output_token_ids) == aborted[0]
    assert all(len(q.output_token_ids) == 30 for q in p.requests.values() if q is not r)
    assert p.kv.pool.num_free == p.kv.pool.num_blocks and not p._draining
