"""`pp-runtime`: the command line.

  pp-runtime run      generate on a model and print one line per micro-batch, then the
                      per-stage table; default: a 2-stage pipeline of Ray actors on
                      127.0.0.1 (cpu/gpt2_pp2: GPT-2-small shapes, random weights)
  pp-runtime memory   the paper's batch-size formula for a config and device memory
  pp-runtime simulate run a workload on the profile-driven pipeline simulator, write reports
  pp-runtime compare  run several planners / deployments on one workload, print ratios
  pp-runtime report   re-print and re-plot a finished run directory
  pp-runtime profile  measure this machine's operation times into a profile the simulator loads
  pp-runtime serve    an OpenAI-compatible HTTP server over the pipeline (streaming,
                      /health, /metrics); 127.0.0.1 unless --host
  pp-runtime bench serve  load generator and capacity search against `pp-runtime serve`
  pp-runtime plan     the best deployment (tp, pp, replicas, chunk, B, planner) for a model,
                      a cluster and an SLO, searched on the simulator (docs/plan.md)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
import traceback
from pathlib import Path

import yaml

from pp_runtime import interrupt
from pp_runtime.config import CheckpointError, Config, ConfigError, load_config
from pp_runtime.errors import WorkerFailed
from pp_runtime.memory import kv_capacity, memory_plan
from pp_runtime.workload import generate as generate_workload
from pp_runtime.driver import ExecutorFailed
from pp_runtime.request import InvalidRequestError, SamplingParams
from pp_runtime.cli_run import (RUN_DEFAULT_CONFIG, describe_microbatch, kv_cache_text,
                                run_arrivals, run_base_config, run_prompt_args, what_runs,
                                with_checkpoint_model)


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected FIELD=VALUE, e.g. --set chunk_size=64")
        key, value = pair.split("=", 1)
        try:
            out[key] = yaml.safe_load(value)  # "64" -> 64, "true" -> True, "null" -> None
        except yaml.YAMLError as exc:
            problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
            raise ConfigError(f"--set {pair!r}: the value is not valid YAML ({problem}); "
                              "quote a string value, e.g. --set 'name=\"[x\"'") from exc
    return out


def _config(args) -> Config:
    overrides = parse_overrides(args.set)
    if args.config:
        return load_config(args.config, **overrides)
    return Config().with_overrides(**overrides) if overrides else Config()


def cmd_run(args) -> int:
    from pp_runtime.llm import LLM  # torch is imported only by commands that need it
    from pp_runtime.telemetry.recorder import RunRecorder
    from pp_runtime.telemetry.report import RunResult, format_summary, write_report

    if args.workload:
        return _run_config_workload(args)
    t0 = time.perf_counter()
    overrides = parse_overrides(args.set)
    if args.planner:
        overrides["planner"] = args.planner
    base = run_base_config(args)
    cfg = base.with_overrides(**overrides) if overrides else base.validate()
    n, lo, hi = run_prompt_args(args, cfg.seq_len)  # before anything starts
    arrivals, qps = run_arrivals(args, n, args.seed or 0)
    print(what_runs(cfg, args), flush=True)
    llm = LLM(cfg, checkpoint=args.checkpoint)
    cfg = llm.config
    m, p = cfg.model, cfg.parallel
    print(f"model {m.name} ({m.family}, {m.num_layers} layers, hidden {m.hidden_size}, "
          f"{m.num_params() / 1e6:.1f}M params, {m.dtype}) on {llm.executor.describe()}, "
          f"tp={p.tp} pp={p.pp}, planner {cfg.planner.planner}: chunk {cfg.planner.chunk_size}, "
          f"B={cfg.planner.max_batch_size}; {kv_cache_text(cfg)}; "
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
    rec, executor, failed = RunRecorder(time.perf_counter), llm.executor.name, None
    device = str(llm.executor.device)  # resolved: "cpu" or "cuda", not the config's "auto"

    def on_microbatch(mb, out):
        rec(mb, out)
        if not args.quiet:
            print(describe_microbatch(mb, out), flush=True)

    t1 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, on_microbatch=on_microbatch, arrival_s=arrivals)
    except (ExecutorFailed, KeyboardInterrupt) as exc:  # a dead worker; Ctrl-C or SIGTERM
        if not hasattr(exc, "outputs"):  # interrupted before the requests were added
            raise
        outputs, failed = exc.outputs, exc
    finally:
        llm.shutdown()
    elapsed = time.perf_counter() - t1
    print(f"\n{'req':>4} {'prompt':>6} {'output':>6} {'finish':>7} {'ttft_s':>7} first tokens")
    for o in outputs:
        ttft = "-" if o.first_token_s is None else f"{o.first_token_s:7.2f}"
        print(f"{o.request_id:4d} {len(o.prompt_token_ids):6d} {len(o.token_ids):6d} "
              f"{o.finish_reason.value:>7} {ttft:>7} {o.token_ids[:8]}")
    n_out = sum(len(o.token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    out_dir = Path(args.out or f"runs/run-{m.name}-{cfg.planner.planner}")
    stopped = _stopped_by(failed)
    with _report_kept(out_dir):  # a signal now waits for the report, then exits 130 / 143
        report = write_report(RunResult(cfg, executor, outputs, [rec], elapsed, device=device,
                                        interrupted_by=stopped), out_dir)
    print(f"\n{n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s "
          f"({(n_in + n_out) / elapsed:.0f} tok/s); {'partial ' * bool(stopped)}reports and "
          f"plots in {out_dir}/")
    print(f"\n{format_summary(report)}")  # last: the run ends with the per-stage table
    if failed:
        failed.report_dir = out_dir
        raise failed
    return 0


@contextlib.contextmanager
def _report_kept(out: Path):
    """Ctrl-C or SIGTERM while the report is written waits until it is (a few seconds;
    `interrupt.deferred`), then stops the command with the report in `out`."""
    try:
        with interrupt.deferred():
            yield
    except KeyboardInterrupt as exc:
        exc.report_dir, exc.report_written = out, True
        raise


def _stopped_by(exc: BaseException | None) -> str | None:
    """What a report's `interrupted_by` says: SIGINT, SIGTERM, worker failure, or None."""
    if exc is None:
        return None
    return interrupt.signal_name(exc) if isinstance(exc, KeyboardInterrupt) else "worker failure"


@contextlib.contextmanager
def _partial_report(out: Path):
    """Write the partial result an interrupted run attached (`exc.result`, from simulate
    or run_workload) to out, and re-raise with the report attached (`exc.report`)."""
    from pp_runtime.telemetry.report import write_report

    try:
        yield
    except KeyboardInterrupt as exc:
        if getattr(exc, "result", None) is not None:
            exc.report, exc.report_dir = write_report(exc.result, out), out
        raise


def _run_config_workload(args) -> int:
    """`run --workload`: the config's workload section on the real runtime, like simulate
    (without --config: the default 2-stage pipeline's workload)."""
    if not args.config and not args.checkpoint:
        args.config = RUN_DEFAULT_CONFIG

    def to(cfg: Config, out: Path, progress: bool) -> dict:  # the checkpoint's weights
        return _run_to(cfg, out, progress, args.checkpoint)
    report = _workload_report(args, to, "run", "ran")
    return 1 if report["summary"]["finish_reasons"].get("error") else 0


def _workload_report(args, to, kind: str, verb: str) -> dict:
    """The config's workload through `to` (_simulate_to or _run_to); prints the summary."""
    from pp_runtime.telemetry.report import format_summary

    cfg = config_from_args(args.config, args)
    if getattr(args, "checkpoint", None):  # `run --workload --checkpoint DIR`: its shapes
        cfg = with_checkpoint_model(cfg, args.checkpoint).validate()
    out = Path(args.out or f"runs/{kind}-{cfg.model.name}-{cfg.planner.planner}")
    try:
        report = to(cfg, out, not args.quiet)
    except KeyboardInterrupt as exc:  # the partial report: written by `to`, printed here
        if getattr(exc, "report", None) is not None:
            print(format_summary(exc.report), flush=True)
        raise
    print(format_summary(report))
    print(f"  {verb} in {report['summary']['run_wall_s']:.1f} s; reports and plots in {out}/")
    return report


def cmd_memory(args) -> int:
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        raise ConfigError(f"--device-memory-gb: must be > 0, got {args.device_memory_gb}")
    cfg = _config(args)
    gb = args.device_memory_gb if args.device_memory_gb is not None else cfg.cache.device_memory_gb
    print(f"{cfg.model.name}: tp={cfg.parallel.tp} pp={cfg.parallel.pp}, "
          f"utilization {cfg.cache.memory_utilization}")
    if gb is not None:  # the paper's formula needs a device size; the blocks do not
        plan = memory_plan(cfg, gb)
        print(plan.summary())
        if why := _why_no_batch(plan, cfg.parallel.pp):
            print(f"  {why}")
    lengths = [s.prompt_len + s.output_len for s in generate_workload(cfg.workload)]
    print(kv_capacity(cfg, lengths, gb).summary())
    return 0


def _why_no_batch(plan, pp: int) -> str | None:
    """Why B (or B per micro-batch) is 0, and what would change it; None when it is not."""
    gib, free = 2**30, plan.device_bytes - plan.param_bytes
    if plan.max_requests == 0:
        room = (f"the weights ({plan.param_bytes / gib:.2f} GiB) do not fit in the usable "
                f"{plan.device_bytes / gib:.2f} GiB" if free <= 0 else
                f"after the weights {free / gib:.2f} GiB are left, less than one request's KV "
                f"({plan.seq_len * plan.kv_bytes_per_token / gib:.2f} GiB for L={plan.seq_len})")
        fixes = "a device with more memory, more tp or pp, a smaller dtype" + (
            "" if free <= 0 else " or a shorter max_seq_len")
        return f"B=0: {room}; no request fits: use {fixes}"
    if plan.batch_per_microbatch == 0:
        return (f"0 per micro-batch: {plan.max_requests} requests fit, fewer than the {pp} "
                "micro-batches in flight; use more memory per device or fewer stages")
    return None


def config_from_args(config: str | None, args, planner: str | None = None) -> Config:
    overrides = parse_overrides(args.set)
    if planner or getattr(args, "planner", None):
        overrides["planner"] = planner or args.planner
    if args.requests is not None:
        overrides["workload.num_requests"] = args.requests
    if args.seed is not None:
        overrides["workload.seed"] = args.seed
    cfg = load_config(config, **overrides) if config else Config().with_overrides(**overrides)
    if args.requests is not None and cfg.workload.kind == "trace":
        raise ConfigError(f"--requests {args.requests}: a trace workload has its own requests "
                          f"(every line of {cfg.workload.trace}); drop --requests, or cut the "
                          "trace file")
    return cfg


def _simulate_to(cfg: Config, out: Path, progress: bool = True) -> dict:
    from pp_runtime.simulate import simulate
    from pp_runtime.telemetry.report import write_report

    with _partial_report(out):
        run = simulate(cfg, progress=progress)
    with _report_kept(out):
        return write_report(run, out)


def _run_to(cfg: Config, out: Path, progress: bool = True, checkpoint: str | None = None) -> dict:
    """cfg's workload on the real runtime (a checkpoint's weights, else random ones); a
    progress bar counts generated tokens."""
    from tqdm import tqdm

    from pp_runtime.llm import run_workload
    from pp_runtime.telemetry.report import write_report
    from pp_runtime.workload import generate

    total = sum(s.output_len for s in generate(cfg.workload))
    with _partial_report(out), tqdm(total=total, unit="tok", disable=not progress, leave=False,
                                    desc=f"run {cfg.planner.planner}") as bar:
        run = run_workload(cfg, checkpoint,
                           on_microbatch=lambda mb, res: bar.update(len(res.tokens)))
    with _report_kept(out):
        return write_report(run, out)


def cmd_simulate(args) -> int:
    _workload_report(args, _simulate_to, "simulate", "simulated")
    return 0


def _run_specs(args) -> list[tuple[str, str | None]]:
    """(config, planner) pairs: CONFIG@PLANNER pins a planner, else every --planners entry
    (default: the config's own planner)."""
    planners = [p for p in (args.planners or "").split(",") if p] or [None]
    specs = []
    for config in args.config:
        name, _, pinned = config.partition("@")
        specs += [(name, pinned)] if pinned else [(name, p) for p in planners]
    return specs


def cmd_compare(args) -> int:
    from pp_runtime.telemetry.compare import compare_runs
    from pp_runtime.telemetry.report import format_summary

    out = Path(args.out or "runs/compare")
    runs = []
    configs = [(config, config_from_args(config, args, planner))  # all checked before any runs
               for config, planner in _run_specs(args)]
    for config, cfg in configs:
        label = f"{Path(config).stem}-{cfg.planner.planner}"
        print(f"== {label}: {cfg.model.name} tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
              f"dp={cfg.parallel.dp}, B={cfg.planner.max_batch_size}, "
              f"{cfg.workload.num_requests} requests", flush=True)
        report = (_simulate_to if args.simulate else _run_to)(cfg, out / label, not args.quiet)
        print("\n".join(format_summary(report).splitlines()[1:]), flush=True)  # what == named
        runs.append(out / label)
    print(compare_runs(runs, out))
    return 0


def cmd_report(args) -> int:
    from pp_runtime.telemetry.plots import plot_run
    from pp_runtime.telemetry.report import format_summary, read_report

    report = read_report(args.dir)  # ConfigError naming the file when it is not a report
    try:
        summary = format_summary(report)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{args.dir}/report.json: an incomplete or older report: "
                          f"{type(exc).__name__} {exc}; re-run to write it again") from exc
    print(printable(summary))  # report.json may come from elsewhere: no terminal escapes
    try:
        paths = plot_run(args.dir)
    except (OSError, KeyError, ValueError) as exc:  # a csv file missing or cut short
        raise ConfigError(f"{args.dir}: cannot plot: {exc}; re-run to write the run "
                          "directory again") from exc
    for path in paths:
        print(f"  wrote {path}")
    return 0


def printable(text: str) -> str:
    """`text` with every control character but newline and tab shown as `\\xNN`."""
    return "".join(c if c in "\n\t" or (c.isprintable() and not 0x7f <= ord(c) <= 0x9f)
                   else f"\\x{ord(c):02x}" for c in text)


def cmd_profile(args) -> int:
    from pp_runtime.costmodel.measure import measure_profile

    cfg = _config(args)
    if cfg.runtime.threads_per_worker:  # measure as the stage workers will run
        import torch
        torch.set_num_threads(cfg.runtime.threads_per_worker)
    out = Path(args.out or f"runs/profile-{cfg.model.name}")
    t0 = time.perf_counter()
    path = measure_profile(cfg, out, quick=args.quick, progress=not args.quiet)
    print(f"profile of {cfg.model.name} (tp={cfg.parallel.tp}) written to {path}/ in "
          f"{time.perf_counter() - t0:.0f} s; simulate with it: --set hardware.profile={path}")
    if args.calibrate:  # a short real run on the config's executor (docs/costmodel.md)
        from pp_runtime.costmodel.calibrate import calibrate
        from pp_runtime.costmodel.calibration import describe
        print(f"calibration: {describe(calibrate(cfg, path, requests=args.calibrate))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pp-runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Exit codes: 0 done, 1 the run failed (a worker died), "
                                       "2 bad input (the message names it), 130 / 143 "
                                       "interrupted by Ctrl-C / SIGTERM. docs/errors.md")
    p.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error (also PP_RUNTIME_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, default="built-in"):
        sp.add_argument("--config", help=f"YAML config (path or shipped name); default: {default}")
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field, e.g. --set chunk_size=64 (repeatable)")

    run = sub.add_parser("run", help="generate on a pipeline: one line per micro-batch, then "
                                     "the per-stage table",
                         description="Generate for random prompts and print one line per "
                                     "micro-batch, the requests, and the report's summary ending "
                                     "with the per-stage table (busy, transfer, bubble by cause, "
                                     "idle). Without --config or --checkpoint it runs "
                                     f"{RUN_DEFAULT_CONFIG}: 2 pipeline stages as Ray actors on "
                                     "127.0.0.1 (gloo on a CPU, NCCL with a GPU per stage), "
                                     "GPT-2-small shapes with random weights.")
    common(run, f"{RUN_DEFAULT_CONFIG} (2 Ray stage actors); 'default' = all in this process")
    run.add_argument("--checkpoint",
                     help="Hugging Face-format model directory: its shapes and weights, with "
                          "--config's other sections (alone: pp=1 in this process)")
    run.add_argument("--requests", type=int, default=None,
                     help="requests (default 8; the main job, without --config: 20)")
    run.add_argument("--qps", type=float, default=None,
                     help="Poisson arrivals per second (default: all at once; the main job, "
                          "without --config: 1.6); 0: all at once")
    run.add_argument("--min-prompt", type=int, default=None,
                     help="shortest random prompt (default: min(32, --max-prompt))")
    run.add_argument("--max-prompt", type=int, default=None,
                     help="longest random prompt (default: min(600, context - max tokens))")
    run.add_argument("--max-tokens", type=int, default=24)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None, help="sampling / workload seed (default 0)")
    run.add_argument("--planner", help="planner.planner (sarathi, uniform, orca-best, ...)")
    run.add_argument("--workload", action="store_true",
                     help="run the config's workload section (as simulate does) instead of "
                          "random prompts; --requests and --seed then set workload fields")
    run.add_argument("--out", help="report directory (default: runs/run-MODEL-PLANNER)")
    run.add_argument("--quiet", action="store_true", help="no per-micro-batch lines")
    run.set_defaults(func=cmd_run)

    mem = sub.add_parser("memory", help="the paper's max batch size B for a config")
    common(mem)
    mem.add_argument("--device-memory-gb", type=float, default=None,
                     help="memory of one device (default: cache.device_memory_gb of the config)")
    mem.set_defaults(func=cmd_memory)

    def workload(sp):
        sp.add_argument("--requests", type=int, help="workload.num_requests")
        sp.add_argument("--seed", type=int, help="workload.seed")
        sp.add_argument("--out", help="output directory (default: under runs/)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")

    sim = sub.add_parser("simulate", help="run a workload on the pipeline simulator")
    common(sim)
    sim.add_argument("--planner", help="planner.planner (sarathi, uniform, orca-best, ...)")
    workload(sim)
    sim.set_defaults(func=cmd_simulate)

    cmp = sub.add_parser("compare", help="several planners / deployments on one workload")
    cmp.add_argument("--config", action="append", required=True, metavar="FILE[@PLANNER]",
                     help="a deployment (repeatable); @PLANNER runs it with that planner only")
    cmp.add_argument("--planners", help="comma-separated planners for configs without @")
    cmp.add_argument("--simulate", action="store_true",
                     help="on the simulator (default: on the real runtime)")
    cmp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="override a field of every config (repeatable)")
    workload(cmp)
    cmp.set_defaults(func=cmd_compare)

    rep = sub.add_parser("report", help="re-print and re-plot a finished run")
    rep.add_argument("dir", help="a directory written by simulate / run / compare")
    rep.set_defaults(func=cmd_report)

    prof = sub.add_parser("profile", help="measure operation times on this machine")
    common(prof)
    prof.add_argument("--out", help="profile directory (default: runs/profile-MODEL)")
    prof.add_argument("--quick", action="store_true", help="fewer points (about a minute)")
    prof.add_argument("--quiet", action="store_true", help="no progress bar")
    prof.add_argument("--calibrate", type=int, default=0, metavar="N",
                      help="then run N requests on the config's executor (ray) to measure "
                           "contention and host costs into calibration.json")
    prof.set_defaults(func=cmd_profile)

    from pp_runtime.serve.command import add_parser as add_serve  # no fastapi import
    add_serve(sub, common, RUN_DEFAULT_CONFIG)

    from pp_runtime.bench import add_serve_parser  # `pp-runtime bench serve` (pp_runtime/bench.py)
    bench = sub.add_parser("bench", help="benchmarks against a running server: load, capacity")
    add_serve_parser(bench.add_subparsers(dest="bench", required=True))

    from pp_runtime.plan.command import add_parser as add_plan  # pp_runtime/plan/command.py
    add_plan(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    # Ray's C++ core worker would take SIGTERM over in this process (a stack dump, then
    # SIGABRT 3 s later) even when ray.init runs off the main thread (serve), where no
    # Python handler can be put back; its switch is read when ray is imported: set it first
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    with interrupt.handled():  # SIGTERM ends a command as Ctrl-C does (pp_runtime/interrupt.py)
        args = build_parser().parse_args(argv)
        debug = args.debug or os.environ.get("PP_RUNTIME_DEBUG", "") not in ("", "0")
        try:
            return _run_command(args, debug)
        except KeyboardInterrupt as exc:
            if debug:
                traceback.print_exc()
            where = getattr(exc, "report_dir", None)
            print(f"pp-runtime: {interrupt.reason(exc)}: stopped, " + (
                f"after the report was written in {where}/" if getattr(exc, "report_written", False)
                else f"unfinished requests ended with finish reason error; partial report in {where}/"
                if where else "nothing was running yet; no report"), file=sys.stderr)
            return interrupt.exit_code(exc)  # 130 for SIGINT, 143 for SIGTERM


def _run_command(args, debug: bool) -> int:
    """The command; user errors exit 2, a failed run 1 (docs/errors.md)."""
    try:
        return args.func(args)
    except (ConfigError, InvalidRequestError, CheckpointError) as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ExecutorFailed as exc:
        where = getattr(exc, "report_dir", None)
        print(f"error: the run failed, unfinished requests ended with finish reason error: {exc}"
              + (f"; partial report in {where}/" if where else ""), file=sys.stderr)
        return 1
    except WorkerFailed as exc:
        print(f"error: the workers could not start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
