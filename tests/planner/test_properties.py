"""Rules every policy keeps, checked by hypothesis over random workloads and pp in
{1, 2, 4, 8}: one in-flight micro-batch per request (with chunk pipelining, several only
as consecutive prefill chunks; a decode never beside its request's own chunk or token in
flight), at most B sequences, KV slots never
shared or exceeded, FCFS admission, every prompt token scheduled once and in order,
decode positions consecutive, every request finished with a reason."""
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
       pipelining=st.booleans())
def test_policy_rules(name, work, pp, batch, chunk, tile_align, slots, eos_every, pipelining):
    p = planner(name, pp=pp, num_layers=8, max_batch_size=batch, chunk_size=chunk,
                tile_size=16, tile_align=tile_align, kv_slots=slots, eos_token_id=EOS,
                max_positions=512, chunk_pipelining=pipelining)
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

    first_seen = []
    for mb in log:
        for s in mb.seqs:
            if s.request_id not in first_seen:
                first_seen.append(s.request_id)
    assert first_seen == sorted(first_seen)  # FCFS: requests start in arrival order

    for rid, (prompt, max_tokens, _) in enumerate(work):
        req = p.requests[rid]
        seqs = [s for mb in log for s in mb.seqs if s.request_id == rid]
        chunks = [s for s in seqs if not s.is_decode]
        decodes = [s for s in seqs if s.is_decode]
        # every prompt token exactly once, in order
        assert [t for s in chunks for t in range(s.start, s.kv_len)] == list(range(prompt))
        assert [s.start for s in decodes] == list(range(prompt, prompt + len(decodes)))
        assert req.finish_reason in ("length", "eos")
        out = req.output_token_ids
        assert 1 <= len(out) <= max_tokens and len(out) == len(decodes) + 1
        if req.finish_reason == "eos":
            assert out[-1] == EOS and EOS not in out[:-1]
        else:
            assert len(out) == max_tokens and EOS not in out
        assert req.first_token_s is not None and req.finish_s >= req.first_token_s >= req.arrival_s


def check_microbatch(p, mb, name, batch, chunk, tile_align, num_slots):
    ids = [s.request_id for s in mb.seqs]
    assert len(ids) == len(set(ids)) and 1 <= len(ids) <= batch
    assert len(p.running) <= num_slots
    slots = [r.slot for r in p.running]
    assert len(slots) == len(set(slots)) and all(0 <= s < num_slots for s in slots)
    for s in mb.seqs:
        assert s.slot == p.requests[s.request_id].slot
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
            assert s.start == 0 and s.kv_len == p.requests[s.request_id].prompt_len
    if name in ("orca-worst", "vllm", "request-level"):  # prefills and decodes never mix
        assert not prefills or len(prefills) == len(mb.seqs)
