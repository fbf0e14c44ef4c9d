"""The 2024-25 baselines, `sarathi-serve` and `gllm`: exact micro-batch contents on
hand-made requests, computed by hand from each upstream scheduler (docs/baselines.md):
Sarathi-Serve's budget, lazy admission and max_num_seqs; gLLM's page back-pressure
(P = 0 at the reserve), maxd rows, R counting sequences in flight, the iterp / minp queue
cap and check_preempt; and Sarathi-Serve's packing checked over random workloads."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import add, contents, drive, planner
from pp_runtime.core.batch import SampledTokens

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


# ---- sarathi-serve: admission only with a chunk, max_num_seqs ------------------------------
def test_sarathi_serve_admits_a_prompt_only_when_it_gets_a_chunk():
    """Sarathi-Serve allocates a prompt's blocks in phase 2, when the budget has room for its
    first chunk (`_schedule` 196-235): the others keep theirs free."""
    p = serve(paged=True, block_size=4)
    first = p.schedule(0.0)
    assert contents([first]) == [[(0, 0, 8, False)]]
    assert [r.request_id for r in p.waiting] == [1, 2]
    assert p.kv.pool.num_blocks - p.kv.pool.num_free == 3  # 10 tokens in blocks of 4


def test_sarathi_serve_max_num_seqs_caps_running_requests():
    """cache.max_running = Sarathi-Serve's max_num_seqs = 1: a prompt waits until the one
    running finishes, though the budget has room."""
    p = serve(max_running=1)
    assert contents(drive(p, 1)) == [
        [(0, 0, 8, False)],
        [(0, 8, 2, False)],  # 6 tokens left in the budget, but one request already runs
        [(0, 10, 1, True)],
        [(0, 11, 1, True)],
        [(1, 0, 5, False)],
        [(1, 5, 1, True)],
        [(2, 0, 8, False)],
        [(2, 8, 4, False)],
        [(2, 12, 1, True)],
    ]


# ---- gllm: decodes spread over pp micro-batches, prefills throttled by pages ----------------
def gllm(**overrides):
    return planner("gllm", **overrides)


def test_gllm_spreads_decodes_over_the_micro_batches_in_flight():
    """8 requests decoding, pp = 4: R = ready + in flight = 8, so each micro-batch carries
    8 // 4 = 2 decodes; ready decodes go most recently returned first (gLLM appends left)."""
    p = gllm(max_batch_size=8, pp=4, chunk_pipelining=False)
    for rid in range(8):
        add(p, rid, 4, 3)
    log = contents(drive(p, 4))
    assert log[0] == [(rid, 0, 4, False) for rid in range(8)]  # 32 tokens = minp: all go
    assert log[1:] == [[(a, 4, 1, True), (a - 1, 4, 1, True)] for a in (7, 5, 3, 1)] + \
        [[(a, 5, 1, True), (a + 1, 5, 1, True)] for a in (6, 4, 2, 0)]


def test_gllm_running_decodes_count_sequences_in_flight():
    """pp = 2, 4 requests: after the first pair goes, R = 2 ready + 2 in flight = 4, so the
    next micro-batch takes (4 + 1) // 2 = 2, not (2 + 1) // 2 = 1."""
    p = gllm(max_batch_size=8, pp=2)
    for rid in range(4):
        add(p, rid, 4, 3)
    assert contents(drive(p, 2)) == [
        [(0, 0, 4, False), (1, 0, 4, False), (2, 0, 4, False), (3, 0, 4, False)],
        [(3, 4, 1, True), (2, 4, 1, True)],  # R = 4 ready: (4 + 0) // 2
        [(1, 4, 1, True), (0, 4, 1, True)],  # R = 2 ready + 2 in flight: (4 + 1) // 2
        [(2, 5, 1, True), (3, 5, 1, True)],
        [(0, 5, 1, True), (1, 5, 1, True)],
    ]


def test_gllm_maxd_caps_rows_prefill_first():
    """pp = 1 (no throttle), maxd = 3 rows: three prompts take every row; then the fourth
    prompt's chunk leaves 2 rows for the 3 ready decodes (gLLM: maxd - prefill rows)."""
    p = gllm(max_batch_size=8, pp=1, gllm_maxd=3)
    for rid in range(4):
        add(p, rid, 4, 2)
    assert contents(drive(p, 1)) == [
        [(0, 0, 4, False), (1, 0, 4, False), (2, 0, 4, False)],
        [(2, 4, 1, True), (1, 4, 1, True), (3, 0, 4, False)],
        [(3, 4, 1, True), (0, 4, 1, True)],
    ]


def test_gllm_prefill_budget_drains_the_queue_over_iterp_micro_batches():
    """Prompts of 200, 100, 40 tokens (pp = 2, 256 pages of 16): the budget is
    max(waiting prompt tokens // iterp, minp), below the page ramp (~8000); a lone prompt
    goes whole."""
    p = gllm(max_batch_size=4, pp=2, max_positions=512, chunk_pipelining=True)
    for rid, n in enumerate((200, 100, 40)):
        add(p, rid, n, 2)
    assert contents(drive(p, 2)) == [
        [(0, 0, 42, False)],  # 340 // 8
        [(0, 42, 37, False)],  # 298 // 8, pipelined behind 0's first chunk
        [(0, 79, 32, False)],  # 261 // 8 = 32
        [(0, 111, 32, False)],  # 229 // 8 = 28 -> minp
        [(0, 143, 32, False)],
        [(0, 175, 25, False), (1, 0, 7, False)],  # 0's prompt ends: 1 takes the rest
        [(1, 7, 32, False)],
        [(0, 200, 1, True), (1, 39, 32, False)],  # R = 1 ready + 1 in flight: 1 decode
        [(1, 71, 29, False), (2, 0, 3, False)],  # 0 finished
        [(2, 3, 37, False)],  # the only prompt left: no queue cap
        [(1, 100, 1, True)],
        [(2, 40, 1, True)],
    ]


def test_gllm_iterp_and_minp_are_knobs():
    """iterp 2, minp 8: 340 // 2 = 170 tokens first, then 170 // 2 = 85."""
    p = gllm(max_batch_size=4, pp=2, max_positions=512, gllm_iterp=2, gllm_minp=8)
    for rid, n in enumerate((200, 100, 40)):
        add(p, rid, n, 2)
    assert contents(drive(p, 2))[:2] == [[(0, 0, 170, False)], [(0, 170, 30, False), (1, 0, 55, False)]]


def test_gllm_single_rank_skips_the_throttle():
    """pp = tp = 1 (gLLM: world size 1): prefill budget min(maxp, free pages - reserve)."""
    p = gllm(max_batch_size=4, pp=1, max_positions=512)
    for rid, n in enumerate((200, 100, 40)):
        add(p, rid, n, 2)
    assert contents(drive(p, 1)) == [
        [(0, 0, 200, False), (1, 0, 100, False), (2, 0, 40, False)],
        [(2, 40, 1, True), (1, 100, 1, True), (0, 200, 1, True)],
    ]


def test_gllm_no_prefill_while_free_pages_are_at_the_reserve():
    """16 pages of 4 tokens, a fixed reserve of 4 pages (kvthresh 0.25), pp = 2. Prompt 0
    (48 tokens) takes 12 pages in two chunks (32 = the queue cap, then 16 = the pages above
    the reserve); free pages = reserve, so P = 0: prompt 1 waits while 0 decodes (its
    decode takes a page from the reserve), and starts when 0 finishes."""
    p = gllm(max_batch_size=4, pp=2, max_positions=64, kv_slots=1, block_size=4,
             gllm_kvthresh=0.25, chunk_pipelining=True)
    add(p, 0, 48, 3)
    add(p, 1, 8, 1)
    log = drive(p, 2)
    assert contents(log) == [
        [(0, 0, 32, False)],
        [(0, 32, 16, False)],
        [(0, 48, 1, True)],
        [(0, 49, 1, True)],
        [(1, 0, 8, False)],
    ]
    assert p.kv.pool.num_blocks == 16 and p.num_stalls == 0


def test_gllm_preempts_the_ready_decode_with_most_pages():
    """No free page for the decodes to run: gLLM preempts ready decodes, most pages first
    (`check_preempt`), and raises its reserve ratio by 0.05."""
    p = gllm(max_batch_size=4, pp=1, max_positions=64, kv_slots=1, block_size=4)
    add(p, 0, 4, 8)
    add(p, 1, 8, 8)
    mb = p.schedule(0.0)
    assert contents([mb]) == [[(0, 0, 4, False), (1, 0, 8, False)]]  # 1 + 2 pages
    p.on_result(mb, SampledTokens(mb.mb_id, {0: 5, 1: 5}), 1.0)
    for _ in range(p.pool.num_free):  # the pool full from outside
        p.pool.take()
    ratio = p.ratio
    mb = p.schedule(1.0)  # 2 decodes want 2 pages: 1 (2 pages) goes, 0 decodes
    assert contents([mb]) == [[(0, 4, 1, True)]]
    assert p.requests[1].num_preemptions == 1 and [r.request_id for r in p.waiting] == [1]
    assert p.ratio == pytest.approx(ratio + 0.05 - 0.002)


@pytest.mark.parametrize("name", ["sarathi-serve", "gllm"])
def test_new_baselines_are_registered(name):  # the registries' agreement: tests/config/test_names.py
    from pp_runtime.planner import PLANNERS

    assert PLANNERS[name].name == name
