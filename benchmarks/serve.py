"""Serving capacity per planner through HTTP, the simulator's prediction beside it, and the
server's overhead per token against offline `LLM.generate`.

On this machine: PP=2 (two Ray stage actors, one torch thread each, gloo on 127.0.0.1),
GPT-2-small shapes with random weights (`configs/cpu/gpt2_pp2.yaml`). In one run,
for each planner (default sarathi, orca-best, uniform):
  1. capacity on the simulator: the highest Poisson QPS whose p99 time between tokens
     (TBT) and median TTFT meet the SLOs (`capacity.capacity_search`, Sarathi-Serve's
     metric; `--ttft-key p99`: the p99 TTFT, as benchmarks/goodput.py), priced with a
     profile of this machine (measured first, or --profile DIR);
  2. `pp-runtime serve --set planner=P` started as a subprocess on 127.0.0.1 (ready when
     /health answers 200), and the same search against it through the load generator
     (streaming HTTP, client-side TTFT and TBT), starting from the simulator's capacity;
  3. overhead: the same requests, all at once, through offline `LLM.generate` (in this
     process) and through the server (streamed): seconds per output token of each and
     the ratio (target: the server within 5 %), and whether they generated the same tokens.
It prints one table, writes bench.json and latency_vs_qps.png (p99 TBT and p50 TTFT
against QPS, server and simulator, per planner) to --out.

    python benchmarks/serve.py --quick                      # a few minutes on 2 cores
    python benchmarks/serve.py [--planners sarathi,orca-best,uniform] [--requests 32]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.bench.capacity import (ServerProcess, capacity_search, plot_latency,  # noqa: E402
                                 server_probe, sim_probe)
from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.bench.loadgen import load_test, workload_prompts  # noqa: E402
from pp_runtime.core.net import free_port  # noqa: E402
from pp_runtime.core.workload import generate  # noqa: E402

# --quick: shorter requests and chunks, fewer requests and probes (GPT-2-small shapes kept)
QUICK = {"workload.num_requests": 12, "workload.min_len": 64, "workload.max_len": 512,
         "chunk_size": 128, "tile_size": 128}


SIM_MAX_PROBES = 12  # a simulated probe takes well under a second: bracket it tightly


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def profile_for(cfg, args, out: Path) -> str:
    """A profile of this machine for the simulator: --profile, else measured once into out."""
    if args.profile:
        return args.profile
    path = out / "profile"
    if not (path / "profile.json").exists() and not any(path.glob("*.csv")):
        import torch

        from pp_runtime.profile.measure import measure_profile

        torch.set_num_threads(cfg.runtime.threads_per_worker or 1)  # as each stage worker runs
        t0 = time.perf_counter()
        measure_profile(cfg, path, quick=True, progress=False)
        print(f"profile of this machine measured in {time.perf_counter() - t0:.0f} s: {path}/", flush=True)
    return str(path)


def offline_vs_server(cfg, url: str | None, n: int, repeats: int) -> dict:
    """n requests of cfg's workload, all at once: offline LLM.generate (in this process,
    its own Ray) when url is None, else the server at url; the fastest of `repeats` runs
    after a warm-up. Seconds per output token."""
    from pp_runtime.core.request import SamplingParams

    specs = [replace(s, arrival_s=0.0) for s in generate(replace(cfg.workload, num_requests=n, qps=None))]
    prompts = workload_prompts(specs, cfg.model.vocab_size, cfg.workload.seed)
    if url is None:
        from pp_runtime.engine.llm import LLM

        with LLM(cfg) as llm:
            llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            walls = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, [SamplingParams(max_tokens=s.output_len, ignore_eos=True)
                                              for s in specs])
                walls.append(time.perf_counter() - t0)
        tokens = [o.token_ids for o in outs]
    else:
        load_test(url, specs[:1], [prompts[0][:16]], progress=False)  # warm-up
        walls = []
        for _ in range(repeats):
            s, results = load_test(url, specs, prompts, progress=False)
            walls.append(s["wall_s"])
        tokens = [r.token_ids for r in results]
    n_out = sum(map(len, tokens))
    return {"wall_s": min(walls), "walls_s": walls, "output_tokens": n_out,
            "s_per_token": min(walls) / n_out, "tokens": tokens}


def planner_sets(spec: str, args) -> tuple[str, list[str]]:
    """'NAME[:FIELD=VALUE;...]' -> (NAME, --set pairs): an anchor at chosen knobs, e.g.
    'sarathi-serve:chunk_size=256'; `uniform` also gets the benchmark's latency targets
    (planner.tbt_slo_ms, ttft_slo_ms), which is how a user runs it."""
    name, _, knobs = spec.partition(":")
    pairs = [k for k in knobs.split(";") if k] + [f"planner={name}"]
    if name == "uniform" and args.slo_uniform:
        pairs += [f"tbt_slo_ms={args.tbt_slo * 1e3:g}", f"ttft_slo_ms={args.ttft_slo * 1e3:g}"]
    return name, pairs


def run_planner(spec: str, cfg, args, out: Path, profile: str, sets: list[str]) -> dict:
    name, pairs = planner_sets(spec, args)
    planner = spec
    c = cfg.with_overrides(**_parsed(pairs))
    print(f"== {planner}", flush=True)
    sim = capacity_search(sim_probe(c.with_overrides(**{"hardware.profile": profile}),
                                    args.tbt_slo, args.ttft_slo, ttft_key=args.ttft_key),
                          args.start_qps, args.rel_tol, SIM_MAX_PROBES, max_qps=args.max_qps)
    print(f"  simulator: capacity {sim.qps:.3f} req/s; " + ", ".join(
        f"{p.qps:.3g}: {ms(p.tbt_p99_s)}/{ms(p.ttft_p50_s)}{'' if p.ok else ' x'}" for p in sim.curve),
          flush=True)
    row = {"planner": planner, "sim": asdict(sim)}
    overhead = planner in args.overhead_planners.split(",")
    if overhead:
        row["offline"] = offline_vs_server(c, None, args.overhead_requests, args.overhead_repeats)
    server_args = ["--config", args.config, *sum((["--set", s] for s in sets + pairs), [])]
    log = out / f"server-{planner.replace(':', '_').replace('=', '').replace(',', '_')}.log"
    with ServerProcess(server_args, free_port(), log) as server:
        print(f"  server ready in {server.ready_s:.1f} s at {server.url}", flush=True)

        def probe(q):
            p = server_probe(server.url, c, args.tbt_slo, args.ttft_slo, progress=not args.quiet,
                             ttft_key=args.ttft_key)(q)
            s = p.detail
            print(f"  server {q:7.3f} req/s: p99 TBT {ms(p.tbt_p99_s)}, {args.ttft_key} TTFT {ms(p.ttft_p50_s)}, "
                  f"{s['output_tok_s']:.0f} tok/s, SLO attainment {s['slo_attainment']['both']:.0%}"
                  f"{'' if p.ok else ' (misses)'}", flush=True)
            return p

        real = capacity_search(probe, sim.qps or args.start_qps, args.rel_tol, args.max_probes,
                               max_qps=args.max_qps, min_qps=args.requests / args.max_probe_s)
        row["server"] = asdict(real)
        if overhead:
            row["served"] = offline_vs_server(c, server.url, args.overhead_requests, args.overhead_repeats)
    return row


def table(rows: list[dict], args) -> list[str]:
    floor = args.requests / args.max_probe_s
    lines = [f"capacity: highest Poisson QPS with p99 TBT <= {ms(args.tbt_slo)} and {args.ttft_key} TTFT <= "
             f"{ms(args.ttft_slo)}, {args.requests} requests per probe (server probes >= "
             f"{floor:.2f} and <= {args.max_qps:.2f} req/s)",
             f"{'planner':<11}{'server req/s':>13}{'sim req/s':>11}{'sim/server':>11}"
             f"{'server probes':>15}{'sim probes':>11}"]
    for r in rows:
        a, b = r["server"]["qps"], r["sim"]["qps"]
        server = (f"{a:.3f}" if a else f"< {min(p['qps'] for p in r['server']['probes']):.3f}")
        server = f">= {a:.3f}" if a >= args.max_qps else server
        sim = f">= {b:.3f}" if b >= args.max_qps else f"{b:.3f}"
        lines.append(f"{r['planner']:<11}{server:>13}{sim:>11}{(f'{b / a:.2f}x' if a else '-'):>11}"
                     f"{len(r['server']['probes']):>15}{len(r['sim']['probes']):>11}")
    first = rows[0]["server"]["qps"]
    for r in rows[1:]:
        if r["server"]["qps"]:
            lines.append(f"server capacity {rows[0]['planner']} / {r['planner']}: "
                         f"{first / r['server']['qps']:.2f}x")
    for r in rows:
        if "served" in r:
            off, srv = r["offline"], r["served"]
            same = off["tokens"] == srv["tokens"]
            walls = lambda x: "/".join(f"{w:.2f}" for w in x["walls_s"])  # noqa: E731
            lines.append(f"overhead, {r['planner']}, {args.overhead_requests} requests at once, "
                         f"{off['output_tokens']} output tokens, fastest of {args.overhead_repeats}: "
                         f"offline generate {off['s_per_token'] * 1e3:.2f} ms/token ({walls(off)} s), "
                         f"server {srv['s_per_token'] * 1e3:.2f} ms/token ({walls(srv)} s): "
                         f"{srv['s_per_token'] / off['s_per_token'] - 1:+.1%} (target <= +5 %); "
                         f"same tokens: {'yes' if same else 'NO'}")
    return lines


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM too: the `with ServerProcess` blocks stop their servers


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cpu/gpt2_pp2")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="config override for every run and server (repeatable)")
    ap.add_argument("--planners", default="sarathi,orca-best,uniform",
                    help="comma-separated NAME[:FIELD=VALUE;...] (knobs joined by ';')")
    ap.add_argument("--requests", type=int, help="requests per probe (default 32; --quick 12)")
    ap.add_argument("--tbt-slo", type=float, default=None, help="p99 TBT SLO, s (default 1.5; --quick 1.0)")
    ap.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO, s (default 5; --quick 2)")
    ap.add_argument("--ttft-key", choices=("median", "p99"), default="median",
                    help="what the TTFT SLO bounds: the median (Sarathi-Serve's scheduling delay, "
                         "the default) or the p99 (benchmarks/goodput.py's, issue 34's)")
    ap.add_argument("--start-qps", type=float, default=0.5, help="the simulator search's first probe")
    ap.add_argument("--max-probes", type=int, default=None,
                    help="per server search (default 6; --quick 4); the simulator's: 12")
    ap.add_argument("--rel-tol", type=float, default=0.15)
    ap.add_argument("--min-probe-s", type=float, default=None,
                    help="no probe faster than N requests in this many s (default 8; --quick 4)")
    ap.add_argument("--max-probe-s", type=float, default=None,
                    help="no server probe slower than N requests in this many s (default 120; --quick 30)")
    ap.add_argument("--overhead-planners", default=None,
                    help="planners whose server overhead is measured (default: the first)")
    ap.add_argument("--overhead-requests", type=int, default=None, help="(default 16; --quick 8)")
    ap.add_argument("--overhead-repeats", type=int, default=2, help="runs each way; the fastest counts")
    ap.add_argument("--profile", help="a profile directory of this machine (default: measure one)")
    ap.add_argument("--ray-address", help="a running Ray cluster (launch/ray_cluster.sh head) for "
                                          "the servers and the offline runs (default: each starts its own)")
    ap.add_argument("--slo-uniform", action="store_true",
                    help="give uniform the SLOs as its latency targets (--tbt-slo-ms, --ttft-slo-ms)")
    ap.add_argument("--profile-servers", action="store_true",
                    help="every server prices with the profile (uniform's budget; auto layer split)")
    ap.add_argument("--quick", action="store_true", help="a few minutes on 2 cores")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--out", default="runs/bench-serve")
    args = ap.parse_args()
    q = args.quick
    args.requests = args.requests or (12 if q else 32)
    args.tbt_slo = args.tbt_slo or (1.0 if q else 1.5)
    args.ttft_slo = args.ttft_slo or (2.0 if q else 5.0)
    args.max_probes = args.max_probes or (4 if q else 6)
    args.max_probe_s = args.max_probe_s or (30.0 if q else 120.0)
    # above N / min_probe_s the N requests arrive in less time than one takes: the probe is
    # a burst, not a rate, and says nothing about the rate the pipeline sustains
    args.max_qps = args.requests / (args.min_probe_s or (4.0 if q else 8.0))
    args.overhead_requests = args.overhead_requests or (8 if q else 16)
    args.overhead_planners = args.overhead_planners or args.planners.split(",")[0]
    sets = ([f"{k}={v}" for k, v in QUICK.items()] if q else []) + args.set
    sets.append(f"workload.num_requests={args.requests}")
    if args.ray_address:
        sets.append(f"ray_address={args.ray_address}")
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # a driver joining by address must ask for it
    cfg = load_config(args.config, **_parsed(sets))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    profile = profile_for(cfg, args, out)
    if args.profile_servers:
        sets.append(f"hardware.profile={profile}")
    rows = [run_planner(p, cfg, args, out, profile, sets) for p in args.planners.split(",")]
    lines = table(rows, args)
    print("\n" + "\n".join(lines))
    curves = {}
    for r in rows:
        from pp_runtime.bench.capacity import Probe

        for where in ("server", "sim"):
            curves[f"{r['planner']} ({where})"] = [Probe(**p) for p in r[where]["probes"]]
    path = plot_latency(curves, args.tbt_slo, args.ttft_slo, out / "latency_vs_qps.png",
                        f"{cfg.model.name} PP={cfg.parallel.pp} on this CPU, {args.requests} requests per probe",
                        args.ttft_key)
    for r in rows:  # token lists are long: keep counts only
        for k in ("offline", "served"):
            if k in r:
                r[k] = {key: v for key, v in r[k].items() if key != "tokens"}
    (out / "bench.json").write_text(json.dumps({"args": vars(args), "sets": sets, "rows": rows,
                                                "table": lines}, indent=1, default=str))
    print(f"wrote {out}/bench.json, {path}; {time.perf_counter() - t0:.0f} s in all")


def _parsed(sets: list[str]) -> dict:
    from pp_runtime.cli.common import parse_overrides

    return parse_overrides(sets)


if __name__ == "__main__":
    main()
