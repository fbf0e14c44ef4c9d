"""Issue 39's third hot-path pass: what is priced once per micro-batch instead of once per
step of a binary search gives exactly (==, not approx) the seconds of the plain calls it
replaces, on the real cost model: `StageCostModel.with_chunk` and `with_chunk_decodes`
against `stage_times`, `PipelineClock.ends_with_chunk` against `PipelineClock.end`, and
the layer split's dynamic programme written out against its plain formulation."""
import random

import pytest

from pp_runtime.config import Config, load_model_config
from pp_runtime.costmodel import build_cost_model
from pp_runtime.costmodel.balance import balanced_units
from pp_runtime.planner.budget import PipelineClock


def cost_model(tp: int, pp: int, split: list | str = "even", model: str = "gpt3-175b",
               gpu: str = "a100-80gb"):
    cfg = Config(model=load_model_config(model)).with_overrides(**{
        "hardware.gpu": gpu, "parallel.tp": tp, "parallel.pp": pp, "parallel.layer_split": split})
    return build_cost_model(cfg)


LAYOUTS = [  # (tp, pp, split): one stage, two, deep, uneven ends, a layer cut in two
    (8, 1, "even"), (8, 2, "even"), (4, 12, "even"), (2, 32, "even"),
    (4, 4, [22, 26, 26, 22]), (4, 4, [20, 26, 28, 22]), (4, 3, [31.5, 33, 31.5])]


@pytest.mark.parametrize("tp, pp, split", LAYOUTS)
def test_a_chunk_priced_on_a_fixed_part_is_priced_to_the_bit(tp, pp, split):
    cost = cost_model(tp, pp, split)
    rng = random.Random(pp)
    for _ in range(300):
        chunks = [(rng.randrange(0, 3000), rng.randrange(1, 600)) for _ in range(rng.randrange(0, 3))]
        kv = [rng.randrange(1, 4000) for _ in range(rng.randrange(0, 60))]
        priced = cost.with_chunk(chunks, kv)
        same = cost.with_chunk_decodes(chunks, len(kv), kv[0] if kv else 1)
        if priced is None:  # a layer cut in two, or middle stages of different layers
            assert split != "even" and same is None
            continue
        for _ in range(5):
            start, n = rng.randrange(0, 3000), rng.randrange(0, 2000)
            times = cost.stage_times([*chunks, (start, n)], kv)
            first, mid, last = priced(start, n)
            assert (first, last) == (times[0], times[-1])
            assert all(t == mid for t in times[1:-1])
            if kv:
                first, mid, last = same(start, n)
                times = cost.stage_times([*chunks, (start, n)], [kv[0]] * len(kv))
                assert (first, last) == (times[0], times[-1]) and all(t == mid for t in times[1:-1])


@pytest.mark.parametrize("tp, pp, split", LAYOUTS)
def test_the_clock_s_binary_search_ends_are_its_end_to_the_bit(tp, pp, split):
    """`ends_with_chunk(now, chunks, kv, scale, start, tokens)(n)` ==
    `end(now, [*chunks, (start, n)], kv, scale, tokens + n)`, micro-batches in flight
    ahead, sends priced or not yet."""
    cost = cost_model(tp, pp, split)
    clock, rng, now = PipelineClock(cost, pp), random.Random(7 + pp), 0.0
    for mb_id in range(150):
        chunks = [(rng.randrange(0, 3000), rng.randrange(1, 600)) for _ in range(rng.randrange(0, 3))]
        kv = [rng.randrange(1, 4000) for _ in range(rng.randrange(0, 60))]
        tokens, scale, start = sum(n for _, n in chunks) + len(kv), rng.uniform(0.5, 2.0), rng.randrange(0, 3000)
        ends = clock.ends_with_chunk(now, chunks, kv, scale, start, tokens)
        for n in sorted(rng.randrange(0, 1500) for _ in range(8)):
            assert ends(n) == clock.end(now, [*chunks, (start, n)], kv, scale, tokens + n)
        if tokens:
            clock.commit(mb_id, clock.completion(now, clock.times(chunks, kv, scale), tokens))
        now += rng.uniform(0.0, 0.05)


def plain_units(unit_s, extra_s):
    """`balanced_units` as it was written before its first pass was written out."""
    from pp_runtime.costmodel.balance import _REL
    pp, total = len(extra_s), len(unit_s)
    prefix = [0.0]
    for u in unit_s:
        prefix.append(prefix[-1] + u)
    cost = lambda s, n, k: prefix[n] - prefix[n - k] + extra_s[s]  # noqa: E731
    choices = lambda s, n: range(1, n - s + 1) if s else range(n, n + 1)  # noqa: E731
    inf = float("inf")
    worst = [[inf] * (total + 1) for _ in range(pp)]
    for s in range(pp):
        for n in range(s + 1, total - (pp - 1 - s) + 1):
            worst[s][n] = min(max(worst[s - 1][n - k] if s else -inf, cost(s, n, k))
                              for k in choices(s, n))
    cap = worst[pp - 1][total] * (1 + _REL) + 1e-15
    squares = [[inf] * (total + 1) for _ in range(pp)]
    take = [[0] * (total + 1) for _ in range(pp)]
    for s in range(pp):
        for n in range(s + 1, total - (pp - 1 - s) + 1):
            for k in choices(s, n):
                t = cost(s, n, k)
                if t > cap:
                    break
                total_sq = (squares[s - 1][n - k] if s else 0.0) + t * t
                if total_sq < squares[s][n] * (1 - _REL):
                    squares[s][n], take[s][n] = total_sq, k
    split, n = [], total
    for s in reversed(range(pp)):
        split.append(take[s][n])
        n -= take[s][n]
    return split[::-1]


def test_the_layer_split_written_out_is_the_plain_one():
    rng = random.Random(3)
    for _ in range(40):
        units = [rng.choice([1.0, rng.uniform(0.2, 2.0)]) for _ in range(rng.choice([4, 12, 40, 96]))]
        extra = [rng.choice([0.0, rng.uniform(0.0, 5.0)]) for _ in range(rng.choice([1, 2, 3, 4]))]
        assert balanced_units(units, extra) == plain_units(units, extra)
