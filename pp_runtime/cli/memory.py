"""`pp-runtime memory`: the paper's batch-size formula (§4.3) for a config and a device, and
how many requests of the config's workload the KV cache holds."""
from __future__ import annotations

from pp_runtime.cli.common import add_config_args, config_from_args, positive_float
from pp_runtime.core.workload import generate as generate_workload
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.costmodel.memory import kv_capacity, memory_plan


def add_parser(sub) -> None:
    mem = sub.add_parser("memory", help="the paper's max batch size B for a config")
    add_config_args(mem)
    mem.add_argument("--device-memory-gb", type=positive_float, default=None,
                     help="memory of one device (default: cache.device_memory_gb of the config)")
    mem.set_defaults(func=cmd_memory)


def cmd_memory(args) -> int:
    cfg = resolve_layer_split(config_from_args(args))  # the split the stages would hold
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

