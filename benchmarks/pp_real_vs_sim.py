"""SARATHI vs Orca on the real pipeline runtime, and the simulator's prediction of both.

On this machine: PP=2 (two Ray actors, one process and one torch thread per stage, gloo on
127.0.0.1), GPT-2-small shapes with random weights, a Zipf workload
(`configs/cpu/gpt2_pp2.yaml`). In one run it
  1. measures a profile of this machine (`pp-runtime profile`, the model's own ops),
  2. calibrates it on a short real run (`--calibrate N` requests: compute under contention
     and host costs per micro-batch, docs/costmodel.md "Calibration"),
  3. runs SARATHI and orca-best on the real runtime (the layer split resolved once, by
     default `auto` from the profile; `--splits default,7/5` runs each split),
  4. simulates both with that profile,
and prints median bubble per request, bubble fraction, throughput and makespan for each,
the SARATHI / orca ratios, the simulated / real makespan gap, and every stage's split
(busy, transfer, upstream, downstream, dependency, idle as shares of its wall time), real
and simulated side by side, cause by cause.
Targets (issue 5): SARATHI's bubble fraction <= 5 % and >= 3x lower than orca-best's;
simulated makespan within 10 % of the real one.

    python benchmarks/pp_real_vs_sim.py [--requests 32] [--out runs/pp_real_vs_sim]
        [--planners sarathi,gllm,uniform,orca-best] [--splits default,even,7/5]
        [--set workload.qps=0.6] [--calibrate 10]
Issue 22's targets: simulated makespan within 10 % of the real one and every stage's busy /
upstream / downstream / dependency share within 3 points (both printed at the end).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.costmodel.balance import resolve_layer_split  # noqa: E402
from pp_runtime.profile.measure import measure_profile  # noqa: E402
from pp_runtime.engine.llm import run_workload  # noqa: E402
from pp_runtime.engine.simulate import simulate  # noqa: E402
from pp_runtime.telemetry.report import format_summary, write_report  # noqa: E402


def isolated_check(cfg, profile: Path) -> None:
    """One stage at a time in this process (no other stage, no driver, no Ray beside it):
    the real StageWorker.execute against the cost model's price of the same micro-batch."""
    import statistics
    import time

    import torch

    from pp_runtime.core.batch import MicroBatch, Sampling, SeqChunk, slot_tables
    from pp_runtime.costmodel import build_cost_model
    from pp_runtime.worker.stage import StageWorker

    # the quiet profile alone (no executor's calibration: nothing runs beside the stage)
    local = resolve_layer_split(cfg.with_overrides(  # the workers hold the cut priced
        **{"hardware.profile": str(profile), "executor": "local"}))
    cost = build_cost_model(local)
    workers = [StageWorker(local, s, torch.device("cpu")) for s in range(cfg.parallel.pp)]
    sampling, kv = Sampling(0.0, 1.0, 0), 400
    per = -(-cfg.seq_len // cfg.cache.block_size)  # blocks of a whole context
    decodes = slot_tables([SeqChunk(i, i, kv, (1,), sampling, True) for i in range(7)], per)
    chunk = slot_tables([SeqChunk(7, 7, 256, tuple(range(249)), None)], per)[0]
    for name, mb, prefills in (("7 decodes at KV 401", MicroBatch(0, decodes), []),
                               ("chunk 249 + 7 decodes", MicroBatch(0, decodes + (chunk,)), [(256, 249)])):
        priced = cost.stage_times(prefills, [kv + 1] * len(decodes))
        for s, w in enumerate(workers):
            x = None if s == 0 else torch.randn(mb.num_tokens, cfg.model.hidden_size)
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                w.execute(mb, x)
                times.append(time.perf_counter() - t0)
            real = statistics.median(times)
            print(f"isolated stage {s}, {name}: real {real * 1e3:.1f} ms, simulated "
                  f"{priced[s] * 1e3:.1f} ms ({priced[s] / real - 1:+.1%})")


def row(name: str, s: dict) -> str:
    b = s["bubble_per_request_s"]["median"]
    return (f"{name:<24}{s['makespan_s']:>10.2f}{s['throughput_tok_s']:>10.0f}"
            f"{b * 1e3:>14.1f}{s['bubble_fraction']:>12.1%}")


PARTS = ("busy", "transfer", "upstream", "downstream", "dependency", "idle")
CHECKED = ("busy", "upstream", "downstream", "dependency")  # issue 22: each within 3 points


def shares(st: dict) -> dict[str, float]:
    """One stage's parts as shares of its wall time."""
    secs = {"busy": st["busy_s"], "transfer": st["transfer_s"], "idle": st["idle_s"],
            **st["bubble_by_cause_s"]}
    return {k: secs[k] / st["wall_s"] if st["wall_s"] > 0 else 0.0 for k in PARTS}


def cause_table(planner: str, real: dict, sim: dict) -> list[str]:
    lines = [f"\n{planner}: share of each stage's wall time, real vs simulated",
             f"{'stage':<8}" + "".join(f"{p:>24}" for p in PARTS)]
    for r, s in zip(real["per_stage"], sim["per_stage"]):
        a, b = shares(r), shares(s)
        lines.append(f"{r['stage']:<8}" + "".join(
            f"{a[p]:>8.1%} /{b[p]:>6.1%} ({b[p] - a[p]:+6.1%})" for p in PARTS))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cpu/gpt2_pp2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default="runs/pp_real_vs_sim")
    ap.add_argument("--quick-profile", action="store_true")
    ap.add_argument("--planners", default="sarathi,orca-best",
                    help="comma-separated; the last is the baseline of the ratios")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="config override, e.g. parallel.layer_split=auto or workload.qps=2 "
                         "(Poisson arrivals; repeatable)")
    ap.add_argument("--splits", default="default",
                    help="comma-separated layer splits to run each planner with: default (the "
                         "config's: auto with the profile), even, auto, or counts like 7/5")
    ap.add_argument("--calibrate", type=int, default=10, metavar="N",
                    help="requests of the calibration run (0: none; docs/costmodel.md)")
    args = ap.parse_args()
    out = Path(args.out)
    import yaml
    extra = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    cfg = load_config(args.config, **{"workload.num_requests": args.requests}, **extra)
    import torch
    torch.set_num_threads(cfg.runtime.threads_per_worker or 1)  # as each stage worker runs
    profile = measure_profile(cfg, out / "profile", quick=args.quick_profile, progress=False)
    print(f"profile of this machine in {profile}/")
    if cfg.seq_len >= 256 + 249 + 8:  # its micro-batches need that many positions
        isolated_check(cfg, profile)
    if args.calibrate:
        from pp_runtime.profile.calibrate import calibrate
        from pp_runtime.costmodel.calibration import describe
        cal = calibrate(cfg, profile, requests=args.calibrate)
        print(f"calibration ({args.calibrate} requests, split "
              f"{'|'.join(map(str, cal.layer_split))}): {describe(cal)}")
        # auto chose the calibration's split from the uncalibrated profile; where the
        # calibrated one picks another, calibrate again at it: the runs price that split
        chosen = resolve_layer_split(cfg.with_overrides(**{"hardware.profile": str(profile)}))
        split = chosen.layers_per_stage()
        if list(split) != list(cal.layer_split):
            cal = calibrate(cfg.with_overrides(layer_split=list(split)), profile, requests=args.calibrate)
            print(f"calibrated again at the split the calibrated profile chose "
                  f"({'|'.join(map(str, cal.layer_split))}): {describe(cal)}")
    results = {}
    planners = [f"{p} {s}" for p in args.planners.split(",") for s in args.splits.split(",")]
    for name in planners:  # the profile prices the simulator and layer_split: auto
        planner, split = name.split(" ")
        c = cfg.with_overrides(planner=planner, **{"hardware.profile": str(profile)}, **(
            {} if split == "default" else {"layer_split": split if split in ("even", "auto")
                                           else [float(k) if "." in k else int(k) for k in split.split("/")]}))
        c = resolve_layer_split(c)  # chosen once: the real and simulated runs share it
        tag = f"{planner}-{split.replace('/', '_')}"
        print(f"{name}: layer_split {'|'.join(map(str, c.layers_per_stage()))}", flush=True)
        real = write_report(run_workload(c), out / f"real-{tag}")["summary"]
        sim = write_report(simulate(c, progress=False), out / f"sim-{tag}")["summary"]
        results[name] = (real, sim)
        print(format_summary({"summary": real}))
        print(format_summary({"summary": sim}))
    print(f"\n{'run':<24}{'makespan s':>10}{'tok/s':>10}{'bubble/req ms':>14}{'bubble frac':>12}")
    for planner, (real, sim) in results.items():
        print(row(f"real {planner}", real))
        print(row(f"sim {planner}", sim))
    for planner, (real, sim) in results.items():
        print("\n".join(cause_table(planner, real, sim)))
    base = planners[-1]
    for planner in planners[:-1]:
        (ra, sa), (rb, sb) = results[planner], results[base]
        for label, a, b in (("real", ra, rb), ("sim", sa, sb)):
            frac = b["bubble_fraction"] / a["bubble_fraction"] if a["bubble_fraction"] else float("inf")
            med = (b["bubble_per_request_s"]["median"] / a["bubble_per_request_s"]["median"]
                   if a["bubble_per_request_s"]["median"] else float("inf"))
            print(f"{label}: {base} / {planner}: bubble fraction {frac:.2f}x, median bubble per "
                  f"request {med:.2f}x, makespan {b['makespan_s'] / a['makespan_s']:.2f}x")
    for planner, (real, sim) in results.items():
        worst = max((abs(shares(b)[p] - shares(a)[p]), p, a["stage"])
                    for a, b in zip(real["per_stage"], sim["per_stage"]) for p in CHECKED)
        print(f"largest per-stage share gap, {planner}: {worst[0]:.1%} ({worst[1]} of stage "
              f"{worst[2]}; target within 3 points)")
        gap = sim["makespan_s"] / real["makespan_s"] - 1
        print(f"simulated / real makespan, {planner}: {sim['makespan_s']:.2f} / {real['makespan_s']:.2f} s "
              f"= {gap:+.1%} (target within 10 %)")
    rb = results[base][0]
    for planner in planners[:-1]:
        ra = results[planner][0]
        print(f"real {planner}: bubble fraction {ra['bubble_fraction']:.1%}, {base} / {planner} "
              f"{rb['bubble_fraction'] / max(ra['bubble_fraction'], 1e-12):.1f}x "
              "(targets: uniform <= 3 % and >= 3x; sarathi <= 5 %)")


if __name__ == "__main__":
    main()
