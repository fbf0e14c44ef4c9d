"""The runtime's host cost per micro-batch per stage (issues 22 and 23), per executor.

For each model and pipeline depth: a quick profile of this machine, then a short real run
on the Ray executor (`costmodel/calibrate.py`), and the host costs the simulator charges
(docs/simulator.md, "Host costs"): the driver's turn before a submit, the submit (`ray.put`
and one task per actor), the call's trip to an idle stage, each stage's gap between two
calls, the result's trip back; plus the compute fit under contention.

    python benchmarks/host_cost.py [--models tiny,cpu/gpt2_pp2] [--pp 2,3,4] [--requests 6]
"""
from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray on 127.0.0.1

from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.costmodel.calibrate import calibrate  # noqa: E402
from pp_runtime.costmodel.measure import measure_profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,cpu/gpt2_pp2", help="shipped configs")
    ap.add_argument("--pp", default="2,3,4")
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    ms = 1e3
    print(f"{'config':<14}{'pp':>3}{'mbs':>6}{'plan':>7}{'submit':>8}{'dispatch':>9}"
          f"{'return':>8}  between calls per stage (ms)   compute fit")
    for name in args.models.split(","):
        for pp in map(int, args.pp.split(",")):
            cfg = load_config(name, pp=pp, executor="ray", threads_per_worker=1)
            with tempfile.TemporaryDirectory() as d:
                measure_profile(cfg, d, quick=True, progress=False)
                cal = calibrate(cfg, d, requests=args.requests, whole_prompts=False)
            h, c = cal.host, cal.compute
            calls = " ".join(f"{x * ms:5.2f}" for x in h.call_s)
            print(f"{name:<14}{pp:>3}{cal.microbatches // pp:>6}{h.plan_s * ms:>7.2f}"
                  f"{h.submit_s * ms:>8.2f}{h.dispatch_s * ms:>9.2f}{h.return_s * ms:>8.2f}  "
                  f"{calls:<30} x{c.scale:.2f} + {c.per_layer_s * ms:.2f} ms/layer", flush=True)


if __name__ == "__main__":
    main()
