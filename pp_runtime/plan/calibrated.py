"""`plan --profile DIR`: the calibration each layout is priced with, measured first where
the profile has none.

A profile times each operation alone; `calibration.json` beside it (`pp-runtime profile
--calibrate N`) adds what a real pipeline pays on top (contention, host costs), one entry
per executor, tp and pp (costmodel/calibration.py). Uncalibrated, the simulator runs
optimistic (1.33 x the measured capacity on this machine's CPU pipeline, docs/plan.md).
So before the search, for every layout that fits: the calibration found is said in one
line; where there is none and the profile is this machine's (`--gpu cpu`), it is measured
now, as `pp-runtime profile --calibrate N` would (N requests for real on the layout's
executor, then N / 2 whole prompts, then the N arriving as a served load), and said so; on a GPU profile it can only be
measured on that machine, which the line says.
"""
from __future__ import annotations

from dataclasses import replace

from pp_runtime.config import Config
from pp_runtime.costmodel import calibration
from pp_runtime.costmodel.calibration import Calibration


def entry_name(cfg: Config) -> str:
    """The calibration.json entry a config's cost model looks up first (costmodel/model.py:
    `find_calibration`; under Ray's `compiled_graph: auto` also the `/auto` one)."""
    from pp_runtime.costmodel import calibration

    p = cfg.parallel
    return calibration.key(calibration.executor_kind(cfg.runtime.executor, p.tp, p.pp), p.pp, tp=p.tp)


def ensure(configs: list[Config], profile: str, requests: int, here: bool, log=print) -> int:
    """One line per layout (one config each): the calibration its cost model uses, or none;
    with `here` (the profile is this machine's) and requests > 0, a missing one is measured
    first. Returns how many were measured (the caller prices its candidates again)."""
    from pp_runtime.costmodel.model import find_calibration

    measured = 0
    for cfg in configs:
        name = f"tp{cfg.parallel.tp} pp{cfg.parallel.pp}"
        found = find_calibration(cfg)
        if found is not None:
            log(f"  calibration of {name}: {found.key} in {profile}")
            continue
        if not (here and requests > 0):
            why = ("--calibrate 0" if here else "a GPU profile is calibrated on its machine: "
                   f"`pp-runtime profile --calibrate N --out {profile}` there")
            log(f"  calibration of {name}: none ({entry_name(cfg)}) in {profile}: priced "
                f"uncalibrated, optimistic ({why})")
            continue
        log(f"  calibration of {name}: none ({entry_name(cfg)}) in {profile}: measuring it now, "
            f"as `pp-runtime profile --calibrate {requests}` does ({requests} requests for real "
            "on this machine) ...", flush=True)
        log(f"    {describe(measure(cfg, profile, requests))}", flush=True)
        measured += 1
    return measured


def measure(cfg: Config, profile: str, requests: int):
    """`profile --calibrate`'s run for this config (saved into the profile's calibration.json)."""
    from pp_runtime.profile.calibrate import calibrate

    if cfg.runtime.threads_per_worker:  # as `pp-runtime profile` runs it
        import torch
        torch.set_num_threads(cfg.runtime.threads_per_worker)
    return calibrate(cfg, profile, requests=requests)


def describe(cal) -> str:
    from pp_runtime.costmodel.calibration import describe as said

    return said(cal)


def shared_name(cfg: Config, replicas: int) -> str:
    """The entry of `replicas` replicas of cfg's layout served side by side: `local/pp1/x2`."""
    p = cfg.parallel
    kind = calibration.executor_kind(cfg.runtime.executor, p.tp, p.pp)
    return calibration.key(kind, p.pp, f"x{replicas}", p.tp)


def shared(cfg: Config, replicas: int) -> Calibration | None:
    """The calibration of `replicas` replicas of cfg's layout served side by side
    (`plan/shared.py` measures it), or None (one replica, no profile, a GPU, or never
    measured: priced as one replica alone)."""
    if replicas <= 1 or cfg.hardware.gpu != "cpu" or not cfg.hardware.profile:
        return None
    p = cfg.parallel
    kind = calibration.executor_kind(cfg.runtime.executor, p.tp, p.pp)
    return calibration.load(cfg.hardware.profile, kind, p.pp, f"x{replicas}", p.tp)


def scaled(cal: Calibration, factor: float, replicas: int) -> Calibration:
    """`cal` with its compute `factor` x slower, as the entry of `replicas` side by side."""
    c = cal.compute
    compute = replace(c, scale=c.scale * factor, per_layer_s=c.per_layer_s * factor,
                      per_row_s=c.per_row_s * factor)
    return replace(cal, compute=compute, path=f"x{replicas}")
