"""`pp-runtime simulate`, `compare` and `report`: a config's workload on the simulator or the
real runtime, several side by side, and a finished run printed and plotted again."""
from __future__ import annotations

from pathlib import Path

from pp_runtime.cli.common import (add_config_args, add_slo_args, add_workload_args, config_from_args,
                                   partial_report, printable, report_kept,
                                   with_checkpoint_model)
from pp_runtime.config import Config, ConfigError

WORKLOAD_FLAGS = ("planner", "requests", "seed")


def add_parsers(sub) -> None:
    sim = sub.add_parser("simulate", help="run a workload on the pipeline simulator")
    add_config_args(sim)
    sim.add_argument("--planner", help="planner.planner (sarathi, uniform, orca-best, ...)")
    add_slo_args(sim)
    add_workload_args(sim)
    sim.set_defaults(func=cmd_simulate)

    cmp = sub.add_parser("compare", help="several planners / deployments on one workload")
    cmp.add_argument("--config", action="append", required=True, metavar="FILE[@PLANNER]",
                     help="a deployment (repeatable); @PLANNER runs it with that planner only")
    cmp.add_argument("--planners", help="comma-separated planners for configs without @")
    cmp.add_argument("--simulate", action="store_true",
                     help="on the simulator (default: on the real runtime)")
    cmp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="override a field of every config (repeatable)")
    add_workload_args(cmp)
    add_slo_args(cmp)
    cmp.set_defaults(func=cmd_compare)

    rep = sub.add_parser("report", help="re-print and re-plot a finished run")
    rep.add_argument("dir", help="a directory written by simulate / run / compare")
    rep.set_defaults(func=cmd_report)


def workload_report(args, to, kind: str, verb: str) -> dict:
    """The config's workload through `to` (_simulate_to or run_to); prints the summary."""
    from pp_runtime.telemetry.report import format_summary

    cfg = config_from_args(args, flags=WORKLOAD_FLAGS)
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


def _simulate_to(cfg: Config, out: Path, progress: bool = True) -> dict:
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.telemetry.report import write_report

    with partial_report(out):
        run = simulate(cfg, progress=progress)
    with report_kept(out):
        return write_report(run, out)


def run_to(cfg: Config, out: Path, progress: bool = True, checkpoint: str | None = None) -> dict:
    """cfg's workload on the real runtime (a checkpoint's weights, else random ones); a
    progress bar counts generated tokens."""
    from tqdm import tqdm

    from pp_runtime.engine.llm import run_workload
    from pp_runtime.telemetry.report import write_report
    from pp_runtime.core.workload import generate

    total = sum(s.output_len for s in generate(cfg.workload))
    with partial_report(out), tqdm(total=total, unit="tok", disable=not progress, leave=False,
                                    desc=f"run {cfg.planner.planner}") as bar:
        run = run_workload(cfg, checkpoint,
                           on_microbatch=lambda mb, res: bar.update(len(res.tokens)))
    with report_kept(out):
        return write_report(run, out)


def cmd_simulate(args) -> int:
    workload_report(args, _simulate_to, "simulate", "simulated")
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
    configs = [(config, config_from_args(args, config, flags=WORKLOAD_FLAGS, planner=planner))  # all checked before any runs
               for config, planner in _run_specs(args)]
    for config, cfg in configs:
        label = f"{Path(config).stem}-{cfg.planner.planner}"
        print(f"== {label}: {cfg.model.name} tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
              f"dp={cfg.parallel.dp}, B={cfg.planner.max_batch_size or '-'}, "
              f"{cfg.workload.num_requests} requests", flush=True)
        report = (_simulate_to if args.simulate else run_to)(cfg, out / label, not args.quiet)
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

