"""Preallocated KV cache of one pipeline stage (the paper's design, §4.5).

One K and one V tensor per layer of the stage, each [slots, seq_len, kv_heads, head_dim]:
a request owns one slot from admission to finish and its KV is updated in place.
"""
from __future__ import annotations

import torch

from pp_runtime.config import Config


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, seq_len: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_slots, seq_len, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.seq_len = num_slots, seq_len

    @classmethod
    def for_stage(cls, cfg: Config, num_layers: int, dtype: torch.dtype,
                  device: torch.device) -> "KVCache":
        m = cfg.model
        return cls(num_layers, cfg.num_slots, cfg.seq_len, m.kv_heads // cfg.parallel.tp,
                   m.head_dim, dtype, device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
