"""`pp-runtime profile`: this machine's operation times into a profile the simulator loads,
and with --calibrate N a short real run that measures contention and host costs."""
from __future__ import annotations

import time
from pathlib import Path

from pp_runtime.cli.common import add_config_args, config_from_args


def add_parser(sub) -> None:
    prof = sub.add_parser("profile", help="measure operation times on this machine")
    add_config_args(prof)
    prof.add_argument("--out", help="profile directory (default: runs/profile-MODEL)")
    prof.add_argument("--quick", action="store_true", help="fewer points (about a minute)")
    prof.add_argument("--quiet", action="store_true", help="no progress bar")
    prof.add_argument("--calibrate", type=int, default=0, metavar="N",
                      help="then run N requests on the config's executor (ray) to measure "
                           "contention and host costs into calibration.json")
    prof.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    from pp_runtime.profile.measure import measure_profile

    cfg = config_from_args(args)
    if cfg.runtime.threads_per_worker:  # measure as the stage workers will run
        import torch
        torch.set_num_threads(cfg.runtime.threads_per_worker)
    out = Path(args.out or f"runs/profile-{cfg.model.name}")
    t0 = time.perf_counter()
    path = measure_profile(cfg, out, quick=args.quick, progress=not args.quiet)
    print(f"profile of {cfg.model.name} (tp={cfg.parallel.tp}) written to {path}/ in "
          f"{time.perf_counter() - t0:.0f} s; simulate with it: --set hardware.profile={path}")
    old = path / "calibration.json"
    if old.exists():  # fitted against the tables just replaced: it would price them wrong
        old.replace(path / "calibration.json.old")
        print(f"the calibration fitted to the previous tables moved to {path}/calibration.json.old"
              f"{'' if args.calibrate else ' (--calibrate N measures a new one)'}")
    if args.calibrate:  # a short real run on the config's executor (docs/costmodel.md)
        from pp_runtime.profile.calibrate import calibrate
        from pp_runtime.costmodel.calibration import describe
        print(f"calibration: {describe(calibrate(cfg, path, requests=args.calibrate))}")
    return 0

