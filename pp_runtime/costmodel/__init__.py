"""Cost model of one pipeline stage for one micro-batch (no torch; see docs/costmodel.md).

    cost = build_cost_model(cfg)
    cost.stage_times(prefills, decode_kv_lens)   # seconds on each of the pp stages
    cost.microbatch_time(prefills, decode_kv_lens)
    cost.send_time(num_tokens, stage)            # stage - 1 -> stage
    cost.breakdown(...), cost.sources()

Sources in order: a local profile (`hardware.profile`, measured by `pp_runtime/profile/`,
which this package never imports), the shipped measured tables (Vidur's A100/H100
profiles, scaled to missing shapes by roofline ratios), the roofline.
"""
from pp_runtime.costmodel.devices import DEVICES, DeviceSpec, Link, device_spec
from pp_runtime.costmodel.model import StageCostModel, build_cost_model, build_pricing

__all__ = ["DEVICES", "DeviceSpec", "Link", "StageCostModel", "build_cost_model",
           "build_pricing", "device_spec"]
