"""The real pipeline's steady-state bubble per layer split, at fixed rates (issue 35).

For each split (`parallel.layer_split`, whole or half layers) one real pipeline is started
(`cpu/gpt2_pp2` by default: two Ray stage actors on this machine), and `uniform` serves
each mix of `steady_state.py` (balanced P:D 3, decode-heavy P:D 1, prefill-heavy P:D 10)
at the rate given for it, the same Poisson arrivals for every split. Per run: the steady
window's bubble by cause (docs/bubbles.md), the whole run's, each stage's busy seconds
(a balanced split makes them equal), the makespan, TTFT and TBT.

    python benchmarks/split_sweep.py --splits "6,6;7,5;7.5,4.5" \\
        --mixes balanced=1.85,decode-heavy=2.5 [--span 20] [--out runs/split_sweep]

Where the split should go, from the cost model instead: `layer_split: auto` with a
profile of this machine (`pp-runtime profile --config cpu/gpt2_pp2 --quick`), chosen per
workload (costmodel/balance.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

sys.path.insert(0, str(Path(__file__).resolve().parent))
from steady_state import MIXES, Kept, split_label  # noqa: E402

from pp_runtime.cli.common import parse_overrides  # noqa: E402
from pp_runtime.config import ConfigError, load_config  # noqa: E402
from pp_runtime.engine.llm import run_workload  # noqa: E402
from pp_runtime.telemetry.report import write_report  # noqa: E402


def parse_splits(text: str) -> list[list[float]]:
    """"6,6;7,5" -> [[6, 6], [7, 5]] (a half is a layer cut between attention and MLP)."""
    try:
        return [[float(x) for x in one.split(",")] for one in text.split(";") if one.strip()]
    except ValueError:
        raise SystemExit(f"--splits: {text!r} is not 'a,b;c,d' (layers per stage, ';' between splits)")


def parse_mixes(text: str) -> dict[str, float]:
    """"balanced=1.85,decode-heavy=2.5" -> {mix: req/s}, mixes from steady_state.MIXES."""
    out = {}
    for item in text.split(","):
        name, _, rate = item.partition("=")
        if name not in MIXES:
            raise SystemExit(f"--mixes: unknown mix {name!r}; one of {', '.join(MIXES)}")
        try:
            out[name] = float(rate)
        except ValueError:
            raise SystemExit(f"--mixes: {item!r} needs a rate, e.g. {name}=1.5")
    return out


def one_run(cfg, executor, mix: str, qps: float, span: float, out: Path) -> str:
    pd, lo, hi = MIXES[mix]
    n = max(20, min(64, int(qps * span)))
    c = cfg.with_overrides(planner="uniform", **{
        "workload.pd_ratio": pd, "workload.min_len": lo, "workload.max_len": hi,
        "workload.num_requests": n, "workload.qps": qps})
    s = write_report(run_workload(c, executor=executor), out, plots=False)["summary"]
    st = s["windows"]["steady"]
    by = "/".join(f"{v * 100:.1f}" for v in st["bubble_fraction_by_cause"].values())
    busy = " / ".join(f"{p['busy_s']:.1f}" for p in s["per_stage"])
    return (f"{mix:<14}{qps:>6.2f}{n:>4}  steady {st['bubble_fraction']:>6.1%} ({by:<14}) "
            f"whole {s['bubble_fraction']:>6.1%}  busy {busy} s  makespan {s['makespan_s']:.1f} s  "
            f"TTFT p50 {s['ttft_s']['median']:.2f} s  TBT p50/p99 {s['tbt_s']['median'] * 1e3:.0f}/"
            f"{s['tbt_s']['p99'] * 1e3:.0f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="cpu/gpt2_pp2")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--splits", required=True, help="layers per stage, e.g. '6,6;7,5;7.5,4.5'")
    ap.add_argument("--mixes", default="balanced=1.85,decode-heavy=2.5",
                    help="mix=req/s, comma-separated (steady_state.py's mixes)")
    ap.add_argument("--span", type=float, default=20.0, help="seconds of arrivals per run")
    ap.add_argument("--out", default="runs/split_sweep")
    args = ap.parse_args(argv)
    splits, mixes = parse_splits(args.splits), parse_mixes(args.mixes)
    from pp_runtime.executors import make_executor

    t0, rows = time.perf_counter(), {}
    for split in splits:
        label = split_label(split)
        try:
            cfg = load_config(args.config, layer_split=split, **parse_overrides(args.set))
        except ConfigError as e:
            raise SystemExit(f"--splits {label}: {e}")
        executor = make_executor(cfg)
        try:
            for mix, qps in mixes.items():
                line = one_run(cfg, Kept(executor), mix, qps, args.span,
                               Path(args.out) / f"{label.replace('|', '-')}-{mix}")
                rows.setdefault(label, []).append(line)
                print(f"{label:>9}  {line}", flush=True)
        finally:
            executor.shutdown()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep.json").write_text(json.dumps(rows, indent=1))
    print(f"in {time.perf_counter() - t0:.0f} s; reports in {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
