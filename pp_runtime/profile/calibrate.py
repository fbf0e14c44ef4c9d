"""A short real run that measures what the quiet profile misses: `calibration.json`.

    from pp_runtime.profile.calibrate import calibrate
    calibrate(cfg, "profiles/cpu-gpt2", requests=10)   # -> Calibration, saved in the profile

It runs `cfg`'s workload (all requests at once, `requests` of them) on the real executor
`cfg` names (Ray, or a torchrun rank 0's executor handed in), with the profile as
`hardware.profile`, and records on one clock (`time.perf_counter` is CLOCK_MONOTONIC,
shared by every process of one machine) when the driver submits and gets each micro-batch
and when each stage takes, computes and frees it. From those:

- the compute fit (`ComputeFit`): every (micro-batch, stage) compute time against the
  profile's price of the same micro-batch on that stage, least squares of the error in
  seconds with negative terms dropped (`costmodel.attention.lstsq_dropping_negatives`:
  the long micro-batches make the run's time, so they weigh most); the first 2 * pp
  micro-batches are warm-up and left out; then each stage's factor (`stage_scale`), its
  measured compute over the fit's for it summed over the run;
- the host costs (`HostCost`), medians over the micro-batches where each is visible:
  plan (the driver's time before a submit), submit, dispatch (submit to an idle stage 0
  taking it), each stage's time between calls (when the next call was already queued),
  return (every stage done to the driver holding the result, while it waited).

Imports torch through the runtime (only when called); docs/costmodel.md.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from pp_runtime.core.batch import MicroBatch, SampledTokens, StageTiming
from pp_runtime.config import Config
from pp_runtime.costmodel import calibration
from pp_runtime.costmodel.attention import lstsq_dropping_negatives
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.costmodel.calibration import Calibration, ComputeFit, HostCost

WARM_UP = 2  # micro-batches per stage left out of the compute fit (first calls are slow)


class TimedExecutor:
    """An executor that notes when the driver submits and waits (everything else passes)."""

    def __init__(self, inner, clock=time.perf_counter):
        self.inner, self.clock = inner, clock
        self.times: dict[int, list[float]] = {}  # mb id -> [submit start, end, wait start, end]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, mb: MicroBatch):
        t0 = self.clock()
        handle = self.inner.submit(mb)
        self.times[mb.mb_id] = [t0, self.clock(), 0.0, 0.0]
        return mb.mb_id, handle

    def wait(self, handle):
        mb_id, inner = handle
        t0 = self.clock()
        out = self.inner.wait(inner)
        self.times[mb_id][2:] = [t0, self.clock()]
        return out


def _median(values: Sequence[float], default: float = 0.0) -> float:
    return statistics.median(values) if values else default


def _take(t: StageTiming) -> float:
    """When the stage took the call: before its waits for activations and for the token
    hop's ids (the simulator prices both apart from the call's trip)."""
    return t.compute_start_s - t.transfer_s - t.wait_s - t.token_wait_s


def host_costs(times: dict[int, list[float]], timings: dict[int, Sequence[StageTiming]],
               pp: int) -> HostCost:
    """Medians of each host cost over the micro-batches where it shows (module doc)."""
    ids = sorted(i for i in times if i in timings)
    stages = [{t.stage: t for t in timings[i] if t.tp_rank == 0} for i in ids]
    free = [{s: t.compute_end_s + t.send_wait_s for s, t in st.items()} for st in stages]
    submit = [times[i][1] - times[i][0] for i in ids]
    events = sorted([(times[i][1], "s") for i in ids] + [(times[i][3], "w") for i in ids])
    plan, dispatch, ret, calls = [], [], [], [[] for _ in range(pp)]
    for n, i in enumerate(ids):
        s0, s1, w0, w1 = times[i]
        before = [t for t, _ in events if t <= s0]
        if before:
            plan.append(s0 - before[-1])
        done = max(free[n].values())
        if w0 < done:
            ret.append(w1 - done)
        for s in range(pp):
            prev, st = free[n - 1].get(s) if n else None, stages[n].get(s)
            if st is None:
                continue
            if prev is not None and s1 < prev:  # queued before the stage freed: its own gap
                calls[s].append(_take(st) - prev)
            elif s == 0:  # stage 0 idle when submitted: the call's trip to it
                dispatch.append(_take(st) - s0)
    return HostCost(plan_s=_median(plan), submit_s=_median(submit),
                    dispatch_s=max(0.0, _median(dispatch)),
                    call_s=tuple(max(0.0, _median(c)) for c in calls),
                    return_s=max(0.0, _median(ret)))


def fit_compute(cfg: Config, mbs: dict[int, MicroBatch],
                timings: dict[int, Sequence[StageTiming]]) -> tuple[ComputeFit, int, float]:
    """The compute fit over every (micro-batch, stage) after warm-up: (fit, points, rms)."""
    from pp_runtime.costmodel.model import StageCostModel, build_pricing

    cost = StageCostModel(cfg, build_pricing(cfg))  # the profile alone, not calibrated
    layers, last = cost.layers, len(cost.layers) - 1
    x, y, stage = [], [], []
    for i in sorted(mbs)[WARM_UP * len(layers):]:
        mb = mbs[i]
        decodes = [s.start + 1 for s in mb.seqs if s.is_decode]
        prefills = [(s.start, len(s.token_ids)) for s in mb.seqs if not s.is_decode]
        priced = cost.stage_times(prefills, decodes)  # uncalibrated: the tables alone
        rows = len(decodes) + len(prefills)
        for t in timings[i]:
            if t.tp_rank:
                continue
            s = t.stage
            x.append([priced[s], layers[s], rows if s == last else 0.0])
            y.append(t.compute_end_s - t.compute_start_s)
            stage.append(s)
    if not y:
        return ComputeFit(), 0, 0.0
    xa, ya, sa = np.array(x), np.array(y), np.array(stage)
    coef = lstsq_dropping_negatives(xa, ya, relative=False)  # seconds: the run's total counts
    fitted = xa @ coef
    factors = stage_factors(fitted, ya, sa, len(layers))
    rms = float(np.sqrt(np.mean((fitted * np.array(factors)[sa] / ya - 1) ** 2)))
    return (ComputeFit(float(coef[0]), float(coef[1]), float(coef[2]),
                       tuple(factors) if len(layers) > 1 else ()), len(y), rms)


def stage_factors(fitted, measured, stage, pp: int) -> list[float]:
    """Each stage's measured compute over the shared fit's, summed over the run (1.0 for a
    stage the run never timed)."""
    out = []
    for s in range(pp):
        mine = stage == s
        total = float(fitted[mine].sum())
        out.append(float(measured[mine].sum()) / total if total > 0 else 1.0)
    return out


WHOLE_PROMPTS = "orca-best"  # the second calibration run: whole prompts in one micro-batch
PACED_LOAD = 0.8  # the third run's Poisson rate, as a share of the first run's offline rate


def _run(cfg: Config, executor) -> tuple[TimedExecutor, dict, dict]:
    """One calibration run: (the timed executor, micro-batches, their stage timings)."""
    from pp_runtime.executors import make_executor
    from pp_runtime.engine.llm import run_workload

    timed = TimedExecutor(executor if executor is not None else make_executor(cfg))
    mbs: dict[int, MicroBatch] = {}
    timings: dict[int, Sequence[StageTiming]] = {}

    def record(mb: MicroBatch, out: SampledTokens) -> None:
        mbs[mb.mb_id], timings[mb.mb_id] = mb, out.timings

    run_workload(cfg, on_microbatch=record, executor=timed)
    return timed, mbs, timings


def offline_rate(timed: TimedExecutor, requests: int) -> float:
    """Requests per second of a run of `requests` all at once: first submit to last result."""
    times = timed.times.values()
    span = max(t[3] for t in times) - min(t[0] for t in times)
    return requests / span if span > 0 else 0.0


def _merged(runs: list[tuple[dict, dict]], pp: int) -> tuple[dict, dict]:
    """The runs' micro-batches and timings under one numbering; each later run's first
    micro-batches (its new actors' warm-up) left out, as the fit leaves out the first's."""
    mbs, timings = dict(runs[0][0]), dict(runs[0][1])
    for more, more_t in runs[1:]:
        n, cold = max(mbs) + 1, set(sorted(more)[:WARM_UP * pp])
        mbs.update({n + i: mb for i, mb in more.items() if i not in cold})
        timings.update({n + i: t for i, t in more_t.items()})
    return mbs, timings


def calibrate(cfg: Config, profile: str | Path, requests: int = 10, executor=None,
              save: bool = True, whole_prompts: bool = True, paced: bool = True) -> Calibration:
    """Run a short real workload on `cfg`'s executor (or `executor`, already started) and
    fit what the profile misses; saved into the profile's calibration.json. Without an
    `executor`, two more runs join the compute fit (the host costs come from the first):
    `requests` // 2 whole prompts (`WHOLE_PROMPTS`: long micro-batches), and `requests`
    arriving as Poisson at `PACED_LOAD` x the first run's offline rate (`paced`): the
    micro-batches of a served load, a few decodes beside a chunk, which a burst of
    requests at once hardly makes (stage 0 computed 8 % more than priced on such a load,
    docs/measurements/plan.md)."""
    # the path the simulator prices: tokens back through the driver (the token hop's waits
    # on stage 0 are not priced yet, docs/simulator.md), unless an executor is handed in
    cfg = cfg.with_overrides(**{"hardware.profile": str(profile), "workload.num_requests": requests,
                                "workload.qps": None, "runtime.token_hop": False})
    cfg = resolve_layer_split(cfg).with_layer_split_resolved()
    timed, mbs, timings = _run(cfg, executor)
    runs = [(mbs, timings)]
    if executor is None and requests >= 2:
        if whole_prompts and cfg.planner.planner != WHOLE_PROMPTS:
            whole = cfg.with_overrides(planner=WHOLE_PROMPTS, num_requests=requests // 2)
            runs.append(_run(whole, None)[1:])
        rate = offline_rate(timed, requests)
        if paced and rate > 0:
            runs.append(_run(cfg.with_overrides(**{"workload.qps": PACED_LOAD * rate}), None)[1:])
    fit, points, rms = fit_compute(cfg, *_merged(runs, cfg.parallel.pp))
    p = cfg.parallel
    kind = calibration.executor_kind(timed.inner.name, p.tp, p.pp)
    cal = Calibration(kind, p.pp, fit, host_costs(timed.times, timings, p.pp),
                      tuple(cfg.layers_per_stage()), points, rms, timed.inner.path, p.tp)
    if save:
        auto = kind == "ray" and cfg.runtime.compiled_graph == calibration.AUTO
        calibration.save(profile, cal, auto=auto)
    return cal
