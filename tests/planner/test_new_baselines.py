"""The 2024-25 baselines, `sarathi-serve` and `gllm`: exact micro-batch contents on
hand-made requests, computed by hand from each published rule (docs/planner.md), and
Sarathi-Serve's packing checked over random workloads."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import add, contents, drive, planner

THREE = [(10, 3), (5, 2), (12, 2)]  # (prompt tokens, max tokens)


def serve(pp=1, pipelining=False, **overrides):
    p = planner("sarathi-serve", chunk_size=8, max_batch_size=4, tile_size=8, pp=pp,
                chunk_pipelining=pipelining, **overrides)
    for rid, (prompt, max_tokens) in enumerate(THREE):
        add(p, rid, prompt, max_tokens)
    return p


# ---- sarathi-serve: one budget of C = 8 tokens, decodes counted ---------------------------
def test_sarathi_serve_packs_chunks_of_several_prompts():
    assert contents(drive(serve(), 1)) == [
        [(0, 0, 8, False)],
        # 0 ends after 2 tokens: the rest of the budget goes to 1 (whole) and 2 (1 token)
        [(0, 8, 2, False), (1, 0, 5, False), (2, 0, 1, False)],
        # decodes first, counted: 8 - 2 = 6 tokens for the started prompt; 1 finishes
        [(0, 10, 1, True), (1, 5, 1, True), (2, 1, 6, False)],
        [(0, 11, 1, True), (2, 7, 5, False)],  # 0 finishes (3 tokens)
        [(2, 12, 1, True)],
    ]


def test_sarathi_serve_strict_rule_skips_requests_in_flight():
    """pp = 2 without chunk pipelining: a prompt whose chunk is in flight waits; the budget
    goes to the next prompts instead."""
    assert contents(drive(serve(pp=2), 2)) == [
        [(0, 0, 8, False)],
        [(1, 0, 5, False), (2, 0, 3, False)],  # 0 in flight: 1 and 2 share the budget
        [(0, 8, 2, False)],  # 1 and 2 in flight, no other prompt: a light micro-batch
        [(1, 5, 1, True), (2, 3, 7, False)],  # 1 decode + 7 = 8
        [(0, 10, 1, True)],
        [(2, 10, 2, False)],  # 1 finished
        [(0, 11, 1, True)],
        [(2, 12, 1, True)],
    ]


def test_sarathi_serve_started_prompt_goes_first_with_chunk_pipelining():
    """With chunk pipelining 0's second chunk follows its first into the pipeline, before
    the new prompts: partial prefills, then new ones."""
    assert contents(drive(serve(pp=2, pipelining=True), 2)) == [
        [(0, 0, 8, False)],
        [(0, 8, 2, False), (1, 0, 5, False), (2, 0, 1, False)],
        [(2, 1, 8, False)],  # 0 and 1 wait for their first tokens; 2 pipelines its next chunk
        [(0, 10, 1, True), (1, 5, 1, True), (2, 9, 3, False)],
        [(0, 11, 1, True), (2, 12, 1, True)],
    ]


def test_sarathi_serve_decodes_fill_b_before_prompts():
    p = planner("sarathi-serve", chunk_size=8, max_batch_size=2, tile_size=8, kv_slots=3)
    add(p, 0, 2, 3)
    add(p, 1, 2, 3)
    add(p, 2, 6, 1)
    assert contents(drive(p, 1))[:3] == [
        [(0, 0, 2, False), (1, 0, 2, False)],  # B = 2 sequences: 2 waits
        [(0, 2, 1, True), (1, 2, 1, True)],  # 2 is admitted, but two decodes use B
        [(0, 3, 1, True), (1, 3, 1, True)],
    ]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 8), st.integers(0, 3)),
                     min_size=1, max_size=20),
       pp=st.sampled_from([1, 2, 4]), batch=st.integers(1, 9), chunk=st.sampled_from([16, 64]),
       pipelining=st.booleans())
def test_sarathi_serve_never_light_while_a_prompt_could_fill_it(work, pp, batch, chunk, pipelining):
    """Every micro-batch holds at most C tokens (B <= C here) and is full, C tokens or B
    sequences, unless no prompt was left that could take the rest."""
    p = planner("sarathi-serve", pp=pp, num_layers=8, max_batch_size=batch, chunk_size=chunk,
                tile_size=16, max_positions=512, chunk_pipelining=pipelining)
    arrival = 0.0
    for rid, (prompt, max_tokens, gap) in enumerate(work):
        arrival += gap
        add(p, rid, prompt, max_tokens, arrival)
    original = p.schedule

    def schedule(now):
        mb = original(now)
        if mb is not None:
            assert mb.num_tokens <= chunk
            if mb.num_tokens < chunk and len(mb.seqs) < batch:
                assert not p.prefilling(), "light micro-batch beside a prompt that could go"
        return mb

    p.schedule = schedule
    drive(p, pp)
    assert all(r.finish_reason is not None for r in p.requests.values())


# ---- gllm: decodes spread over pp micro-batches, prefills throttled ------------------------
def test_gllm_spreads_decodes_over_the_micro_batches_in_flight():
    """8 requests decoding, pp = 4: each micro-batch carries 8 / 4 = 2 decodes (a SARATHI
    micro-batch takes every ready decode, up to B)."""
    p = planner("gllm", max_batch_size=8, pp=4, chunk_pipelining=False)
    for rid in range(8):
        add(p, rid, 4, 3)
    log = contents(drive(p, 4))
    assert log[0] == [(rid, 0, 4, False) for rid in range(8)]  # 32 tokens = MINP: all go
    assert log[1:] == [[(a, pos, 1, True), (a + 1, pos, 1, True)]
                       for pos in (4, 5) for a in (0, 2, 4, 6)]


def test_gllm_rotating_jitter_spreads_the_remainder():
    """5 running decodes, pp = 2: budgets (5 + j) // 2 with j = 0, 1, 0, ... (j advances
    once per micro-batch gLLM composes)."""
    p = planner("gllm", max_batch_size=4, pp=2, chunk_pipelining=False)
    for rid in range(5):
        add(p, rid, 6, 4)
    assert contents(drive(p, 2)) == [
        [(0, 0, 6, False), (1, 0, 6, False), (2, 0, 6, False), (3, 0, 6, False)],  # B = 4
        [(4, 0, 6, False)],  # one prompt waits: no queue cap; 4 decodes in flight: j = 0 used
        [(0, 6, 1, True), (1, 6, 1, True), (2, 6, 1, True)],  # (5 + 1) // 2 = 3
        [(3, 6, 1, True), (4, 6, 1, True)],  # (5 + 0) // 2 = 2
        [(0, 7, 1, True), (1, 7, 1, True), (2, 7, 1, True)],
        [(3, 7, 1, True), (4, 7, 1, True)],
        [(0, 8, 1, True), (1, 8, 1, True), (2, 8, 1, True)],
        [(3, 8, 1, True), (4, 8, 1, True)],
    ]


def test_gllm_prefill_budget_drains_the_queue_over_iterp_micro_batches():
    """Prompts of 200, 100, 40 tokens (pp = 2, KV 8 slots x 512 tokens): the budget is
    max(waiting prompt tokens // 8, 32), below the KV ramp (~8192); a lone prompt goes
    whole."""
    p = planner("gllm", max_batch_size=4, pp=2, max_positions=512, chunk_pipelining=True)
    for rid, n in enumerate((200, 100, 40)):
        add(p, rid, n, 2)
    assert contents(drive(p, 2)) == [
        [(0, 0, 42, False)],  # 340 // 8
        [(0, 42, 37, False)],  # 298 // 8, pipelined behind 0's first chunk
        [(0, 79, 32, False)],  # 261 // 8 = 32
        [(0, 111, 32, False)],  # 229 // 8 = 28 -> MINP
        [(0, 143, 32, False)],
        [(0, 175, 25, False), (1, 0, 7, False)],  # 0's prompt ends: 1 takes the rest
        [(1, 7, 32, False)],
        [(0, 200, 1, True), (1, 39, 32, False)],  # 1 running decode < pp: budget 1
        [(1, 71, 29, False), (2, 0, 3, False)],  # 0 finished
        [(2, 3, 37, False)],  # the only prompt left: no queue cap
        [(1, 100, 1, True)],
        [(2, 40, 1, True)],
    ]


def test_gllm_single_rank_skips_the_throttle():
    """pp = tp = 1 (gLLM: world size 1): prefill budget min(MAXP, free KV - reserve)."""
    p = planner("gllm", max_batch_size=4, pp=1, max_positions=512)
    for rid, n in enumerate((200, 100, 40)):
        add(p, rid, n, 2)
    assert contents(drive(p, 1)) == [
        [(0, 0, 200, False), (1, 0, 100, False), (2, 0, 40, False)],
        [(0, 200, 1, True), (1, 100, 1, True), (2, 40, 1, True)],
    ]


def test_gllm_full_kv_slows_prefill_but_never_stops_it():
    """One slot of 64 tokens, a 62-token prompt: the KV reserve (5 % = 3 tokens) caps the
    first chunk at 61; then free KV - reserve is 0 and gLLM would give 0, but a slot is
    reserved at admission here, so MINP keeps the prompt moving."""
    p = planner("gllm", max_batch_size=4, pp=2, max_positions=64, kv_slots=1,
                chunk_pipelining=True)
    add(p, 0, 62, 2)
    assert contents(drive(p, 2)) == [[(0, 0, 61, False)], [(0, 61, 1, False)], [(0, 62, 1, True)]]


@pytest.mark.parametrize("name", ["sarathi-serve", "gllm"])
def test_new_baselines_are_registered(name):
    from pp_runtime.config import PLANNERS as CONFIG_PLANNERS
    from pp_runtime.planner import PLANNERS

    assert name in PLANNERS and name in CONFIG_PLANNERS
    assert PLANNERS[name].name == name
