"""Rules every policy keeps, checked by hypothesis over random workloads, pp in
{1, 2, 4, 8} and KV pools from one context up (paged or whole contexts): one in-flight
micro-batch per request (with chunk pipelining, several only as consecutive prefill chunks;
a decode never beside its request's own chunk or token in flight), at most B sequences,
no KV block owned twice and every block back in the pool at the end, a sequence's blocks
cover its positions, FCFS admission (`uniform` with no latency target: least slack first), every token scheduled once and in order since the
request's last preemption (a preempted one starts again from 0), every request finished
with a reason and the tokens it would have had without preemption."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import add, drive, planner
from pp_runtime.planner import PLANNERS

EOS = 0

workloads = st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 12), st.integers(0, 30)),  # prompt, max tokens, arrival gap
    min_size=1, max_size=25)


@pytest.mark.parametrize("name", sorted(PLANNERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=workloads, pp=st.sampled_from([1, 2, 4, 8]), batch=st.integers(1, 9),
       chunk=st.sampled_from([16, 64, 256]), tile_align=st.booleans(),
       slots=st.one_of(st.none(), st.integers(1, 12)), eos_every=st.integers(2, 50),
       pipelining=st.booleans(), paged=st.booleans(), block_size=st.sampled_from([1, 4, 16]),
       extra_blocks=st.one_of(st.none(), st.integers(0, 200)))
def test_policy_rules(name, work, pp, batch, chunk, tile_align, slots, eos_every, pipelining,
                      paged, block_size, extra_blocks):
    blocks = None if extra_blocks is None or not paged else 512 // block_size + extra_blocks
    p = planner(name, pp=pp, num_layers=8, max_batch_size=batch, chunk_size=chunk,
                tile_size=16, tile_align=tile_align, kv_slots=slots, eos_token_id=EOS,
                max_positions=512, chunk_pipelining=pipelining, paged=paged,
                block_size=block_size, num_blocks=blocks)
    arrival = 0.0
    for rid, (prompt, max_tokens, gap) in enumerate(work):
        arrival += gap
        add(p, rid, prompt, max_tokens, arrival)
    num_slots = p.cfg.num_slots
    checked = []

    def token(rid, step):  # some requests hit EOS early
        return EOS if (rid * 7 + step) % eos_every == 0 else 5

    original_schedule, original_on_result = p.schedule, p.on_result
    in_flight: dict[int, list] = {}  # request -> its sequences in micro-batches in flight

    def schedule(now):
        mb = original_schedule(now)
        if mb is not None:
            check_microbatch(p, mb, name, batch, chunk, tile_align, num_slots)
            for s in mb.seqs:
                earlier = in_flight.setdefault(s.request_id, [])
                if earlier:  # only pipelined prefill chunks, each right after the last
                    assert pipelining and not s.is_decode, (s, earlier)
                    assert all(not e.is_decode and e.sampling is None for e in earlier)
                    assert s.start == earlier[-1].kv_len
                earlier.append(s)
            checked.append(mb)
        return mb

    def on_result(mb, out, now):
        for s in mb.seqs:
            assert in_flight[s.request_id][0] is s  # results come back in order
            in_flight[s.request_id].pop(0)
        return original_on_result(mb, out, now)

    p.schedule, p.on_result = schedule, on_result
    log = drive(p, pp, token)
    assert log == checked and not p.running and not p.waiting
    assert p.kv.pool.num_free == p.kv.pool.num_blocks  # every block back

    first_seen = []
    for mb in log:
        for s in mb.seqs:
            if s.request_id not in first_seen:
                first_seen.append(s.request_id)
    order = getattr(p, "order", None)  # uniform with no latency target: least slack first
    if order is None:
        assert first_seen == sorted(first_seen)  # FCFS: requests start in arrival order
    for i, early in enumerate(first_seen):  # one started before an earlier arrival: less slack
        for late in first_seen[i + 1:]:
            if late < early:
                assert order is not None
                assert order.key(p.requests[early]) < order.key(p.requests[late])

    for rid, (prompt, max_tokens, _) in enumerate(work):
        req = p.requests[rid]
        seqs = last_run([s for mb in log for s in mb.seqs if s.request_id == rid])
        assert req.num_preemptions or all(s.start for s in seqs[1:])  # one run unless preempted
        chunks = [s for s in seqs if not s.is_decode]
        decodes = [s for s in seqs if s.is_decode]
        known = req.prefill_len  # the prompt, and what it had generated when last preempted
        assert [t for s in chunks for t in range(s.start, s.kv_len)] == list(range(known))
        assert [s.start for s in decodes] == list(range(known, known + len(decodes)))
        assert req.finish_reason in ("length", "eos")
        out = req.output_token_ids
        assert 1 <= len(out) <= max_tokens and len(out) == known - prompt + len(decodes) + 1
        if req.finish_reason == "eos":
            assert out[-1] == EOS and EOS not in out[:-1]
        else:
            assert len(out) == max_tokens and EOS not in out
        assert req.first_token_s is not None and req.finish_s >= req.first_token_s >= req.arrival_s


def last_run(seqs):
    """The sequences since the request last started again from position 0."""
    starts = [i for i, s in enumerate(seqs) if s.start == 0]
    return seqs[starts[-1]:] if starts else seqs


def check_microbatch(p, mb, name, batch, chunk, tile_align, num_slots):
    ids = [s.request_id for s in mb.seqs]
    assert len(ids) == len(set(ids)) and 1 <= len(ids) <= batch
    kv = p.kv
    assert kv.paged or len(p.running) <= num_slots
    owned = [b for r in p.requests.values() if r.blocks is not None for b in r.blocks]
    assert len(owned) == len(set(owned)) and all(0 <= b < kv.pool.num_blocks for b in owned)
    assert len(owned) + kv.pool.num_free == kv.pool.num_blocks  # nothing lost
    assert all(r.blocks is None for r in p.waiting)
    for s in mb.seqs:
        assert s.blocks is p.requests[s.request_id].blocks
        assert len(s.blocks) * kv.block_size >= s.kv_len
    prefills = [s for s in mb.seqs if not s.is_decode]
    if name in ("sarathi", "orca-best"):
        assert len(prefills) <= 1
    if name == "uniform":  # packed: a prompt's last chunk, then the next prompts' first
        assert len(prefills) <= 4
        assert all(s.sampling is not None for s in prefills[:-1])
        assert all(s.start == 0 for s in prefills[1:])
    if name in ("sarathi", "uniform") and prefills:
        limit = chunk if tile_align else chunk + batch - 1
        assert mb.num_tokens <= limit
    if name in ("orca-best", "orca-worst", "vllm", "request-level"):  # whole prefills
        for s in prefills:
            assert s.start == 0 and s.kv_len == p.requests[s.request_id].prefill_len
    if name in ("orca-worst", "vllm", "request-level"):  # prefills and decodes never mix
        assert not prefills or len(prefills) == len(mb.seqs)
