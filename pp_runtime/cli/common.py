"""What every command shares: --config / --set / workload flags, the one way arguments
become a `Config` (`config_from_args`), the one way a number flag is range-checked (argparse
`type=` functions: `positive_int`, `positive_float`, ...; `Parser` prints what they reject
as one `error: --flag: problem` line, exit 2), and the report a stopped run still writes."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from pp_runtime.config import Config, ConfigError, load_config
from pp_runtime.core import interrupt

RUN_DEFAULT_CONFIG = "cpu/gpt2_pp2"  # `run` and `serve` without --config / --checkpoint: a real pipeline

# named flags -> the config fields they set (a command lists the ones it has: `run`'s
# --requests and --seed are its prompts' count and sampling seed, not workload fields)
FLAG_FIELDS = {"planner": "planner", "requests": "workload.num_requests",
               "seed": "workload.seed", "qps": "workload.qps",
               "tbt_slo_ms": "planner.tbt_slo_ms", "ttft_slo_ms": "planner.ttft_slo_ms"}
SLO_FLAGS = ("tbt_slo_ms", "ttft_slo_ms")  # every command with add_slo_args: always read


# ---- number flags: checked as argparse parses them -----------------------------------------
def number(kind: type, low: float, strict: bool = False, high: float | None = None):
    """An argparse `type=` that parses `kind` (int or float) and checks low <= value (low <
    value if strict, and <= high if given); argparse names the flag in the error."""
    what = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return value
    parse.__name__ = what  # argparse's "invalid <name> value" if ever reached
    return parse


positive_int = number(int, 1)
non_negative_int = number(int, 0)
positive_float = number(float, 0, strict=True)
non_negative_float = number(float, 0)


class Parser(argparse.ArgumentParser):
    """argparse whose subcommands share it (`add_subparsers` builds them of this class): a
    flag's bad value is one line, `error: --flag: problem`, and exit 2, as every other
    bad input (docs/errors.md); other usage errors add argparse's usage line."""

    def error(self, message: str):
        if message.startswith("argument "):  # "argument --qps: must be >= 0, got -1"
            message = message.removeprefix("argument ")
        else:
            self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


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


def config_from_args(args, base: Config | str | None = None, *, flags: tuple[str, ...] = (),
                     planner: str | None = None, defaults: dict[str, Any] | None = None) -> Config:
    """The one way a command's arguments become a `Config`, in this order (later wins):
    `base` (a Config, or a config name or path; default --config, else `Config()`), the
    command's own `defaults`, every --set FIELD=VALUE, then the named flags in `flags` that
    were given (FLAG_FIELDS; --trace FILE sets the workload to that trace) and `planner`."""
    overrides = dict(defaults or {})
    overrides.update(parse_overrides(getattr(args, "set", None) or []))
    for flag in (*flags, *SLO_FLAGS):
        value = getattr(args, flag, None)
        if value is not None and flag == "trace":
            overrides.update({"workload.kind": "trace", "workload.trace": value})
        elif value is not None:
            overrides[FLAG_FIELDS[flag]] = value
    if planner:
        overrides["planner"] = planner
    base = base if base is not None else getattr(args, "config", None)
    if isinstance(base, Config):
        cfg = base.with_overrides(**overrides) if overrides else base.validate()
    else:
        cfg = load_config(base, **overrides) if base else Config().with_overrides(**overrides)
    if "requests" in flags and args.requests is not None and cfg.workload.kind == "trace":
        raise ConfigError(f"--requests {args.requests}: a trace workload has its own requests "
                          f"(every line of {cfg.workload.trace}); drop --requests, or cut the "
                          "trace file")
    return cfg


def run_base_config(args) -> Config:
    """The config `run` starts from: --config (the default 2-stage Ray pipeline without
    one; not `Config()`, which runs in this process), with the model section taken from
    --checkpoint when one is given. A checkpoint alone runs in this process (pp=1 unless
    --set pp), as LLM.from_pretrained does."""
    if args.checkpoint and not args.config:
        return with_checkpoint_model(Config(), args.checkpoint)
    return with_checkpoint_model(load_config(args.config or RUN_DEFAULT_CONFIG), args.checkpoint)


def with_checkpoint_model(cfg: Config, checkpoint: str | None) -> Config:
    """cfg with its model section read from a checkpoint's config.json (shapes, dtype auto):
    a config and a checkpoint compose like every other override; the config's other
    sections (parallel, planner, runtime, workload) are kept."""
    if not checkpoint:
        return cfg
    import dataclasses

    from pp_runtime.model.hf_config import model_config_from_hf, read_hf_config  # no torch

    model = model_config_from_hf(read_hf_config(checkpoint), name=Path(checkpoint).name,
                                 where=f"{checkpoint}/config.json")
    return dataclasses.replace(cfg, model=model)


def add_config_args(sp, default: str = "built-in") -> None:
    """--config and --set, for every command that reads a config."""
    sp.add_argument("--config", help=f"YAML config (path or shipped name); default: {default}")
    sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a config field, e.g. --set chunk_size=64 (repeatable)")


def add_slo_args(sp) -> None:
    """--tbt-slo-ms, --ttft-slo-ms: the latency targets `uniform` sizes micro-batches by."""
    sp.add_argument("--tbt-slo-ms", type=positive_float, default=None,
                    help="p99 time-between-tokens target, ms (planner.tbt_slo_ms): uniform fills "
                         "each micro-batch so a decode's round stays within it; default none: "
                         "the throughput knee")
    sp.add_argument("--ttft-slo-ms", type=positive_float, default=None,
                    help="p99 time-to-first-token target, ms (planner.ttft_slo_ms)")


def add_workload_args(sp) -> None:
    """--requests, --seed (workload fields), --out, --quiet: simulate, compare, run --workload."""
    sp.add_argument("--requests", type=positive_int, help="workload.num_requests")
    sp.add_argument("--seed", type=non_negative_int, help="workload.seed")
    sp.add_argument("--out", help="output directory (default: under runs/)")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")


def printable(text: str) -> str:
    """`text` with every control character but newline and tab shown as `\\xNN`."""
    return "".join(c if c in "\n\t" or (c.isprintable() and not 0x7f <= ord(c) <= 0x9f)
                   else f"\\x{ord(c):02x}" for c in text)


@contextlib.contextmanager
def report_kept(out: Path):
    """Ctrl-C or SIGTERM while the report is written waits until it is (a few seconds;
    `interrupt.deferred`), then stops the command with the report in `out`."""
    try:
        with interrupt.deferred():
            yield
    except KeyboardInterrupt as exc:
        exc.report_dir, exc.report_written = out, True
        raise


@contextlib.contextmanager
def partial_report(out: Path):
    """Write the partial result an interrupted run attached (`exc.result`, from simulate
    or run_workload) to out, and re-raise with the report attached (`exc.report`)."""
    from pp_runtime.telemetry.report import write_report

    try:
        yield
    except KeyboardInterrupt as exc:
        if getattr(exc, "result", None) is not None:
            exc.report, exc.report_dir = write_report(exc.result, out), out
        raise

