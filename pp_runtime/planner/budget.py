"""The time a micro-batch may take, from the deployment's latency targets (`uniform`).

A decode rides one micro-batch of every round of `depth` micro-batches in flight, so the
time between its tokens is about depth x the period of a micro-batch. For a TBT target S:

    T = margin x S / depth                      (margin: room for the tail)

The margin is 0.95, or less where the tokens' gaps come out longer than planned: when a
micro-batch is planned, each token it will bring has a planned gap (its predicted return
less the request's previous token, as then known: back, or predicted on its way); when it
comes back, `unplanned` keeps how much longer each gap came out (the last `GAP_WINDOW`),
and every `TAIL_EVERY` returns the margin becomes 1 - (their p99) / S where that is below
0.95 (at least `MIN_MARGIN`). On the simulator the clock is exact to well under the 5 % of
S that 0.95 leaves, so the margin stays 0.95 there; on this CPU's real PP = 2 pipeline
(Ray calls, two processes on two cores) micro-batches come back up to 66-83 ms late (p99)
against 15 ms of room at a 300 ms target, but a late return delays the tokens before and
after it alike: a margin read from how late each return came (1 - p99 late / S, until
2026-11-28) sat at 0.63-0.88 while the p99 time between tokens stayed 70 ms under S. The
tokens' realized gaps alone do not tell jitter from a plan: a micro-batch the TTFT need
takes past its round's deadline lengthens gaps on purpose, and a margin cut for those (as
tried, the same day) took 4.6 % of a simulated GPT-3 cell's capacity.

Beside T, every micro-batch has a token budget K, the throughput knee of the cost model:
the smallest micro-batch (prefill tokens and decode rows, in whole tiles) whose time per
token is within `KNEE_SLACK` of the best any size reaches. Past it more tokens stop
lowering the time per token: they only lengthen the wait for a first token. Below it the
weights are read for too few tokens. With no target, T is unbounded and K alone sets the
micro-batch (decodes first, prefill to K), so an offline batch runs at the knee.

T at the 0.95 margin (`pace_s`) sizes the rows (admission); each micro-batch is then
bounded by the round it starts.
`PipelineClock` replays the pipeline on predicted stage times (in order, stage by stage,
sends included), so it knows when each micro-batch in flight will come back. A new one
may come back no later than S after the last token of every decode it carries; its
predicted return includes the wait behind every micro-batch ahead of it, which a fixed
per-micro-batch T does not see: after a lull, a burst of prompts delays every request
behind it, and a T alone let the p99 time between tokens pass S.

Predicted times come from the one cost model (`costmodel/`); `observe` corrects them by
the measured micro-batches (the residual: measured / predicted over the stage that took
longest, sends included, a moving average), so a pipeline slower than priced shrinks
what each micro-batch carries by itself. No torch.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Sequence

from pp_runtime.core.errors import ConfigError
from pp_runtime.planner.cost import CostModel

KNEE_SLACK = 0.05  # the knee: time per token within 5 % of the best
KNEE_MAX_TOKENS = 16384  # largest micro-batch the knee search prices
MARGIN = 0.95  # share of the TBT target a round is planned to: the p99's room
MIN_MARGIN = 0.5  # the measured tail never takes more than half the target
TAIL_EVERY = 32  # returns between two readings of the p99 (none under GAP_MIN gaps)
GAP_MIN = 256  # gaps a reading needs (their p99: the 3rd largest of 256)
GAP_WINDOW = 2048  # gaps whose unplanned excess sets the margin (the last ones)
RESIDUAL_WEIGHT = 0.05  # moving-average weight of one measured micro-batch
RESIDUAL_RANGE = (1e-3, 1e3)  # a ratio outside is a measurement gone wrong: clamped (a CPU
#                              priced on the shipped A100 tables is ~10^2 slower: kept)


def knee(cost: CostModel, tile: int, slack: float = KNEE_SLACK,
         top: int = KNEE_MAX_TOKENS) -> tuple[int, float]:
    """(tokens, seconds) of the smallest prefill-only micro-batch, in whole tiles, whose
    time per token is within `slack` of the best up to `top` tokens. Found once per cost
    model (a cost model's prices never change; the plan's probes make a planner each on
    the same one, and this search cost 11 ms of each)."""
    try:
        return _kept_knee(cost, tile, slack, top)
    except TypeError:  # a cost model that is not hashable (a test's dataclass)
        return _knee(cost, tile, slack, top)


@lru_cache(maxsize=64)
def _kept_knee(cost: CostModel, tile: int, slack: float, top: int) -> tuple[int, float]:
    return _knee(cost, tile, slack, top)


def _knee(cost: CostModel, tile: int, slack: float, top: int) -> tuple[int, float]:
    sizes = list(range(tile, top + 1, tile))
    per_token = [cost.microbatch_time([(0, n)], []) / n for n in sizes]
    best = min(per_token)
    n = next(s for s, t in zip(sizes, per_token) if t <= (1 + slack) * best)
    return n, cost.microbatch_time([(0, n)], [])


def decode_floor(cost: CostModel, depth: int) -> float:
    """The shortest time between tokens any load can have: one decode alone, `depth`
    micro-batches to a round."""
    return depth * cost.microbatch_time([], [1])


class TimeBudget:
    """T for the next micro-batch, and the cost model's prediction corrected by what the
    pipeline measured."""

    def __init__(self, cost: CostModel, depth: int, tile: int, tbt_slo_s: float | None = None,
                 ttft_slo_s: float | None = None, target_s: float | None = None):
        self.cost, self.depth = cost, depth
        self.tbt_slo_s, self.ttft_slo_s = tbt_slo_s, ttft_slo_s
        self.margin = MARGIN  # share of S a round is planned to (`unplanned`)
        self.excess: deque[float] = deque(maxlen=GAP_WINDOW)  # gaps less their plan, last ones
        self.returns = 0  # micro-batches folded in by `unplanned`
        self.room = (1 - MARGIN) * tbt_slo_s if tbt_slo_s is not None else 0.0
        self.over = 0  # excesses in the window above `room`
        self.target_s = target_s
        self.knee_tokens, self.knee_s = knee(cost, tile)
        if tbt_slo_s is not None:
            floor = decode_floor(cost, depth)
            if tbt_slo_s <= floor:
                raise ConfigError(
                    f"planner.tbt_slo_ms: {tbt_slo_s * 1e3:g} ms is below one decode through "
                    f"the pipeline ({depth} micro-batches in flight x "
                    f"{floor / depth * 1e3:.3g} ms = {floor * 1e3:.3g} ms, the floor); raise it "
                    "above the floor, or lower pp / the in-flight depth")
        if target_s is not None:  # planner.target_ms: T set by hand
            self.base_s = target_s
        elif tbt_slo_s is not None:
            self.base_s = self.margin * tbt_slo_s / depth
        else:
            self.base_s = float("inf")
        self.residual = 1.0  # measured / predicted, a moving average
        self.observed = 0  # micro-batches folded in

    @property
    def period_s(self) -> float:
        """T in the cost model's seconds: the budget less what the pipeline measured slower."""
        return self.base_s / self.residual

    @property
    def pace_s(self) -> float:
        """T at the 0.95 margin, whatever `unplanned` made it: what a micro-batch may carry at
        the target's pace. A host's jitter is noise added to a round, not a cost of each row,
        so admission's row count is priced on this (rounds are still planned to T)."""
        if self.target_s is not None or self.tbt_slo_s is None:
            return self.period_s
        return MARGIN * self.tbt_slo_s / self.depth / self.residual

    def time(self, prefills: Sequence[tuple[int, int]], kv: Sequence[int]) -> float:
        """The cost model's seconds for a micro-batch (compare with `period_s`)."""
        return self.cost.microbatch_time(prefills, kv)

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """One micro-batch came back: fold measured / predicted into the residual."""
        if predicted_s <= 0 or measured_s <= 0:
            return
        lo, hi = RESIDUAL_RANGE
        ratio = min(hi, max(lo, measured_s / predicted_s))
        weight = max(RESIDUAL_WEIGHT, 1 / (self.observed + 1))  # the first ones: their mean
        self.residual += weight * (ratio - self.residual)
        self.observed += 1

    def unplanned(self, excess_s: Sequence[float]) -> None:
        """A micro-batch came back bringing tokens whose gaps to the token before came out
        `excess_s` longer than planned (negative: shorter). Every TAIL_EVERY returns, with
        GAP_MIN of them kept, the margin becomes min(0.95, 1 - p99 / S) of the last
        GAP_WINDOW (at least MIN_MARGIN), and T follows it."""
        if self.tbt_slo_s is None:
            return
        window, room = self.excess, self.room
        for e in excess_s:
            if len(window) == GAP_WINDOW and window[0] > room:
                self.over -= 1  # it leaves the window
            window.append(e)
            if e > room:
                self.over += 1
        self.returns += 1
        if self.returns % TAIL_EVERY or len(window) < GAP_MIN:
            return
        if not self.over and self.margin == MARGIN:
            return  # (none past the room 0.95 leaves: the margin stays; the simulator's case)
        tail = sorted(window)[int(0.99 * (len(window) - 1))]
        margin = max(MIN_MARGIN, min(MARGIN, 1 - tail / self.tbt_slo_s))
        if margin != self.margin:
            self.margin = margin
            if self.target_s is None:  # target_ms sets T by hand: only the deadline moves
                self.base_s = margin * self.tbt_slo_s / self.depth

    def largest(self, fits, hi: int) -> int:
        """The largest n in [0, hi] with fits(n) (fits grows false with n); binary search."""
        if hi <= 0 or fits(hi):
            return max(hi, 0)
        lo, hi = 0, hi - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


def largest_at_most(f, limit: float, hi: int) -> int:
    """`TimeBudget.largest(lambda n: f(n) <= limit, hi)`: the same calls of f in the same
    order, without a lambda between each (the plan's probes run ~10^6 of these searches)."""
    if hi <= 0 or f(hi) <= limit:
        return max(hi, 0)
    lo, hi = 0, hi - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if f(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PipelineClock:
    """Predicted stage times of the micro-batches in flight, replayed as the pipeline runs
    them: each stage takes micro-batches in order, after the previous stage sent them."""

    def __init__(self, cost: CostModel, pp: int):
        self.cost, self.pp = cost, pp
        self.stage_times = getattr(cost, "stage_times", None)
        self.keep = getattr(cost, "keep_stage_times", None)
        self.send = getattr(cost, "send_time", None)
        self.free = [0.0] * pp  # when each stage ends its last micro-batch (predicted)
        self.done: dict[int, float] = {}  # mb_id in flight -> predicted completion
        self.sends: dict[int, list[float]] = {}  # tokens -> each stage's send (0 for stage 0)

    def times(self, prefills: Sequence[tuple[int, int]], kv: Sequence[int],
              scale: float) -> list[float]:
        if self.stage_times is None:
            return [scale * self.cost.microbatch_time(prefills, kv)] * self.pp
        if scale == 1.0:  # 1.0 * t is t
            return self.stage_times(prefills, kv)
        return [scale * t for t in self.stage_times(prefills, kv)]

    def committed_times(self, prefills: list[tuple[int, int]], kv: list[int]) -> list[float]:
        """`times(prefills, kv, 1.0)` of a micro-batch about to be submitted, kept by the cost
        model where it can (`keep_stage_times`: the simulated executor prices it next); the
        lists must not change afterwards."""
        if self.keep is None:
            return self.times(prefills, kv, 1.0)
        return self.keep(prefills, kv)

    def completion(self, now: float, times: list[float], tokens: int) -> list[float]:
        """Each stage's predicted end for a micro-batch submitted now (committing nothing)."""
        sends = self.sends.get(tokens)
        if sends is None:  # a binary search asks for the same sizes again and again
            sends = self.sends[tokens] = [self.send(tokens, s) if s and self.send else 0.0
                                          for s in range(self.pp)]
        ends, prev, free = [], now, self.free
        for s, t in enumerate(times):
            ready = prev + sends[s]
            start = ready if ready > free[s] else free[s]
            prev = start + t
            ends.append(prev)
        return ends

    def end(self, now: float, prefills: Sequence[tuple[int, int]], kv: Sequence[int],
            scale: float, tokens: int) -> float:
        """`completion(now, times(prefills, kv, scale), tokens)[-1]` without building
        either list: the same arithmetic in the same order (a binary search calls it ~10
        times per micro-batch)."""
        sends = self.sends.get(tokens)
        if sends is None:
            return self.completion(now, self.times(prefills, kv, scale), tokens)[-1]
        if self.stage_times is None:
            times = [self.cost.microbatch_time(prefills, kv)] * self.pp
        else:
            times = self.stage_times(prefills, kv)
        prev, free = now, self.free
        for s, t in enumerate(times):
            ready = prev + sends[s]
            start = ready if ready > free[s] else free[s]
            prev = start + scale * t
        return prev

    def ends_with_chunk(self, now: float, prefills: Sequence[tuple[int, int]],
                        kv: Sequence[int], scale: float, start: int, tokens: int):
        """n -> `end(now, [*prefills, (start, n)], kv, scale, tokens + n)`, for a binary
        search over n: what does not depend on n priced once (`with_chunk` of the cost
        model), the same arithmetic in the same order, so the same float to the bit."""
        with_chunk = getattr(self.cost, "with_chunk", None)
        priced = with_chunk(prefills, kv) if with_chunk is not None and self.stage_times else None
        if priced is None:
            return lambda n: self.end(now, [*prefills, (start, n)], kv, scale, tokens + n)
        pp, all_sends, end = self.pp, self.sends, self.end
        free = self.free
        last = pp - 1

        def ends(n: int) -> float:
            sends = all_sends.get(tokens + n)
            if sends is None:  # priced and kept by `completion`, as `end` does
                return end(now, [*prefills, (start, n)], kv, scale, tokens + n)
            first, mid, tail = priced(start, n)
            ready = now + sends[0]
            prev = (ready if ready > free[0] else free[0]) + scale * first
            if pp == 1:
                return prev
            if last > 1:  # the middle stages, all of the same layers (`with_chunk`)
                step = scale * mid
                for s in range(1, last):
                    ready = prev + sends[s]
                    f = free[s]
                    prev = (ready if ready > f else f) + step
            ready = prev + sends[last]
            f = free[last]
            return (ready if ready > f else f) + scale * tail

        return ends

    def commit(self, mb_id: int, ends: list[float]) -> None:
        self.free = ends
        self.done[mb_id] = ends[-1]

    def start_after(self, now: float, sources, hop_s: float) -> float:
        """The predicted return of the latest of micro-batches `sources` (None: none) plus
        one token's hop to stage 0, or `now` if later."""
        done, start = self.done, now
        for src in sources:
            t = done.get(src) if src is not None else None
            if t is not None and t + hop_s > start:
                start = t + hop_s
        return start

    def returned(self, mb_id: int, now: float) -> None:
        """A micro-batch came back at `now`: the prediction of everything behind it shifts
        by its error (the pipeline ran late or early by as much)."""
        predicted = self.done.pop(mb_id, None)
        if predicted is None:
            return
        shift = now - predicted
        self.free = [t if (t := f + shift) > now else now for f in self.free]  # max(now, f + shift)
        for k in self.done:
            self.done[k] += shift
