"""`uniform`'s round from the KV pages (planner/memory.py), by hand."""
from types import SimpleNamespace

import pytest

from pp_runtime.core.request import Request, SamplingParams
from pp_runtime.planner.memory import MemoryRound
from test_uniform import beside_a_decode, toy


def paged(blocks=505, watermark=5):
    return SimpleNamespace(paged=True, pool=SimpleNamespace(num_blocks=blocks),
                           watermark=watermark, block_size=16, per_context=64)


def arrivals(m, n, every, prompt=100, max_tokens=50):
    for i in range(n):
        m.add(Request(i, [1] * prompt, SamplingParams(max_tokens=max_tokens), seed=0,
                      arrival_s=every * i))


def test_the_round_keeps_the_p99_of_the_requests_in_flight_within_the_pages():
    """17 arrivals 0.1 s apart: 10 a second; 100 prompt and 50 output tokens, so a request
    holds 100 + 50 / 2 = 125 positions over its life; 505 blocks less a watermark of 5, of
    16 positions: 8000 positions, n = 64 requests. The p99 of a Poisson count of mean x is
    within 64 while x + 2.326 sqrt(x) <= 64: x = ((2.326^2 + 4 x 64)^0.5 - 2.326)^2 / 4 =
    47.91; a life of D rounds R at 10 arrivals a second: R = 47.91 / (10 x 50) = 95.8 ms.
    Half the output made (out_share 0.5): 100 + 12.5 positions, n = 71.1, x = 54.0, R =
    54.0 / (10 x 25) = 216.1 ms."""
    m = MemoryRound(seq_len=1024, kv=paged())
    arrivals(m, 17, 0.1)
    x = ((2.326 ** 2 + 4 * 64) ** 0.5 - 2.326) ** 2 / 4
    assert x + 2.326 * x ** 0.5 == pytest.approx(64)
    assert m.round_s(1.6, 1.0) == pytest.approx(x / 500)
    assert m.round_s(1.6, 1.0) == pytest.approx(0.0958, abs=1e-4)
    assert m.round_s(1.6, 0.5) == pytest.approx(0.2161, abs=1e-4)


def test_no_reading_before_16_arrivals_and_whole_contexts_without_paging():
    """15 arrivals: no reading (inf). Without paging a request takes a whole context: 505
    blocks of 64-block contexts hold 7 requests, x + 2.326 sqrt(x) <= 7: x = 2.67."""
    m = MemoryRound(seq_len=1024, kv=paged())
    arrivals(m, 15, 0.1)
    assert m.round_s(1.4, 1.0) == float("inf")
    whole = MemoryRound(seq_len=1024, kv=SimpleNamespace(**{**vars(paged()), "paged": False}))
    arrivals(whole, 17, 0.1)
    x = ((2.326 ** 2 + 28) ** 0.5 - 2.326) ** 2 / 4
    assert whole.round_s(1.6, 1.0) == pytest.approx(x / 500)


def test_a_round_the_pages_cannot_sustain_cuts_the_chunk_as_a_tighter_target_would():
    """As test_uniform's `test_the_tbt_target_cuts_the_chunk_by_the_round` (S = 30 ms: 656
    tokens), with the pages sustaining a 20 ms round at the measured load: the micro-batch
    must come back by 0.95 x 20 = 19 ms; half of the slack: 2.222 + 0.5 x 16.778 = 10.611
    ms >= 2 x (1.101 + 0.01 (n + 1)) -> n = 419. With the pages sustaining 40 ms the
    target's 30 ms holds: 656."""
    for room, chunk in ((0.020, 419), (0.040, 656)):
        p = toy(in_flight=2, tbt_slo_ms=30.0)
        p.memory.round_s = lambda now, share, room=room: room
        assert beside_a_decode(p) == [(0, 1, True), (1, chunk, False)]
