"""Is a profile's calibration right for a served load? One real run answers it micro-batch
by micro-batch.

  1. copies of PROFILE calibrated two ways (`profile.calibrate.calibrate`, N requests):
     `burst` (the N requests at once, then N / 2 whole prompts: the calibration before
     the paced run) and `paced` (the same, then the N requests as Poisson at
     `PACED_LOAD` x the burst's offline rate: what `pp-runtime profile --calibrate N` runs);
  2. one served load for real (the config's workload, `--requests` at `--qps`, Poisson),
     every micro-batch's compute on every stage recorded;
  3. each of those micro-batches priced by both calibrated cost models: measured / priced
     per stage, in sum and by kind (decode-only, or with a prompt chunk), and the same
     load simulated on each.

    python benchmarks/calibration_mix.py PROFILE [--config cpu/gpt2_pp2] [--qps 0.884]
        [--requests 100] [--calibrate 8] [--out runs/calibration_mix]

PROFILE is measured first when it has no device.json (`pp-runtime profile --quick`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.costmodel import build_cost_model  # noqa: E402
from pp_runtime.costmodel.balance import resolve_layer_split  # noqa: E402
from pp_runtime.costmodel.calibration import describe  # noqa: E402
from pp_runtime.engine.llm import run_workload  # noqa: E402
from pp_runtime.engine.simulate import simulate  # noqa: E402
from pp_runtime.profile.calibrate import calibrate  # noqa: E402
from pp_runtime.telemetry.report import build_report  # noqa: E402

WAYS = {"burst": False, "paced": True}  # calibrate(paced=...)


def kind(prefills: list, decodes: list) -> str:
    if not prefills:
        return f"decode-only, {'1-3' if len(decodes) <= 3 else '4+'} decodes"
    tokens = sum(n for _, n in prefills)
    return f"chunk {'<= 64' if tokens <= 64 else '> 64'} tokens{' + decodes' if decodes else ''}"


def record(cfg) -> list[tuple[list, list, dict]]:
    """(prefills, decode KV lengths, {stage: compute seconds}) per micro-batch of a real run."""
    rows = []

    def keep(mb, out):
        decodes = [s.start + 1 for s in mb.seqs if s.is_decode]
        prefills = [(s.start, len(s.token_ids)) for s in mb.seqs if not s.is_decode]
        rows.append((prefills, decodes, {t.stage: t.compute_end_s - t.compute_start_s
                                         for t in out.timings if t.tp_rank == 0}))

    report = build_report(run_workload(cfg, on_microbatch=keep))
    return rows, report


def priced(cfg, rows, skip: int) -> dict:
    """{(kind, stage): [n, measured s, priced s, [ratios]]} under cfg's cost model."""
    cost, out = build_cost_model(cfg), {}
    for prefills, decodes, measured in rows[skip:]:
        times = cost.stage_times(prefills, decodes)
        for s, m in measured.items():
            for key in ((kind(prefills, decodes), s), ("all", s)):
                g = out.setdefault(key, [0, 0.0, 0.0, []])
                g[0], g[1], g[2] = g[0] + 1, g[1] + m, g[2] + times[s]
                g[3].append(m / times[s])
    return out


def summary(tag: str, rep: dict) -> str:
    s = rep["summary"]
    busy = " / ".join(f"{st['busy_s']:.1f}" for st in s["per_stage"])
    return (f"{tag:16s} makespan {s['makespan_s']:6.1f} s, TTFT p50 {s['ttft_s']['median']:.2f} "
            f"p99 {s['ttft_s']['p99']:.2f} s, TBT p50 {s['tbt_s']['median'] * 1e3:.0f} p99 "
            f"{s['tbt_s']['p99'] * 1e3:.0f} ms, stage busy {busy} s, {s['num_microbatches']} micro-batches")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--config", default="cpu/gpt2_pp2")
    ap.add_argument("--qps", type=float, default=0.884)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--calibrate", type=int, default=8, metavar="N")
    ap.add_argument("--out", default="runs/calibration_mix")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    base, out = load_config(args.config), Path(args.out)
    if not (Path(args.profile) / "device.json").exists():
        from pp_runtime.profile.measure import measure_profile
        measure_profile(base, args.profile, quick=True)
    profiles = {}
    for way, paced in WAYS.items():
        prof = out / f"profile-{way}"
        shutil.rmtree(prof, ignore_errors=True)
        shutil.copytree(args.profile, prof)
        (prof / "calibration.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        cal = calibrate(base, prof, args.calibrate, paced=paced)
        print(f"{way}: {describe(cal)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        profiles[way] = prof
    load = {"workload.num_requests": args.requests, "workload.qps": args.qps}
    cfgs = {way: resolve_layer_split(base.with_overrides(**{"hardware.profile": str(p), **load}))
            .with_layer_split_resolved() for way, p in profiles.items()}
    for way, cfg in cfgs.items():
        print(summary(f"{way}, simulated", build_report(simulate(cfg, progress=False))), flush=True)
    real = cfgs["paced"]  # the real run's planner prices with the calibration profile shipped
    rows, rep = record(real)
    print(summary("real (paced)", rep))
    skip = 2 * real.parallel.pp  # warm-up, as the calibration leaves out
    split = real.layers_per_stage()
    tables = {way: priced(cfg.with_overrides(layer_split=split), rows, skip) for way, cfg in cfgs.items()}
    print(f"\nthe real run's {len(rows) - skip} micro-batches, measured / priced "
          f"(sum of seconds; median of the ratios), split {split}:")
    print(f"  {'micro-batches':34s} stage {'n':>5s}  " + "  ".join(f"{w:>16s}" for w in WAYS))
    for key in sorted(tables["paced"], key=lambda k: (k[0] == "all", k)):
        n = tables["paced"][key][0]
        cells = [f"{g[1] / g[2]:6.3f}; {statistics.median(g[3]):6.3f}"
                 for g in (tables[w][key] for w in WAYS)]
        print(f"  {key[0]:34s} {key[1]:5d} {n:5d}  " + "  ".join(f"{c:>16s}" for c in cells))


if __name__ == "__main__":
    main()
