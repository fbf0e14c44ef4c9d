"""SARATHI: exact micro-batch contents on hand-made requests, and tile alignment."""
from helpers import add, contents, drive, planner


def test_chunk_then_piggybacked_decodes_exact_contents():
    p = planner("sarathi", chunk_size=8, max_batch_size=3, tile_size=8, kv_slots=2)
    add(p, 0, 10, 3)
    add(p, 1, 12, 2)
    add(p, 2, 4, 1)  # waits for a KV slot
    assert contents(drive(p, 1)) == [
        [(0, 0, 8, False)],
        [(0, 8, 2, False)],  # prompt done: samples the first token
        [(0, 10, 1, True), (1, 0, 7, False)],  # 1 decode + chunk 8 - 1 = 7 (tile-aligned)
        [(0, 11, 1, True), (1, 7, 5, False)],  # request 0 finishes (3 tokens), frees its slot
        [(1, 12, 1, True), (2, 0, 4, False)],  # 2 is admitted; 1 finishes, 2 too (1 token)
    ]


def test_two_stages_in_flight_interleave_requests():
    """Without chunk pipelining, the second micro-batch cannot take request 0 (in flight):
    it chunks 1."""
    p = planner("sarathi", chunk_size=8, max_batch_size=3, tile_size=8, pp=2,
                chunk_pipelining=False)
    add(p, 0, 12, 2)
    add(p, 1, 6, 2)
    assert contents(drive(p, 2)) == [
        [(0, 0, 8, False)],
        [(1, 0, 6, False)],
        [(0, 8, 4, False)],
        [(1, 6, 1, True)],  # 1's decode; 0 is in flight and no prompt waits
        [(0, 12, 1, True)],
    ]


def test_pipelined_chunks_follow_each_other_into_the_pipeline():
    """With chunk pipelining (the default) request 0's second chunk enters right behind its
    first: its first token comes back after micro-batch 1 (tick 2), not 2 (tick 3). Its
    decode still waits for that token."""
    p = planner("sarathi", chunk_size=8, max_batch_size=3, tile_size=8, pp=2)
    add(p, 0, 12, 2)
    add(p, 1, 6, 2)
    log = drive(p, 2)
    assert contents(log) == [
        [(0, 0, 8, False)],
        [(0, 8, 4, False)],  # behind its first chunk, both in flight
        [(1, 0, 6, False)],  # 0 is fully scheduled but not computed: no decode yet
        [(0, 12, 1, True)],  # after micro-batch 1 came back with 0's first token
        [(1, 6, 1, True)],
    ]
    assert p.requests[0].first_token_s == 2.0


def test_untiled_chunks_keep_their_size():
    p = planner("sarathi", chunk_size=8, max_batch_size=3, tile_align=False)
    add(p, 0, 3, 4)
    add(p, 1, 20, 1)
    log = contents(drive(p, 1))
    assert log[1] == [(0, 3, 1, True), (1, 0, 8, False)]


def test_tile_aligned_chunks_with_the_papers_batch_size():
    """B = 27, C = 256, tile 128: every micro-batch with a prefill chunk totals exactly 256
    tokens (a prompt's last, shorter chunk aside), with up to 26 piggybacked decodes."""
    p = planner("sarathi", chunk_size=256, max_batch_size=27, tile_size=128, pp=4,
                max_positions=4096)  # 4 x 27 KV slots
    for rid in range(60):
        add(p, rid, 300 + 37 * rid, 200)
    log = drive(p, 4)
    with_prefill = [mb for mb in log if mb.num_prefill_tokens]
    for mb in with_prefill:
        chunk = next(s for s in mb.seqs if not s.is_decode)
        assert mb.num_decodes <= 26
        assert mb.num_tokens == 256 or chunk.sampling is not None  # last chunk of a prompt
    assert sum(mb.num_decodes >= 10 and mb.num_tokens == 256 for mb in with_prefill) > 100
    assert max(mb.num_decodes for mb in log) <= 27  # decode-only batches: up to B


def test_chunk_not_multiple_of_tile_warns():
    import pytest

    with pytest.warns(UserWarning, match="not a multiple of tile_size"):
        planner("sarathi", chunk_size=200, tile_size=128)
