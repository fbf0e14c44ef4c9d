"""`pp-runtime bench serve`: the load generator and the capacity search on the command line.

  pp-runtime bench serve --url http://127.0.0.1:8000 --config cpu/gpt2_pp2 --qps 0.5
        one run of the config's workload (Poisson at 0.5 req/s) against a running server:
        TTFT / TBT p50, p90, p99, throughput, SLO attainment
  pp-runtime bench serve --url ... --capacity --tbt-slo 1.5 --ttft-slo 5
        capacity search: the highest QPS whose p99 TBT (and median TTFT) meet the SLOs
  pp-runtime bench serve --simulate --capacity --config cpu/gpt2_pp2 --tbt-slo 1.5 ...
        the same search on the simulator (no server), the config's planner and cost model

Writes loadgen.json + requests.csv (one run) or capacity.json + latency_vs_qps.png (search)
to --out. A server that does not answer: one line naming the URL, exit status 2.
"""
from __future__ import annotations

import csv
import json
from dataclasses import asdict, replace
from pathlib import Path

from pp_runtime.cli.common import non_negative_int, positive_float, positive_int

DEFAULT_URL = "http://127.0.0.1:8000"


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks against a running server: load, capacity")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    sp = bench_sub.add_parser("serve", help="load generator and capacity search against "
                                            "`pp-runtime serve` (or the simulator)",
                              description=__doc__.split("\n\n")[0])
    sp.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    sp.add_argument("--api-key", help="Bearer token, as given to `pp-runtime serve --api-key`")
    sp.add_argument("--config", default="cpu/gpt2_pp2",
                    help="config whose workload (and, with --simulate, deployment) to use")
    sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a config field, e.g. --set workload.max_len=512")
    sp.add_argument("--requests", type=positive_int, help="workload.num_requests (per probe)")
    sp.add_argument("--seed", type=non_negative_int, help="workload.seed (lengths, arrivals, prompt ids)")
    sp.add_argument("--qps", type=positive_float, help="Poisson arrivals at this rate (workload.qps)")
    sp.add_argument("--trace", help="a JSONL trace {arrival_s, prompt_len, output_len} per line")
    sp.add_argument("--vocab-size", type=positive_int,
                    help="prompt token ids are drawn below this (default: the config's model)")
    sp.add_argument("--tbt-slo", type=positive_float, default=None, help="p99 time-between-tokens SLO, s")
    sp.add_argument("--ttft-slo", type=positive_float, default=None, help="TTFT SLO, s (in a search: on --ttft-key)")
    sp.add_argument("--ttft-key", choices=("median", "p99"), default="median",
                    help="what a search's TTFT SLO bounds: the median (Sarathi-Serve's scheduling "
                         "delay, the default) or the p99 (benchmarks/goodput.py's)")
    sp.add_argument("--capacity", action="store_true",
                    help="search the highest QPS meeting the SLOs (needs --tbt-slo)")
    sp.add_argument("--start-qps", type=positive_float, default=1.0, help="the search's first probe")
    sp.add_argument("--max-probes", type=positive_int, default=8)
    sp.add_argument("--rel-tol", type=positive_float, default=0.1, help="stop bisecting at this gap")
    sp.add_argument("--min-probe-s", type=positive_float, default=4.0,
                    help="no probe faster than its N requests arriving in this many s (a burst "
                         "says nothing about a sustained rate)")
    sp.add_argument("--max-probe-s", type=positive_float, default=120.0,
                    help="no probe slower than its N requests arriving in this many s")
    sp.add_argument("--simulate", action="store_true", help="probe the simulator, not a server")
    sp.add_argument("--out", help="output directory (default runs/bench-serve)")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=cmd_bench_serve)


def _config(args):
    from pp_runtime.cli.common import config_from_args

    return config_from_args(args, flags=("requests", "seed", "qps", "trace"))


def cmd_bench_serve(args) -> int:
    import sys

    from pp_runtime.config import ConfigError
    from pp_runtime.bench.loadgen import ServerUnreachable

    out = Path(args.out or "runs/bench-serve")
    try:
        cfg = _config(args)
        if args.capacity:
            return _capacity(args, cfg, out)
        if args.simulate:
            raise ConfigError("--simulate goes with --capacity (a single simulated run: "
                              "`pp-runtime simulate`)")
        return _one_run(args, cfg, out)
    except ServerUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _one_run(args, cfg, out: Path) -> int:
    from pp_runtime.bench.loadgen import format_summary, load_test, results_rows
    from pp_runtime.core.workload import generate, workload_prompts

    specs = generate(cfg.workload)
    prompts = workload_prompts(specs, args.vocab_size or cfg.model.vocab_size, cfg.workload.seed)
    rate = f"Poisson {cfg.workload.qps:g} req/s" if cfg.workload.qps else "all at once"
    if cfg.workload.kind == "trace":
        rate = f"trace {cfg.workload.trace}" + (f" at Poisson {cfg.workload.qps:g} req/s"
                                                if cfg.workload.qps else "")
    print(f"{len(specs)} requests ({rate}) to {args.url}", flush=True)
    summary, results = load_test(args.url, specs, prompts, api_key=args.api_key,
                                 ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo,
                                 progress=not args.quiet)
    print(format_summary(summary))
    out.mkdir(parents=True, exist_ok=True)
    rows = results_rows(results)
    (out / "loadgen.json").write_text(json.dumps({"url": args.url, "summary": summary,
                                                  "requests": rows}, indent=1))
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    print(f"  wrote {out}/loadgen.json, {out}/requests.csv")
    return 0 if summary["failed"] == 0 else 1


def _capacity(args, cfg, out: Path) -> int:
    from pp_runtime.bench.capacity import capacity_search, plot_latency, server_probe, sim_probe
    from pp_runtime.config import ConfigError

    if args.tbt_slo is None:
        raise ConfigError("--capacity needs --tbt-slo (seconds; and --ttft-slo to bound queueing)")
    cfg = replace(cfg, workload=replace(cfg.workload, qps=None))  # each probe sets its rate
    where = "simulator" if args.simulate else args.url
    if args.simulate:
        probe = sim_probe(cfg, args.tbt_slo, args.ttft_slo, ttft_key=args.ttft_key)
    else:
        probe = server_probe(args.url, cfg, args.tbt_slo, args.ttft_slo, args.api_key,
                             progress=not args.quiet, vocab_size=args.vocab_size,
                             ttft_key=args.ttft_key)
    key = "p50" if args.ttft_key == "median" else "p99"

    def verbose(q):
        p = probe(q)
        print(f"  {q:8.3f} req/s: p99 TBT {_ms(p.tbt_p99_s)}, {key} TTFT {_ms(p.ttft_p50_s)}: "
              f"{'meets' if p.ok else 'misses'} the SLOs", flush=True)
        return p

    print(f"capacity search {'on the' if args.simulate else 'against'} {where}: {cfg.workload.num_requests} requests per probe, "
          f"p99 TBT <= {_ms(args.tbt_slo)}" + (f", {args.ttft_key} TTFT <= {_ms(args.ttft_slo)}"
                                               if args.ttft_slo is not None else ""), flush=True)
    n = cfg.workload.num_requests
    lo, hi = n / args.max_probe_s, n / args.min_probe_s
    cap = capacity_search(verbose, min(max(args.start_qps, lo), hi), args.rel_tol, args.max_probes,
                          max_qps=hi, min_qps=lo)
    bound = (" (the fastest rate probed: raise --requests to tell more)" if cap.qps >= hi else
             f" (none from {cap.probes[0].qps:.3f} down to {lo:.3f} req/s met them)" if not cap.qps else "")
    print(f"capacity: {cap.qps:.3f} req/s{bound}, {len(cap.probes)} probes")
    out.mkdir(parents=True, exist_ok=True)
    label = f"{cfg.planner.planner} ({'sim' if args.simulate else 'server'})"
    (out / "capacity.json").write_text(json.dumps(
        {"where": where, "tbt_slo_s": args.tbt_slo, "ttft_slo_s": args.ttft_slo, "ttft_key": args.ttft_key,
         "capacity_qps": cap.qps, "probes": [asdict(p) for p in cap.probes]}, indent=1))
    path = plot_latency({label: cap.probes}, args.tbt_slo, args.ttft_slo, out / "latency_vs_qps.png",
                        ttft_key=args.ttft_key)
    print(f"  wrote {out}/capacity.json, {path}")
    return 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"
