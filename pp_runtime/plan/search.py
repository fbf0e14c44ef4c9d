"""The search: every layout's capacity on the simulator, in parallel processes (runner.py).

Capacity is a grid point (`probe.rate(k)`, req/s per GPU, 5 % apart): the highest rate
whose probe meets both p99 SLOs, found by bracketing from START x the candidate's bound
in growing steps, then cutting the bracket above its middle (`UPPER`: a miss is cheaper than
a pass) down to one grid step (`grid_capacity`; it assumes, as every capacity search does,
that a rate that misses is missed at every higher one).

Every candidate has an upper bound on its capacity from the cost model alone
(`upper_bound`). A layout's candidates are put in one order (`ordered`: the SLO-driven
uniform first, then by bound), and a layout's best is its highest capacity, the earlier
in that order on a tie, so the answer does not depend on which process finishes first.

  exhaustive  every candidate searched to its capacity;
  fast        first every layout's first candidate, searched to its capacity k; then each
              other one is out without a probe where its bound is below rate(k + 1)
              ("bound"), else probed once at k + 1 and out when it misses there ("lost at
              the layout's best"), else searched to its capacity from its own start, as
              the exhaustive path searches it (a pass at k + 1 that a search from above
              would not have found, where pass or miss is not monotone in the rate, does
              not make the answer differ); a layout whose first met nothing has its
              others searched in order from their own start instead (`fast_phases`;
              the processes: `runner.py`).
On both, a probe that cannot meet the SLOs any more stops early (`probe.Watch`; exact, off
with stop_early False), and every answer is cached (`probe.ProbeCache`): a second
identical search simulates nothing.
Both give every layout the same capacity and the same best candidate, so the same winner
and frontier.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pp_runtime.bench.capacity import Probe
from pp_runtime.config import Config, ConfigError
from pp_runtime.plan.probe import ProbeCache, Prober, Slo, grid_index, rate
from pp_runtime.plan.space import Candidate, Layout, cost_model

REL_TOL = 0.05  # the grid's step (probe.STEP - 1)
START = 0.95  # a search starts at this share of the bound (capacities came at 0.5-1 of it: a
#               miss above is quick and hints where to look, a pass below is a whole run)
FIRST_JUMP = 2  # grid steps of the first bracketing move (x 1.10), doubled after each
NARROW = 3  # a bracket this narrow is searched from its top down: a miss just above the capacity
#             stops before its end, a pass under it runs to the end
FLOOR = 1e-4  # no capacity searched below this share of the bound
NEAR = 0.85  # a miss certain only after this share of its arrivals' time hints one point lower
NEAR_STEPS = 3  # such hints followed one point at a time, at most this many in a row
#                (they do not grow the bracketing jump: a run of them sits at the capacity)
UPPER = 0.7  # a wide bracket is cut this far up: a pass runs its whole arrivals, a miss stops
#              once certain, so probing above the middle spends fewer passes
LOST = "lost at the layout's best"
PASSED = "passed the layout's best"  # fast path, between its phases
__all__ = ["Slo", "Result", "upper_bound", "LOST", "REL_TOL"]  # search(): plan/runner.py


@dataclass
class Result:
    """What the search learnt of one candidate."""

    candidate: Candidate
    bound_qps: float  # the cost model's upper bound on its capacity (all replicas)
    order: int = 0  # its place in its layout's search (ties go to the earlier)
    k: int | None = None  # its capacity's grid point; None: not searched to the end or none met
    outcome: str = "pending"  # searched | lost at the layout's best | bound | budget | error
    probes: list[Probe] = field(default_factory=list)  # in the order run
    detail: dict = field(default_factory=dict)  # the probe at its capacity (or the deciding one)
    seconds: float = 0.0

    @property
    def qps(self) -> float | None:  # capacity of all replicas
        return None if self.k is None else rate(self.k) * self.candidate.layout.gpus

    @property
    def per_gpu(self) -> float:
        return 0.0 if self.k is None else rate(self.k)


@dataclass(frozen=True)
class Workload:
    """What the bound needs of the workload: means over its requests."""

    tokens: float  # prompt + output tokens
    keys: float  # keys its decodes read: sum over output tokens j of (prompt + j)

    @classmethod
    def of(cls, pairs: list[tuple[int, int]]) -> "Workload":
        n = len(pairs)
        return cls(sum(p + d for p, d in pairs) / n,
                   sum(d * p + d * (d + 1) / 2 for p, d in pairs) / n)


def upper_bound(cfg: Config, wl: Workload, replicas: int) -> float:
    """Requests per second the replicas could finish at best: on each stage, every token at
    the best time per token of any micro-batch the candidate can form (at most C + B
    tokens: no bubbles, no SLO) plus the decode attention each request must read (the
    cost model's decode attention is affine in the keys read, its coefficients >= 0); the
    slowest stage bounds the rate."""
    cost = cost_model(cfg, replicas)
    capped = cfg.planner.chunk_size and cfg.planner.max_batch_size
    top = cfg.chunk_tokens + cfg.batch_rows if capped else 16384
    sizes = sorted({max(1, round(top / 2 ** k)) for k in range(15)})
    per_token = [min(ts) for ts in zip(*([x / t for x in cost.stage_times([(0, t)], [])]
                                        for t in sizes))]
    one, more = cost.stage_times([], [1]), cost.stage_times([], [1025])
    per_key = [max(0.0, (b - a) / 1024) for a, b in zip(one, more)]
    slowest = max(t * wl.tokens + k * wl.keys for t, k in zip(per_token, per_key))
    return replicas / slowest


def likely_tbt_s(cfg: Config, mean_tokens: float) -> float:
    """A rough p99 TBT: a full micro-batch (a chunk and B - 1 decodes at half the mean
    length) on the slowest stage, once per micro-batch in flight. Orders the search (the
    likely feasible first), never prunes it."""
    rows = cfg.planner.max_batch_size or 32
    stage = max(cost_model(cfg).stage_times([(0, cfg.chunk_tokens)],
                                            [max(1, int(mean_tokens / 2))] * (rows - 1)))
    return cfg.in_flight * stage


def grid_capacity(ok: Callable[[int], bool], start: int, top: int, floor: int,
                  known_ok: int | None = None,
                  hint: Callable[[int], int | None] | None = None) -> int | None:
    """The highest k in [floor, top] with ok(k), ok taken as monotone (true up to the
    capacity, false above); None if none is. known_ok: a k already known ok (the first
    probe is then the higher of start and known_ok + 1: a miss up there is cheap, it stops
    early). hint(k), after k missed: a grid point it suggests (`miss_hint`): the next probe
    goes no higher, and from one that passes there the search climbs in small steps; a
    bracket of NARROW points or fewer is searched from its top down, a wider one cut at UPPER
    of its width. Which points are probed changes, not the answer."""
    lo, hi, jump, step = known_ok, None, FIRST_JUMP, 0  # step: climbing from a hinted pass
    near = 0  # misses in a row that hinted the point just below (`_down`)
    if lo is not None and lo >= top:
        return lo
    k = min(max(start, floor) if lo is None else max(start, lo + 1), top)
    while True:
        climb = step  # after a pass: how far up the next probe goes (0: bisect)
        if ok(k):
            lo, step = k, 2 * step
            if k >= top:
                return lo
            if hi is None:  # bracket: up in growing steps
                k, jump = min(k + jump, top), 2 * jump
                continue
        else:
            hi = k
            if lo is None and k <= floor:
                return None
            guess = hint(k) if hint else None
            if lo is None:  # bracket: down, no higher than the hint, in growing steps
                near = near + 1 if guess == k - 1 else 0
                k, step, jump = _down(k, guess, jump, floor, 0 < near <= NEAR_STEPS)
                continue
            step = climb = 1 if guess is not None and lo < guess < hi - 1 else 0
            if step and hi - lo > NARROW:
                k = guess
                continue
        if hi - lo <= 1:
            return lo
        if hi - lo <= NARROW:  # narrow: the point under the miss
            k = hi - 1
        else:
            cut = lo + min(hi - lo - 1, max(1, round(UPPER * (hi - lo))))
            k = min(lo + climb, cut) if climb else cut


def _down(k: int, guess: int | None, jump: int, floor: int,
          one: bool = False) -> tuple[int, int, int]:
    """After a miss at k with nothing known to pass: the next probe (the hint's point, but
    at least jump / 2 lower: hints that creep down speed up; one: a hint of the point just
    below, a miss that was only just one, taken as it is and the jump kept), the climbing
    step (1: the hint chose it), the next jump."""
    if one and guess == k - 1:
        return max(floor, guess), 1, jump
    if guess is not None and guess < k:
        nxt, step = min(guess, k - jump // 2), int(guess <= k - jump // 2)
    else:
        nxt, step = k - jump, 0
    return max(floor, nxt), step, 2 * jump


def search_candidate(res: Result, cfg: Config, slo: Slo, stop_early: bool, cache_dir: str | None,
                     best: int | None, climb: bool = True,
                     high: bool = False) -> tuple[Result, tuple[int, int]]:
    """One candidate searched (run in a worker process; module docstring); best: its
    layout's best grid point known (fast path, None: search it to its capacity); climb
    False: stop once it passes best + 1 (outcome PASSED); high: no probe at best + 1
    first, the search comes down to it from the candidate's own start (a layout whose
    best so far is far below its candidates' bounds: passing there is slow, missing up
    high is quick). Returns it and the probes simulated and asked for (the rest came from
    the cache)."""
    import warnings

    warnings.simplefilter("ignore", UserWarning)  # e.g. a chunk off the tile: said once by `plan`
    t0, cache = time.perf_counter(), ProbeCache(cache_dir)
    try:
        _search_one(res, cfg, slo, stop_early, cache, best, climb, high)
    except ConfigError as exc:  # a deployment the simulator refuses: out, with its reason
        res.outcome, res.detail = "error", {"error": str(exc)}
    res.seconds = time.perf_counter() - t0
    return res, (cache.simulated, cache.asked)


def _search_one(res: Result, cfg: Config, slo: Slo, stop_early: bool, cache: ProbeCache,
                best: int | None, climb: bool, high: bool) -> None:
    lay = res.candidate.layout
    prober = Prober(cfg, lay.replicas, slo, cache, stop_early)
    seen: dict[int, Probe] = {}

    def ok(k: int) -> bool:
        if k not in seen:
            seen[k] = prober(k)
            res.probes.append(seen[k])
        return seen[k].ok

    def served(k: int) -> int | None:  # where a miss suggests looking (`miss_hint`)
        return miss_hint(k, seen[k].detail, cfg.parallel.tp * cfg.parallel.pp)

    top = grid_index(res.bound_qps / lay.gpus)
    floor = grid_index(res.bound_qps / lay.gpus * FLOOR)
    known = None
    if best is not None:
        if top < best + 1:
            res.outcome = "bound"
            return
        if high:  # down to best + 1 at the lowest: None there is lost
            floor = best + 1
        elif not ok(best + 1):
            res.outcome, res.detail = LOST, seen[best + 1].detail
            return
        elif not climb:
            res.outcome = PASSED
            return
        else:
            known = best + 1
    res.k = grid_capacity(ok, grid_index(res.bound_qps / lay.gpus * START), top, floor, known,
                          served)
    if res.k is None and best is not None:
        res.outcome, res.detail = LOST, seen[best + 1].detail
        return
    res.outcome = "searched"
    res.detail = (seen[res.k] if res.k is not None else res.probes[-1]).detail


def miss_hint(k: int, detail: dict, gpus: int) -> int | None:
    """Where a miss at grid point k suggests looking next: one point lower where it became
    certain only near the end of its arrivals (NEAR: the rate sits just above the capacity),
    else the rate its replica served (gpus: one replica's); None where neither is known."""
    if detail.get("certain_at", 0.0) >= NEAR:
        return k - 1
    per_gpu = (detail.get("served_qps") or 0.0) / gpus
    return grid_index(per_gpu) if per_gpu > 0 else None


def search_in_order(best: int | None, items: list[tuple[Result, Config]], slo: Slo,
                    stop_early: bool, cache_dir: str | None,
                    high: bool = False) -> tuple[list[Result], tuple[int, int]]:
    """Candidates of one layout searched one after the other, each against the best so far."""
    simulated = asked = 0
    for i, (res, cfg) in enumerate(items):
        fresh = Result(res.candidate, res.bound_qps, res.order)
        got, (n, m) = search_candidate(fresh, cfg, slo, stop_early, cache_dir, best, high=high)
        items[i] = (got, cfg)
        simulated, asked = simulated + n, asked + m
        if got.k is not None and (best is None or got.k > best):
            best = got.k
    return [r for r, _ in items], (simulated, asked)


def ordered(items: list[tuple[Candidate, Config]], wl: Workload, slo: Slo
            ) -> list[list[tuple[Result, Config]]]:
    """Candidates grouped by layout, each group in search order (`order_group`)."""
    return [order_group(group, wl, slo) for group in by_layout(items)]


def by_layout(items: list[tuple[Candidate, Config]]) -> list[list[tuple[Candidate, Config]]]:
    """Candidates grouped by layout, the layouts and each one's candidates in the space's order."""
    groups: dict[Layout, list[tuple[Candidate, Config]]] = {}
    for cand, cfg in items:
        groups.setdefault(cand.layout, []).append((cand, cfg))
    return list(groups.values())


def order_group(group: list[tuple[Candidate, Config]], wl: Workload, slo: Slo
                ) -> list[tuple[Result, Config]]:
    """One layout's candidates in search order: the SLO-driven uniform first, then the
    highest bound per GPU (discounted where a rough TBT, `likely_tbt_s`, is over the SLO);
    `Result.order` is the place in it (ties go to the earlier)."""
    keyed = []
    for cand, cfg in group:
        res = Result(cand, upper_bound(cfg, wl, cand.layout.replicas))
        per_gpu = res.bound_qps / cand.layout.gpus
        key = (cand.slo_ms is None, -per_gpu * min(1.0, slo.tbt_s / likely_tbt_s(cfg, wl.tokens)))
        keyed.append((key, res, cfg))
    keyed.sort(key=lambda x: x[0])  # stable: equal keys keep the space's order
    for i, (_, res, _) in enumerate(keyed):
        res.order = i
    return [(res, cfg) for _, res, cfg in keyed]
