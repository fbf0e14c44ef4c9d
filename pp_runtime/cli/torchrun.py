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
boundary where torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*) is read.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pp_runtime.cli.common import Parser, config_from_args, non_negative_int, positive_int
from pp_runtime.config import Config
from pp_runtime.worker.device import dist_backend, resolve_device
from pp_runtime.core.errors import ConfigError


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


def keep_on_loopback(master_addr: str) -> None:
    """With a loopback MASTER_ADDR (one machine), gloo and NCCL listen on the loopback
    interface too, as `parallel/groups.py` does for the Ray executor; set variables win."""
    try:
        loopback = ipaddress.ip_address(master_addr).is_loopback
    except ValueError:
        loopback = master_addr == "localhost"
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback and lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


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
    dist.init_process_group(dist_backend(device), init_method="env://", rank=rank,
                            world_size=world, timeout=timedelta(seconds=cfg.runtime.step_timeout_s))
    try:
        groups = stage_groups(tp, pp, rank)
        ctrl = ControlChannel(dist.new_group(list(range(world)), backend="gloo"))
        worker = StageWorker(cfg, groups.stage, device, checkpoint, groups)
        warm_up(groups, device)  # communicator setup before, not inside, the first bubble
        if rank != 0:
            serve(worker, ctrl)
            return 0
        from pp_runtime.engine.llm import run_workload
        from pp_runtime.telemetry.report import format_summary, write_report

        run = run_workload(cfg, checkpoint, executor=TorchrunExecutor(worker, ctrl, world, tp))
        report = write_report(run, out)
        if not quiet:
            print(format_summary(report))
            print(f"  ran in {run.run_wall_s:.1f} s; reports and plots in {out}/", flush=True)
        return 1 if report["summary"]["finish_reasons"].get("error") else 0
    finally:
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
        cfg = config_from_args(args, flags=("planner", "requests", "seed")).with_overrides(
            executor="torchrun")
        out = Path(args.out or f"runs/torchrun-{cfg.model.name}-{cfg.planner.planner}")
        keep_on_loopback(env.get("MASTER_ADDR", ""))
        return run_rank(cfg, rank, world, int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", world)), args.checkpoint, out, args.quiet)
    except ConfigError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
