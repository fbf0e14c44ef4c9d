"""The search's parts whose answer is known by hand: the grid capacity search finds the
same grid point from any start (what makes the fast and the exhaustive path agree), the
early stop never stops a probe the full run would pass, and the Pareto set of a hand-made
set of layout points."""
from concurrent.futures import Future

import numpy as np
import pytest

from pp_runtime.plan.frontier import pareto
from pp_runtime.plan.probe import STEP, Slo, Watch, _need, grid_index, rate
from pp_runtime.plan.search import Result, grid_capacity
from pp_runtime.plan.space import Candidate, Layout


class InProcessPool:
    """The runner's worker processes, run in this one (each task done at submit)."""

    def submit(self, fn, *args):
        done = Future()
        done.set_result(fn(*args))
        return done

    def shutdown(self, **kw):
        pass


@pytest.mark.parametrize("start", [-40, -12, -3, 0, 5, 30])
@pytest.mark.parametrize("known", [None, -20, -8])
def test_grid_capacity_finds_the_same_point_from_any_start(start, known):
    cap = -7  # ok up to grid point -7, a miss above it
    asked = []

    def ok(k):
        asked.append(k)
        return k <= cap

    got = grid_capacity(ok, start, top=20, floor=-60, known_ok=known)
    assert got == cap
    assert len(asked) <= 14, asked  # a bracket and a bisection, not a sweep


def test_grid_capacity_none_when_nothing_meets_and_top_when_all_do():
    assert grid_capacity(lambda k: False, 0, top=10, floor=-10) is None
    assert grid_capacity(lambda k: True, 0, top=10, floor=-10) == 10


def test_grid_points_sit_on_one_scale():
    assert rate(grid_index(0.1303)) <= 0.1303 < rate(grid_index(0.1303) + 1)
    assert rate(grid_index(rate(-41))) == pytest.approx(rate(-41)) and STEP == 1.05


@pytest.mark.parametrize("n", [1, 2, 50, 99, 100, 101, 200, 257, 1000, 4999])
def test_the_early_stop_count_is_exactly_where_p99_passes_the_slo(n):
    need, slo, hair = _need(n), 1.0, 1e-6
    values = np.full(n, slo + hair)
    values[: n - need] = 0.0  # `need` values just above the SLO, the rest far below
    assert np.percentile(values, 99) > slo  # the full run misses: stopping was right
    if need > 1:
        values[n - need] = 0.5  # one fewer above it: the full run may still pass
        assert np.percentile(values, 99) <= slo


class _Req:
    def __init__(self, arrival_s, first_token_s):
        self.arrival_s, self.first_token_s, self.finish_reason = arrival_s, first_token_s, None


class _Rec:
    token_gaps_s: list = []
    last_tokens = 100  # tokens of the micro-batch that just came back


def test_watch_stops_only_once_the_miss_is_certain():
    from pp_runtime.plan.probe import ClearMiss

    reqs = [_Req(float(i), None) for i in range(100)]  # TTFT SLO 1 s; n = 100: need 2 late
    w = Watch(Slo(ttft_s=1.0, tbt_s=0.1), num_requests=100, num_tokens=1000)
    reqs[0].first_token_s = 0.5
    w(_Rec(), reqs, 2.5)  # request 0 on time, request 1's deadline (2 s) passed without a token
    assert w.late == 1
    with pytest.raises(ClearMiss, match="p99 TTFT") as miss:
        w(_Rec(), reqs, 3.5)  # request 2 late too: 2 of 100 is past p99
    # where to look next: the tokens of the second half (1.75 s on), 100 of them after
    # 2.5 s, at 50 tokens a request: 2 requests in 1.75 s
    assert miss.value.served_qps == 0.0  # no mean length given: unknown
    w = Watch(Slo(ttft_s=1.0, tbt_s=0.1), num_requests=100, num_tokens=1000, mean_tokens=50.0)
    w(_Rec(), reqs, 1.5)
    w(_Rec(), reqs, 2.5)
    with pytest.raises(ClearMiss) as miss:
        w(_Rec(), reqs, 3.5)
    assert miss.value.served_qps == pytest.approx(200 / 50 / 1.75)


def _point(tp, pp, replicas, k, tbt, ttft) -> Result:
    r = Result(Candidate(Layout(tp, pp, replicas), "uniform", None, None, pp, "even", (200, 5000)), 1.0)
    r.k, r.outcome, r.detail = k, "searched", {"tbt_p99_s": tbt, "ttft_p99_s": ttft}
    return r


def test_pareto_keeps_the_points_no_other_beats_on_every_axis():
    a = _point(8, 4, 2, -40, 0.150, 4.0)  # the most per GPU
    b = _point(4, 8, 2, -45, 0.120, 1.0)  # less per GPU, lower latencies: on it
    c = _point(8, 8, 1, -46, 0.130, 2.0)  # b carries more at lower TBT and TTFT: off
    d = _point(2, 16, 2, -50, 0.100, 3.0)  # the lowest TBT: on it
    assert pareto([c, d, b, a]) == [a, b, d]


def test_at_the_same_rate_per_gpu_the_winner_is_the_one_that_uses_more_of_the_gpus():
    """GPT-3 on 64 A100 (2026-11-28): tp4 pp8 x2 and tp4 pp12 x1 met the same grid rate per
    GPU; the 64-GPU one carries 10.0 req/s, the 48-GPU one 7.5. A p99 TBT 0.06 ms lower
    must not hand the win to the one that leaves 16 GPUs idle; latency breaks the tie
    between layouts of as many GPUs."""
    from pp_runtime.plan.report import ranked
    both = _point(4, 8, 2, 40, 0.19005, 3.30)
    fewer = _point(4, 12, 1, 40, 0.18999, 4.26)
    same = _point(8, 4, 2, 40, 0.18000, 3.40)  # 64 GPUs too, the lower TBT: first
    assert ranked([fewer, both]) == [both, fewer]
    assert ranked([fewer, both, same]) == [same, both, fewer]
    assert pareto([fewer, both, same])[0] is same


def test_memory_split_gives_the_end_stages_fewer_layers_where_that_frees_kv():
    from pp_runtime.config import Config, load_model_config
    from pp_runtime.costmodel import memory
    from pp_runtime.plan.space import memory_split, with_layers

    def cfg(model, pp, tp, gb):
        return Config(model=load_model_config(model)).with_overrides(**{
            "parallel.pp": pp, "parallel.tp": tp, "cache.paged": True, "cache.num_blocks": "auto",
            "cache.device_memory_gb": gb})

    # GPT-2 small: the embedding (38.6 M parameters) outweighs 5 layers (7.1 M each), so the
    # end stages, which hold it and the LM head, run out of KV room first
    small = cfg("gpt2-small", 3, 1, 0.5)
    split = memory_split(small)
    assert split is not None and split[0] < 4 and split[-1] < 4 and sum(split) == 12
    assert memory.kv_blocks(with_layers(small, split)) > memory.kv_blocks(with_layers(small, [4, 4, 4]))
    # GPT-3 at tp 8: a layer (0.45 GB a rank) outweighs the embedding (0.15 GB): even is best
    assert memory_split(cfg("gpt3-175b", 4, 8, 80)) is None


@pytest.mark.parametrize("guess", [-30, -9, -7, -6, -5, 0])
@pytest.mark.parametrize("known", [None, -20])
def test_a_hint_after_a_miss_changes_the_probes_not_the_answer(guess, known):
    """A hint below or above the capacity, before or after a point is known to pass: it
    chooses where to probe next, it is never taken for a pass."""
    asked = []

    def ok(k):
        asked.append(k)
        return k <= -7

    assert grid_capacity(ok, 5, top=20, floor=-60, known_ok=known, hint=lambda k: guess) == -7
    assert len(asked) <= 14, asked


@pytest.mark.parametrize("pp,planner", [(2, "uniform"), (3, "sarathi")])
def test_the_probe_recorder_reports_what_the_run_recorder_does(pp, planner):
    """A probe records less than a run (plan/record.py); what it reports is the same."""
    from dataclasses import replace

    from pp_runtime.config import Config, load_model_config
    from pp_runtime.core.workload import WorkloadConfig
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.plan.record import ProbeRecorder, summary
    from pp_runtime.telemetry.report import build_report

    cfg = replace(Config(model=load_model_config("gpt2-small")).with_overrides(
        **{"pp": pp, "planner.planner": planner, "planner.chunk_size": 256}),
        workload=WorkloadConfig(kind="zipf", num_requests=60, qps=40.0, min_len=128,
                                max_len=1024, pd_ratio=8))
    full = build_report(simulate(cfg, progress=False))["summary"]
    lean = summary(simulate(cfg, progress=False, recorder=ProbeRecorder))
    assert lean == {k: full[k] for k in lean}
    assert full["bubble_fraction"] > 0 and full["tbt_s"]["p99"] > 0


def test_work_the_budget_leaves_is_marked_and_counted():
    """No search starts after the budget: every candidate of the fast path's steps is
    left as 'budget', each counted once on the progress bar."""
    from pp_runtime.config import Config, load_model_config
    from pp_runtime.plan.runner import Runner

    cfg = Config(model=load_model_config("gpt2-small"))
    groups = [[(Result(Candidate(Layout(1, pp, 2 // pp), "uniform", c, 4, pp, "even"), 1.0), cfg)
               for c in (128, 256, 512)] for pp in (1, 2)]

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    bar = Bar()
    run = Runner(1, -1.0, Slo(1.0, 1.0), True, None, bar)
    try:
        run.fast(groups)
    finally:
        run.close()
    assert all(r.outcome == "budget" for g in groups for r, _ in g) and bar.n == 6


def test_a_lucky_pass_above_the_layout_s_best_gets_the_exhaustive_capacity(monkeypatch):
    """Pass or miss need not be monotone in the rate (a TBT p99 near its SLO flips with the
    draw of each rate's arrivals). A candidate that passes its layout's best + 1 by such a
    flip is searched from its own start, as the exhaustive path does: the same capacity,
    so both paths name the same best for the layout."""
    from types import SimpleNamespace

    import pp_runtime.plan.search as search
    from pp_runtime.bench.capacity import Probe
    from pp_runtime.plan.runner import Runner, fast_phases

    lay = Layout(1, 1, 1)
    first, lucky = (Candidate(lay, "uniform", c, 8, 1, "even") for c in (128, 256))
    cfg = {first: SimpleNamespace(parallel=SimpleNamespace(tp=1, pp=1), ok=lambda k: k <= -10),
           lucky: SimpleNamespace(parallel=SimpleNamespace(tp=1, pp=1),
                                  ok=lambda k: k == -9 or k <= -20)}  # a flip at -9

    class Prober:  # each config's table above instead of a simulation
        def __init__(self, cfg, *args):
            self.ok = cfg.ok

        def __call__(self, k):
            return Probe(rate(k), 0.1, 1.0, self.ok(k), {"k": k})

    monkeypatch.setattr(search, "Prober", Prober)
    bound = rate(0) / 0.95  # start at grid point -1, top 0
    run = Runner(1, 60, Slo(1.0, 1.0), True, None, SimpleNamespace(update=lambda n: None))
    run.pool.shutdown()
    run.pool = InProcessPool()
    results = [Result(first, bound, 0), Result(lucky, bound, 1)]
    fast_phases(run, [[(r, cfg[r.candidate]) for r in results]])
    alone, _ = search.search_candidate(Result(lucky, bound, 1), cfg[lucky], Slo(1.0, 1.0), True,
                                       None, None)  # the exhaustive path's search
    assert results[0].k == -10 and results[1].k == alone.k == -20


@pytest.mark.parametrize("cap", [-12, -8, -7, -6, -3, 0, 4])
@pytest.mark.parametrize("start", [-20, -7, -2, 6])
@pytest.mark.parametrize("hint", ["near", "low", "high", None])
def test_near_miss_hints_and_narrow_brackets_keep_the_answer(cap, start, hint):
    """After a miss, the next probe follows `miss_hint` (one point lower for a miss certain
    only near the end of its arrivals) and a bracket of NARROW points or fewer is searched
    from its top down: the probes change, the grid point found does not."""
    hints = {"near": lambda k: k - 1, "low": lambda k: cap - 5, "high": lambda k: k - 1 if k > cap + 3 else cap + 2,
             None: None}
    asked = []

    def ok(k):
        asked.append(k)
        return k <= cap

    assert grid_capacity(ok, start, top=6, floor=-60, hint=hints[hint]) == cap
    assert len(asked) <= 14, asked


def test_a_miss_just_above_the_capacity_costs_one_pass():
    """A pass runs to its end, a miss stops once certain: from a miss one point above the
    capacity that says so (its hint: the point below) the search passes once, there."""
    asked = []

    def ok(k):
        asked.append(k)
        return k <= -7

    # far above first (a served rate that overshoots), then just above: one pass in all
    got = grid_capacity(ok, 4, top=6, floor=-60, hint=lambda k: -6 if k > -6 else k - 1)
    assert got == -7 and asked == [4, -6, -7]
    asked.clear()  # a pass below, then the miss above: the point under it next
    assert grid_capacity(ok, -9, top=6, floor=-60, hint=lambda k: k - 1) == -7
    assert [k for k in asked if k <= -7] == [-9, -7], asked


def test_the_miss_hint_reads_where_the_miss_became_certain():
    from pp_runtime.plan.search import NEAR, miss_hint

    served = {"served_qps": rate(-20) * 4}  # one replica of 4 GPUs served grid point -20
    assert miss_hint(-10, served, 4) == -20
    assert miss_hint(-10, {**served, "certain_at": 0.5}, 4) == -20  # early: far above
    assert miss_hint(-10, {**served, "certain_at": NEAR}, 4) == -11  # at the end: just above
    assert miss_hint(-10, {"certain_at": 1.7}, 4) == -11  # a miss only a whole run showed
    assert miss_hint(-10, {}, 4) is None


def test_watch_says_when_the_miss_became_certain():
    from pp_runtime.plan.probe import ClearMiss

    reqs = [_Req(float(i), i + 0.5 if i < 48 else None) for i in range(100)]  # the last at 99 s
    w = Watch(Slo(ttft_s=1.0, tbt_s=0.1), num_requests=100, num_tokens=1000)
    w(_Rec(), reqs, 49.5)  # 48 late: one of the two p99 needs
    with pytest.raises(ClearMiss) as miss:
        w(_Rec(), reqs, 50.5)
    assert miss.value.certain_at == pytest.approx(50.5 / 99)


def test_workers_started_early_are_released_when_no_search_takes_them():
    from pp_runtime.plan import runner

    runner.prestart(1)
    pool = runner._STARTED[1]
    runner.release()
    assert not runner._STARTED and pool._shutdown_thread


def _table_search(monkeypatch, tables: dict, bound: float, runs: list):
    """The fast path on hand-written pass/miss tables (candidate -> ok(k)) in this process;
    runs gets each simulated (candidate, k)."""
    from types import SimpleNamespace

    import pp_runtime.plan.search as search
    from pp_runtime.bench.capacity import Probe
    from pp_runtime.plan.runner import Runner, fast_phases

    class Prober:
        def __init__(self, cfg, *args):
            self.cfg = cfg

        def __call__(self, k):
            runs.append((self.cfg.name, k))
            return Probe(rate(k), 0.1, 1.0, self.cfg.ok(k), {"k": k})

    monkeypatch.setattr(search, "Prober", Prober)
    run = Runner(1, 60, Slo(1.0, 1.0), True, None, SimpleNamespace(update=lambda n: None))
    run.pool.shutdown()
    run.pool = InProcessPool()
    cfgs = {c: SimpleNamespace(parallel=SimpleNamespace(tp=1, pp=1), ok=ok, name=c.name)
            for c, ok in tables.items()}
    results = [Result(c, bound, i) for i, c in enumerate(tables)]
    fast_phases(run, iter([[(r, cfgs[r.candidate]) for r in results]]))
    fast_runs = list(runs)
    exhaustive = [search.search_candidate(Result(c, bound, i), cfgs[c], Slo(1.0, 1.0), True,
                                          None, None)[0] for i, c in enumerate(tables)]
    runs[:] = fast_runs  # the fast path's probes only
    return results, exhaustive


def test_a_weak_layout_s_lost_candidates_cost_one_probe_each(monkeypatch):
    """A first candidate far below its bound (the SLO-driven uniform on GPT-3's tp2 x pp3 x
    10: 0.007 of 0.17 req/s/GPU) is not searched around: each other candidate is probed
    once, at the layout's best + 1, and one that passes is searched from its own start as
    the exhaustive path searches it; the layout's best is the exhaustive path's."""
    lay = Layout(1, 1, 1)
    first, better, lost1, lost2 = (Candidate(lay, "uniform", c, 8, 1, "even") for c in (128, 256, 512, 1024))
    tables = {first: lambda k: k <= -60, better: lambda k: k <= -55,
              lost1: lambda k: k <= -70, lost2: lambda k: k <= -61}
    runs: list = []
    results, exhaustive = _table_search(monkeypatch, tables, rate(0) / 0.95, runs)
    assert results[0].k == -60 and results[1].k == exhaustive[1].k == -55
    best = max(results, key=lambda r: (r.k or -999, -r.order))
    assert best.candidate == max(exhaustive, key=lambda r: (r.k or -999, -r.order)).candidate
    for lost in (lost1, lost2):  # one miss each, at the first's capacity + 1
        assert [k for name, k in runs if name == lost.name] == [-59]
        assert next(r for r in results if r.candidate == lost).outcome == "lost at the layout's best"


def test_the_probe_recorder_counts_the_slow_gaps_the_watch_reads():
    """ProbeRecorder counts the times between tokens above the TBT SLO as it records them
    (`probe.Watch` reads the count), the same count as over the recorded gaps; and the
    Watch's deadlines from the arrivals stop where the requests' own would."""
    from dataclasses import replace
    from functools import partial

    from pp_runtime.config import Config, load_model_config
    from pp_runtime.core.workload import WorkloadConfig, generate
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.plan.probe import ClearMiss
    from pp_runtime.plan.record import ProbeRecorder

    cfg = replace(Config(model=load_model_config("gpt2-small")).with_overrides(
        **{"pp": 2, "planner.chunk_size": 256}),
        workload=WorkloadConfig(kind="zipf", num_requests=60, qps=40.0, min_len=128,
                                max_len=1024, pd_ratio=8))
    gaps = sorted(simulate(cfg, progress=False, recorder=ProbeRecorder).replicas[0].token_gaps_s)
    slo = gaps[len(gaps) // 2]  # half of them slow
    run = simulate(cfg, progress=False, recorder=partial(ProbeRecorder, slow_above=slo))
    rec = run.replicas[0]
    assert rec.slow == sum(g > slo for g in rec.token_gaps_s) > 0
    assert rec.tokens_done == rec.prefill_ran + len(rec.token_gaps_s)  # prompts + decodes
    specs = generate(cfg.workload)
    stops = []
    for arrivals in (None, [s.arrival_s for s in specs]):
        w = Watch(Slo(ttft_s=gaps[0], tbt_s=10.0), len(specs), sum(s.output_len for s in specs),
                  arrivals=arrivals)
        with pytest.raises(ClearMiss) as miss:
            simulate(cfg, progress=False, watch=w, recorder=ProbeRecorder)
        stops.append((str(miss.value), w.next, w.late))
    assert stops[0] == stops[1]


def test_the_rest_are_probed_above_the_best_the_slo_driven_ones_found(monkeypatch):
    """The SLO-driven candidates after the first are searched first; the rest (which come
    after them in the layout's order) are probed once at the highest capacity found + 1:
    one that only beats the first is lost without a search, one that ties the leader is
    lost (the earlier wins a tie, as on the exhaustive path), one that beats it is
    searched to the exhaustive path's capacity."""
    lay = Layout(1, 1, 1)
    first, leader = (Candidate(lay, "uniform", None, None, d, "even", (200, 5000)) for d in (1, 2))
    beats_first, ties, wins = (Candidate(lay, "uniform", c, 8, 1, "even") for c in (128, 256, 512))
    tables = {first: lambda k: k <= -20, leader: lambda k: k <= -15,
              beats_first: lambda k: k <= -17, ties: lambda k: k <= -15, wins: lambda k: k <= -12}
    runs: list = []
    results, exhaustive = _table_search(monkeypatch, tables, rate(0) / 0.95, runs)
    assert [r.k for r in results] == [-20, -15, None, None, -12]
    assert results[4].k == exhaustive[4].k
    for cand in (beats_first, ties):  # one probe, above the leader's capacity
        assert [k for name, k in runs if name == cand.name] == [-14]
    best = max(results, key=lambda r: (r.k if r.k is not None else -999, -r.order))
    assert best.candidate == max(exhaustive, key=lambda r: (r.k if r.k is not None else -999,
                                                             -r.order)).candidate == wins


def test_a_run_of_near_misses_does_not_grow_the_jump():
    """Misses certain only near their end, each hinting the point below, sit at the
    capacity: the first NEAR_STEPS are followed one point at a time and do not grow the
    bracketing jump, so the next move down is FIRST_JUMP / 2 points, not a leap far under
    the capacity that passes there and climbs back one pass at a time (GPT-3 tp2 x pp24:
    10 probes, 5 of them passes, became 7)."""
    asked = []

    def ok(k):
        asked.append(k)
        return k <= -6

    assert grid_capacity(ok, 0, top=6, floor=-60, hint=lambda k: k - 1) == -6
    # 0 .. -3: start and three near steps; -4: the hint, FIRST_JUMP / 2 = 1 below; then -6
    # (the hint -5 against jump 4 / 2 below -4) passes, and -5 between them missed already
    assert asked == [0, -1, -2, -3, -4, -6, -5], asked


def test_a_wide_bracket_is_cut_above_its_middle():
    """A pass runs its whole arrivals, a miss stops once certain: a bracket wider than
    NARROW is cut at UPPER of its width. Bracketing from 0 passes 0, 2, 6 and misses 14;
    [6, 14] is cut at 12 (bisection: at 10, then 12), which passes, and 13 misses: four
    passes where bisection spends five."""
    asked = []

    def ok(k):
        asked.append(k)
        return k <= 12

    assert grid_capacity(ok, 0, top=40, floor=-60) == 12
    assert asked == [0, 2, 6, 14, 12, 13], asked
