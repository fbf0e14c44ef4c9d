"""The paged KV cache on the real PP=2 pipeline, through HTTP: capacity paged against
whole-context slots at the same KV memory, and TTFT with the prefix cache against without.

On this machine: `pp-runtime serve --config cpu/gpt2_pp2` (two Ray stage actors, one torch
thread each, gloo on 127.0.0.1) as a subprocess, driven by the load generator.
  1. capacity (the highest Poisson QPS whose p99 time between tokens and median TTFT meet
     the SLOs, `capacity.capacity_search`) with the KV memory of --contexts whole contexts
     of 1024 tokens: `paged: false` (that many requests at once) against the paged pool
     (as many as its blocks hold), B = 8 sequences per micro-batch either way; the
     workload: Zipf lengths in [64, 512], P:D 10;
  2. a shared system prompt of --system tokens before each request's own 16..64 tokens,
     Poisson arrivals at --prefix-qps: median and p99 TTFT with prefix caching (serve's
     default) against `--no-prefix-cache`, the same requests; the tokens must match.

    python benchmarks/paged_serve.py [--contexts 4] [--requests 24] [--out runs/paged_serve]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.bench.capacity import ServerProcess, capacity_search, server_probe  # noqa: E402
from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.bench.loadgen import load_test  # noqa: E402
from pp_runtime.core.net import free_port  # noqa: E402
from pp_runtime.core.workload import RequestSpec  # noqa: E402

WORKLOAD = {"workload.min_len": 64, "workload.max_len": 512, "chunk_size": 128, "tile_size": 128}


def sets(d: dict) -> list[str]:
    text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731  (YAML booleans)
    return [x for k, v in d.items() for x in ("--set", f"{k}={text(v)}")]


def capacity(label: str, over: dict, args, out: Path) -> dict:
    cfg = load_config("cpu/gpt2_pp2", **WORKLOAD, **over,
                      **{"workload.num_requests": args.requests})
    server_args = ["--config", "cpu/gpt2_pp2", "--no-prefix-cache", *sets({**WORKLOAD, **over})]
    with ServerProcess(server_args, free_port(), out / f"server-{label}.log") as server:
        print(f"== {label}: server ready in {server.ready_s:.1f} s", flush=True)

        def probe(q):
            p = server_probe(server.url, cfg, args.tbt_slo, args.ttft_slo, progress=False)(q)
            s = p.detail
            print(f"  {q:6.3f} req/s: p99 TBT {p.tbt_p99_s * 1e3:5.0f} ms, p50 TTFT "
                  f"{p.ttft_p50_s * 1e3:5.0f} ms, {s['output_tok_s']:.0f} tok/s"
                  f"{'' if p.ok else '  (misses)'}", flush=True)
            return p

        found = capacity_search(probe, args.start_qps, 0.15, args.max_probes, max_qps=8.0,
                                min_qps=0.1)
    print(f"  capacity {found.qps:.3f} req/s", flush=True)
    return asdict(found)


def prefix(label: str, no_cache: bool, args, out: Path) -> dict:
    rng = random.Random(7)
    system = [rng.randrange(50257) for _ in range(args.system)]
    prompts, specs, t = [], [], 0.0
    for _ in range(args.prefix_requests):
        own = [rng.randrange(50257) for _ in range(rng.randint(16, 64))]
        t += rng.expovariate(args.prefix_qps)
        prompts.append(system + own)
        specs.append(RequestSpec(t, len(system) + len(own), 16))
    server_args = ["--config", "cpu/gpt2_pp2", *(["--no-prefix-cache"] if no_cache else [])]
    with ServerProcess(server_args, free_port(), out / f"server-{label}.log") as server:
        print(f"== {label}: server ready in {server.ready_s:.1f} s", flush=True)
        load_test(server.url, specs[:1], [prompts[0]], progress=False)  # warm-up (fills the cache too)
        summary, results = load_test(server.url, specs, prompts, progress=False)
    ttft = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    row = {"ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
           "tokens": [r.token_ids for r in results]}
    print(f"  TTFT median {row['ttft_p50_s'] * 1e3:.0f} ms, p99 {row['ttft_p99_s'] * 1e3:.0f} ms",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, default=4, help="KV memory in 1024-token contexts")
    ap.add_argument("--requests", type=int, default=24, help="requests per capacity probe")
    ap.add_argument("--tbt-slo", type=float, default=1.0, help="p99 TBT SLO, s")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="median TTFT SLO, s")
    ap.add_argument("--start-qps", type=float, default=1.0)
    ap.add_argument("--max-probes", type=int, default=5)
    ap.add_argument("--system", type=int, default=512, help="shared system-prompt tokens")
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--prefix-qps", type=float, default=0.5)
    ap.add_argument("--skip", default="", help="capacity or prefix: a part not to run")
    ap.add_argument("--out", default="runs/paged_serve")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result, lines = {}, []
    if "capacity" not in args.skip:
        memory = {"kv_slots": args.contexts, "max_batch_size": 8}
        slots = capacity("slots", {**memory, "paged": False}, args, out)
        paged = capacity("paged", {**memory, "paged": True}, args, out)
        result["capacity"] = {"slots": slots, "paged": paged}
        lines.append(f"capacity at the KV memory of {args.contexts} x 1024 tokens, p99 TBT <= "
                     f"{args.tbt_slo:g} s, median TTFT <= {args.ttft_slo:g} s: slots "
                     f"{slots['qps']:.3f} req/s, paged {paged['qps']:.3f} req/s, paged / slots "
                     + (f"{paged['qps'] / slots['qps']:.2f}x" if slots["qps"] else "n/a"))
    if "prefix" not in args.skip:
        hit = prefix("prefix cache", False, args, out)
        miss = prefix("no prefix cache", True, args, out)
        result["prefix"] = {"cache": hit, "no_cache": miss}
        lines.append(f"shared {args.system}-token system prompt, {args.prefix_requests} requests at "
                     f"{args.prefix_qps:g} req/s: TTFT median {hit['ttft_p50_s'] * 1e3:.0f} ms with "
                     f"the prefix cache, {miss['ttft_p50_s'] * 1e3:.0f} ms without: "
                     f"{hit['ttft_p50_s'] / miss['ttft_p50_s']:.2f}x (p99 "
                     f"{hit['ttft_p99_s'] / miss['ttft_p99_s']:.2f}x); same tokens: "
                     f"{'yes' if hit['tokens'] == miss['tokens'] else 'NO'}")
    print("\n" + "\n".join(lines))
    (out / "paged_serve.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
