"""Goodput: capacity under latency targets, `uniform` at its defaults beside every anchor at
the best of its own knobs for that target. Simulated: GPT-3 175B TP8 x PP8 on A100s and
LLaMA-2-70B TP8 x PP8 on H100s, at P:D 1, 3 and 10.

For each setting:
  - u, the unloaded time between tokens (one decode through the pipeline, sends included),
    and the TTFT target: 5 x the unloaded time to first token of the mean prompt;
  - the offline makespan of every row (every request at once);
  - the highest rate probed: the cost model's work bound (every token at the best time per
    token any micro-batch reaches, on the slowest stage: `plan.search.upper_bound`), which
    no schedule sustains past. (An offline makespan is no such bound: with N requests at
    once it ends in the decode tail of the longest ones, a latency; on LLaMA-2-70B P:D 1,
    400 requests finish at 11.7 req/s while a Poisson load of 29.7 req/s meets a 3x target.)
    A probe at rate q holds at least q x the mean output x the loosest TBT target requests
    (`LIFETIMES` of them): its arrivals span a request's life at that target, so the rows
    in flight reach what the rate sustains before the arrivals end, instead of a burst of
    N that the KV memory absorbs;
  - TBT targets 2u, 3u, 5u; for each, the capacity (the highest Poisson rate whose p99 TBT
    and p99 TTFT meet their targets, on a geometric grid of rates x1.1, then bisected
    `--refine` times towards the next grid rate for `uniform` and each anchor's best knob) of
      uniform        its defaults, given the two targets (planner.tbt_slo_ms, ttft_slo_ms);
      sarathi-serve  chunk_size in SERVE_CHUNKS, max_num_seqs what the pages hold;
      gllm           maxp in GLLM_MAXP, its other knobs at gLLM's defaults;
    an anchor's best is its best knob for that target (each knob's probes are cached by
    rate, so the targets share them);
  - no target: every request at once, makespan of uniform's defaults against each anchor's
    best knob;
  - a Pareto figure: throughput against p99 TBT of every probe that met the TTFT target,
    each planner's frontier (its best over knobs: for `uniform`, its TBT target, probed at
    the table's targets and at each anchor frontier point it does not match yet, that
    point's p99 TBT as its target; `goodput_frontier.py`), and a line saying at how many of
    the anchors' frontier points `uniform`'s frontier lies at or above.
Every planner gets the same KV bytes (the config's kv_slots contexts, as 16-token pages).

    python benchmarks/goodput.py [--requests 1000] [--pd 1,3,10] [--models gpt3,llama]
                                 [--out runs/goodput] [--jobs N] [--anchors-from FILE]

Settings run side by side, one process each (`--jobs`, default the cores). goodput.json
keeps every probe's figures and a fingerprint of the code the anchors run on
(`anchor_code`: every source file but `uniform`'s own modules, the configs and profiles,
and this script's knobs); `--anchors-from` an earlier goodput.json with the same
fingerprint reads the anchors' probes from it instead of simulating them again (the
simulator's clock is virtual: the same code gives the same figures), so a change to
`uniform` gets the whole table and its Pareto figures in the time of `--only-uniform`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from pp_runtime.bench.capacity import meets
from pp_runtime.cli.common import parse_overrides
from pp_runtime.config import ConfigError, load_config
from pp_runtime.costmodel import build_cost_model
from pp_runtime.core.workload import generate
from pp_runtime.engine.simulate import check_memory, simulate
from pp_runtime.plan.search import Workload, upper_bound
from pp_runtime.telemetry.report import build_report

sys.path.insert(0, str(Path(__file__).resolve().parent))  # goodput_frontier beside this file
from goodput_frontier import check, pareto, summary  # noqa: E402

MODELS = {"gpt3": "paper/gpt3_tp8_pp8", "llama": "paper/llama2_70b_tp8_pp8_h100"}
SLO_MULTIPLES = (2, 3, 5)
SERVE_CHUNKS = (128, 256, 512, 1024)
GLLM_MAXP = (2048, 8192)
GRID_STEP = 1.1  # rates probed: RATE0 x GRID_STEP^k
RATE0 = 0.05
ROWS_B = 4096  # B for the anchors: never binds (they cap rows by their own knobs)
ONLY_UNIFORM = False  # --only-uniform: the anchors' offline rows (for the rate cap) only
REFINE = 2  # --refine: bisections between a capacity's grid rate and the next (x1.1 -> ~x1.024)
LIFETIMES = 1.0  # a probe's arrivals span at least this many request lives at the loosest
#                 target (mean output x 5u): the rows reach what the rate sustains
UNIFORM_ONLY = ("planner/uniform.py", "planner/admit.py", "planner/budget.py",  # no anchor
                "planner/due.py", "planner/order.py", "planner/memory.py")  # imports these
ROOT = Path(__file__).resolve().parent.parent
SOURCES = (".py", ".csv", ".json", ".yaml")  # what the fingerprint reads (no build outputs)


def anchor_code() -> str:
    """A fingerprint of what the anchors' probes depend on: every file of the package but
    `uniform`'s own modules, the shipped configs and profiles, and this script's knobs."""
    h = hashlib.sha256(repr((SLO_MULTIPLES, SERVE_CHUNKS, GLLM_MAXP, GRID_STEP, RATE0, ROWS_B,
                             LIFETIMES)).encode())
    pkg = ROOT / "pp_runtime"
    files = [f for f in sorted(pkg.rglob("*")) if f.suffix in SOURCES
             and f.relative_to(pkg).as_posix() not in UNIFORM_ONLY]
    for f in files + sorted(f for f in (ROOT / "configs").rglob("*") if f.suffix in SOURCES):
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


class Setting:
    def __init__(self, config: str, requests: int, pd: float, bar: tqdm,
                 overrides: dict | None = None):
        base = load_config(config, **(overrides or {}))
        self.config, self.bar, self.pp, self.requests = config, bar, base.parallel.pp, requests
        self.base = {**(overrides or {}), "workload.num_requests": requests,
                     "workload.pd_ratio": pd, "cache.kv_slots": base.num_slots,
                     "cache.paged": True}
        cfg = load_config(config, **self.base)
        cost = build_cost_model(cfg)
        w = cfg.workload
        kv = (w.min_len + w.max_len) // 2
        self.tbt_unloaded = (sum(cost.stage_times([], [kv]))
                             + sum(cost.send_time(1, s) for s in range(1, self.pp)))
        prompt = int(kv * pd / (pd + 1))
        self.ttft_slo = 5 * (sum(cost.stage_times([(0, prompt)], []))
                             + sum(cost.send_time(prompt, s) for s in range(1, self.pp)))
        self.runs: dict[str, dict] = {}
        self.multiples = SLO_MULTIPLES  # the table's targets, x the unloaded TBT
        self.known: dict[str, dict] = {}  # the anchors' probes of an earlier run (--anchors-from)
        self.simulated = 0  # probes simulated here (not read from `known`)
        specs = generate(cfg.workload)
        self.mean_output = sum(s.output_len for s in specs) / len(specs)
        self.life_s = self.mean_output * max(SLO_MULTIPLES) * self.tbt_unloaded
        uni = load_config(config, **self.base, chunk_size=None, max_batch_size=None)
        self.wl = Workload.of([(s.prompt_len, s.output_len) for s in specs])
        self.bound, self.cost = upper_bound(uni, self.wl, 1), cost
        self.top = int(math.log(self.bound / RATE0) / math.log(GRID_STEP) + 1e-9)

    def requests_at(self, qps: float | None) -> int:
        """Requests in a probe at rate qps: N, or more so that the arrivals span LIFETIMES
        request lives at the loosest target (offline: N)."""
        if qps is None:
            return self.requests
        return max(self.requests, math.ceil(qps * LIFETIMES * self.life_s))

    def run(self, planner: str, knobs: dict, qps: float | None) -> dict:
        key = json.dumps([planner, knobs, qps], sort_keys=True)
        if key not in self.runs and planner != "uniform" and key in self.known:
            self.runs[key] = self.known[key]  # --anchors-from: the same code's figures
        if key not in self.runs:
            self.bar.set_postfix_str(f"{self.config.split('/')[-1]} {planner} {knobs} {qps}"[:70])
            over = {**self.base, **knobs, "workload.qps": qps,
                    "workload.num_requests": self.requests_at(qps)}
            if planner == "uniform":  # its defaults: the paper config's C and B are sarathi's
                over = {"chunk_size": None, "max_batch_size": None, **over}
            else:
                over.update({"in_flight": self.pp, "max_batch_size": ROWS_B})
            s = build_report(simulate(load_config(self.config, planner=planner, **over),
                                      progress=False))["summary"]
            self.simulated += 1
            self.runs[key] = {"qps": qps, "makespan_s": s["makespan_s"],
                              "throughput_tok_s": s["throughput_tok_s"],
                              "bubble": s["bubble_fraction"], "tbt_p99": s["tbt_s"]["p99"],
                              "tbt_p50": s["tbt_s"]["median"], "ttft_p99": s["ttft_s"]["p99"],
                              "requests": s["num_requests"],
                              "failed": s["num_requests"] - s["finish_reasons"].get("length", 0)}
            self.bar.update()
        return self.runs[key]

    def ok(self, r: dict, tbt_slo: float) -> bool:
        return meets(r["tbt_p99"], r["ttft_p99"], tbt_slo, self.ttft_slo, r["failed"])

    def capacity(self, planner: str, knobs: dict, tbt_slo: float) -> tuple[float, dict | None]:
        """The highest grid rate that meets both targets: bracket in steps of 8 grid points
        (x2.1), then bisect (a rate that fails is taken to fail at every higher one)."""
        rate = lambda k: round(RATE0 * GRID_STEP ** k, 6)  # noqa: E731
        ok = lambda k: k <= self.top and self.ok(self.run(planner, knobs, rate(k)), tbt_slo)  # noqa: E731
        lo = hi = None
        k = min(30, self.top)
        while lo is None or hi is None:
            if ok(k):
                lo, k = k, k + 8
            else:
                hi, k = k, k - 8
            if k < 0 and lo is None:
                return 0.0, None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return rate(lo), self.run(planner, knobs, rate(lo))

    def refine(self, planner: str, knobs: dict, tbt_slo: float, qps: float) -> tuple[float, dict]:
        """The capacity between grid rate `qps` (met) and the next one (missed, or past the
        work bound), bisected REFINE times on a log scale: x1.1 steps hide ratios between
        1.00 and 1.10, and 1.15x needs two of them."""
        lo, hi = qps, min(qps * GRID_STEP, self.bound)
        for _ in range(REFINE if qps > 0 else 0):
            mid = round(math.sqrt(lo * hi), 6)
            if self.ok(self.run(planner, knobs, mid), tbt_slo):
                lo = mid
            else:
                hi = mid
        return lo, self.run(planner, knobs, lo)


def slo_bound(cost, wl: Workload, pp: int, tbt_s: float) -> float:
    """Requests per second that no schedule of a pipeline of pp stages carries within a TBT
    target tbt_s, beside the work bound (the ceiling of a cell's capacities): a request's
    next decode enters the pipeline only once its token is back, so its round is at least
    pp micro-batches through the slowest stage, and in a steady load any pp consecutive
    micro-batches fit in tbt_s: on average each takes at most tbt_s / pp of a stage. The
    most tokens any of them carries is then n*, the largest micro-batch that fits in that
    slot (a stage's time per token falls with n: the weights are read once per
    micro-batch), so every token costs at least t(n*) / n* of each stage, beside each
    request's decode attention (as `upper_bound`). Sends between stages are left out and
    1 % of the gaps may pass a p99 target: an optimistic ceiling, not a proof."""
    slot = tbt_s / pp
    fits = lambda n: max(cost.stage_times([(0, n)], [])) <= slot  # noqa: E731
    lo, hi = 0, 1
    while fits(hi) and hi < 1 << 20:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        return 0.0
    per_token = [t / lo for t in cost.stage_times([(0, lo)], [])]
    one, more = cost.stage_times([], [1]), cost.stage_times([], [1025])
    per_key = [max(0.0, (b - a) / 1024) for a, b in zip(one, more)]
    return 1 / max(t * wl.tokens + k * wl.keys for t, k in zip(per_token, per_key))


def anchors() -> list[tuple[str, str, dict]]:
    rows = [("sarathi-serve", f"C {c}", {"chunk_size": c}) for c in SERVE_CHUNKS]
    rows += [("gllm", f"maxp {m}", {"gllm_maxp": m}) for m in GLLM_MAXP]
    return rows


def one_setting(st: Setting, label: str) -> dict:
    out = {"setting": label, "tbt_unloaded_s": st.tbt_unloaded, "ttft_slo_s": st.ttft_slo,
           "cells": [], "offline": {}}
    out["offline"]["uniform"] = st.run("uniform", {}, None)
    for planner, name, knobs in anchors():
        r = st.run(planner, knobs, None)
        cur = out["offline"].get(planner)
        if cur is None or r["makespan_s"] < cur["makespan_s"]:
            out["offline"][planner] = {**r, "knobs": name}
    out["max_rate"], out["work_bound"] = RATE0 * GRID_STEP ** st.top, st.bound
    out["offline_rate"] = st.requests / min(v["makespan_s"] for v in out["offline"].values())
    out["life_s"] = st.life_s
    for mult in SLO_MULTIPLES:
        slo = mult * st.tbt_unloaded
        uni_knobs = {"tbt_slo_ms": slo * 1e3, "ttft_slo_ms": st.ttft_slo * 1e3}
        grid = st.capacity("uniform", uni_knobs, slo)[0]
        cap, run = st.refine("uniform", uni_knobs, slo, grid)
        cell = {"slo_x": mult, "tbt_slo_s": slo,
                "uniform": {"qps": cap, "grid_qps": grid, "run": run},
                "slo_bound": min(st.bound, slo_bound(st.cost, st.wl, st.pp, slo))}
        for planner in () if ONLY_UNIFORM else ("sarathi-serve", "gllm"):
            rows = [(st.capacity(planner, knobs, slo)[0], name, knobs)
                    for p, name, knobs in anchors() if p == planner]
            grid = max(r[0] for r in rows)  # the knobs that tie at the best grid rate, refined
            (cap, run), name = max(((st.refine(planner, knobs, slo, q), name)
                                    for q, name, knobs in rows if q == grid),
                                   key=lambda x: x[0][0])
            cell[planner] = {"qps": cap, "grid_qps": grid, "knobs": name, "run": run}
        out["cells"].append(cell)
    return out


def print_setting(res: dict) -> None:
    if ONLY_UNIFORM:
        print(f"\n### {res['setting']}: uniform only; TTFT target {res['ttft_slo_s']:.2f} s, "
              f"rates up to {res['max_rate']:.3f} req/s")
        for c in res["cells"]:
            run = c["uniform"]["run"] or {}
            print(f"| {c['slo_x']}x = {c['tbt_slo_s'] * 1e3:.0f} ms | {c['uniform']['qps']:.3f} req/s "
                  f"| TBT p99 {run.get('tbt_p99', math.nan) * 1e3:.0f} ms | bubble "
                  f"{run.get('bubble', math.nan):.2%} |")
        off = res["offline"]["uniform"]
        print(f"| none | makespan {off['makespan_s']:.1f} s | bubble {off['bubble']:.2%} |")
        return
    print(f"\n### {res['setting']}: unloaded TBT {res['tbt_unloaded_s'] * 1e3:.1f} ms, "
          f"TTFT target (p99) {res['ttft_slo_s']:.2f} s, rates probed up to "
          f"{res['max_rate']:.3f} req/s\n")
    print(f"(work bound {res['work_bound']:.3f} req/s; the fastest offline run finished "
          f"{res['offline_rate']:.3f} req/s; a probe at q req/s holds at least "
          f"q x {res['life_s']:.1f} s of arrivals)\n")
    print("| TBT SLO | uniform (defaults) | sarathi-serve best | gllm best | uniform ÷ best anchor "
          "| uniform TBT p99 | uniform bubble | SLO bound | uniform, best anchor ÷ SLO bound |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in res["cells"]:
        u, ss, g = c["uniform"], c["sarathi-serve"], c["gllm"]
        best = max(ss["qps"], g["qps"])
        ratio = u["qps"] / best if best else math.inf
        run = u["run"] or {}
        print(f"| {c['slo_x']}x = {c['tbt_slo_s'] * 1e3:.0f} ms | {u['qps']:.3f} req/s "
              f"| {ss['qps']:.3f} ({ss['knobs']}) | {g['qps']:.3f} ({g['knobs']}) | {ratio:.3f} "
              f"| {run.get('tbt_p99', math.nan) * 1e3:.0f} ms | {run.get('bubble', math.nan):.2%} "
              f"| {c['slo_bound']:.3f} | {u['qps'] / c['slo_bound']:.2f}, {best / c['slo_bound']:.2f} |")
    off = res["offline"]
    best = min(v["makespan_s"] for k, v in off.items() if k != "uniform")
    print(f"| none (all at once) | makespan {off['uniform']['makespan_s']:.1f} s "
          f"| {off['sarathi-serve']['makespan_s']:.1f} s ({off['sarathi-serve']['knobs']}) "
          f"| {off['gllm']['makespan_s']:.1f} s ({off['gllm']['knobs']}) "
          f"| {off['uniform']['makespan_s'] / best:.3f} (makespan) "
          f"| {off['uniform']['tbt_p99'] * 1e3:.0f} ms | {off['uniform']['bubble']:.2%} |")
    if res.get("frontier"):
        print(f"\n{res['frontier']}")


def run_setting(model: str, pd: float, requests: int, only_uniform: bool, out: Path,
                bar: tqdm | None = None, overrides: dict | None = None,
                refine: int = REFINE, known: dict | None = None) -> dict:
    """One setting whole (its offline rows, every target's capacities, its Pareto figure);
    in a worker process of `--jobs` or in this one (bar: the progress bar, None in a worker).
    model: a key of MODELS or any config (name or path), with `overrides` (--set) on it;
    known: {label: that setting's probes} of an earlier run on the same anchor code."""
    global ONLY_UNIFORM, REFINE
    ONLY_UNIFORM, REFINE = only_uniform, refine
    config = MODELS.get(model, model)
    sets = "".join(f", {k}={v}" for k, v in (overrides or {}).items())
    label = f"{config}{sets}, P:D {pd:g}, {requests} requests"
    st = Setting(config, requests, pd, bar if bar is not None else tqdm(disable=True), overrides)
    st.known = (known or {}).get(label, {})
    res = one_setting(st, label)
    if not only_uniform:  # uniform's TBT target swept like the anchors' knobs (goodput_frontier)
        res["frontier_check"] = check(st, st.refine)
        res["frontier"] = summary(st, res["frontier_check"])
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).stem if model not in MODELS else model)
    pareto(st, res, out / f"pareto_{name}_pd{pd:g}.png")
    res["simulations"] = st.simulated
    res["anchor_code"], res["runs"] = anchor_code(), st.runs
    return res


def anchors_from(ap: argparse.ArgumentParser, path: str) -> dict:
    """{setting label: its probes} from an earlier goodput.json, if the anchors' code is
    this tree's (else a one-line error: their figures would not be this code's)."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        ap.error(f"--anchors-from {path}: {exc}")
    here = anchor_code()
    for res in earlier:
        if res.get("anchor_code") != here:
            ap.error(f"--anchors-from {path}: {res['setting']} ran on other anchor code "
                     f"({res.get('anchor_code', 'none recorded')}, this tree {here}): "
                     "run the anchors again (without --anchors-from)")
    return {res["setting"]: res.get("runs", {}) for res in earlier}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--pd", default="1,3,10")
    ap.add_argument("--models", default="gpt3,llama",
                    help=f"settings: {', '.join(MODELS)}, or any config (a name under "
                         "configs/ or a path), e.g. a held-out check of your own")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of every setting's config, e.g. --set "
                         "hardware.gpu=h100 --set parallel.pp=4 (another model: a config "
                         "of its own in --models, as benchmarks/heldout/)")
    ap.add_argument("--out", default="runs/goodput")
    ap.add_argument("--only-uniform", action="store_true",
                    help="capacity of uniform only (the anchors' code unchanged since a full run)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="settings simulated side by side, one process each (default: the "
                         "cores, at most one per setting; the simulator's clock is virtual, so "
                         "the figures do not depend on it)")
    ap.add_argument("--refine", type=int, default=REFINE,
                    help="bisections of each best capacity between its grid rate and the next "
                         f"(default {REFINE}: to about x1.024; 0: the x1.1 grid alone)")
    ap.add_argument("--anchors-from", metavar="FILE",
                    help="an earlier goodput.json: the anchors' probes of its settings are read "
                         "from it (its anchor_code must be this tree's) instead of simulated")
    args = ap.parse_args()
    settings = [(m, float(x)) for m in args.models.split(",") for x in args.pd.split(",")]
    known = anchors_from(ap, args.anchors_from) if args.anchors_from else None
    if args.requests < 1 or (args.jobs is not None and args.jobs < 1) or args.refine < 0:
        ap.error("--requests and --jobs must be >= 1, --refine >= 0")
    try:
        overrides = parse_overrides(args.set)
        for m in dict.fromkeys(m for m, _ in settings):  # a bad name, field or memory: now,
            base = load_config(MODELS.get(m, m), **overrides)  # in one line, not mid-run
            check_memory(base.with_overrides(**{"cache.kv_slots": base.num_slots,
                                                "cache.paged": True}))
    except ConfigError as exc:
        ap.error(str(exc))
    global ONLY_UNIFORM
    ONLY_UNIFORM = args.only_uniform  # print_setting reads it here; run_setting in a worker
    jobs = args.jobs or max(1, min(os.cpu_count() or 1, len(settings)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, results = time.perf_counter(), {}

    def done(key: tuple[str, float], res: dict) -> None:
        results[key] = res
        tqdm.write(f"{res['setting']}: done at {time.perf_counter() - t0:.0f} s")
        print_setting(res)  # as it comes: a long run shows its settings one by one
        ordered = [results[k] for k in settings if k in results]
        (out / "goodput.json").write_text(json.dumps(ordered, indent=1, default=str))

    if jobs == 1:
        with tqdm(desc="goodput", unit="sim") as bar:
            for model, pd in settings:
                done((model, pd), run_setting(model, pd, args.requests, args.only_uniform, out,
                                              bar, overrides, args.refine, known))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=ctx) as pool, \
                tqdm(desc="goodput", unit="setting", total=len(settings)) as bar:
            futures = {pool.submit(run_setting, m, pd, args.requests, args.only_uniform, out,
                                   None, overrides, args.refine, known): (m, pd)
                       for m, pd in settings}
            for fut in as_completed(futures):
                done(futures[fut], fut.result())
                bar.update()
    print("\n## All settings")
    for key in settings:
        print_setting(results[key])
    print(f"\nsimulated in {time.perf_counter() - t0:.0f} s ({jobs} process(es)); figures and "
          f"goodput.json in {out}")


if __name__ == "__main__":
    main()
