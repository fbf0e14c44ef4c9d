"""The baselines SARATHI is measured against, on hand-made request sets."""
from helpers import add, contents, drive, planner


def three(p):
    add(p, 0, 10, 3)
    add(p, 1, 12, 2)
    add(p, 2, 4, 1)


def test_orca_best_one_whole_prefill_plus_decodes():
    p = planner("orca-best", max_batch_size=3, chunk_size=8)  # chunk size is ignored
    three(p)
    assert contents(drive(p, 1)) == [
        [(0, 0, 10, False)],
        [(0, 10, 1, True), (1, 0, 12, False)],
        [(0, 11, 1, True), (1, 12, 1, True), (2, 0, 4, False)],  # 0 and 1 finish; 2 (1 token)
    ]


def test_orca_worst_prefills_and_decodes_never_mix():
    p = planner("orca-worst", max_batch_size=2)
    three(p)
    assert contents(drive(p, 1)) == [
        [(0, 0, 10, False), (1, 0, 12, False)],  # up to B whole prefills together
        [(0, 10, 1, True), (1, 12, 1, True)],  # 1 finishes (2 tokens)
        [(2, 0, 4, False)],  # a waiting prefill goes before 0's decode; 2 finishes
        [(0, 11, 1, True)],
    ]


def test_vllm_prefill_first_within_token_budget():
    p = planner("vllm", max_batch_size=4, token_budget=16)
    three(p)
    add(p, 3, 30, 1)  # longer than the budget: runs alone
    assert contents(drive(p, 1)) == [
        [(0, 0, 10, False)],  # 10 + 12 > 16: request 1 waits
        [(1, 0, 12, False), (2, 0, 4, False)],  # 12 + 4 = 16 fits; 2 finishes
        [(3, 0, 30, False)],  # alone, over budget; finishes
        [(0, 10, 1, True), (1, 12, 1, True)],  # decodes only when no prefill waits
        [(0, 11, 1, True)],
    ]


def test_request_level_groups_start_and_end_together():
    p = planner("request-level", max_batch_size=2)
    three(p)
    assert contents(drive(p, 1)) == [
        [(0, 0, 10, False), (1, 0, 12, False)],
        [(0, 10, 1, True), (1, 12, 1, True)],  # 1 is done but holds its slot
        [(0, 11, 1, True)],  # group ends: slots free
        [(2, 0, 4, False)],  # the next group
    ]


def test_request_level_keeps_slots_until_the_group_ends():
    p = planner("request-level", max_batch_size=2, kv_slots=2)
    three(p)
    p.schedule(0.0)
    assert p.kv.pool.num_free == 0 and [r.request_id for r in p.waiting] == [2]


def test_requests_wait_for_their_arrival():
    p = planner("sarathi", chunk_size=16, max_batch_size=2, tile_size=16)
    add(p, 0, 4, 1, arrival=0.0)
    add(p, 1, 4, 1, arrival=5.0)
    log = drive(p, 1)
    assert contents(log) == [[(0, 0, 4, False)], [(1, 0, 4, False)]]
    assert p.requests[1].first_token_s == 6.0  # admitted at 5, done one tick later


def test_vllm_never_exceeds_b_sequences():
    p = planner("vllm", max_batch_size=2)
    for rid in range(5):
        add(p, rid, 3, 1)
    assert [len(mb.seqs) for mb in drive(p, 1)] == [2, 2, 1]
