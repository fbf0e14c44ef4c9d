"""Preallocated KV cache of one pipeline stage (the paper's design, §4.5).

One K and one V tensor per layer of the stage, each [slots, seq_len, kv_heads, head_dim]:
a request owns one slot from admission to finish and its KV is updated in place.

That shape is what every reader indexes; the memory order under it is the stage's
`runtime.kv_layout`. "tokens": the shape's own order, so the cache flattens to
[slots * seq_len, kv_heads, head_dim] rows, what FlashAttention's varlen decode reads on
CUDA. "heads": stored [slots, kv_heads, seq_len, head_dim] and shown permuted, so one
head's keys of a slot are contiguous and a decode streams them (1.6x faster decode
attention on a CPU core than the strided "tokens" order, bit-identical results).
"""
from __future__ import annotations

import torch

from pp_runtime.config import Config


def heads_major(cfg: Config, device: torch.device) -> bool:
    """Whether `cfg.runtime.kv_layout` stores the cache heads-major on `device`."""
    layout = cfg.runtime.kv_layout
    return layout == "heads" or (layout == "auto" and device.type == "cpu")


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, seq_len: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 heads_major: bool = False):
        def one() -> torch.Tensor:  # [slots, seq_len, kv_heads, head_dim], in either order
            if heads_major:
                return torch.zeros(num_slots, kv_heads, seq_len, head_dim, dtype=dtype,
                                   device=device).transpose(1, 2)
            return torch.zeros(num_slots, seq_len, kv_heads, head_dim, dtype=dtype, device=device)

        self.k = [one() for _ in range(num_layers)]
        self.v = [one() for _ in range(num_layers)]
        self.num_slots, self.seq_len = num_slots, seq_len

    @classmethod
    def for_stage(cls, cfg: Config, num_layers: int, dtype: torch.dtype,
                  device: torch.device) -> "KVCache":
        m = cfg.model
        return cls(num_layers, cfg.num_slots, cfg.seq_len, m.kv_heads // cfg.parallel.tp,
                   m.head_dim, dtype, device, heads_major(cfg, device))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
