"""`pp-runtime plan --validate N`: the first N points of the plan's frontier (the winner
first, then the next most throughput per GPU at lower latency) and a reference config,
for real.

Each deployment is written as a config (`report.write_config`), served by `replicas`
`pp-runtime serve` processes on 127.0.0.1, and its capacity searched with the load
generator (`capacity.capacity_search`, the plan's p99 SLOs, Poisson arrivals split evenly
over the replicas; each probe's arrivals span at least 10 TTFT SLOs, as in the search),
starting at the rate the simulator predicts for the same requests.

A capacity measured on one draw of requests is itself a sample: p99 over a probe's few
dozen requests is nearly its slowest request's, so the draw moves it more than the cost
model's error does (GPT-2 small's pipeline on this machine, simulated alone: 0.68-1.35
req/s over eight draws of 32 requests a probe, 0.79-1.23 of 100, 0.75-1.17 of 200;
`benchmarks/validate_draws.py`). So the prediction is the simulator's capacity over DRAWS draws (other
seeds of the same workload): their mean is the predicted capacity, their range what one
real measurement may land on with a perfect cost model.
Printed: predicted (the draws' mean and range) and measured capacity side by side, their
ratio, whether the measurement lies within the draws' range, and the plan's choice against
the reference, measured and as the draws allow. Small models on this machine's CPU pipeline only
(the search's `--gpu cpu` and a profile measured here), pp <= 2.
"""
from __future__ import annotations

import math
import statistics
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

from pp_runtime.bench.capacity import Probe, ServerProcess, capacity_search, meets
from pp_runtime.config import Config, ConfigError, load_config
from pp_runtime.core.net import free_port
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.plan.probe import SPAN_TTFTS, Prober, ProbeCache, grid_index, rate
from pp_runtime.plan.search import REL_TOL, Result, Slo, Workload, upper_bound
from pp_runtime.plan.space import Candidate, Layout

MAX_REAL_PROBES = 6
START_SHARE = 0.4  # of the bound, where the predicted capacity's climb starts
MIN_PER_GPU = 1e-3  # req/s per GPU: the prediction's floor
MAX_REAL_REQUESTS = 300  # the fastest rate probed sends this many in 10 TTFT SLOs
DRAWS = 8  # workload draws the prediction is spread over (module docstring)
DRAW_SEED_STEP = 1000  # draw d's seed: the workload's + d x this (replicas take seed + i)


def real_probe(urls: list[str], cfg: Config, slo: Slo, log):
    """probe(qps of all replicas): each server gets its share, with its own seed."""
    from pp_runtime.bench.loadgen import load_test, workload_prompts
    from pp_runtime.core.workload import generate

    def probe(qps: float) -> Probe:
        got: list[dict] = [{} for _ in urls]

        share = qps / len(urls)
        n = max(cfg.workload.num_requests, math.ceil(share * SPAN_TTFTS * slo.ttft_s))

        def one(i: int) -> None:
            wl = replace(cfg.workload, qps=share, seed=cfg.workload.seed + i, num_requests=n)
            specs = generate(wl)
            prompts = workload_prompts(specs, cfg.model.vocab_size, wl.seed)
            got[i], _ = load_test(urls[i], specs, prompts, progress=False, desc=f"{qps:.3g} req/s")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tbt = max((s["tbt_s"]["p99"] or 0.0) for s in got)
        ttft = max((s["ttft_s"]["p99"] or 0.0) for s in got)
        failed = sum(s["failed"] for s in got)
        ok = meets(tbt, ttft, slo.tbt_s, slo.ttft_s, failed)
        log(f"    {qps:7.3f} req/s: p99 TBT {tbt * 1e3:6.0f} ms, p99 TTFT {ttft * 1e3:6.0f} ms"
            f"{'' if ok else '  (misses)'}")
        return Probe(qps, tbt, ttft, ok, {"tbt_p99_s": tbt, "ttft_p99_s": ttft, "failed": failed})

    return probe


@contextmanager
def serving(config: Path, replicas: int, out: Path, name: str):
    """`replicas` servers of one config file, started side by side on 127.0.0.1 (their
    logs `out/{name}-server{i}.log`); yields their URLs and stops every one that started."""
    with ExitStack() as stack:
        yield [stack.enter_context(ServerProcess(["--config", str(config), "--no-prefix-cache"],
                                                 free_port(), out / f"{name}-server{i}.log")).url
               for i in range(replicas)]


def measure(name: str, cfg: Config, replicas: int, slo: Slo, start: float, out: Path, log) -> float:
    """Capacity of `replicas` servers of cfg, for real (req/s over all of them)."""
    from pp_runtime.plan.report import dump_config

    path = dump_config(cfg, replicas, out / f"{name}.yaml", f"validated by pp-runtime plan: {name}")
    with serving(path, replicas, out, name) as urls:
        probe = real_probe(urls, cfg, slo, log)
        n = cfg.workload.num_requests
        lo, hi = n / 600.0, max(n, MAX_REAL_REQUESTS) / (SPAN_TTFTS * slo.ttft_s)
        cap = capacity_search(probe, min(max(start, lo), hi), 2 * REL_TOL, MAX_REAL_PROBES,
                              max_qps=hi, min_qps=lo)
        return cap.qps


def validate(args, rank: list[Result], configs: dict, slo: Slo, out: Path) -> int:
    """Predicted / measured capacity of the first N of `rank` (the frontier, one point per
    layout) and of --reference (module docstring)."""
    log = lambda text: print(text, flush=True)  # noqa: E731
    chosen = top_layouts(rank, args.validate)
    if any(r.candidate.layout.pp > 2 or configs[r.candidate].hardware.gpu != "cpu" for r in chosen):
        raise ConfigError("--validate runs small models on this machine's CPU pipeline: "
                          "plan with --gpu cpu and pp <= 2")
    n = args.validate_requests
    base = configs[chosen[0].candidate]
    ref = load_config(args.reference)  # its deployment and knobs, on the plan's model and traffic
    ref = resolve_layer_split(replace(ref, model=base.model, workload=base.workload,
                                      hardware=base.hardware).validate())
    ref_cand = Candidate(Layout(ref.parallel.tp, ref.parallel.pp, 1), ref.planner.planner,
                         ref.chunk_tokens, ref.batch_rows, ref.in_flight, "config")
    rows = [(f"#{i} {r.candidate.name}", r.candidate, configs[r.candidate]) for i, r in enumerate(chosen, 1)]
    rows.append((f"reference {args.reference}", ref_cand, ref))
    log(f"\nvalidate: {n} requests per probe, for real on this machine (p99 SLOs as planned); "
        f"predicted over {DRAWS} draws of the requests")
    table = []
    for label, cand, cfg in rows:
        cfg = replace(cfg, workload=replace(cfg.workload, num_requests=n))
        draws = predict_draws(cand, cfg, slo)
        log(f"  {label}: predicted {statistics.mean(draws):.3f} req/s (draws {min(draws):.3f}-"
            f"{max(draws):.3f}; this draw {draws[0]:.3f}); measuring ...")
        name = label.split()[0].strip("#") if label.startswith("#") else "reference"
        measured = measure(f"validate-{name}", cfg, cand.layout.replicas, slo,
                           max(draws[0], n / 600.0), out, log)
        table.append((label, draws, measured))
    log(f"\n{'deployment':<54} {'predicted':>9} {'draws':>13} {'measured':>9} {'pred/meas':>9}")
    for label, draws, m in table:
        p = statistics.mean(draws)
        log(f"{label:<54} {p:>9.3f} {min(draws):>6.3f}-{max(draws):<6.3f} {m:>9.3f} "
            f"{p / m if m else float('inf'):>9.2f}  {within(draws, m)}")
    log(ranking(table[0][1:], table[-1][1:]))
    return 0


def within(draws: list[float], measured: float) -> str:
    """Whether a measured capacity is one the draws allow (module docstring)."""
    if min(draws) <= measured <= max(draws):
        return "within the draws"
    return f"{'below' if measured < min(draws) else 'above'} the draws"


def ranking(best: tuple[list[float], float], ref: tuple[list[float], float]) -> str:
    """The plan's choice against the reference: measured, predicted (the draws' means), and
    whether the draws settle which carries more (every draw of one above every draw of the
    other) or leave it to chance."""
    (bd, bm), (rd, rm) = best, ref
    measured = bm / rm if rm else float("inf")
    predicted = statistics.mean(bd) / statistics.mean(rd)
    if min(bd) > max(rd) or max(bd) < min(rd):
        settled = "the draws settle the ranking"
    else:
        settled = (f"the draws overlap (ratio {min(bd) / max(rd):.2f}-{max(bd) / min(rd):.2f}): "
                   "one measurement cannot rank them")
    return (f"the plan's choice / the reference, measured: {measured:.2f}x, predicted "
            f"{predicted:.2f}x; {settled}")


def predict_draws(cand: Candidate, cfg: Config, slo: Slo, draws: int = DRAWS) -> list[float]:
    """`predict` over `draws` draws of the workload, the first the one measured for real."""
    wl = cfg.workload
    return [predict(cand, replace(cfg, workload=replace(wl, seed=wl.seed + d * DRAW_SEED_STEP)), slo)
            for d in range(draws)]


def predict(cand: Candidate, cfg: Config, slo: Slo) -> float:
    """The simulator's capacity at the validation's probe length (req/s of all replicas):
    the grid rate below the first that misses, climbing from START_SHARE of the bound. At
    32 requests a probe, each rate a different draw of requests, the simulated pass or miss
    is not monotone in the rate (GPT-2 small's two replicas: pass up to 1.81 req/s, miss
    at 1.91-2.32, pass again at 2.43-2.55), and a search from above (the plan's) stops on
    the upper pass; the real search bisects down to the first miss."""
    lay = cand.layout
    prober = Prober(cfg, lay.replicas, slo, ProbeCache(None), True)
    k = grid_index(upper_bound(cfg, _workload(cfg), lay.replicas) / lay.gpus * START_SHARE)
    while not prober(k).ok and k > grid_index(MIN_PER_GPU):
        k -= 1
    while prober(k + 1).ok:
        k += 1
    return rate(k) * lay.gpus


def top_layouts(rank: list[Result], n: int) -> list[Result]:
    """The best deployment of each of the n best layouts (tp, pp, replicas), best first:
    what a real run can tell apart (two chunk sizes of one layout differ by less than a
    real probe's noise)."""
    best: dict = {}
    for r in rank:
        best.setdefault(r.candidate.layout, r)
    return list(best.values())[:n]


def _workload(cfg: Config) -> Workload:
    from pp_runtime.core.workload import generate

    return Workload.of([(s.prompt_len, s.output_len) for s in generate(cfg.workload)])
