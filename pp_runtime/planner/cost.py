"""The cost-model interface planners use, with an analytic roofline default.

`microbatch_time(prefills, decode_kv_lens)` predicts how long one pipeline stage takes for
a micro-batch: `prefills` is a list of (start, num_tokens) chunks, `decode_kv_lens` the KV
length each decode attends to. Linear work grows with the number of tokens, attention
with the KV length. The default prices both on a roofline of one device (the simulator's
profile-driven cost model implements the same method).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from pp_runtime.config import Config


class CostModel(Protocol):
    def microbatch_time(self, prefills: Sequence[tuple[int, int]],
                        decode_kv_lens: Sequence[int]) -> float: ...


@dataclass(frozen=True)
class AnalyticCost:
    """Roofline: each operation takes max(flops / peak, bytes / bandwidth)."""

    layers: int  # layers of one stage
    weight_bytes: float  # linear weights of one layer, one TP rank
    linear_flops_per_token: float  # of one layer, one TP rank
    attn_width: float  # heads * head_dim of one TP rank
    kv_bytes_per_token: float  # K and V of one token, one layer, one TP rank
    peak_flops: float = 312e12  # A100 fp16 dense
    bandwidth: float = 2.0e12  # A100-80GB HBM bytes/s

    @classmethod
    def from_config(cls, cfg: Config, peak_flops: float = 312e12,
                    bandwidth: float = 2.0e12) -> "AnalyticCost":
        m, tp = cfg.model, cfg.parallel.tp
        h, kv = m.hidden_size, m.kv_heads * m.head_dim
        mlp = (3 if m.family == "llama" else 2) * h * m.ffn
        params = (h * (h + 2 * kv) + h * h + mlp) / tp
        layers = -(-m.num_layers // cfg.parallel.pp)
        return cls(layers, params * m.dtype_bytes, 2 * params, h / tp,
                   2 * kv / tp * m.dtype_bytes, peak_flops, bandwidth)

    def _op(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.bandwidth)

    def microbatch_time(self, prefills: Sequence[tuple[int, int]],
                        decode_kv_lens: Sequence[int]) -> float:
        tokens = sum(n for _, n in prefills) + len(decode_kv_lens)
        t = self._op(self.linear_flops_per_token * tokens, self.weight_bytes)
        for start, n in prefills:  # QK^T and AV: 4 * n * (average keys seen) * width
            t += self._op(4 * n * (start + (n + 1) / 2) * self.attn_width,
                          (start + n) * self.kv_bytes_per_token)
        kv = sum(decode_kv_lens)
        if kv:
            t += self._op(4 * kv * self.attn_width, kv * self.kv_bytes_per_token)
        return t * self.layers
