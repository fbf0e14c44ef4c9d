"""The paged KV cache's rules in the planner (planner/blocks.py, BasePlanner.place): schedules
computed by hand for admission by blocks, growth, preemption and prefix hits; the block
pool's invariants under random use (hypothesis); bad cache settings refused."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import add, contents, drive, planner
from pp_runtime.config import Config, ConfigError
from pp_runtime.planner.blocks import BlockPool, block_key
from pp_runtime.core.request import Request, SamplingParams


def paged(name="sarathi", **overrides):
    """max_seq_len 16 in blocks of 4: a context is 4 blocks."""
    base = dict(paged=True, max_seq_len=16, block_size=4, chunk_size=16, tile_size=16,
                max_batch_size=4, watermark=0.0)
    return planner(name, **{**base, **overrides})


def test_admission_takes_the_prefill_blocks_only():
    """Pool of 5 blocks: prompts of 5 and 6 tokens take 2 blocks each, a third of 3 tokens
    needs 1: all three are in, where whole contexts (4 blocks) would admit one."""
    p = paged(num_blocks=5)
    for rid, n in enumerate((5, 6, 3)):
        add(p, rid, n, 1)
    p.schedule(0.0)
    assert [len(r.blocks) for r in p.running] == [2, 2, 1] and p.kv.pool.num_free == 0
    slots = paged(paged=False, kv_slots=1)
    for rid, n in enumerate((5, 6, 3)):
        add(slots, rid, n, 1)
    slots.schedule(0.0)
    assert [r.request_id for r in slots.running] == [0] and len(slots.running[0].blocks) == 4


def test_a_decode_entering_a_new_block_takes_one():
    p = paged(num_blocks=8)
    add(p, 0, 4, 3)  # positions 0-3 fill block 0; the first decode (position 4) needs another
    log = drive(p, 1)
    assert contents(log) == [[(0, 0, 4, False)], [(0, 4, 1, True)], [(0, 5, 1, True)]]
    assert p.kv.pool.num_free == 8


def test_preemption_takes_the_newest_idle_request_and_recomputes_it():
    """Pool of 4 blocks, two prompts of 8 tokens (2 blocks each: the pool is full), vllm
    (whole prefills together). Request 0's first decode needs a block: request 1, the
    newest, leaves the micro-batch and waits first in line. When 0 finishes, 1 prefills
    its prompt and its generated token again (9 tokens), then decodes on; its tokens are
    what they would have been."""
    p = paged("vllm", num_blocks=4, max_batch_size=2)
    add(p, 0, 8, 3)
    add(p, 1, 8, 3)
    log = drive(p, 1, token=lambda rid, step: 10 * rid + step + 1)
    assert contents(log) == [
        [(0, 0, 8, False), (1, 0, 8, False)],
        [(0, 8, 1, True)],  # 0 needs a third block: 1 is preempted (its decode dropped)
        [(0, 9, 1, True)],  # 1 needs 3 blocks, 1 is free: it waits; 0 ends (3 tokens)
        [(1, 0, 9, False)],  # the prompt and the token it had generated, again
        [(1, 9, 1, True)],
    ]
    r1 = p.requests[1]
    assert r1.num_preemptions == 1 and r1.num_recomputed == 8 and p.num_preemptions == 1
    assert r1.output_token_ids == [11, 12, 13] and p.requests[0].output_token_ids == [1, 2, 3]
    assert p.kv.pool.num_free == 4


def test_a_lone_request_preempts_itself_rather_than_stall():
    """Two requests whose decodes both need the last free block: the one not in flight
    that was admitted last gives way, even when it is the decode's own request."""
    p = paged(num_blocks=5, max_batch_size=1, chunk_size=8)
    add(p, 0, 8, 5)
    add(p, 1, 8, 5)
    drive(p, 2)
    assert all(len(r.output_token_ids) == 5 for r in p.requests.values())
    assert p.num_preemptions >= 1 and p.kv.pool.num_free == 5


def test_prefix_hits_skip_the_cached_chunks():
    """Request 1 shares request 0's first 8 tokens (2 full blocks): once 0 has computed
    them, 1 is admitted with them, and its first chunk starts at position 8."""
    p = paged(num_blocks=16, prefix_caching=True, chunk_size=4, tile_align=False)
    shared = [7] * 8
    p.add(Request(0, shared + [1, 2], SamplingParams(max_tokens=1), seed=0))
    p.add(Request(1, shared + [3, 4, 5], SamplingParams(max_tokens=1), seed=0, arrival_s=5.0))
    log = drive(p, 1)
    r1 = p.requests[1]
    assert r1.num_cached == 8
    assert [(s.start, s.num_tokens) for mb in log for s in mb.seqs if s.request_id == 1] == [(8, 3)]
    assert r1.blocks is None and p.kv.pool.num_free == 16  # keyed blocks count as free


def test_a_whole_cached_prompt_still_computes_its_last_token():
    p = paged(num_blocks=16, prefix_caching=True, chunk_size=4, tile_align=False)
    p.add(Request(0, [7] * 8, SamplingParams(max_tokens=1), seed=0))
    p.add(Request(1, [7] * 8, SamplingParams(max_tokens=1), seed=0, arrival_s=5.0))
    log = drive(p, 1)
    assert [(s.start, s.num_tokens) for mb in log for s in mb.seqs if s.request_id == 1] == [(4, 4)]
    assert p.requests[1].num_cached == 4  # one full block; the second holds the token to sample


def test_keyed_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(3, prefix_caching=True)
    a, b, c = pool.take(), pool.take(), pool.take()
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(block, key)
    pool.release([a, b])  # the table's tail first: b is older in the list than a
    pool.release([c])
    assert pool.num_free == 3 and not pool.free
    assert pool.take() == b and pool.share(b"b") is None  # evicted, key gone
    assert pool.share(b"a") == a and pool.refs[a] == 1  # still cached: revived


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["take", "share", "release", "register"]),
                              st.integers(0, 7)), max_size=80))
def test_block_pool_never_hands_out_a_block_twice(ops):
    """Random takes, shares, releases and keyings: a block with owners is never handed to a
    new owner, counts add up, and releasing every owner returns every block."""
    pool = BlockPool(6, prefix_caching=True)
    owned: list[int] = []  # one entry per ownership
    for op, i in ops:
        if op == "take" and pool.num_free:
            block = pool.take()
            assert block not in owned
            owned.append(block)
        elif op == "share":
            block = pool.share(block_key(b"", [i]))
            if block is not None:
                owned.append(block)
        elif op == "release" and owned:
            pool.release([owned.pop(i % len(owned))])
        elif op == "register" and owned:
            pool.register(owned[i % len(owned)], block_key(b"", [i]))
        assert len(set(owned)) + pool.num_free == 6
        assert all(pool.refs[b] == owned.count(b) for b in range(6))
    pool.release(owned)
    assert pool.num_free == 6 and all(r == 0 for r in pool.refs)


@pytest.mark.parametrize("fields, match", [
    (dict(block_size=12), "cache.block_size: 12 is not a power of two"),
    (dict(block_size=2048), "cache.block_size: 2048 is not a power of two in \\[1, max_seq_len=1024\\]"),
    (dict(num_blocks=10), "cache.num_blocks: 10 blocks of 16 tokens hold less than one request"),
    (dict(num_blocks="auto"), "cache.num_blocks: auto sizes the pool from cache.device_memory_gb"),
    (dict(paged=False, prefix_caching=True), "cache.prefix_caching: needs the paged cache"),
    (dict(watermark=1.0), "cache.watermark: must be in \\[0, 1\\)"),
])
def test_bad_cache_settings_are_refused(fields, match):
    with pytest.raises(ConfigError, match=match):
        Config().with_overrides(**fields)


def test_taking_many_blocks_takes_what_one_at_a_time_takes():
    def pool():  # two plain free blocks, then keyed ones nobody owns
        p = BlockPool(6, prefix_caching=True)
        held = [p.take() for _ in range(4)]
        for i, b in enumerate(held):
            p.register(b, bytes([i]))
        p.release(held)
        return p

    for n in (1, 2, 3, 5):
        a, b = pool(), pool()
        assert a.take_many(n) == [b.take() for _ in range(n)]
        assert (list(a.free), a.refs, a.unused, a.by_key) == (list(b.free), b.refs, b.unused, b.by_key)
