"""The runtime's host cost per micro-batch per stage (issues 22 and 23), per executor.

For each model and pipeline depth: a quick profile of this machine, then a short real run
on each executor (`profile/calibrate.py`): Ray (one actor per stage) and torchrun (one
process per stage, started here with torch.multiprocessing as torchrun would, rank 0
driving), and the host costs the simulator charges (docs/simulator.md, "Host costs"): the
driver's turn before a submit, the submit (Ray: `ray.put` and one task per actor, or one
compiled-graph execution; torchrun: one broadcast, rank 0's own stage work handed to its thread), the
call's trip to an idle stage, each stage's gap between two calls, the result's trip back;
plus the compute fit under contention.

    python benchmarks/host_cost.py [--models tiny,cpu/gpt2_pp2] [--pp 2,3,4] [--tp 2]
        [--executors ray,torchrun] [--requests 6] [--set compiled_graph=true]
"""
from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.profile.calibrate import calibrate  # noqa: E402
from pp_runtime.profile.measure import measure_profile  # noqa: E402


def torchrun_rank(rank: int, world: int, cfg, profile: str, requests: int, port: int, out) -> None:
    """One torchrun-like rank: rank 0 calibrates through the torchrun executor (and puts
    the result in `out`), the others serve its plans (`cli/torchrun.py`'s run_rank)."""
    import torch
    import torch.distributed as dist

    from pp_runtime.executors.control import ControlChannel
    from pp_runtime.executors.torchrun_executor import TorchrunExecutor, serve
    from pp_runtime.core.net import keep_on_loopback
    from pp_runtime.parallel.groups import destroy, stage_groups
    from pp_runtime.parallel.p2p import warm_up
    from pp_runtime.worker.stage import StageWorker

    torch.set_num_threads(cfg.runtime.threads_per_worker or 1)
    keep_on_loopback("127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        groups = stage_groups(cfg.parallel.tp, cfg.parallel.pp, rank)
        ctrl = ControlChannel(dist.new_group(list(range(world)), backend="gloo"))
        worker = StageWorker(cfg, groups.stage, torch.device("cpu"), None, groups)
        warm_up(groups, worker.device)
        if rank:
            serve(worker, ctrl)
            return
        ex = TorchrunExecutor(worker, ctrl, world, cfg.parallel.tp)
        try:
            out.put(calibrate(cfg, profile, requests=requests, executor=ex, save=False))
        finally:
            ex.shutdown()
    finally:
        destroy()


def calibrate_torchrun(cfg, profile: str, requests: int):
    import torch.multiprocessing as mp

    from pp_runtime.parallel.groups import free_port

    ctx, world = mp.get_context("spawn"), cfg.parallel.tp * cfg.parallel.pp
    out, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=torchrun_rank, args=(r, world, cfg, profile, requests, port, out))
             for r in range(world)]
    for p in procs:
        p.start()
    cal = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return cal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,cpu/gpt2_pp2", help="shipped configs")
    ap.add_argument("--pp", default="2,3,4")
    ap.add_argument("--tp", type=int, default=1, help="TP ranks per stage")
    ap.add_argument("--executors", default="ray,torchrun")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. compiled_graph=true")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    sets = dict(kv.split("=", 1) for kv in args.set)
    sets = {k: {"true": True, "false": False}.get(v, v) for k, v in sets.items()}
    ms = 1e3
    print(f"{'config':<14}{'executor':>9}{'pp':>3}{'mbs':>6}{'plan':>7}{'submit':>8}"
          f"{'dispatch':>9}{'return':>8}  between calls per stage (ms)   compute fit")
    for name in args.models.split(","):
        for pp in map(int, args.pp.split(",")):
            with tempfile.TemporaryDirectory() as d:
                measure_profile(load_config(name, pp=pp, tp=args.tp), d, quick=True, progress=False)
                for kind in args.executors.split(","):
                    cfg = load_config(name, pp=pp, tp=args.tp, executor=kind, threads_per_worker=1,
                                      **sets)
                    cal = (calibrate_torchrun(cfg, d, args.requests) if kind == "torchrun" else
                           calibrate(cfg, d, requests=args.requests, whole_prompts=False, save=False))
                    h, c = cal.host, cal.compute
                    calls = " ".join(f"{x * ms:5.2f}" for x in h.call_s)
                    print(f"{name:<14}{kind:>9}{pp:>3}{cal.microbatches // pp:>6}{h.plan_s * ms:>7.2f}"
                          f"{h.submit_s * ms:>8.2f}{h.dispatch_s * ms:>9.2f}{h.return_s * ms:>8.2f}  "
                          f"{calls:<30} x{c.scale:.2f} + {c.per_layer_s * ms:.2f} ms/layer", flush=True)


if __name__ == "__main__":
    main()
