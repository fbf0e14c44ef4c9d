"""How far one draw of requests moves a simulated capacity: `plan --validate`'s prediction
(plan/validate.py `predict`) over several draws of the same workload, at several probe
lengths. The spread is what a single real measurement may land on with a perfect cost
model, so it bounds how closely `--validate` can confirm a prediction.

    python benchmarks/validate_draws.py runs/plan/validate-1.yaml --requests 32 100 200 --draws 8

A config written by `plan --validate` (or any config with a profile); p99 SLOs as the plan's.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from pp_runtime.config import load_config
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.plan.search import Slo
from pp_runtime.plan.space import Candidate, Layout
from pp_runtime.plan.validate import predict_draws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 100, 200],
                    help="requests per probe (at least; a probe spans 10 TTFT SLOs)")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--ttft-slo", type=float, default=5.0, help="p99, s")
    ap.add_argument("--tbt-slo", type=float, default=1.0, help="p99, s")
    args = ap.parse_args()
    base = resolve_layer_split(load_config(args.config).validate())
    cand = Candidate(Layout(base.parallel.tp, base.parallel.pp, 1), base.planner.planner,
                     base.chunk_tokens, base.batch_rows, base.in_flight, "config")
    slo = Slo(args.ttft_slo, args.tbt_slo)
    print(f"{args.config}: simulated capacity (req/s) over {args.draws} draws, p99 TTFT <= "
          f"{slo.ttft_s:g} s, p99 TBT <= {slo.tbt_s * 1e3:g} ms")
    for n in args.requests:
        t0 = time.perf_counter()
        cfg = replace(base, workload=replace(base.workload, num_requests=n))
        caps = predict_draws(cand, cfg, slo, args.draws)
        mean = statistics.mean(caps)
        print(f"  {n:4d} requests: mean {mean:.3f}, range {min(caps):.3f}-{max(caps):.3f}, "
              f"sd / mean {statistics.pstdev(caps) / mean:.3f}  "
              f"[{' '.join(f'{c:.3f}' for c in caps)}]  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
