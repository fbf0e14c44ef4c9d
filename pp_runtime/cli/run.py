"""`pp-runtime run`: generate for random prompts on a pipeline and print one line per
micro-batch, the requests, and the per-stage table; with --workload, the config's workload.
Here too what it checks and prints first: its base config, the one-line description of
what starts, its prompt arguments (checked before any worker starts)."""
from __future__ import annotations

import random
import time
from pathlib import Path

from pp_runtime.cli.common import (RUN_DEFAULT_CONFIG, add_config_args, add_slo_args, config_from_args,
                                   non_negative_float, non_negative_int, positive_int, report_kept,
                                   run_base_config)
from pp_runtime.cli.simulate import run_to, workload_report
from pp_runtime.config import Config, ConfigError
from pp_runtime.costmodel.memory import kv_blocks, kv_cache_bytes
from pp_runtime.core.request import SamplingParams


def describe_microbatch(mb, out) -> str:
    """One line: the first prefill chunk (and how many more were packed beside it), the
    decodes and their KV lengths, the tokens, and the stage-time sum of TP rank 0."""
    prefill = [s for s in mb.seqs if not s.is_decode]
    decodes = [s for s in mb.seqs if s.is_decode]
    parts = [f"mb {mb.mb_id:4d}"]
    if prefill:
        s = prefill[0]
        more = f" +{len(prefill) - 1} packed" if len(prefill) > 1 else ""
        parts.append(f"prefill r{s.request_id} [{s.start}:{s.kv_len}) {s.num_tokens:4d} tok{more}")
    else:
        parts.append(f"{'no prefill':>24s}")
    kv = f" (kv {min(s.kv_len for s in decodes)}..{max(s.kv_len for s in decodes)})" if decodes else ""
    parts.append(f"{len(decodes):3d} decodes{kv}")
    parts.append(f"{mb.num_tokens:4d} tokens")
    parts.append(f"{sum(t.compute_s for t in out.timings if t.tp_rank == 0) * 1e3:7.1f} ms")
    return " | ".join(parts)


# The main job (`run` without --config / --checkpoint) has a steady state: its requests
# arrive at Poisson times at 70 % of the pipeline's capacity on the 2-core machine (the rate
# at which its busiest stage would never rest, as benchmarks/steady_state.py measures it:
# `run --qps 0 --requests 16`), so its bubble is read over the steady window apart from the
# warm-up and the tail (docs/bubbles.md, docs/measurements/steady_state.md)
MAIN_JOB_REQUESTS = 20
MAIN_JOB_QPS = 1.6  # 16 requests at once: stage 1 busy 6.91 s -> 2.32 req/s; 70 % of it


def is_main_job(args) -> bool:
    return not args.config and not args.checkpoint


def run_arrivals(args, n: int, seed: int) -> tuple[list[float] | None, float | None]:
    """(arrival times of `run`'s n requests, their rate): Poisson at --qps (default: the main
    job's rate, else all at time 0; --qps 0: all at time 0), seeded by --seed."""
    qps = args.qps if args.qps is not None else (MAIN_JOB_QPS if is_main_job(args) else None)
    if not qps:
        return None, None
    import numpy as np

    from pp_runtime.core.workload import poisson_arrivals
    return [float(a) for a in poisson_arrivals(np.random.default_rng(seed), qps, n)], qps


def what_runs(cfg: Config, args) -> str:
    """One line, printed before anything starts: processes, where, transport, weights
    (executor and device as `executors.resolve` decides them for `make_executor`)."""
    from pp_runtime.executors import resolve

    m, p, rt = cfg.model, cfg.parallel, cfg.runtime
    executor, device = resolve(cfg)
    ranks = f"{p.pp} pipeline stage{'s' if p.pp > 1 else ''}"
    ranks += f" x {p.tp} TP ranks" if p.tp > 1 else ""
    weights = f"weights from {args.checkpoint}" if args.checkpoint else "random weights"
    source = (f"config {args.config} + checkpoint {args.checkpoint}" if args.checkpoint and args.config
              else f"checkpoint {args.checkpoint}" if args.checkpoint else
              f"config {args.config}" if args.config else
              f"config {RUN_DEFAULT_CONFIG}, the default; --config default runs in this process")
    if executor != "ray":
        return f"{ranks} in this process ({device}), {m.name} shapes with {weights} [{source}]"
    if device is not None:  # a Ray started here
        threads = rt.threads_per_worker
        how = ("NCCL, one GPU each" if device.startswith("cuda") else "gloo, CPU" + (
            f", {threads} torch thread{'s' if threads != 1 else ''} each" if threads else ""))
        where = f"127.0.0.1 ({how})"
    else:
        where = f"the Ray cluster at {rt.ray_address} (NCCL on GPUs, else gloo)"
    from pp_runtime.executors.local_ray import start_log
    return (f"{ranks} as {p.tp * p.pp} Ray actor{'s' if p.tp * p.pp > 1 else ''} on {where}, "
            f"{m.name} shapes with {weights} [{source}]; Ray's start-up output: {start_log()}")


def run_prompt_args(args, seq_len: int) -> tuple[int, int, int]:
    """`run`'s requests and prompt lengths (n, shortest, longest), checked against each
    other and the context before anything starts. Unset lengths fit the context: the
    longest prompt defaults to min(600, context - max_tokens), the shortest to min(32, it);
    lengths the user gave are never clipped silently. (Each flag's own range, >= 1, is
    checked as argparse parses it: `positive_int`.)"""
    def bad(flag: str, problem: str) -> ConfigError:
        return ConfigError(f"{flag}: {problem}")
    n = args.requests if args.requests is not None else (
        MAIN_JOB_REQUESTS if is_main_job(args) else 8)
    problems = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p).problems()
    if problems:
        raise bad("--temperature/--top-p", problems[0])
    room = seq_len - args.max_tokens  # positions left for a prompt
    if room < 1:
        raise bad("--max-tokens", f"{args.max_tokens} leaves no room for a prompt in the "
                  f"{seq_len}-token context; lower it")
    hi = min(600, room) if args.max_prompt is None else args.max_prompt
    lo = min(32, hi) if args.min_prompt is None else args.min_prompt
    if hi < lo:
        raise bad("--max-prompt", f"{hi} is below --min-prompt {lo}")
    if hi > room:
        raise bad("--max-prompt", f"{hi} + --max-tokens {args.max_tokens} exceeds the "
                  f"{seq_len}-token context; use --max-prompt {room} or less")
    return n, lo, hi


def kv_cache_text(cfg: Config) -> str:
    """The KV cache in one phrase: blocks, tokens, and bytes over all workers."""
    c, blocks = cfg.cache, kv_blocks(cfg)
    kind = "paged" if c.paged else f"{cfg.num_slots} slots of {cfg.seq_len} tokens"
    return (f"KV cache {blocks} blocks x {c.block_size} tokens ({kind}) = "
            f"{kv_cache_bytes(cfg) / 2**20:.0f} MiB")


def add_parser(sub) -> None:
    run = sub.add_parser("run", help="generate on a pipeline: one line per micro-batch, then "
                                     "the per-stage table",
                         description="Generate for random prompts and print one line per "
                                     "micro-batch, the requests, and the report's summary ending "
                                     "with the per-stage table (busy, transfer, bubble by cause, "
                                     "idle). Without --config or --checkpoint it runs "
                                     f"{RUN_DEFAULT_CONFIG}: 2 pipeline stages as Ray actors on "
                                     "127.0.0.1 (gloo on a CPU, NCCL with a GPU per stage), "
                                     "GPT-2-small shapes with random weights.")
    add_config_args(run, f"{RUN_DEFAULT_CONFIG} (2 Ray stage actors); 'default' = all in this process")
    add_slo_args(run)
    run.add_argument("--checkpoint",
                     help="Hugging Face-format model directory: its shapes and weights, with "
                          "--config's other sections (alone: pp=1 in this process)")
    run.add_argument("--requests", type=positive_int, default=None,
                     help="requests (default 8; the main job, without --config: 20)")
    run.add_argument("--qps", type=non_negative_float, default=None,
                     help="Poisson arrivals per second (default: all at once; the main job, "
                          "without --config: 1.6); 0: all at once")
    run.add_argument("--min-prompt", type=positive_int, default=None,
                     help="shortest random prompt (default: min(32, --max-prompt))")
    run.add_argument("--max-prompt", type=positive_int, default=None,
                     help="longest random prompt (default: min(600, context - max tokens))")
    run.add_argument("--max-tokens", type=positive_int, default=24)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=non_negative_int, default=None,
                     help="sampling / workload seed (default 0)")
    run.add_argument("--planner", help="planner.planner (sarathi, uniform, orca-best, ...)")
    run.add_argument("--workload", action="store_true",
                     help="run the config's workload section (as simulate does) instead of "
                          "random prompts; --requests and --seed then set workload fields")
    run.add_argument("--out", help="report directory (default: runs/run-MODEL-PLANNER)")
    run.add_argument("--quiet", action="store_true", help="no per-micro-batch lines")
    run.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from pp_runtime.engine.llm import LLM, run_requests  # torch: only where a command needs it
    from pp_runtime.telemetry.report import format_summary, write_report

    if args.workload:
        return _run_config_workload(args)
    t0 = time.perf_counter()
    cfg = config_from_args(args, run_base_config(args), flags=("planner",))
    n, lo, hi = run_prompt_args(args, cfg.seq_len)  # before anything starts
    arrivals, qps = run_arrivals(args, n, args.seed or 0)
    print(what_runs(cfg, args), flush=True)
    llm = LLM(cfg, checkpoint=args.checkpoint)
    cfg = llm.config
    m, p = cfg.model, cfg.parallel
    print(f"model {m.name} ({m.family}, {m.num_layers} layers, hidden {m.hidden_size}, "
          f"{m.num_params() / 1e6:.1f}M params, {m.dtype}) on {llm.executor.describe()}, "
          f"tp={p.tp} pp={p.pp}, planner {cfg.planner.planner}: chunk {cfg.planner.chunk_size}, "
          f"B={cfg.planner.max_batch_size or '-'}; {kv_cache_text(cfg)}; "
          f"ready in {time.perf_counter() - t0:.1f} s")
    seed = args.seed or 0
    rng = random.Random(seed)
    prompts = [[rng.randrange(m.vocab_size) for _ in range(rng.randint(lo, hi))]
               for _ in range(n)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=seed)
    print(f"{n} requests, prompts of {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"tokens, {args.max_tokens} new tokens each" + (
              f", Poisson arrivals at {qps:g} req/s over {arrivals[-1]:.1f} s" if qps else ""))

    def on_microbatch(mb, out):
        if not args.quiet:
            print(describe_microbatch(mb, out), flush=True)

    try:  # the partial-result rule: engine/llm.run_requests
        run = run_requests(llm, prompts, params, arrivals, on_microbatch)
        failed = run.failure  # a dead worker, not recovered: the report first, then raised
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM
        if not hasattr(exc, "result"):  # interrupted before the requests were added
            raise
        run, failed = exc.result, exc
    finally:
        llm.shutdown()
    outputs, elapsed = run.requests, run.run_wall_s
    print(f"\n{'req':>4} {'prompt':>6} {'output':>6} {'finish':>7} {'ttft_s':>7} first tokens")
    for o in outputs:
        ttft = "-" if o.first_token_s is None else f"{o.first_token_s:7.2f}"
        print(f"{o.request_id:4d} {len(o.prompt_token_ids):6d} {len(o.token_ids):6d} "
              f"{o.finish_reason.value:>7} {ttft:>7} {o.token_ids[:8]}")
    n_out = sum(len(o.token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    out_dir = Path(args.out or f"runs/run-{m.name}-{cfg.planner.planner}")
    stopped = run.interrupted_by
    with report_kept(out_dir):  # a signal now waits for the report, then exits 130 / 143
        report = write_report(run, out_dir)
    print(f"\n{n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s "
          f"({(n_in + n_out) / elapsed:.0f} tok/s); {'partial ' * bool(stopped)}reports and "
          f"plots in {out_dir}/")
    print(f"\n{format_summary(report)}")  # last: the run ends with the per-stage table
    if failed:
        failed.report_dir = out_dir
        raise failed
    return 0


def _run_config_workload(args) -> int:
    """`run --workload`: the config's workload section on the real runtime, like simulate
    (without --config: the default 2-stage pipeline's workload)."""
    if not args.config and not args.checkpoint:
        args.config = RUN_DEFAULT_CONFIG

    def to(cfg: Config, out: Path, progress: bool) -> dict:  # the checkpoint's weights
        return run_to(cfg, out, progress, args.checkpoint)
    report = workload_report(args, to, "run", "ran")
    return 1 if report["summary"]["finish_reasons"].get("error") else 0

