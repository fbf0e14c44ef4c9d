"""Rotary position embedding: which frequencies, and the cos/sin tables of a micro-batch.

`Rope` is fixed when a layer is built (`Rope.of(model config)`), so `forward` never asks
which scaling a checkpoint uses. The frequencies follow transformers'
`modeling_rope_utils` in float32, op for op, so logits match it:

- default: inv_freq[j] = theta^(-2j / d)
- linear:  inv_freq / factor (positions stretched by `factor`)
- llama3:  wavelengths 2 pi / inv_freq above original / low_freq_factor are divided by
  `factor`, those below original / high_freq_factor kept, the band between interpolated
- dynamic: NTK. A sequence of length L > original gets the base
  theta * (factor * L / original - (factor - 1))^(d / (d - 2)). transformers recomputes
  it per forward call from the batch's longest position; here L is the row's own
  sequence length at the end of its chunk (`BatchLayout.seq_ends`): the same for a
  prompt prefilled in one chunk and for every decode, and keys keep the rotation they
  were cached with, as in transformers.

The tables are built once per micro-batch (`BatchLayout.rope_tables`) and shared by q, k
and every layer of the stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pp_runtime.config import ModelConfig


@dataclass(frozen=True)
class Rope:
    theta: float  # the base
    head_dim: int  # rotated width (the whole head)
    scaling: str = "default"  # default, linear, dynamic, llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original: int = 0  # llama3's original context; dynamic: the length past which the base grows

    @classmethod
    def of(cls, m: ModelConfig) -> "Rope":
        return cls(m.rope_theta, m.head_dim, m.rope_scaling, m.rope_factor,
                   m.rope_low_freq_factor, m.rope_high_freq_factor,
                   m.rope_original_positions or m.max_positions)

    def _exponents(self, device: torch.device) -> torch.Tensor:
        d = self.head_dim  # [d / 2]: 2j / d, as transformers computes it
        return torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[head_dim / 2] float32, for every scaling but dynamic (whose base depends on L)."""
        inv = 1.0 / (self.theta ** self._exponents(device))
        if self.scaling == "linear":
            return inv / self.factor
        if self.scaling != "llama3":
            return inv
        low_wavelen = self.original / self.low_freq_factor
        high_wavelen = self.original / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = ((self.original / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[T, head_dim / 2] float32: each row's frequencies for its sequence's length."""
        d = self.head_dim
        length = torch.clamp(seq_lens, min=self.original)  # [T] int64
        base = self.theta * ((self.factor * length / self.original) - (self.factor - 1)) ** (d / (d - 2))
        return 1.0 / (base[:, None] ** self._exponents(seq_lens.device)[None, :])

    def tables(self, positions: torch.Tensor, seq_ends: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for rows at `positions` [T] whose sequences end at
        `seq_ends` [T] (read by dynamic scaling only)."""
        pos = positions.to(torch.float32)[:, None]  # [T, 1]
        if self.scaling == "dynamic":
            freqs = pos * self.dynamic_inv_freq(seq_ends)  # [T, d/2]
        else:
            freqs = pos * self.inv_freq(positions.device)[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Hugging Face LLaMA convention (rotate halves).
    x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim] from `BatchLayout.rope_tables`."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
