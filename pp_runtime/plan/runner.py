"""The search's worker processes: candidate searches (`search.search_candidate`) and
layouts searched in order (`search.search_in_order`) run in `jobs` spawned processes, and
no new one starts after the budget (what it leaves is marked `budget`). The fast path's
layouts come one at a time (their bounds computed while the processes search the first).

The exhaustive path is one batch (`Runner.__call__`). The fast path (`Runner.fast`) is a
small state machine per layout: its first candidate; then either its others against that
best, one task each, and once all are back each one that passed searched to its capacity
from its own start, as the exhaustive path searches it, one task each; or, for a layout
whose first met nothing, its others in order as one task. A layout's next step is queued
as soon as its last one came back, never waiting for another layout (a barrier between
phases left a process idle behind the slowest task of each phase); waiting work goes
out in the order: first candidates (deep pipelines first), whole layouts, single probes.
Which process runs what changes the time, not the answer: each layout's steps are the
same.
"""
from __future__ import annotations

import heapq
import itertools
import multiprocessing
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Callable, Iterable

from tqdm import tqdm

from pp_runtime.config import Config
from pp_runtime.plan.probe import Slo
from pp_runtime.plan.search import (PASSED, Result, Workload, by_layout, order_group,
                                    ordered, search_candidate, search_in_order)
from pp_runtime.plan.space import Candidate

FIRST, LAYOUT, SINGLE = 0, 1, 2  # the order waiting work goes out in


_STARTED: dict[int, ProcessPoolExecutor] = {}  # jobs -> a pool `prestart` started


def prestart(jobs: int) -> None:
    """Start the worker processes now, each importing what a probe runs, so that they are
    ready when the search starts (`pp-runtime plan` calls it before it builds the
    candidates: their layer splits and bounds take a second of one core)."""
    if jobs not in _STARTED:
        ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        _STARTED[jobs] = pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)
        for _ in range(jobs):  # each submit starts one process (spawn): all of them, now
            pool.submit(_ready)


def release() -> None:
    """Stop the processes `prestart` started that no search took (a plan that ended early)."""
    while _STARTED:
        _STARTED.popitem()[1].shutdown(cancel_futures=True)


class Runner:
    """Runs candidate searches in `jobs` processes; no new one after the budget."""

    def __init__(self, jobs: int, budget_s: float, slo: Slo, stop_early: bool,
                 cache_dir: str | None, bar: tqdm):
        prestart(jobs)
        self.pool = _STARTED.pop(jobs)
        self.jobs, self.deadline = jobs, time.monotonic() + budget_s
        self.args, self.bar, self.simulated, self.asked = (slo, stop_early, cache_dir), bar, 0, 0
        self.queue: list = []
        self.order = itertools.count()
        self.running: dict = {}  # future -> what to do with its result

    def __call__(self, tasks: list[tuple[Result, Config, int | None]], climb: bool = True) -> None:
        """Each (result, config, best) searched (`search_candidate`), as a batch."""
        for res, cfg, best in tasks:
            self._push(SINGLE, search_candidate, (res, cfg, *self.args, best, climb),
                       lambda got, res=res: self._one(res, got))
        self._drain()

    def fast(self, groups: Iterable[list[tuple[Result, Config]]]) -> None:
        """The fast path's steps for every layout (module docstring; `search.fast_phases`).
        groups: each layout's candidates in search order, deep pipelines first; each one's
        first candidate goes to the processes as soon as its group comes (the next
        groups are ordered, their bounds computed, while the processes search)."""
        for g in groups:
            res, cfg = g[0]
            self._push(FIRST, search_candidate, (res, cfg, *self.args, None, True),
                       lambda got, g=g: self._first(g, got))
            self._feed()
        self._drain()

    def _first(self, g: list[tuple[Result, Config]], got) -> None:
        first, rest = g[0][0], g[1:]
        self._one(first, got)
        if not rest:
            return
        if first.k is None:  # met nothing: its others in order, from their own start
            self._push(LAYOUT, search_in_order, (None, list(rest), *self.args, True),
                       lambda out: self._many(rest, out))
            return
        lead, follow = split_lead(rest)
        self._against(first.k, lead, (lambda best: self._against(best, follow, None)) if follow else None)

    def _against(self, best: int, items: list[tuple[Result, Config]],
                 then: Callable[[int], None] | None) -> None:
        """Each of items probed at best + 1 (out by its bound first), each one that passed
        searched to its capacity from its own start, as the exhaustive path does; then
        then(the highest of best and their capacities)."""
        if not items:
            if then:
                then(best)
            return
        left = [len(items)]
        for res, cfg in items:
            self._push(SINGLE, search_candidate, (res, cfg, *self.args, best, False),
                       lambda out, res=res: self._second(best, items, res, out, left, then))

    def _second(self, best: int, items, res: Result, got, left: list[int], then) -> None:
        self._one(res, got, count=got[0].outcome != PASSED)
        left[0] -= 1
        if left[0]:
            return
        passed = [(slot, cfg) for slot, cfg in items if slot.outcome == PASSED]
        if not passed:
            if then:
                then(best)
            return
        more = [len(passed)]
        for slot, cfg in passed:  # passed best + 1: searched to its capacity as the exhaustive
            fresh = Result(slot.candidate, slot.bound_qps, slot.order)  # path does (its probe
            self._push(SINGLE, search_candidate, (fresh, cfg, *self.args, None, True),  # at best
                       lambda out, slot=slot: self._third(best, items, slot, out, more, then))  # + 1: cached

    def _third(self, best: int, items, slot: Result, got, more: list[int], then) -> None:
        self._one(slot, got)
        more[0] -= 1
        if not more[0] and then:
            then(max([best] + [r.k for r, _ in items if r.outcome == "searched" and r.k is not None]))

    def _one(self, slot: Result, got, count: bool = True) -> None:
        new, (n, m) = got
        slot.__dict__.update(new.__dict__)
        self.simulated, self.asked = self.simulated + n, self.asked + m
        self.bar.update(int(count))

    def _many(self, items: list[tuple[Result, Config]], got) -> None:
        new, (n, m) = got
        for (slot, _), r in zip(items, new):
            slot.__dict__.update(r.__dict__)
        self.simulated, self.asked = self.simulated + n, self.asked + m
        self.bar.update(len(items))

    def _push(self, kind: int, fn: Callable, args: tuple, done: Callable) -> None:
        heapq.heappush(self.queue, (kind, next(self.order), fn, args, done))

    def _feed(self) -> None:
        """Hand queued tasks to the pool until jobs + 1 are in it (`self.running`)."""
        running = self.running
        while self.queue and len(running) <= self.jobs:
            _, _, fn, args, done = heapq.heappop(self.queue)
            if time.monotonic() > self.deadline:
                done(_expired(fn, args))
                continue
            running[self.pool.submit(fn, *args)] = done

    def _drain(self) -> None:
        """Run the queue, and what each finished task queues, until both are empty; one
        task waits in the pool beside the running ones (no process idles between)."""
        running = self.running
        while self.queue or running:
            self._feed()
            if not self.queue and len(running) < self.jobs:
                _report_modules()  # a process is free until the end: the report's imports now
            if running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    running.pop(fut)(fut.result())

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def _expired(fn: Callable, args: tuple):
    """What a task not started before the budget returns: its candidates left, 'budget'."""
    if fn is search_candidate:
        args[0].outcome = "budget"
        return args[0], (0, 0)
    for res, _ in args[1]:
        res.outcome = "budget"
    return [res for res, _ in args[1]], (0, 0)


def _report_modules() -> None:
    """matplotlib, which the report draws its figures with (half a second to import)."""
    import sys
    if "matplotlib.pyplot" in sys.modules:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def _ready() -> None:
    """A worker's first task: the modules a probe runs, imported."""
    import pp_runtime.engine.simulate  # noqa: F401
    import pp_runtime.plan.record  # noqa: F401


def search(items: list[tuple[Candidate, Config]], wl: Workload, slo: Slo, jobs: int,
           budget_s: float, fast: bool = True, cache_dir: str | None = None,
           progress: bool = True, stop_early: bool = True) -> tuple[list[Result], tuple[int, int]]:
    """Every candidate's Result (module docstring), the probes simulated and asked for.
    The processes start (and import what a probe runs) while the bounds are computed, or
    earlier (`prestart`)."""
    bar = tqdm(total=len(items), unit="deployment", desc="plan", disable=not progress, leave=False)
    run = Runner(jobs, budget_s, slo, stop_early, cache_dir, bar)
    try:
        if not fast:
            groups = ordered(items, wl, slo)
            run([(res, cfg, None) for res, cfg in sorted(
                (rc for g in groups for rc in g), key=lambda rc: -rc[1].parallel.pp)])
        else:  # each layout ordered (its bounds) as the processes take the first ones
            raw = by_layout(items)
            groups = [[] for _ in raw]

            def deep_first():
                for i in sorted(range(len(raw)), key=lambda i: -raw[i][0][0].layout.pp):
                    groups[i] = order_group(raw[i], wl, slo)
                    yield groups[i]

            fast_phases(run, deep_first())
        results = [r for g in groups for r, _ in g]
    finally:
        run.close()
        bar.close()
    return results, (run.simulated, run.asked)


def split_lead(rest: list[tuple[Result, Config]]
               ) -> tuple[list[tuple[Result, Config]], list[tuple[Result, Config]]]:
    """A layout's candidates after its first, in two steps: the other SLO-driven ones
    (the leaders, searched against the first's capacity), then the rest (against the
    highest capacity of the first and the leaders). The rest come after every leader in
    the layout's order (`search.order_group`), so a tie goes to the leader: they must
    beat it. Where the order is not so, one step (all against the first's)."""
    lead = [rc for rc in rest if rc[0].candidate.slo_ms is not None]
    follow = [rc for rc in rest if rc[0].candidate.slo_ms is None]
    if lead and follow and max(r.order for r, _ in lead) > min(r.order for r, _ in follow):
        return rest, []
    return (lead, follow) if lead else (follow, [])


def fast_phases(run, groups: Iterable[list[tuple[Result, Config]]]) -> None:
    """The fast path: (1) every layout's first candidate to its capacity; (2) every other
    one against its layout's best, one probe at most; (3) each one that passed, searched
    to its capacity from its own start as the exhaustive path does (its probe of (2) may
    come back from the cache): every candidate searched gets the exhaustive path's
    capacity, and the others missed above the layout's best.
    A layout whose first candidate met nothing skips (2): its others one after the other
    from their own start (`search_in_order`). A weak first candidate (far below its bound)
    takes (2) as any other: each of its others that is lost costs its one miss at best + 1,
    which the search from its own start down to best + 1 it once had also probes, after
    misses above it (issue 39, sixth pass). Each layout's next phase starts as soon as its
    last one ended
    (`runner.Runner.fast`), so the processes never wait for another layout."""
    run.fast(groups)
