"""The engine core's chunked planner (SARATHI): exact micro-batch contents on hand-made
requests, and its rules under a synthetic pipeline. Pure Python: no model runs."""
from collections import deque

from pp_runtime.batch import SampledTokens
from pp_runtime.config import Config
from pp_runtime.planner.sarathi import SarathiPlanner
from pp_runtime.request import Request, SamplingParams


def planner(**overrides) -> SarathiPlanner:
    return SarathiPlanner(Config().with_overrides(**overrides))


def add(p, rid, prompt_len, max_tokens):
    p.add(Request(rid, [rid % 100] * prompt_len, SamplingParams(max_tokens=max_tokens), seed=0))


def drive(p: SarathiPlanner, depth: int):
    """Run the planner against a fake pipeline `depth` deep; every sample returns token 1."""
    in_flight, log = deque(), []
    while p.has_work():
        while len(in_flight) < depth and (mb := p.schedule()) is not None:
            for s in mb.seqs:  # a request is never in two in-flight micro-batches
                assert all(s.request_id not in {t.request_id for t in f.seqs} for f in in_flight)
            in_flight.append(mb)
            log.append(mb)
        mb = in_flight.popleft()
        p.on_result(mb, SampledTokens(mb.mb_id, {s.request_id: 1 for s in mb.seqs if s.sampling}), 0.0)
    return log


def test_exact_microbatches_chunk_then_piggybacked_decodes():
    p = planner(chunk_size=8, max_batch_size=3, tile_size=8, kv_slots=2)
    add(p, 0, 10, 3)
    add(p, 1, 12, 2)
    add(p, 2, 4, 1)  # waits for a KV slot
    got = [[(s.request_id, s.start, s.num_tokens, s.is_decode) for s in mb.seqs] for mb in drive(p, 1)]
    assert got == [
        [(0, 0, 8, False)],
        [(0, 8, 2, False)],  # prompt done: samples the first token
        [(0, 10, 1, True), (1, 0, 7, False)],  # 1 decode + chunk 8 - 1 = 7 (tile-aligned)
        [(0, 11, 1, True), (1, 7, 5, False)],  # request 0 finishes (3 tokens), frees its slot
        [(1, 12, 1, True), (2, 0, 4, False)],  # 2 is admitted; 1 finishes, 2 too (1 token)
    ]


def test_tile_aligned_chunks_with_the_papers_batch_size():
    """B = 27, C = 256, tile 128: every micro-batch with a prefill chunk totals exactly 256
    tokens (a prompt's last, shorter chunk aside)."""
    p = planner(chunk_size=256, max_batch_size=27, tile_size=128, kv_slots=64, max_positions=4096)
    for rid in range(60):
        add(p, rid, 300 + 37 * rid, 8)
    log = drive(p, 4)
    full = [mb for mb in log if mb.num_prefill_tokens]
    for mb in full:
        chunk = next(s for s in mb.seqs if not s.is_decode)
        last_chunk = chunk.sampling is not None
        assert mb.num_decodes <= 26
        assert mb.num_tokens == 256 or last_chunk
    assert sum(mb.num_decodes > 0 and mb.num_tokens == 256 for mb in full) > 20


def test_every_prompt_token_scheduled_once_in_order_and_every_request_finishes():
    p = planner(chunk_size=16, max_batch_size=4, tile_size=16, kv_slots=6)
    lens = [5, 40, 17, 1, 64, 33, 9, 16]
    for rid, n in enumerate(lens):
        add(p, rid, n, 1 + rid % 4)
    log = drive(p, 3)
    for rid, n in enumerate(lens):
        chunks = [s for mb in log for s in mb.seqs if s.request_id == rid and not s.is_decode]
        assert [s.start for s in chunks] == sorted(s.start for s in chunks)
        assert sum(s.num_tokens for s in chunks) == n and chunks[0].start == 0
        req = p.requests[rid]
        assert req.finish_reason == "length" and len(req.output_token_ids) == 1 + rid % 4
    assert not p.running and sorted(p.free_slots) == list(range(6))
