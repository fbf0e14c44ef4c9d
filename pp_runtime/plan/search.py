"""The search: every candidate's capacity on the simulator, best first, in parallel.

Every candidate has an upper bound on its capacity from the cost model alone
(`upper_bound`: the slowest stage's best time per token, at most C + B tokens a
micro-batch, times the workload's mean request). They are searched in `jobs` processes,
highest bound per GPU first, discounted where a rough TBT (`likely_tbt_s`) is over the SLO
so that the likely feasible come first. A candidate's capacity search (`capacity.capacity_search` on the simulator,
one replica at its share of the rate) starts at the best capacity found so far (a
little above it): a candidate that misses the SLOs there cannot win and costs one probe
("lost at the best's rate", with the latencies it had). A candidate whose bound is within
the search's tolerance of the best capacity is out without a probe ("bound").
The time budget stops new searches; what it left unsearched is listed as such.

A probe is a sustained rate, not a burst: its arrivals span at least 10 TTFT SLOs (more
requests than `--requests` where the rate asks for it, at most 5000), so a rate 10 % above
what the deployment serves builds a queue longer than the TTFT SLO and fails.
"""
from __future__ import annotations

import math
import multiprocessing
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field

from tqdm import tqdm

from pp_runtime.bench.capacity import Probe, capacity_search, meets
from pp_runtime.config import Config, ConfigError
from pp_runtime.plan.space import Candidate, with_share

REL_TOL = 0.05  # bisect until the bracket is this narrow
MAX_PROBES = 9
SPAN_TTFTS = 10  # a probe's arrivals span at least this many TTFT SLOs
MAX_REQUESTS = 5000  # and no probe simulates more requests than this
LOST = "lost at the best's rate"


@dataclass(frozen=True)
class Slo:
    ttft_s: float  # p99 time to first token
    tbt_s: float  # p99 time between tokens


@dataclass
class Result:
    """What the search learnt of one candidate."""

    candidate: Candidate
    bound_qps: float  # the cost model's upper bound on its capacity (all replicas)
    qps: float | None = None  # its capacity (all replicas); None: not searched to the end
    outcome: str = "pending"  # searched | lost at the best's rate | bound | budget | error
    probes: list[Probe] = field(default_factory=list)  # one replica's, at its share
    detail: dict = field(default_factory=dict)  # the summary at its capacity (or last probe)
    seconds: float = 0.0

    @property
    def per_gpu(self) -> float:
        return (self.qps or 0.0) / self.candidate.layout.gpus


def upper_bound(cfg: Config, mean_tokens: float, replicas: int) -> float:
    """Requests per second the replicas could finish if every micro-batch were as efficient
    as the best one of at most C + B tokens on the slowest stage (no bubbles, no attention
    beyond a chunk's first, no SLO): no schedule does better."""
    from pp_runtime.costmodel import build_cost_model

    cost = build_cost_model(cfg)
    top = cfg.chunk_tokens + cfg.batch_rows
    sizes = sorted({max(1, round(top / 2 ** k)) for k in range(12)})
    per_token = min(max(cost.stage_times([(0, t)], [])) / t for t in sizes)
    return replicas / (mean_tokens * per_token)


def likely_tbt_s(cfg: Config, mean_tokens: float) -> float:
    """A rough p99 TBT: a full micro-batch (a chunk and B - 1 decodes at half the mean
    length) on the slowest stage, once per micro-batch in flight. Orders the search (the
    likely feasible first), never prunes it."""
    from pp_runtime.costmodel import build_cost_model

    stage = max(build_cost_model(cfg).stage_times([(0, cfg.chunk_tokens)],
                                                  [max(1, int(mean_tokens / 2))] * (cfg.batch_rows - 1)))
    return cfg.in_flight * stage


def probe_on_sim(cfg: Config, replicas: int, slo: Slo):
    """probe(qps of all replicas) -> Probe of one replica at its share (the simulator)."""
    from pp_runtime.costmodel import build_cost_model
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import build_report

    cost = build_cost_model(cfg)

    def probe(qps: float) -> Probe:
        one = with_share(cfg, replicas, qps)
        span = math.ceil(one.workload.qps * SPAN_TTFTS * slo.ttft_s)  # a sustained rate
        if one.workload.kind != "trace" and span > one.workload.num_requests:
            one = one.with_overrides(**{"workload.num_requests": min(span, MAX_REQUESTS)})
        s = build_report(simulate(one, cost, progress=False))["summary"]
        tbt, ttft = s["tbt_s"]["p99"], s["ttft_s"]["p99"]
        failed = s["num_requests"] - s["finish_reasons"].get("length", 0)
        detail = {"tbt_p99_s": tbt, "ttft_p99_s": ttft, "bubble_fraction": s["bubble_fraction"],
                  "bubble_by_cause": s["bubble_fraction_by_cause"],
                  "per_stage_bubble": [st["bubble_s"] / st["wall_s"] if st["wall_s"] else 0.0
                                       for st in s["per_stage"]],
                  "throughput_tok_s": s["throughput_tok_s"] * replicas}
        return Probe(qps, tbt, ttft, meets(tbt, ttft, slo.tbt_s, slo.ttft_s, failed), detail)

    return probe


def evaluate(cand: Candidate, cfg: Config, bound: float, best: float, slo: Slo) -> Result:
    """One candidate's capacity (run in a worker process). best: the best capacity known
    when it started (0: none yet); the search starts a little above it."""
    import warnings

    warnings.simplefilter("ignore", UserWarning)  # e.g. a chunk off the tile: said once by `plan`
    t0 = time.perf_counter()
    try:
        return _evaluate(cand, cfg, bound, best, slo, t0)
    except ConfigError as exc:  # a deployment the simulator refuses: out, with its reason
        return Result(cand, bound, outcome="error", detail={"error": str(exc)},
                      seconds=time.perf_counter() - t0)


def _evaluate(cand: Candidate, cfg: Config, bound: float, best: float, slo: Slo,
              t0: float) -> Result:
    probe = probe_on_sim(cfg, cand.layout.replicas, slo)
    res = Result(cand, bound)
    start = best * (1 + REL_TOL) if best else bound / 4
    if best:
        first = probe(start)
        res.probes.append(first)
        if not first.ok:
            res.outcome, res.detail = LOST, first.detail
            res.seconds = time.perf_counter() - t0
            return res
        start = first.qps

    def counted(q: float) -> Probe:
        if res.probes and q == start and best:
            return res.probes[0]  # the first probe, already run
        p = probe(q)
        res.probes.append(p)
        return p

    cap = capacity_search(counted, start, REL_TOL, MAX_PROBES, max_qps=bound, min_qps=bound / 1e4)
    res.qps, res.outcome = cap.qps, "searched"
    ok = [p for p in res.probes if p.ok]
    res.detail = (max(ok, key=lambda p: p.qps) if ok else res.probes[-1]).detail
    res.seconds = time.perf_counter() - t0
    return res


def search(items: list[tuple[Candidate, Config]], mean_tokens: float, slo: Slo, jobs: int,
           budget_s: float, progress: bool = True) -> list[Result]:
    """Every candidate's Result, searched best bound first (module docstring)."""
    def order(rc) -> float:  # the bound per GPU, discounted where the TBT SLO looks out of reach
        res, cfg = rc
        tbt = likely_tbt_s(cfg, mean_tokens)
        return -res.bound_qps / res.candidate.layout.gpus * min(1.0, slo.tbt_s / tbt)

    pending = sorted(((Result(c, upper_bound(cfg, mean_tokens, c.layout.replicas)), cfg)
                      for c, cfg in items), key=order)
    results = [r for r, _ in pending]
    best = 0.0  # per GPU
    t0 = time.monotonic()
    bar = tqdm(total=len(pending), unit="deployment", desc="plan", disable=not progress,
               leave=False, mininterval=0.5)
    ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        running: dict = {}
        while pending or running:
            while pending and len(running) < jobs:
                res, cfg = pending.pop(0)
                if best and res.bound_qps / res.candidate.layout.gpus <= best * (1 + REL_TOL):
                    res.outcome = "bound"
                    bar.update(1)
                    continue
                if time.monotonic() - t0 > budget_s:
                    res.outcome = "budget"
                    bar.update(1)
                    continue
                start = best * res.candidate.layout.gpus
                running[pool.submit(evaluate, res.candidate, cfg, res.bound_qps, start, slo)] = res
            if not running:
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                slot = running.pop(fut)
                got = fut.result()
                slot.__dict__.update(got.__dict__)
                best = max(best, slot.per_gpu)
                bar.update(1)
                bar.set_postfix_str(f"best {best:.4f} req/s/GPU", refresh=False)
    bar.close()
    return results
