"""`uniform`'s hot-path shortcuts (issue 39: the plan simulates ~10^6 micro-batches) give
exactly what the plain formulations they replace give: the pipeline clock's last stage
without its lists, admission that stops before its sums when the pool is short, and the
round's bound from the micro-batches bringing tokens rather than from every request."""
import random

from helpers import add, planner

from pp_runtime.core.batch import SampledTokens
from pp_runtime.planner.budget import PipelineClock


class Stages:
    """A toy pipeline cost: stage s takes (1 + s) x (0.1 ms + 0.01 ms per token + 0.001 ms
    per KV position of a decode); a send 0.05 ms + 0.001 ms per token."""

    def stage_times(self, prefills, kv):
        tokens = sum(n for _, n in prefills) + len(kv)
        base = 1e-4 + 1e-5 * tokens + 1e-6 * sum(kv)
        return [(1 + s) * base for s in range(4)]

    def microbatch_time(self, prefills, kv):
        return max(self.stage_times(prefills, kv))

    def send_time(self, tokens, stage):
        return 5e-5 + 1e-6 * tokens


def test_the_clock_end_is_the_last_stage_of_its_completion_to_the_bit():
    """end(now, chunks, kv, scale, tokens) == completion(now, times(chunks, kv, scale),
    tokens)[-1] exactly (==, not approx), before and after its sends are priced, with
    micro-batches in flight ahead of it."""
    rng = random.Random(0)
    clock = PipelineClock(Stages(), 4)
    now = 0.0
    for mb_id in range(200):
        chunks = [(rng.randrange(0, 900), rng.randrange(1, 300)) for _ in range(rng.randrange(0, 3))]
        kv = [rng.randrange(1, 2000) for _ in range(rng.randrange(0, 40))]
        tokens, scale = sum(n for _, n in chunks) + len(kv), rng.uniform(0.5, 2.0)
        if not tokens:
            continue
        end = clock.end(now, chunks, kv, scale, tokens)  # the sends of this size: maybe new
        assert end == clock.completion(now, clock.times(chunks, kv, scale), tokens)[-1]
        assert end == clock.end(now, chunks, kv, scale, tokens)  # and once they are known
        clock.commit(mb_id, clock.completion(now, clock.times(chunks, kv, scale), tokens))
        now += rng.uniform(0.0, 2e-3)


def test_admission_with_the_pool_short_admits_nothing_and_skips_its_sums():
    """16-token pages, a pool of 32 (2 contexts of 256), no watermark. Request 0 (100 tokens,
    20 out: 7 pages) runs; request 1 (400 tokens: 25 pages, 2 more to grow, 30 % kept: 25.6)
    needs more than the 25 free even before request 0's owed growth: `kv_short`, and
    admit() returns before its sums (a running request's expected length is never read)."""
    p = planner("uniform", paged=True, kv_slots=2, max_seq_len=256, watermark=0.0)
    add(p, 0, 100, 20)
    p.admit(0.0)
    assert len(p.running) == 1 and p.kv.pool.num_free == 25
    p.waiting.clear()
    add(p, 1, 230, 26)  # 15 pages; 256 tokens at the end: 16 pages, 0.3 of 1 kept -> 15.3
    assert not p.kv_short(p.waiting[0])
    p.waiting.clear()
    add(p, 2, 250, 100)  # 16 pages, capped at 256 tokens: 16 -> 16 <= 25: fits
    assert not p.kv_short(p.waiting[0])
    p.kv.pool.free.clear()  # nothing free: every request is short
    assert p.kv_short(p.waiting[0]) is True
    asked, plain = [], p.expected_len
    p.expected_len = lambda r: asked.append(r.request_id) or plain(r)
    p.admit(0.0)  # returns at once: the waiting request's length only, nothing admitted
    assert asked == [2] and [r.request_id for r in p.running] == [0]


def test_the_rounds_bound_counts_every_token_on_its_way():
    """S = 30 ms, pp 2: requests 0-3 each get a first token, then their decodes go out in
    two micro-batches (an even share of the round each); the bound is 0.95 x S after the earliest predicted return among them,
    the minimum over `returning` (every request) that the per-micro-batch counts give."""
    p = planner("uniform", paged=True, kv_slots=8, max_seq_len=512, pp=2, in_flight=2,
                tbt_slo_ms=30.0)
    for rid in range(4):
        add(p, rid, 16, 10)
    first = p.schedule(0.0)
    p.on_result(first, SampledTokens(first.mb_id, {s.request_id: 1 for s in first.seqs if s.sampling}), 1e-3)
    a, b = p.schedule(1e-3), p.schedule(1e-3)
    assert {s.request_id for s in a.seqs} | {s.request_id for s in b.seqs} == {0, 1, 2, 3}
    assert sum(p.carrying.values()) == len(p.returning) == 4
    done = p.clock.done
    expect = min(done[m] for m in p.returning.values()) + 0.95 * 30e-3
    assert p.round_bound(1e-3, []) == expect
    p.on_result(a, SampledTokens(a.mb_id, {s.request_id: 1 for s in a.seqs}), 2e-3)
    assert set(p.carrying) == {b.mb_id} and sum(p.carrying.values()) == len(b.seqs)


def test_planned_ahead_the_bound_follows_the_token_on_its_way():
    """S = 30 ms, pp 2, planning ahead (the token hop). Request 0's first token comes in
    micro-batch A; its next decode goes out in B, then (planned ahead, B's token still on
    its way) in D, two micro-batches after B (C and E: request 1's). When B comes back, D still
    brings request 0's next token: `returning` keeps D (B's return must not drop it), and
    the bound for request 0 planned ahead again is D's predicted return + 0.95 x S, not
    B's token + 0.95 x S (that spans two rounds: B -> D -> the next)."""
    p = planner("uniform", paged=True, kv_slots=8, max_seq_len=512, pp=2, tbt_slo_ms=30.0)
    assert p.plan_ahead(True)
    add(p, 0, 16, 10)
    a = p.schedule(0.0)
    p.on_result(a, SampledTokens(a.mb_id, {0: 1}), 1e-3)
    b = p.schedule(1e-3)  # request 0's decode, its token on its way in B
    add(p, 1, 16, 10, arrival=1e-3)
    c = p.schedule(1e-3)  # request 1's prompt (request 0 is one micro-batch behind)
    d = p.schedule(1e-3)  # planned ahead: request 0's next decode, B still out
    assert [s.request_id for s in b.seqs] == [0] and 0 in {s.request_id for s in d.seqs}
    assert p.returning[0] == d.mb_id
    p.on_result(b, SampledTokens(b.mb_id, {0: 1}), 2e-3)
    assert p.returning[0] == d.mb_id and p.carrying[d.mb_id] >= 1  # D still brings it
    p.on_result(c, SampledTokens(c.mb_id, {1: 1}), 3e-3)
    e = p.schedule(3e-3)  # request 1's decode (request 0's D is one micro-batch back)
    assert [s.request_id for s in e.seqs] == [1]
    lent = p._lend(p._next_mb)  # request 0 looks idle again: D is two micro-batches back
    try:
        assert 0 in [r.request_id for r, _ in lent]
        bound = p.round_bound(3e-3, [0])
    finally:
        for r, computed in lent:
            r.num_computed = computed
    assert bound == p.clock.done[d.mb_id] + 0.95 * 30e-3
    assert bound > p.last_token_s[0] + 0.95 * 30e-3


class TwoStages(Stages):
    """Two stages of equal price (`Stages`' first)."""

    def stage_times(self, prefills, kv):
        first = super().stage_times(prefills, kv)[0]
        return [first, first]


def test_planned_ahead_the_clock_starts_a_micro_batch_when_its_tokens_are_back():
    """Planning ahead, a micro-batch whose decodes wait for tokens still on their way
    cannot start on stage 0 before the latest of them is back and has crossed the hop to
    stage 0 (one token's send): the clock starts it there, not when stage 0 is free (which
    predicted its return early and let the TBT target pass at overload). Toy pipeline of
    two equal stages; request 0 decoding: B carries its decode, C a
    prompt (C), D request 0's next decode planned ahead with B still out, by hand:
    stage 0 from max(B's return + hop, stage 0 free), stage 1 after the send."""
    cost = TwoStages()
    p = planner("uniform", paged=True, kv_slots=8, max_seq_len=512, pp=2, tbt_slo_ms=30.0)
    p.clock, p.hop_s = PipelineClock(cost, 2), cost.send_time(1, 1)
    assert p.plan_ahead(True)
    add(p, 0, 16, 10)
    a = p.schedule(0.0)
    p.on_result(a, SampledTokens(a.mb_id, {0: 1}), 1e-3)
    b = p.schedule(1e-3)
    add(p, 1, 1, 10, arrival=1e-3)
    p.schedule(1e-3)  # C: a one-token prompt, shorter on stage 0 than B's way back
    free = list(p.clock.free)
    d = p.schedule(1e-3)
    assert [s.request_id for s in d.seqs] == [0] and d.placeholders == ((0, b.mb_id),)
    back = p.clock.done[b.mb_id] + p.hop_s  # B's token at stage 0
    assert back > free[0]  # stage 0 is free before the token is back: the case at hand
    t0, t1 = cost.stage_times([], [d.seqs[0].start + 1])
    end0 = max(back, free[0]) + t0
    assert end0 + cost.send_time(1, 1) > free[1]  # and stage 1 waits for it, not for C
    assert p.clock.done[d.mb_id] == max(end0 + cost.send_time(1, 1), free[1]) + t1
    assert p.tokens_back(1e-3, [b.mb_id, None]) == back
    p.ahead = False  # not planning ahead: the clock starts it at `now`
    assert p.tokens_back(1e-3, [b.mb_id]) == 1e-3
