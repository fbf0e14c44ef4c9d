"""Layer shapes and the analytic roofline of every operation of one TP rank.

    time = max(flops / peak_flops, bytes / mem_bandwidth)

with a matmul's row count (tokens) rounded up to a multiple of the device tile (128 on
GPUs): 129 rows cost as much as 256. Bytes count each operand read and the result written
once. Functions take `tokens` as an int or a numpy array (vectorised table building).
The roofline is a lower bound; the measured tables carry real efficiency, and a table
measured for another shape or device is scaled by the ratio of two roofline times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pp_runtime.costmodel.devices import DeviceSpec

if TYPE_CHECKING:  # annotations only: the cost model never imports the config at run time
    from pp_runtime.config import ModelConfig

# vidur's per-layer operations (columns `time_stats.OP.median` of mlp.csv)
LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
SMALL_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
TABLE_OPS = ("emb",) + LINEAR_OPS + SMALL_OPS + ("lm_head",)  # lm_head: local profiles only


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as one TP rank sees it (the key of a measured table)."""

    n_embd: int  # hidden size
    n_head: int  # query heads of the whole layer
    n_kv_head: int  # key/value heads of the whole layer
    n_expanded_embd: int  # FFN inner width of one FFN matrix (gated models have two)
    gated: bool  # SwiGLU-style FFN: gate and up fused into one 2 x n_expanded_embd matmul
    tp: int  # tensor-parallel ranks
    vocab: int = 32000  # vocabulary (embedding and LM head)
    dtype_bytes: int = 2  # bytes per element
    rope: bool = True  # rotary embeddings (llama); GPT adds learned positions once instead
    head_size: int = 0  # width of one head; 0 = n_embd / n_head (Qwen3-32B: 128, not 80)

    @classmethod
    def of(cls, m: ModelConfig, tp: int) -> "LayerShape":
        llama = m.family == "llama"
        return cls(m.hidden_size, m.num_heads, m.kv_heads, m.ffn, llama, tp, m.vocab_size,
                   m.dtype_bytes, llama, m.head_size or 0)

    @property
    def key(self) -> tuple:
        return (self.n_embd, self.n_head, self.n_kv_head, self.n_expanded_embd, self.gated,
                self.tp) + ((self.head_size,) if self.head_size else ())

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def q_width(self) -> int:  # query (and attention output) width of one rank
        return self.n_head // self.tp * self.head_dim

    @property
    def kv_width(self) -> int:  # K (or V) width of one rank
        return self.n_kv_head // self.tp * self.head_dim

    @property
    def up_width(self) -> int:  # output width of one rank's up projection (gate + up)
        return (2 if self.gated else 1) * self.n_expanded_embd // self.tp

    def describe(self) -> str:
        return (f"n_embd={self.n_embd} heads={self.n_head}/{self.n_kv_head} "
                f"ffn={self.n_expanded_embd}{' gated' if self.gated else ''} tp={self.tp}")


def matmul_time(tokens, k: int, n: int, dtype_bytes: int, dev: DeviceSpec):
    """[tokens, k] @ [k, n] on one device."""
    rows = np.ceil(np.asarray(tokens, dtype=float) / dev.tile) * dev.tile
    flops = 2.0 * rows * k * n
    nbytes = (np.asarray(tokens, dtype=float) * (k + n) + k * n) * dtype_bytes
    return np.maximum(flops / dev.flops(dtype_bytes), nbytes / dev.mem_bandwidth)


def memory_time(elements, dtype_bytes: int, dev: DeviceSpec):
    """An elementwise op that moves this many elements (reads + writes)."""
    return np.asarray(elements, dtype=float) * dtype_bytes / dev.mem_bandwidth


def op_time(op: str, s: LayerShape, tokens, dev: DeviceSpec):
    """Roofline seconds of one TABLE_OPS operation (or "lm_head") over `tokens` rows."""
    t, h, d = np.asarray(tokens, dtype=float), s.n_embd, s.dtype_bytes
    if op == "attn_pre_proj":
        return matmul_time(t, h, s.q_width + 2 * s.kv_width, d, dev)
    if op == "attn_post_proj":
        return matmul_time(t, s.q_width, h, d, dev)
    if op == "mlp_up_proj":
        return matmul_time(t, h, s.up_width, d, dev)
    if op == "mlp_down_proj":
        return matmul_time(t, s.n_expanded_embd // s.tp, h, d, dev)
    if op == "lm_head":  # vocab-parallel: each rank owns vocab / tp rows of the head
        return matmul_time(t, h, -(-s.vocab // s.tp), d, dev)
    if op in ("emb", "input_layernorm", "post_attention_layernorm"):
        return memory_time(2 * t * h, d, dev)  # read + write [tokens, hidden]
    if op == "add":
        return memory_time(3 * t * h, d, dev)  # two reads + one write
    if op == "attn_rope":
        return memory_time(2 * t * (s.q_width + s.kv_width), d, dev)  # q and k, in + out
    if op == "mlp_act":  # gated: read gate and up, write one; else read + write
        return memory_time((3 if s.gated else 2) * t * (s.n_expanded_embd // s.tp), d, dev)
    raise ValueError(f"no roofline for operation {op!r}")


def prefill_attention_time(s: LayerShape, start: int, n: int, dev: DeviceSpec) -> float:
    """A chunk of n queries at positions [start, start+n), causal over start+n keys:
    QK^T and AV are 4 * n * (mean keys seen) * q_width FLOPs; K and V are read once."""
    flops = 4.0 * n * (start + (n + 1) / 2) * s.q_width
    nbytes = ((start + n) * 2 * s.kv_width + 2 * n * s.q_width) * s.dtype_bytes
    return max(flops / dev.flops(s.dtype_bytes), nbytes / dev.mem_bandwidth)


def decode_attention_time(s: LayerShape, count: int, sum_kv: int, dev: DeviceSpec) -> float:
    """`count` decodes attending to `sum_kv` keys in all: every cached K/V byte read once."""
    flops = 4.0 * sum_kv * s.q_width
    nbytes = (sum_kv * 2 * s.kv_width + 2 * count * s.q_width) * s.dtype_bytes
    return max(flops / dev.flops(s.dtype_bytes), nbytes / dev.mem_bandwidth)
