"""The bubble split into three windows of a run: warm-up, steady state, tail (docs/bubbles.md).

The rule (one, for real and simulated runs): every stage's time is already cut into calls,
one per micro-batch (the gap before its compute, the compute, the send block after it:
`bubbles.StageAccumulator`). A call belongs to the window of its micro-batch; micro-batches
are cut into windows, in planning order, by the requests they carry for the first time
(a request "enters" the pipeline; admission is FCFS, so requests enter in arrival order):

  warm-up  until the first request finishes the pipeline only fills (requests come, none
           leaves): the micro-batches before the one that carries the first request to
           arrive after the first finish
  steady   from that micro-batch until before the one that carries the last request to
           enter (the last to arrive)
  tail     from that one to the end: nothing waits or will arrive, the pipeline drains

With every request at time 0 no request arrives after the first finish: the steady window
is empty (warm-up, then tail). The three windows' parts add up, stage by stage, to the whole
run's. No clock is shared: a window is the difference of each stage's running totals
(`StageAccumulator`) taken just before the micro-batch that opens it; the first finish and
the arrivals are read on the driver's clock.

`AdmissionSnapshots` takes those totals as micro-batches come back (the run recorder calls
it before applying the rule to each micro-batch); `windows()` cuts a run by the rule;
`account_windows()` does both over hand-written `StageTiming` records (tests).
"""
from __future__ import annotations

from array import array
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

from pp_runtime.core.batch import StageTiming
from pp_runtime.telemetry.bubbles import CAUSES, StageAccumulator, add_microbatch

WINDOWS = ("warmup", "steady", "tail")
# a stage's running totals, in this order
PARTS = ("wall_s", "busy_s", "transfer_s", "upstream_s", "downstream_s", "dependency_s", "idle_s",
         "token_s")

Totals = dict[int, tuple[float, ...]]  # stage -> running totals (PARTS)


def totals(stages: Mapping[int, StageAccumulator]) -> Totals:
    """Every stage's running totals now (PARTS)."""
    return {s: (a.wall_s, a.busy_s, a.transfer_s, a.upstream_s, a.downstream_s, a.dependency_s,
                a.idle_s, a.token_s) for s, a in stages.items()}


class AdmissionSnapshots:
    """Each stage's running totals just before each micro-batch that carried a request for
    the first time (one snapshot per such micro-batch, shared by the requests it admitted).
    Kept flat (a 100K-request simulation takes a snapshot per request or so): snapshot i
    is values[offsets[i]:offsets[i + 1]], (stage, *PARTS) per stage."""

    def __init__(self) -> None:
        self.values = array("d")
        self.offsets = array("q", [0])
        self.entered: dict[int, int] = {}  # request id -> the snapshot before it entered

    def before(self, request_ids: Iterable[int], stages: Mapping[int, StageAccumulator]) -> None:
        """Call with a micro-batch's requests before its records go into `stages`."""
        new = [r for r in request_ids if r not in self.entered]
        if not new:
            return
        values = self.values
        for stage, a in stages.items():
            values.extend((stage, a.wall_s, a.busy_s, a.transfer_s, a.upstream_s, a.downstream_s,
                           a.dependency_s, a.idle_s, a.token_s))  # PARTS
        i = len(self.offsets) - 1
        self.offsets.append(len(self.values))
        for r in new:
            self.entered[r] = i

    @property
    def num_snapshots(self) -> int:
        return len(self.offsets) - 1

    def snapshot(self, i: int) -> Totals:
        width = 1 + len(PARTS)
        flat = self.values[self.offsets[i]:self.offsets[i + 1]]
        return {int(flat[k]): tuple(flat[k + 1:k + width]) for k in range(0, len(flat), width)}


def _diff(a: Totals, b: Totals) -> Totals:
    """b - a, stage by stage (a stage absent from a had zero totals)."""
    zero = (0.0,) * len(PARTS)
    return {s: tuple(y - x for x, y in zip(a.get(s, zero), tb)) for s, tb in b.items()}


Cut = dict[str, tuple[Totals, list[int]]]  # window -> (each stage's parts, requests entered)


def windows(snaps: AdmissionSnapshots, end: Totals, arrival_s: Mapping[int, float],
            finish_s: Mapping[int, float | None]) -> Cut:
    """The run cut by the rule (module docstring): window -> (each stage's parts in it, the
    requests that entered in it). Arrival and finish times: request id -> driver clock."""
    if not snaps.entered:
        return {name: ({}, []) for name in WINDOWS}
    entered = snaps.entered
    tail = max(entered.values())
    first_finish = min((f for r in entered if (f := finish_s.get(r)) is not None),
                       default=float("inf"))
    steady = min([i for r, i in entered.items() if arrival_s.get(r, float("-inf")) > first_finish]
                 + [tail])
    opens = {"warmup": 0, "steady": steady, "tail": tail}
    at = {"warmup": {}, "steady": snaps.snapshot(steady), "tail": snaps.snapshot(tail)}
    until = {"warmup": at["steady"], "steady": at["tail"], "tail": end}
    ends = {"warmup": steady, "steady": tail, "tail": snaps.num_snapshots}
    return {name: (_diff(at[name], until[name]),
                   sorted(r for r, i in entered.items() if opens[name] <= i < ends[name]))
            for name in WINDOWS}


def window_stats(parts: Sequence[Totals]) -> dict:
    """One window over stages (of one or more replicas): its duration (mean stage wall in
    it), stage-seconds, the bubble fraction by cause and each part's share (of the summed
    stage wall, as the whole run's fractions are)."""
    stages = [v for p in parts for v in p.values()]
    sums = dict(zip(PARTS, (sum(v[i] for v in stages) for i in range(len(PARTS)))))
    wall = sums["wall_s"]
    frac = {p[:-2]: (sums[p] / wall if wall > 0 else 0.0) for p in PARTS[1:]}
    by_cause = {c: frac[c] for c in CAUSES}
    return {"duration_s": wall / len(stages) if stages else 0.0, "stage_wall_s": wall,
            "bubble_s": sum(sums[f"{c}_s"] for c in CAUSES),
            "bubble_fraction": sum(by_cause.values()), "bubble_fraction_by_cause": by_cause,
            "busy_fraction": frac["busy"], "transfer_fraction": frac["transfer"],
            "idle_fraction": frac["idle"],
            "dependency_token_fraction": frac["token"]}  # of the dependency: the token hop


def account_windows(timings: Iterable[StageTiming], mb_requests: Mapping[int, Sequence[int]],
                    arrival_s: Mapping[int, float], finish_s: Mapping[int, float | None],
                    idle_before_s: Mapping[int, float] | None = None) -> dict[str, dict]:
    """The three windows' stats over finished records, micro-batches in planning order
    (mb_id), as the run recorder sees them: window name -> `window_stats`."""
    by_mb: dict[int, list[StageTiming]] = defaultdict(list)
    for t in timings:
        by_mb[t.mb_id].append(t)
    stages: dict[int, StageAccumulator] = {}
    snaps = AdmissionSnapshots()
    for mb_id in sorted(by_mb):
        snaps.before(mb_requests.get(mb_id, ()), stages)
        for _ in add_microbatch(stages, sorted(by_mb[mb_id], key=lambda t: t.stage),
                                (idle_before_s or {}).get(mb_id, 0.0)):
            pass
    cut = windows(snaps, totals(stages), arrival_s, finish_s)
    return {name: {**window_stats([cut[name][0]]), "requests": cut[name][1]} for name in WINDOWS}


def summarize(cuts: Sequence[Cut], arrival_s: Mapping[int, float]) -> dict:
    """report.json's `summary.windows`: each window's `window_stats` over every replica's
    stages (`cuts`: one `RunRecorder.run_windows()` per replica), with the requests that
    entered in it and the span of their arrivals."""
    out: dict = {"rule": "warm-up until the first request to arrive after the first finish "
                         "enters; tail from the last request's entry (docs/bubbles.md)"}
    for name in WINDOWS:
        rids = [r for c in cuts for r in c[name][1]]
        out[name] = {**window_stats([c[name][0] for c in cuts]), "requests_entered": len(rids),
                     "arrivals_s": ([min(arrival_s[r] for r in rids), max(arrival_s[r] for r in rids)]
                                    if rids else None)}
    return out


def _pct(x: float) -> str:
    return f"{x:.1%}"


def token_part(fraction: float | None) -> str:
    """', of it on the token hop X%' where the dependency waited for the token hop."""
    return f", of it on the token hop {_pct(fraction)}" if fraction else ""


def format_windows(w: dict | None, whole: float) -> list[str]:
    """The printed lines: the steady-state bubble by cause, what warm-up and tail cost."""
    if not w or not w.get("steady"):
        return []
    st, wu, tl = w["steady"], w["warmup"], w["tail"]
    causes = ", ".join(f"{c} {_pct(st['bubble_fraction_by_cause'][c])}" for c in CAUSES)
    causes += token_part(st.get("dependency_token_fraction"))  # older reports: none
    cost = (f"warm-up {wu['duration_s']:.1f} s at {_pct(wu['bubble_fraction'])}, "
            f"tail {tl['duration_s']:.1f} s at {_pct(tl['bubble_fraction'])}")
    if st["stage_wall_s"] <= 0:  # e.g. every request at time 0: none arrives after a finish
        return [f"  no steady state (no request arrived after the first finished): {cost}; "
                f"whole run {_pct(whole)}"]
    span = st["arrivals_s"] or [0.0, 0.0]
    return [f"  steady state: bubble fraction {_pct(st['bubble_fraction'])} ({causes}), "
            f"{st['duration_s']:.1f} s (arrivals {span[0]:.1f}-{span[1]:.1f} s, idle "
            f"{_pct(st['idle_fraction'])})",
            f"  {cost}; whole run {_pct(whole)} "
            f"({(whole - st['bubble_fraction']) * 100:+.1f} points)"]
