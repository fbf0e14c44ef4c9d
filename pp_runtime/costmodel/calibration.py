"""What a quiet profile misses, measured on a short real run: `calibration.json`.

A profile (`pp-runtime profile`) times each operation alone, in one process. A real
pipeline pays more, and the simulator prices it from this file, one entry per executor,
TP degree, pipeline depth and path (`"ray/pp2"`, `"ray/pp2/graph"`, `"ray/tp2/pp2/relay"`,
`"torchrun/pp3"`: more processes share the cores at tp 2, and the Ray executor's compiled
graph or TP relay cost the host far less or more per micro-batch than a task per actor),
written by `profile/calibrate.py` next to the profile's tables:

- **compute under contention** (`ComputeFit`): the stages run side by side on shared
  cores with the driver and Ray beside them, and every call pays work the per-op tables
  leave out (the KV write, the batch layout, Python between ops, sampling). Fitted over
  every (micro-batch, stage) of the run, least squares with negative terms dropped:

      real compute = scale * priced + per_layer_s * layers + per_row_s * sampling rows (last stage)

  then each stage's measured total over that fit's total for it (`stage_scale`): what is
  particular to one stage (its process's placement on the cores, the LM head's GEMV
  against the layers' GEMMs) and one shared fit cannot see, so each stage's busy time is
  its own;

- **host cost per micro-batch** (`HostCost`): the driver's turn (planning, `on_result`),
  submitting the call, the call reaching a stage, each stage's time between two calls
  (returning its result, taking the next call), and the result's return trip to the
  driver. The simulator charges them where they happen (executors/sim.py), so its
  `dependency` is the real one's.

No torch; docs/costmodel.md and docs/simulator.md have the figures.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FILE = "calibration.json"
AUTO = "auto"  # the key's path of a run under `compiled_graph: auto` (what auto chose there)


@dataclass(frozen=True)
class ComputeFit:
    scale: float = 1.0  # multiplies the profile's price (contention: stages side by side)
    per_layer_s: float = 0.0  # per layer per micro-batch, not in the per-op tables
    per_row_s: float = 0.0  # last stage: per sampling row (sampling, logits copy)
    stage_scale: tuple[float, ...] = ()  # per stage: measured / fitted over the run (one
    #                                      a stage; () is 1.0 everywhere)

    def stage_factors(self, pp: int) -> list[float] | None:
        """`stage_scale` for a pipeline of `pp` stages, or None (no factor, or fitted at
        another depth)."""
        if len(self.stage_scale) != pp or all(f == 1.0 for f in self.stage_scale):
            return None
        return list(self.stage_scale)

    def per_layer(self, priced_s: float) -> float:
        return self.scale * priced_s + self.per_layer_s

    def extra(self, priced_s: float, rows: int = 0) -> float:
        """The embedding (rows 0) or the LM head (its sampling rows), calibrated."""
        return self.scale * priced_s + self.per_row_s * rows


@dataclass(frozen=True)
class HostCost:
    """Seconds per micro-batch outside the stages' compute, as the simulator charges them."""

    plan_s: float = 0.0  # the driver's turn before a submit (on_result, schedule, callbacks)
    submit_s: float = 0.0  # the driver submitting one micro-batch to every stage
    dispatch_s: float = 0.0  # from the submit's start until an idle stage takes the call
    call_s: tuple[float, ...] = ()  # per stage: from the end of one call (send included)
    #                                 to taking the next one already queued
    return_s: float = 0.0  # from the last stage's end to the driver holding the result

    def between_calls(self, stage: int) -> float:
        return self.call_s[stage] if stage < len(self.call_s) else 0.0

    @property
    def total_s(self) -> float:
        """One micro-batch's host time on the critical path of a lone micro-batch."""
        return self.plan_s + self.dispatch_s + self.return_s


@dataclass(frozen=True)
class Calibration:
    executor: str  # ray, torchrun
    pp: int
    compute: ComputeFit = field(default_factory=ComputeFit)
    host: HostCost = field(default_factory=HostCost)
    layer_split: tuple[int, ...] = ()  # the split the calibration run ran
    microbatches: int = 0  # how many the fit saw
    residual: float = 0.0  # relative RMS error of the compute fit
    path: str = ""  # how the driver reached the stages (`Executor.path`): "" a task per
    #                 actor (Ray's default; torchrun, local), "graph" or "relay" (Ray)
    tp: int = 1  # TP ranks per stage in the calibration run

    @property
    def key(self) -> str:
        return key(self.executor, self.pp, self.path, self.tp)


def key(executor: str, pp: int, path: str = "", tp: int = 1) -> str:
    """An entry's name in calibration.json: `ray/pp2`, `ray/pp2/graph`, `ray/pp2/auto`,
    `ray/tp2/pp2/relay` (tp 1 is left out, as in entries from before tp was kept)."""
    parts = [executor, f"tp{tp}" if tp > 1 else "", f"pp{pp}", path]
    return "/".join(part for part in parts if part)


def executor_kind(executor: str, tp: int, pp: int) -> str:
    """The executor a config runs on (`runtime.executor`, auto resolved as make_executor does)."""
    if executor == "auto":
        return "ray" if tp * pp > 1 else "local"
    return executor


def load(profile_dir: str | Path, executor: str, pp: int, path: str = "",
         tp: int = 1) -> Calibration | None:
    """The calibration of `executor` at `tp` x `pp` on `path` (`key`) in a profile
    directory, or None."""
    file = Path(profile_dir).expanduser() / FILE
    if not file.is_file():
        return None
    entry = json.loads(file.read_text()).get(key(executor, pp, path, tp))
    if entry is None:
        return None
    host = dict(entry.get("host", {}))
    host["call_s"] = tuple(host.get("call_s", ()))
    compute = dict(entry.get("compute", {}))
    compute["stage_scale"] = tuple(compute.get("stage_scale", ()))
    return Calibration(entry["executor"], int(entry["pp"]), ComputeFit(**compute),
                       HostCost(**host), tuple(entry.get("layer_split", ())),
                       int(entry.get("microbatches", 0)), float(entry.get("residual", 0.0)),
                       entry.get("path", ""), int(entry.get("tp", 1)))


def save(profile_dir: str | Path, cal: Calibration, auto: bool = False) -> Path:
    """Add (or replace) one entry of the profile's calibration.json; with `auto` (the run's
    config said `compiled_graph: auto`) also as the entry such configs find."""
    path = Path(profile_dir).expanduser() / FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    entry = asdict(cal)
    entry["host"]["call_s"] = list(cal.host.call_s)
    entry["compute"]["stage_scale"] = list(cal.compute.stage_scale)
    entry["layer_split"] = list(cal.layer_split)
    data[cal.key] = entry
    if auto:
        data[key(cal.executor, cal.pp, AUTO, cal.tp)] = entry
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def describe(cal: Calibration) -> str:
    c, h = cal.compute, cal.host
    calls = ", ".join(f"{x * 1e3:.2f}" for x in h.call_s)
    stages = (" (stages " + " / ".join(f"x{f:.3f}" for f in c.stage_scale) + ")"
              if c.stage_scale else "")
    return (f"{cal.key}: compute x{c.scale:.3f} + {c.per_layer_s * 1e3:.2f} ms/layer + "
            f"{c.per_row_s * 1e3:.3f} ms/sampling row{stages} (fit over {cal.microbatches} micro-batches, "
            f"rms {cal.residual:.1%}); host: plan {h.plan_s * 1e3:.2f} ms, submit "
            f"{h.submit_s * 1e3:.2f} ms, dispatch {h.dispatch_s * 1e3:.2f} ms, between calls "
            f"[{calls}] ms, return {h.return_s * 1e3:.2f} ms")
