"""`pp-runtime plan`: its flags, their checks, and the run that ties the parts together.

    pp-runtime plan --model gpt3-175b --gpus 64 --gpu a100-80gb --ttft-slo 5 --tbt-slo 0.2

Every flag is checked before the search starts (one line, exit 2); a search where nothing
fits or nothing meets the SLO ends with one line saying what would (exit 2).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from pp_runtime.cli.common import non_negative_int, number, positive_float, positive_int
from pp_runtime.config import PLANNERS, Config, ConfigError

WORKLOAD_HELP = ("a JSONL trace {arrival_s, prompt_len, output_len} per line (its lengths, at "
                 "Poisson rates), or KIND:FIELD=VALUE,...: zipf:min_len=1024,max_len=4096,"
                 "pd_ratio=10 (default: the paper's), fixed:prompt_len=512,output_len=64")
PAPER = "zipf:min_len=1024,max_len=4096,theta=0.4,pd_ratio=10"


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the best deployment for a model, a cluster and an SLO",
                       description="Search tp x pp x replicas, chunk size, B, in-flight depth, "
                                   "layer split and planner on the simulator; print the ranked "
                                   "deployments and why the others lost, plot capacity against "
                                   "latency, write the winner as a config. docs/plan.md")
    p.add_argument("--model", required=True, help="a shipped model (gpt3-175b, llama2-70b, "
                                                  "gpt2-small, ...) or a model YAML")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs (or CPU workers) in all")
    p.add_argument("--gpu", default="a100-80gb", help="a100-80gb | h100 | h200 | cpu (default a100-80gb)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="tp stays within a node (default 8)")
    p.add_argument("--memory-gb", type=positive_float, help="memory of one device (default: the GPU's; "
                                                   "cpu: a quarter of the RAM shared by --gpus, at most 4)")
    p.add_argument("--profile", help="a directory from `pp-runtime profile` (what --gpu cpu prices)")
    p.add_argument("--calibrate", type=non_negative_int, default=8, metavar="N",
                   help="with --profile and --gpu cpu: a layout the profile has no calibration "
                        "for is calibrated first, as `pp-runtime profile --calibrate N` does (N "
                        "requests for real on this machine; default 8; 0: priced uncalibrated)")
    p.add_argument("--workload", default=PAPER, help=WORKLOAD_HELP)
    p.add_argument("--requests", type=number(int, 2), default=200, help="requests per probe (default 200)")
    p.add_argument("--ttft-slo", type=positive_float, required=True, help="p99 time to first token, s")
    p.add_argument("--tbt-slo", type=positive_float, required=True, help="p99 time between tokens, s")
    p.add_argument("--planners", default="uniform", help=f"comma-separated ({', '.join(PLANNERS)}; default uniform)")
    p.add_argument("--chunk-sizes", default="128,256,512,1024,2048", help="chunk sizes C to try")
    p.add_argument("--budget-minutes", type=positive_float, default=10.0, help="stop starting searches after this")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, help="parallel processes (default: the cores)")
    p.add_argument("--top", type=positive_int, default=10, help="rows of the ranked table")
    p.add_argument("--validate", type=non_negative_int, nargs="?", const=2, default=0, metavar="N",
                   help="run the first N frontier points (default 2; the winner first) and a "
                        "reference config for real on this machine's CPU pipeline: predicted / "
                        "measured capacity per point (small models, pp <= 2)")
    p.add_argument("--validate-requests", type=positive_int, default=100,
                   help="requests per real probe in --validate (default 100: with fewer, which "
                        "requests are drawn moves a capacity more than the cost model errs)")
    p.add_argument("--reference", default="cpu/gpt2_pp2", help="--validate also measures this config")
    p.add_argument("--exhaustive", action="store_true",
                   help="search every candidate to its capacity (slow; the fast default gives "
                        "the same winner and frontier)")
    p.add_argument("--full-probes", action="store_true",
                   help="run every probe to its end (no early stop once a miss is certain)")
    p.add_argument("--cache", default="runs/plan-cache",
                   help="probe answers kept here and read back (default runs/plan-cache)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor keep probe answers")
    p.add_argument("--out", default="runs/plan", help="output directory (default runs/plan)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)


def parse_workload(text: str, requests: int):
    """The --workload flag as a WorkloadConfig (ConfigError naming the problem)."""
    from pp_runtime.core.workload import WorkloadConfig

    if text.endswith(".jsonl") or Path(text).is_file():
        return WorkloadConfig(kind="trace", trace=text).validate()
    kind, _, rest = text.partition(":")
    fields = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"--workload {text!r}: {pair!r} is not FIELD=VALUE")
        fields[key.strip()] = float(value) if any(c in value for c in ".e") else int(value)
    known = set(WorkloadConfig.__dataclass_fields__) - {"kind", "qps", "trace"}
    if set(fields) - known:
        raise ConfigError(f"--workload: unknown field(s) {', '.join(sorted(set(fields) - known))}; "
                          f"known: {', '.join(sorted(known))}")
    try:
        return WorkloadConfig(kind=kind, num_requests=requests, **fields).validate()
    except TypeError as exc:
        raise ConfigError(f"--workload {text!r}: {exc}") from None


def base_config(args) -> Config:
    """The model, the device and the workload every candidate shares."""
    from pp_runtime.config import load_model_config
    from pp_runtime.costmodel.devices import device_spec
    spec = device_spec(args.gpu, "--gpu") if args.gpu != "cpu" else None
    memory_gb = args.memory_gb or (spec.mem_gb if spec else _cpu_share_gb(args.gpus))
    model = load_model_config(args.model)
    if args.gpu == "cpu":
        model = replace(model, dtype="float32")
        if not args.profile:
            raise ConfigError("--gpu cpu: give --profile DIR (`pp-runtime profile` measures this "
                              "machine); the spec-sheet CPU is only a fallback")
    wl = parse_workload(args.workload, args.requests)
    cfg = Config(model=model).with_overrides(**{
        "hardware.gpu": args.gpu, "hardware.gpus_per_node": args.gpus_per_node,
        "hardware.profile": args.profile, "cache.paged": True, "cache.num_blocks": "auto",
        "cache.device_memory_gb": memory_gb, "cache.max_seq_len": longest(wl),
        "runtime.threads_per_worker": 1 if args.gpu == "cpu" else None})
    return replace(cfg, workload=wl).validate()


def _cpu_share_gb(gpus: int) -> float:
    """A CPU worker's default memory: a quarter of the RAM shared out, at most 4 GB."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return min(4.0, round(ram / 4 / gpus, 1))


def longest(wl) -> int:
    """The longest request the workload can make, however many are drawn."""
    if wl.kind == "zipf":
        return wl.max_len
    if wl.kind == "fixed":
        return wl.prompt_len + wl.output_len
    return max(_lengths(wl))


def _lengths(wl) -> list[int]:
    return [p + d for p, d in _pairs(wl)]


def _pairs(wl) -> list[tuple[int, int]]:
    """(prompt, output) tokens of each request of the workload."""
    from pp_runtime.core.workload import generate

    return [(s.prompt_len, s.output_len) for s in generate(wl)]


def cmd_plan(args) -> int:
    from pp_runtime.plan.runner import prestart, release, search
    from pp_runtime.plan.search import Slo, Workload
    from pp_runtime.plan.space import candidates

    try:
        base = base_config(args)
        if not args.profile:  # the workers start while the candidates are built (a profile's
            prestart(args.jobs)  # calibration runs for real on this machine first: not beside it)
        planners = [p.strip() for p in args.planners.split(",") if p.strip()]
        bad = [p for p in planners if p not in PLANNERS]
        if bad or not planners:
            raise ConfigError(f"--planners: unknown {', '.join(bad) or '(none)'}; use {', '.join(PLANNERS)}")
        chunks = _ints(args.chunk_sizes, "--chunk-sizes")
        pairs = _pairs(base.workload)
        lengths = [p + d for p, d in pairs]
        slo = Slo(args.ttft_slo, args.tbt_slo)
        items, outs = candidates(base, args.gpus, planners, chunks, lengths, (slo.tbt_s, slo.ttft_s))
    except ConfigError as exc:
        release()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = base.model
    print(f"plan: {m.name} on {args.gpus} x {args.gpu} ({base.cache.device_memory_gb:g} GB each, "
          f"{args.gpus_per_node} per node); workload {args.workload} ({len(lengths)} requests per "
          f"probe, mean {sum(lengths) / len(lengths):.0f} tokens); SLO p99 TTFT <= {args.ttft_slo:g} s, "
          f"p99 TBT <= {args.tbt_slo * 1e3:g} ms", flush=True)
    if args.profile:
        print(f"  {calibration_line(args.profile)}", flush=True)
        items, outs = calibrate_layouts(args, base, items, outs, planners, chunks, lengths, slo)
    tile = base.planner.tile_size
    if any(c % tile for c in chunks):
        print(f"  note: chunk sizes {', '.join(str(c) for c in chunks if c % tile)} are not multiples "
              f"of the {tile}-token matmul tile (planner.tile_size): part of a tile is wasted", flush=True)
    layouts = len({c.layout for c, _ in items})
    print(f"  {layouts} layouts fit ({len(outs)} left out before simulation), {len(items)} "
          f"deployments to search ({'exhaustive' if args.exhaustive else 'fast'}) in {args.jobs} "
          f"processes, budget {args.budget_minutes:g} min", flush=True)
    if not items:
        release()
        print("error: " + nothing_fits(outs, args), file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results, (simulated, probes) = search(items, Workload.of(pairs), slo, args.jobs, args.budget_minutes * 60,
                                fast=not args.exhaustive, progress=not args.quiet,
                                stop_early=not args.full_probes,
                                cache_dir=None if args.no_cache else args.cache)
    elapsed = time.perf_counter() - t0
    print(f"\n{probes} probes, {simulated} simulated, {probes - simulated} read from the cache; "
          f"search {elapsed:.1f} s", flush=True)
    return finish(args, base, dict(items), results, outs, slo, lengths, elapsed)


def calibrate_layouts(args, base, items, outs, planners, chunks, lengths, slo):
    """Each layout's calibration said (`plan/calibrated.py`), a missing one measured first
    on this machine (--gpu cpu, --calibrate N); the candidates priced again if one was."""
    from pp_runtime.plan import calibrated, space

    from pp_runtime.plan import shared
    from pp_runtime.plan.search import Workload

    firsts: dict = {}
    for cand, cfg in items:
        firsts.setdefault(cand.layout, cfg)
    again = calibrated.ensure(list(firsts.values()), args.profile, args.calibrate, args.gpu == "cpu")
    if again:
        space.forget()
        items, outs = space.candidates(base, args.gpus, planners, chunks, lengths, (slo.tbt_s, slo.ttft_s))
    served: dict = {}  # layout -> (SLO-driven?, the config its replicas serve)
    for cand, cfg in items:
        if cand.layout not in served or (cand.slo_ms and not served[cand.layout][0]):
            served[cand.layout] = (cand.slo_ms is not None, cfg)
    wl = Workload.of(_pairs(base.workload))
    if shared.ensure({lay: cfg for lay, (_, cfg) in served.items()}, wl, args.calibrate,
                     args.gpu == "cpu", Path(args.out)):
        space.forget()
    return items, outs


def finish(args, base, configs, results, outs, slo, lengths, elapsed) -> int:
    from pp_runtime.plan import report
    from pp_runtime.plan.search import LOST

    out = Path(args.out)
    rank = report.layout_points(results)
    n = {k: sum(r.outcome == k for r in results) for k in ("searched", LOST, "bound", "budget")}
    print(f"searched {n['searched']} to the end, {n[LOST]} lost at their layout's best, "
          f"{n['bound']} out by bound, {n['budget']} left by the budget; {elapsed:.0f} s\n")
    if not rank:
        print("error: no deployment met the SLOs at any rate probed; " + what_would(results, slo),
              file=sys.stderr)
        _write_json(out, args, results, outs, None)
        return 2
    print(report.ranked_table(results, configs, lengths, args.top))
    print("\nwhy each layout won or lost:")
    print(report.layout_table(results, outs, slo))
    win = rank[0]
    path = report.winner_config(win, configs[win.candidate], slo, out / "best.yaml")
    fig = report.plot(results, slo, out / "capacity_vs_latency.png",
                      f"{base.model.name} on {args.gpus} x {args.gpu}: best of each tp x pp")
    front = show_frontier(args, base, configs, results, win, slo, out)
    _write_json(out, args, results, outs, win, front)
    print(f"\nbest: {win.candidate.name}: {win.qps:.4f} req/s ({win.per_gpu:.5f} per GPU)")
    print(f"  wrote {path} (pp-runtime run/serve --config {path}), {fig}, {out / 'frontier.png'}, "
          f"{out / 'frontier'}/NN.yaml, {out / 'plan.json'}")
    if args.validate:
        from pp_runtime.plan.validate import validate
        return validate(args, front, configs, slo, out)
    return 0


def show_frontier(args, base, configs, results, win, slo, out: Path) -> list:
    """Print the Pareto frontier of the layouts' best points, write its configs, draw it."""
    from pp_runtime.plan import frontier

    points = frontier.layout_points(results)
    front = frontier.pareto(points)
    print(f"\nfrontier: {len(front)} of {len(points)} layouts (none carries more per GPU at a "
          "lower p99 TBT and TTFT):")
    print(frontier.table(front, win))
    frontier.write_configs(front, configs, slo, out)
    frontier.plot(points, front, win, slo, out / "frontier.png",
                  f"{base.model.name} on {args.gpus} x {args.gpu}: each layout's best, the frontier")
    return front


def calibration_line(profile: str) -> str:
    """One line: the calibration the profile carries (the cost model uses it), or none."""
    from pp_runtime.costmodel import calibration

    f = Path(profile).expanduser() / calibration.FILE
    if not f.is_file():
        return (f"calibration: none in {profile} (no {calibration.FILE}, which `pp-runtime profile "
                f"--calibrate N --out {profile}` writes): uncalibrated, predictions run optimistic")
    try:
        keys = sorted(json.loads(f.read_text()))
    except ValueError:
        keys = ["(unreadable)"]
    return f"calibration: {f} ({', '.join(keys)}): used where a candidate's executor, tp and pp match"


def nothing_fits(outs, args) -> str:
    mem = [o for o in outs if o.reason == "memory"]
    if mem and len(mem) == len(outs):
        return (f"no layout of {args.gpus} x {args.gpu} holds the model and the longest request "
                f"(e.g. {mem[-1].name}: {mem[-1].detail}); more GPUs, or more memory per GPU")
    floor = [o for o in outs if o.reason == "SLO"]
    if floor and len(floor) + len(mem) == len(outs):
        return (f"no layout meets the TBT SLO ({floor[0].name}: {floor[0].detail}); a TBT SLO "
                "above that, or faster GPUs")
    return "no deployment can run: " + "; ".join(f"{o.name}: {o.reason}: {o.detail}" for o in outs[:3])


def what_would(results, slo) -> str:
    got = [r.detail for r in results if r.detail]
    if not got:
        return "nothing was probed"
    tbt = min(d.get("tbt_p99_s") or float("inf") for d in got)
    ttft = min(d.get("ttft_p99_s") or float("inf") for d in got)
    return (f"the lowest p99 TBT seen was {tbt * 1e3:.3g} ms (SLO {slo.tbt_s * 1e3:.3g} ms) and "
            f"the lowest p99 TTFT {ttft * 1e3:.3g} ms (SLO {slo.ttft_s * 1e3:.3g} ms): SLOs above "
            "those would be met")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag}: expected numbers >= 1, got {text!r}")
    return values


def _write_json(out: Path, args, results, outs, win, front=()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"deployment": r.candidate.name, "outcome": r.outcome, "capacity_qps": r.qps,
             "per_gpu": r.per_gpu, "bound_qps": r.bound_qps, "seconds": r.seconds,
             "detail": r.detail, "probes": [{"qps": p.qps, "ok": p.ok} for p in r.probes]}
            for r in results]
    (out / "plan.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "best": win.candidate.name if win else None, "results": rows,
        "frontier": [{"deployment": r.candidate.name, "per_gpu": r.per_gpu,
                      "tbt_p99_s": r.detail.get("tbt_p99_s"), "ttft_p99_s": r.detail.get("ttft_p99_s")}
                     for r in front],
        "left_out": [vars(o) for o in outs]}, indent=1, default=str))
