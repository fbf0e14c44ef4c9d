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
import os
import sys
import traceback

from pp_runtime.cli import bench, memory, plan, profile, run, serve, simulate
from pp_runtime.cli.common import Parser
from pp_runtime.config import CheckpointError, ConfigError
from pp_runtime.core import interrupt
from pp_runtime.core.driver import ExecutorFailed
from pp_runtime.core.errors import WorkerFailed
from pp_runtime.core.request import InvalidRequestError


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pp-runtime", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="Exit codes: 0 done, 1 the run failed (a worker died), 2 bad input (the "
                      "message names it), 130 / 143 interrupted by Ctrl-C / SIGTERM. "
                      "docs/errors.md")
    p.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error (also PP_RUNTIME_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)
    run.add_parser(sub)
    memory.add_parser(sub)
    simulate.add_parsers(sub)
    profile.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    # Ray's C++ core worker would take SIGTERM over in this process (a stack dump, then
    # SIGABRT 3 s later) even when ray.init runs off the main thread (serve), where no
    # Python handler can be put back; its switch is read when ray is imported: set it first
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    with interrupt.handled():  # SIGTERM ends a command as Ctrl-C does (pp_runtime/core/interrupt.py)
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help (0); a bad flag (2: one `error: --flag: ...` line)
            return exc.code if isinstance(exc.code, int) else 2
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
