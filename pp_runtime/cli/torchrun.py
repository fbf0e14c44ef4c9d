"""One torchrun process of a deployment: `torchrun ... -m pp_runtime.cli.torchrun`.

    python -m pp_runtime.cli.agent --nnodes N --nproc-per-node G --rdzv-backend c10d \\
        --rdzv-endpoint IP:PORT -m pp_runtime.cli.torchrun --config FILE [--planner P] \\
        [--requests N] [--out DIR]

(`cli/agent.py` is torchrun with its stores bound to one address; plain `torchrun`
runs this module the same way.)

World size must be tp * pp; rank r = stage * tp + tp_rank (torchrun's RANK), so with G
processes per node a node holds G consecutive ranks: keep G a multiple of tp and a stage's
TP group stays inside a node. Every rank builds its stage worker; rank 0 also runs the
planner and the driver over the config's workload (as `pp-runtime run --workload`) and
writes the same report files as the Ray executor, plus `outputs.jsonl`. This module is the
boundary where torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*,
TORCHELASTIC_RESTART_COUNT) is read.

Recovery (docs/recovery.md): rank 0 journals every sampled token to `OUT/journal.jsonl`
(`core/journal.py`) and, when it starts and finds an unfinished journal of the same run
(after torchrun's agent restarted the group, or a rerun), resumes every request from it.
A broken pipeline (a rank dead, or silent past `runtime.step_timeout_s`) makes rank 0
exit 1, so the agent restarts the group within its `--max-restarts`.

Test hook, not configuration: PP_RUNTIME_FAULT="rank=R,after_mb=N[,mode=kill|stop|hang]"
makes rank R, on the first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0), SIGKILL
itself, SIGSTOP itself or sleep forever before its micro-batch N + 1
(tests/executors/test_torchrun_recovery.py).
"""
from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pp_runtime.cli.common import Parser, config_from_args, non_negative_int, positive_int
from pp_runtime.config import Config
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.executors import token_hop_on
from pp_runtime.worker.device import dist_backend, resolve_device
from pp_runtime.core.errors import ConfigError
from pp_runtime.core.net import keep_on_loopback


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="python -m pp_runtime.cli.torchrun", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (path or shipped name)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--checkpoint", help="Hugging Face-format model directory")
    p.add_argument("--planner")
    p.add_argument("--requests", type=positive_int, help="workload.num_requests")
    p.add_argument("--seed", type=non_negative_int, help="workload.seed")
    p.add_argument("--out", help="report directory (rank 0; default runs/torchrun-MODEL-PLANNER)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def _device(cfg: Config, local_rank: int) -> torch.device:
    device = resolve_device(cfg.runtime.device)
    if device.type == "cuda":  # one GPU per local process
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def attempt_store(rank: int, world: int, timeout: timedelta):
    """torchrun's store (`env://`) under a prefix of its own for this attempt. The agent
    keeps one bootstrap store across restarts, and a restarted group would read the keys
    its predecessor left (gloo's addresses of dead processes: "Connection refused")."""
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    store.set_timeout(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"pp_runtime/attempt_{attempt}/default_pg", store)


FAULT_ENV = "PP_RUNTIME_FAULT"  # the test hook (module docstring)


def install_fault(worker, rank: int, env=os.environ) -> None:
    """The test hook: on the first attempt, rank `rank` of PP_RUNTIME_FAULT faults before
    running its micro-batch `after_mb` + 1 (worker.execute wrapped)."""
    spec = env.get(FAULT_ENV)
    if not spec or int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) != 0:
        return
    try:
        f = dict(kv.split("=", 1) for kv in spec.split(","))
        who, after, mode = int(f["rank"]), int(f["after_mb"]), f.get("mode", "kill")
        assert mode in ("kill", "stop", "hang")
    except (ValueError, KeyError, AssertionError):
        raise ConfigError(f"{FAULT_ENV}={spec!r}: give rank=R,after_mb=N[,mode=kill|stop|hang]")
    if who != rank:
        return
    execute, count = worker.execute, itertools.count()

    def faulty(mb, *args, **kwargs):
        if next(count) == after:
            print(f"{FAULT_ENV}: rank {rank} faults ({mode}) before micro-batch {mb.mb_id}",
                  file=sys.stderr, flush=True)
            if mode == "hang":
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
        return execute(mb, *args, **kwargs)

    worker.execute = faulty


def open_journal(cfg: Config, checkpoint: str | None, out: Path):
    """Rank 0's journal, and the tokens to resume from (by workload index) if it found an
    unfinished one of this run; JournalMismatch (a ConfigError) for another run's."""
    from pp_runtime.core import journal
    from pp_runtime.engine.llm import workload_requests

    run, path = journal.run_id(cfg.to_dict(), checkpoint), out / journal.NAME
    found, generated, resumes = journal.read(path, run), {}, []
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if found is not None and found.done:
        note = f"{path} is of this run, finished: starting afresh"
    elif found is not None:
        _, _, params = workload_requests(cfg)
        generated = journal.resume_tokens(found.tokens, [p.max_tokens for p in params])
        note = (f"resuming from {path} (attempt {attempt}): {found.num_tokens} tokens of "
                f"{len(found.tokens)} requests ({found.dropped} cut-short lines dropped)")
        resumes = found.resumes + [{"attempt": attempt, "tokens": found.num_tokens,
                                    "requests": len(found.tokens),
                                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
    else:
        note = None
    if note:  # always said: a resumed run's report starts from these tokens
        print(f"rank 0: {note}", file=sys.stderr, flush=True)
    what = f"{cfg.model.name}, workload seed {cfg.workload.seed}, checkpoint {checkpoint}"
    return journal.Journal(path, run, generated, what=what, resumes=resumes), generated


def drive(cfg: Config, checkpoint: str | None, executor, out: Path, quiet: bool,
          journal, generated: dict[int, list[int]]) -> int:
    """Rank 0: the workload, resumed from `generated` and journaled; the report. 1 if the
    pipeline broke (the agent then restarts the group), else 0."""
    from pp_runtime.engine.llm import run_workload
    from pp_runtime.telemetry.report import format_summary, write_report

    try:
        run = run_workload(cfg, checkpoint, executor=executor, generated=generated,
                           on_microbatch=journal.on_microbatch)
        report = write_report(run, out)
        failed = bool(report["summary"]["finish_reasons"].get("error"))
        if not failed:
            journal.done()
    finally:
        journal.close()
    if not quiet:
        print(format_summary(report))
        print(f"  ran in {run.run_wall_s:.1f} s; reports and plots in {out}/", flush=True)
    if failed:
        why = next((o.error for o in run.requests if o.error), "a request ended with an error")
        print(f"rank 0: the pipeline broke ({why}); exiting 1: torchrun's agent restarts the "
              f"group (within --max-restarts) and rank 0 resumes from {journal.path}",
              file=sys.stderr, flush=True)
    return 1 if failed else 0


def run_rank(cfg: Config, rank: int, world: int, local_rank: int, local_world: int,
             checkpoint: str | None, out: Path, quiet: bool) -> int:
    from pp_runtime.executors.control import ControlChannel
    from pp_runtime.executors.torchrun_executor import TorchrunExecutor, serve
    from pp_runtime.parallel.groups import destroy, stage_groups
    from pp_runtime.parallel.p2p import warm_up
    from pp_runtime.worker.stage import StageWorker

    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world != tp * pp:
        raise ConfigError(f"torchrun started {world} processes, but parallel.tp x parallel.pp "
                          f"= {tp} x {pp} = {tp * pp}; start tp * pp processes in all")
    torch.set_num_threads(cfg.runtime.threads_per_worker or max(1, (os.cpu_count() or 1) // local_world))
    device = _device(cfg, local_rank)
    # rank 0 reads its journal first: another run's stops the job before anything loads
    journal, generated = open_journal(cfg, checkpoint, out) if rank == 0 else (None, {})
    timeout = timedelta(seconds=cfg.runtime.step_timeout_s)
    dist.init_process_group(dist_backend(device), store=attempt_store(rank, world, timeout),
                            rank=rank, world_size=world, timeout=timeout)
    try:
        groups = stage_groups(tp, pp, rank)
        ctrl = ControlChannel(dist.new_group(list(range(world)), backend="gloo"))
        worker = StageWorker(cfg, groups.stage, device, checkpoint, groups)
        install_fault(worker, rank)
        warm_up(groups, device)  # communicator setup before, not inside, the first bubble
        if rank != 0:
            serve(worker, ctrl)
            return 0
        executor = TorchrunExecutor(worker, ctrl, world, tp, cfg.runtime.step_timeout_s)
        if drive(cfg, checkpoint, executor, out, quiet, journal, generated):
            # a broken pipeline: no goodbye to peers that may never answer (destroying
            # the groups could wait on them); the agent ends them and restarts the group
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return 0
    finally:
        if journal is not None:
            journal.close()
        destroy()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = os.environ
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except KeyError:
        print("error: run this module under torchrun (RANK and WORLD_SIZE are not set)",
              file=sys.stderr)
        return 2
    try:
        cfg = resolve_layer_split(config_from_args(  # every rank chooses auto alike, once
            args, flags=("planner", "requests", "seed")).with_overrides(executor="torchrun"))
        cfg = cfg.with_overrides(**{"runtime.token_hop": token_hop_on(cfg, "torchrun")})
        out = Path(args.out or f"runs/torchrun-{cfg.model.name}-{cfg.planner.planner}")
        keep_on_loopback(env.get("MASTER_ADDR", ""))
        return run_rank(cfg, rank, world, int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", world)), args.checkpoint, out, args.quiet)
    except ConfigError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
