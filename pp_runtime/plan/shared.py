"""Replicas that share this machine: their compute priced as they run, served side by side.

A calibration (`calibration.json`, `plan/calibrated.py`) is measured on one replica of a
layout alone: a pipeline's stages side by side (its Ray actors), or the local executor's
one process, offline. On this machine's CPU the r replicas of a layout are r more `serve`
processes on the same cores, memory bandwidth and caches, each computing on its engine
thread beside its HTTP server. Measured here (GPT-2 small, tp1 pp1, two cores, the same
Poisson stream of 42 requests at 0.84 req/s): the calibrated price of its micro-batches
41.8 s of stage compute; offline for real 44.6 s; served alone 46.5 s; served beside a
second replica 48.8 s. A replica's capacity sits where it is busy most of the time, so
those 17 % move it by far more (the predicted two replicas carried 1.60 x what they did).

So for a layout of r > 1 replicas on `--gpu cpu`, before the search, the plan measures
what its replicas compute served side by side (`measure`): r `pp-runtime serve` processes
of the layout's first candidate, each a Poisson stream at SHARE of one replica's bound (at
most MAX_REQUESTS in SPAN_S) for SPAN_S, their stage busy seconds (`/metrics`) against the
simulator's for the same streams priced with the layout's calibration. The ratio scales
that calibration's compute (every term: a slower core slows all of it), saved as the entry
`<key>/x<r>` (`local/pp1/x2`) that `space.cost_model` prices the layout's candidates with
(`calibrated.shared`).
"""
from __future__ import annotations

import math
import os
import re
import urllib.request
from dataclasses import replace
from pathlib import Path

from pp_runtime.config import Config
from pp_runtime.costmodel import calibration
from pp_runtime.costmodel.calibration import Calibration
from pp_runtime.plan import calibrated
from pp_runtime.plan.calibrated import scaled

SHARE = 0.55  # of one replica's bound, the rate each replica is served at (busy, not swamped)
# seconds of arrivals per replica, at least; PP_RUNTIME_SHARED_SPAN_S is a test hook, not
# configuration (tests/plan/test_plan_validate.py: the suite's time)
SPAN_S = float(os.environ.get("PP_RUNTIME_SHARED_SPAN_S") or 40.0)
MAX_REQUESTS = 60  # per replica, at most: a tiny model's bound would ask for thousands
BUSY = re.compile(r"^pp_runtime_stage_busy_seconds(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def stage_busy_s(url: str) -> float:
    """The server's stage compute seconds so far (`/metrics`, every stage summed)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(float(v) for v in BUSY.findall(text))


def simulated_busy_s(cfg: Config) -> float:
    """Stage compute seconds the simulator prices for cfg's workload (one replica)."""
    from pp_runtime.engine.simulate import simulate

    run = simulate(cfg, progress=False)
    return sum(s.busy_s for rec in run.replicas for s in rec.bubbles().per_stage)


def streams(cfg: Config, replicas: int, qps: float) -> list[Config]:
    """Each replica's stream as `validate.real_probe` sends it (its seed, its share)."""
    n = max(cfg.workload.num_requests, math.ceil(qps * SPAN_S))
    return [replace(cfg, workload=replace(cfg.workload, qps=qps, seed=cfg.workload.seed + i,
                                          num_requests=n)) for i in range(replicas)]


def measure(cfg: Config, replicas: int, bound_qps: float, out: Path, log=print) -> Calibration:
    """Serve `replicas` of cfg (one replica's config, its layout's calibration in its
    profile) side by side, each at SHARE x `bound_qps` (one replica's bound); save and
    return the calibration scaled by measured / simulated stage compute."""
    from pp_runtime.costmodel.model import find_calibration
    from pp_runtime.plan.report import dump_config
    from pp_runtime.plan.probe import SPAN_TTFTS
    from pp_runtime.plan.search import Slo
    from pp_runtime.plan.validate import real_probe, serving

    base = find_calibration(cfg)
    if base is None:
        raise ValueError(f"{calibrated.entry_name(cfg)}: calibrate one replica first")
    qps = min(SHARE * bound_qps, MAX_REQUESTS / SPAN_S)
    mine = streams(cfg.with_overrides(**{"workload.num_requests": 1}), replicas, qps)
    path = dump_config(mine[0], replicas, out / f"shared-x{replicas}.yaml",
                       f"pp-runtime plan: {replicas} replicas served side by side")
    with serving(path, replicas, out, f"shared-x{replicas}") as urls:
        before = [stage_busy_s(u) for u in urls]
        slo = Slo(SPAN_S / SPAN_TTFTS, 1e9)  # real_probe's length: SPAN_S; its answer unused
        real_probe(urls, mine[0], slo, log=lambda line: None)(qps * replicas)
        measured = [stage_busy_s(u) - b for u, b in zip(urls, before)]
    priced = [simulated_busy_s(c.with_overrides(**{"parallel.dp": 1})) for c in mine]
    factor = sum(measured) / sum(priced)
    log(f"    {replicas} replicas at {qps:.3f} req/s each, {mine[0].workload.num_requests} requests: "
        f"stage compute {' + '.join(f'{m:.1f}' for m in measured)} s for real, "
        f"{' + '.join(f'{p:.1f}' for p in priced)} s priced by {base.key}: x{factor:.3f}")
    cal = scaled(base, factor, replicas)
    calibration.save(cfg.hardware.profile, cal)
    return cal


def ensure(firsts: dict, wl, requests: int, here: bool, out: Path, log=print) -> int:
    """One line per layout of several replicas on the CPU (`firsts`: layout -> the config
    its replicas would serve): the side-by-side calibration found, or measured now
    (`measure`, with `here` and requests > 0, where one replica's is known), or none (its
    replicas priced as if each ran alone). Returns how many were measured."""
    from pp_runtime.costmodel.model import find_calibration
    from pp_runtime.plan.search import upper_bound

    measured = 0
    for lay, cfg in firsts.items():
        if lay.replicas <= 1 or cfg.hardware.gpu != "cpu" or not cfg.hardware.profile:
            continue
        name, prof = calibrated.shared_name(cfg, lay.replicas), cfg.hardware.profile
        if calibrated.shared(cfg, lay.replicas) is not None:
            log(f"  calibration of {lay.name}: {name} in {prof} (its replicas served side by side)")
        elif here and requests > 0 and find_calibration(cfg) is not None:
            log(f"  calibration of {lay.name}: none ({name}) in {prof}: measuring it now, "
                f"{lay.replicas} replicas served side by side for {SPAN_S:.0f} s ...", flush=True)
            measure(cfg, lay.replicas, upper_bound(cfg, wl, 1), out, log)
            measured += 1
        else:
            log(f"  calibration of {lay.name}: none ({name}) in {prof}: its replicas priced as "
                "if each ran alone (optimistic where they share the cores)")
    return measured
