"""Steady-state bubbles on the real PP = 2 pipeline under Poisson arrivals (issue 22).

On this machine: `cpu/gpt2_pp2` (GPT-2-small shapes, random weights, two Ray stage actors,
one torch thread each, gloo on 127.0.0.1), shared by every run of a mix and started again
only where a mix's layer split differs (`layer_split: auto`, what a config with a profile and
no split gets, cuts each mix's pipeline for that mix; a given split is kept). For each
request mix (total lengths Zipf(0.4) over [min, max] tokens, split by P:D):

  balanced       P:D 3   (prompt tokens per output token), 128..512 tokens
  decode-heavy   P:D 1,                                     64..256 tokens
  prefill-heavy  P:D 10  (the config's own mix),           256..1024 tokens

Each mix thus generates about the same 20..130 tokens per request: a request lives about
its output length times the time between tokens (~0.1-0.3 s here), and warm-up and tail
last about one lifetime, so equal outputs keep every run's steady window comparable (with
the config's 256..1024 tokens at P:D 1 a request would live over a minute).

  1. capacity: the rate at which the bottleneck stage would compute all the time, at
     saturation: n / its busy seconds in one run of n requests of the mix all at time 0,
     under the config's planner (uniform); n = 32 (--quick 16) is more than the pipeline
     keeps decoding at once (3 micro-batches in flight x B = 8), so its micro-batches are
     full, as under a growing queue. The load is then the utilisation of the bottleneck:
     at 70 % of capacity it would compute 70 % of the time if batches stayed as full.
     Why this: one short run per mix (cheap); requests / makespan of a short offline run
     would mostly measure the longest request (they all run at once), and a search for
     the highest rate that keeps queueing bounded costs several runs per mix. It is an
     upper bound: the pipeline's bubble at saturation is left out, and at a lower load
     decode micro-batches are smaller (on this CPU a decode micro-batch costs about the
     same with 2 or 8 decodes: weight-bound), so a planner may not sustain 90 %: its
     queue then grows and the tail gets long (the table shows it).
  2. Poisson arrivals at 70 % and 90 % of that capacity (the same requests, arrival gaps
     scaled), planners uniform and orca-best on the same arrivals;
  3. per run: the bubble fraction of the steady window by cause, the warm-up and the tail
     (duration and bubble fraction), the whole run's, the makespan; per mix and load:
     orca-best / uniform of the steady bubble. Windows: docs/bubbles.md.

Requests per run: enough for about --span seconds of arrivals at that rate (at least
--min-requests, at most --max-requests), so every run costs about the same time. The
whole benchmark: 578 s on the 2-core machine; --quick: the balanced mix at 70 %
only, shorter runs (about 2 min).

    python benchmarks/steady_state.py [--quick] [--out runs/steady_state] [--set FIELD=VALUE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from tqdm import tqdm  # noqa: E402

from pp_runtime.cli.common import parse_overrides  # noqa: E402
from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.costmodel.balance import resolve_layer_split  # noqa: E402
from pp_runtime.engine.llm import run_workload  # noqa: E402
from pp_runtime.telemetry.bubbles import CAUSES  # noqa: E402
from pp_runtime.telemetry.report import write_report  # noqa: E402

MIXES = {"balanced": (3.0, 128, 512), "decode-heavy": (1.0, 64, 256),
         "prefill-heavy": (10.0, 256, 1024)}  # P:D, shortest and longest total length
LOADS = (0.7, 0.9)
PLANNERS = ("uniform", "orca-best")


class Kept:
    """The executor, shared by every run: `shutdown` at the end of a run leaves it up."""

    def __init__(self, executor):
        self._executor = executor

    def __getattr__(self, name):
        return getattr(self._executor, name)

    def shutdown(self) -> None:
        pass


def split_label(split) -> str:
    """A layer split as the run banner writes it: 6.5|5.5."""
    return "|".join(f"{x:g}" for x in split)


class Pipeline:
    """The real pipeline the runs share, started again only when a mix's split differs
    from the one running (each start: Ray's stages up, a few seconds)."""

    def __init__(self, name: str):
        self.name, self.executor, self.split = name, None, None

    def for_config(self, mcfg) -> Kept:
        from pp_runtime.executors import make_executor
        if self.executor is None or mcfg.parallel.layer_split != self.split:
            self.close()
            t0 = time.perf_counter()
            self.executor, self.split = Kept(make_executor(mcfg)), mcfg.parallel.layer_split
            tqdm.write(f"{self.name}: {self.executor.describe()}, layer_split "
                       f"{split_label(self.split)}, planners "
                       f"{', '.join(PLANNERS)}; Ray and the stages up in "
                       f"{time.perf_counter() - t0:.1f} s", file=sys.stdout)
        return self.executor

    def close(self) -> None:
        if self.executor is not None:
            self.executor._executor.shutdown()
            self.executor = None


def capacity(cfg, executor, n: int, out: Path) -> tuple[float, dict]:
    """Requests per second at which the busiest stage would never rest: n requests at time
    0, n / the largest stage busy time (module docstring, step 1)."""
    c = cfg.with_overrides(**{"workload.num_requests": n, "workload.qps": None})
    s = write_report(run_workload(c, executor=executor), out, plots=False)["summary"]
    busy = max(st["busy_s"] for st in s["per_stage"])
    return n / busy, {"requests": n, "bottleneck_busy_s": busy, "makespan_s": s["makespan_s"],
                      "offline_req_s": n / s["makespan_s"]}


def poisson_run(cfg, executor, planner: str, qps: float, n: int, out: Path) -> dict:
    c = cfg.with_overrides(planner=planner, **{"workload.num_requests": n, "workload.qps": qps})
    s = write_report(run_workload(c, executor=executor), out, plots=False)["summary"]
    w = s["windows"]
    return {"planner": planner, "qps": qps, "requests": n, "makespan_s": s["makespan_s"],
            "whole": s["bubble_fraction"], "whole_by_cause": s["bubble_fraction_by_cause"],
            "steady": w["steady"], "warmup": w["warmup"], "tail": w["tail"],
            "finish_reasons": s["finish_reasons"], "ttft_p99_s": s["ttft_s"]["p99"]}


HEAD = (f"{'mix':<14}{'load':>5}{'req/s':>7}{'N':>4} {'planner':<10}{'steady':>8} "
        f"{'(up/down/dep)':<17}{'hop':>5}{'for':>7}{'idle':>6}{'warm-up':>14}{'tail':>15}{'whole':>8}"
        f"{'makespan':>10}")


def row(mix: str, load: float, r: dict) -> str:
    st, wu, tl = r["steady"], r["warmup"], r["tail"]
    by = "/".join(f"{st['bubble_fraction_by_cause'][c] * 100:.1f}" for c in CAUSES)
    return (f"{mix:<14}{load:>5.0%}{r['qps']:>7.3f}{r['requests']:>4} {r['planner']:<10}"
            f"{st['bubble_fraction']:>8.1%} {by:<17}{st.get('dependency_token_fraction', 0) * 100:>5.1f}"
            f"{st['duration_s']:>5.1f} s"
            f"{st['idle_fraction']:>6.0%}"
            f"{wu['duration_s']:>6.1f} s {wu['bubble_fraction']:>5.1%}"
            f"{tl['duration_s']:>7.1f} s {tl['bubble_fraction']:>5.1%}"
            f"{r['whole']:>8.1%}{r['makespan_s']:>8.1f} s")


def ratio_line(mix: str, load: float, runs: dict) -> str:
    if any(runs[p]["steady"]["duration_s"] <= 0 for p in PLANNERS):  # the warm-up reached
        #   the tail (no request arrived after the first finish): nothing to compare
        ratio = "none (a run has no steady window: " + ", ".join(
            p for p in PLANNERS if runs[p]["steady"]["duration_s"] <= 0) + ")"
        return f"{'':<14}{load:>5.0%}  orca-best / uniform, steady bubble: {ratio}"
    u, o = (runs[p]["steady"]["bubble_fraction"] for p in PLANNERS)
    ratio = f"{o / u:.2f}x" if u > 0 else "inf"
    return f"{'':<14}{load:>5.0%}  orca-best / uniform, steady bubble: {ratio}"


def requests_for(rate: float, span_s: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, math.ceil(rate * span_s)))


def mix_config(cfg, spec: tuple):
    """The config with a mix's workload, its layer split chosen for that mix: `auto` (a
    config with a profile and no split) cuts where the stages balance over the mix's own
    prefill / decode share, as a deployment serving that mix would be cut; a given split
    stays. Explicit, so the planner and the workers read the same cut."""
    pd, min_len, max_len = spec
    mcfg = cfg.with_overrides(**{"workload.pd_ratio": pd, "workload.min_len": min_len,
                                 "workload.max_len": max_len})
    return resolve_layer_split(mcfg).with_layer_split_resolved()


def run_mix(mcfg, executor, mix: str, spec: tuple, loads, args, bar, lines: list[str],
            out: Path) -> dict:
    """One mix: its capacity, then every load and planner; rows appended to lines."""
    pd, min_len, max_len = spec
    bar.set_postfix_str(f"{mix} capacity")
    cap, detail = capacity(mcfg, executor, args.n_cap, out / mix / "capacity")
    bar.update()
    result = {"pd_ratio": pd, "lengths": [min_len, max_len], "capacity_req_s": cap,
              "capacity": detail, "runs": {}, "layer_split": mcfg.parallel.layer_split}
    tqdm.write(f"{mix} (P:D {pd:g}, {min_len}..{max_len} tokens, layer_split "
               f"{split_label(mcfg.parallel.layer_split)}): "
               f"capacity {cap:.3f} req/s "
               f"({args.n_cap} requests at time 0: busiest stage {detail['bottleneck_busy_s']:.1f} s "
               f"busy, makespan {detail['makespan_s']:.1f} s, i.e. {detail['offline_req_s']:.3f} "
               "req/s offline)", file=sys.stdout)
    for load in loads:
        qps, runs = load * cap, {}
        n = requests_for(qps, args.span, args.min_requests, args.max_requests)
        for planner in PLANNERS:
            bar.set_postfix_str(f"{mix} {load:.0%} {planner}")
            runs[planner] = poisson_run(mcfg, executor, planner, qps, n,
                                        out / mix / f"{load:.0%}-{planner}".replace("%", "pct"))
            bar.update()
            lines.append(row(mix, load, runs[planner]))
            tqdm.write(lines[-1], file=sys.stdout)
        lines.append(ratio_line(mix, load, runs))
        tqdm.write(lines[-1], file=sys.stdout)
        result["runs"][f"{load:.0%}"] = runs
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="cpu/gpt2_pp2")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--quick", action="store_true", help="balanced mix at 70 %% only, short runs")
    ap.add_argument("--span", type=float, default=None, help="seconds of arrivals per run "
                    "(default 30, --quick 15)")
    ap.add_argument("--min-requests", type=int, default=None, help="default 20, --quick 8")
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--capacity-requests", type=int, default=None, help="default 32, --quick 16")
    ap.add_argument("--out", default="runs/steady_state")
    args = ap.parse_args(argv)
    args.span = args.span or (15.0 if args.quick else 30.0)
    args.min_requests = args.min_requests or (8 if args.quick else 20)
    args.n_cap = args.capacity_requests or (16 if args.quick else 32)
    mixes = {"balanced": MIXES["balanced"]} if args.quick else MIXES
    loads = LOADS[:1] if args.quick else LOADS
    cfg = load_config(args.config, **parse_overrides(args.set))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    results, lines, pipeline = {}, [HEAD], Pipeline(args.config)
    total = len(mixes) * (1 + len(loads) * len(PLANNERS))
    bar = tqdm(total=total, unit="run", desc="steady_state", file=sys.stderr)
    try:
        for mix, spec in mixes.items():
            mcfg = mix_config(cfg, spec)
            results[mix] = run_mix(mcfg, pipeline.for_config(mcfg), mix, spec, loads, args,
                                   bar, lines, out)
    finally:
        bar.close()
        pipeline.close()
    print("\nsteady: bubble fraction of the steady window (up/down/dep: by cause, %; hop: of "
          "dep, stage 0 holding its call while the token hop brings its decodes' ids), for how "
          "long, and its idle share; warm-up, tail: duration and bubble fraction; whole: the "
          "whole run's (docs/bubbles.md)")
    print("\n".join(lines))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nin {time.perf_counter() - t0:.0f} s; reports in {out}/, table data in "
          f"{out}/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
