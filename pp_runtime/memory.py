"""The paper's batch-size formula (§4.3): how many requests' KV fits beside the weights."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pp_runtime.config import Config, ConfigError


@dataclass(frozen=True)
class MemoryPlan:
    """B = floor((M_G - M_S) / (L * m_kv)), per device of one pipeline stage."""

    device_bytes: float  # M_G: usable memory of one device (capacity * utilization)
    param_bytes: float  # M_S: parameters held by one device
    seq_len: int  # L: KV tokens per request
    kv_bytes_per_token: int  # m_kv: K and V of one token for this device's layers and heads
    max_requests: int  # B over the whole stage: requests whose KV fits at once
    batch_per_microbatch: int  # B / pp: with pp micro-batches in flight

    def summary(self) -> str:
        gib = 2**30
        return (
            f"M_G={self.device_bytes / gib:.2f} GiB, M_S={self.param_bytes / gib:.2f} GiB, "
            f"L={self.seq_len}, m_kv={self.kv_bytes_per_token} B/token -> "
            f"B={self.max_requests} requests per device, "
            f"{self.batch_per_microbatch} per micro-batch"
        )


def memory_plan(cfg: Config, device_memory_gb: float | None = None) -> MemoryPlan:
    """The paper's maximum batch size for this model and parallel layout.

    A device of stage s holds 1/tp of the parameters of 1/pp of the layers and the K/V of
    its layers and heads; with pp micro-batches in flight each micro-batch gets 1/pp of the
    slots (paper §4.3; GPT-3 on A100-80GB gives 27 for TP8xPP8 and 11 for TP8).
    """
    m, p = cfg.model, cfg.parallel
    gb = device_memory_gb if device_memory_gb is not None else cfg.cache.device_memory_gb
    if gb is None:
        raise ConfigError("cache.device_memory_gb: not set; give the memory of one device in GB")
    usable = gb * 1e9 * cfg.cache.memory_utilization
    params = m.num_params() * m.dtype_bytes / (p.tp * p.pp)
    layers = math.ceil(m.num_layers / p.pp)
    kv_token = 2 * layers * (m.kv_heads // p.tp) * m.head_dim * m.dtype_bytes
    total = max(0, math.floor((usable - params) / (cfg.seq_len * kv_token)))
    return MemoryPlan(usable, params, cfg.seq_len, kv_token, total, total // p.pp)
