"""Attention for hybrid micro-batches: prefill chunks one by one, then the decodes.

All tokens of a micro-batch are flattened into rows of one tensor. `BatchLayout` says, once
per micro-batch, which rows belong to which sequence; every layer reuses it.

Attention reads the KV cache in place: every SDPA call gets 4-D `[1, heads, seq, head_dim]`
views of one slot (the shape the fused kernels need: flash on CPU, flash or memory-efficient
on CUDA), never a copy.

- A prefill chunk at positions [start, start + n) attends causally to its own earlier KV
  (already cached) plus itself (paper Fig. 6), so chunked prefill equals full prefill. The
  first chunk is plain causal; a later one uses the lower-right causal bias.
- A decode (one token) reads exactly its first kv_len keys: nothing padded, nothing gathered.
  On CUDA (fp16/bf16) one FlashAttention-2 varlen call per layer serves every decode,
  each slot a sequence of the flattened cache; on a CPU one call of our C++ kernel per layer
  (`cpu_kernels.decode_attention_cpu`, when the worker has it); elsewhere one SDPA call
  per decode.

`attention_paths()` counts the calls per path, so a check can see which kernels ran.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from pp_runtime.batch import MicroBatch
from pp_runtime.model.cpu_kernels import decode_attention_cpu

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what FlashAttention's CUDA kernels take

# calls per path since import: prefill one per span and layer, decode_views one per decode
# and layer, decode_varlen and decode_cpu one per layer; a dict increment, cheap on the hot path
_path_calls = {"prefill_causal": 0, "prefill_lower_right": 0, "decode_views": 0,
               "decode_varlen": 0, "decode_cpu": 0}


def attention_paths() -> dict[str, int]:
    """Attention calls per path since import; the difference of two readings says which paths
    a forward pass took."""
    return dict(_path_calls)


@dataclass
class PrefillSpan:
    rows: slice  # rows of this chunk in the flattened batch
    slot: int
    start: int  # tokens [0, start) are already cached


@dataclass
class BatchLayout:
    """Per micro-batch index tensors, built once and shared by every layer."""

    positions: torch.Tensor  # [num_tokens] position of every row
    slots: torch.Tensor  # [num_tokens] KV slot of every row
    prefills: list[PrefillSpan]
    # the decodes, in ascending slot order (the varlen kernel needs ascending offsets)
    decode_rows: torch.Tensor  # [D] rows of the decode tokens
    decode_seqlens: torch.Tensor  # [D] int32 keys each decode attends to, its own included
    decode_cu_slots: torch.Tensor  # [D + 1] int32 the slots, then the last one + 1
    decode_cu_q: torch.Tensor  # [D + 1] int32 0, 1, ..., D: one query per decode
    sample_rows: torch.Tensor  # [num_sampling] last row of each sequence that samples
    decode_slot_list: list[int]  # the slots as plain ints (per-decode views)
    decode_lens: list[int]  # decode_seqlens as plain ints
    cpu_decode: bool = False  # decodes through the CPU kernel (the worker has it built)
    _rope: dict = field(default_factory=dict)  # (theta, head_dim, dtype) -> (cos, sin)

    def rope_tables(self, theta: float, head_dim: int, dtype: torch.dtype):
        """cos, sin [T, 1, head_dim] for every row; computed once per micro-batch and
        shared by every layer (and by q and k)."""
        key = (theta, head_dim, dtype)
        if key not in self._rope:
            device = self.positions.device
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                                     dtype=torch.float32) / head_dim))
            freqs = self.positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
            self._rope[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._rope[key]

    @classmethod
    def build(cls, mb: MicroBatch, device: torch.device, cpu_decode: bool = False) -> "BatchLayout":
        positions, slots, prefills, sample_rows, decodes = [], [], [], [], []
        row = 0
        for s in mb.seqs:
            n = s.num_tokens
            positions.extend(range(s.start, s.start + n))
            slots.extend([s.slot] * n)
            if s.is_decode:
                decodes.append((s.slot, row, s.kv_len))
            else:
                prefills.append(PrefillSpan(slice(row, row + n), s.slot, s.start))
            row += n
            if s.sampling is not None:
                sample_rows.append(row - 1)
        decodes.sort()  # by slot
        dec_slots = [slot for slot, _, _ in decodes]
        dec_lens = [kv_len for _, _, kv_len in decodes]
        cu_slots = dec_slots + [dec_slots[-1] + 1] if decodes else [0]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        return cls(as_long(positions), as_long(slots), prefills,
                   as_long([r for _, r, _ in decodes]), as_int(dec_lens), as_int(cu_slots),
                   as_int(range(len(decodes) + 1)), as_long(sample_rows), dec_slots, dec_lens,
                   cpu_decode)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      span: PrefillSpan) -> torch.Tensor:
    """q: [n, heads, head_dim]; caches: [slots, max_len, kv_heads, head_dim] (this chunk
    already written). Returns [n, heads, head_dim].

    Query i sits at position start + i and sees keys [0, start + i]. In the [n, start + n]
    score matrix that is the causal triangle anchored at the bottom-right corner
    (`causal_lower_right`); for the first chunk (start = 0) it is plain `is_causal`. GQA:
    `enable_gqa` maps each KV head to its query heads, no copy."""
    n = q.shape[0]
    kv_len = span.start + n
    qh = q.transpose(0, 1)[None]  # [1, heads, n, head_dim]
    k = k_cache[span.slot, :kv_len].transpose(0, 1)[None]  # [1, kv_heads, kv_len, head_dim], a view
    v = v_cache[span.slot, :kv_len].transpose(0, 1)[None]
    if span.start == 0:
        _path_calls["prefill_causal"] += 1
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
    else:
        _path_calls["prefill_lower_right"] += 1
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=causal_lower_right(n, kv_len),
                                           enable_gqa=True)
    return o[0].transpose(0, 1)  # [n, heads, head_dim]


@functools.cache
def _torch_has_flash_varlen() -> bool:
    """Whether this torch's FlashAttention-2 varlen forward takes `seqused_k` (torch >= 2.4)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "seqused_k" in str(op.default._schema)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int,
                 seqused_k: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2's varlen forward as PyTorch ships it (the op under
    `torch.nn.attention.varlen`; CUDA, fp16/bf16): sequence b has query rows
    [cu_q[b], cu_q[b + 1]) of q and the seqused_k[b] key rows of k, v from cu_k[b] on.
    q: [total_q, heads, head_dim]; k, v: [total_k, kv_heads, head_dim]; the index tensors are
    int32. Returns [total_q, heads, head_dim]."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0,
                                                   False, False, seqused_k=seqused_k)[0]


def decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, layout: BatchLayout) -> str:
    """The decode path: "varlen" (one FlashAttention-2 call) for CUDA fp16/bf16, a head_dim
    it takes (a multiple of 8 up to 256) and a cache in "tokens" order (it reads the cache
    as flattened rows; kv_cache.py); "cpu" (one call of our C++ kernel) where the layout
    says the worker has it; else "views"."""
    if layout.cpu_decode and q.dtype in (torch.float32, torch.bfloat16):
        return "cpu"
    head_dim = q.shape[-1]
    if (q.is_cuda and q.dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256
            and k_cache.is_contiguous() and _torch_has_flash_varlen()):
        return "varlen"
    return "views"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     layout: BatchLayout) -> torch.Tensor:
    """Every decode of the micro-batch over the first kv_len keys of its own slot: the KV is
    read in place, exactly sum(kv_len) keys, nothing padded or gathered.
    q: [D, heads, head_dim], decodes in slot order (`BatchLayout`); caches:
    [slots, seq_len, kv_heads, head_dim]. Returns [D, heads, head_dim].

    "varlen": the cache flattened to [slots * seq_len, kv_heads, head_dim] is a varlen key
    batch in which decode b starts at row slot_b * seq_len and uses its kv_len rows; the
    slots ascend, so the offsets do too."""
    kernel = decode_kernel(q, k_cache, layout)
    if kernel == "cpu":
        _path_calls["decode_cpu"] += 1
        return decode_attention_cpu(q, k_cache, v_cache, layout.decode_cu_slots[:-1],
                                    layout.decode_seqlens)
    if kernel == "varlen":
        _path_calls["decode_varlen"] += 1
        seq_len, kv_heads, head_dim = k_cache.shape[1:]
        cu_k = layout.decode_cu_slots * seq_len  # [D + 1] int32 first row of each slot
        return flash_varlen(q, k_cache.view(-1, kv_heads, head_dim),
                            v_cache.view(-1, kv_heads, head_dim), layout.decode_cu_q, cu_k,
                            1, max(layout.decode_lens), layout.decode_seqlens)
    return decode_attention_views(q, k_cache, v_cache, layout.decode_slot_list,
                                  layout.decode_lens)


def decode_attention_views(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: list[int], kv_lens: list[int]) -> torch.Tensor:
    """One SDPA call per decode on views of the cache (no mask, so the fused kernels take it).
    q: [D, heads, head_dim]. Returns [D, heads, head_dim]."""
    out = torch.empty_like(q)
    for i, (slot, n) in enumerate(zip(slots, kv_lens)):
        k = k_cache[slot, :n].transpose(0, 1)[None]  # [1, kv_heads, n, head_dim], a view
        v = v_cache[slot, :n].transpose(0, 1)[None]
        qi = q[i][None, :, None, :]  # [1, heads, 1, head_dim]
        out[i] = F.scaled_dot_product_attention(qi, k, v, enable_gqa=True)[0, :, 0, :]
    _path_calls["decode_views"] += len(slots)
    return out


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor,
                     layout: BatchLayout) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] for every row of the batch.
    Writes k, v into the cache, then attends. Returns [T, heads, head_dim]."""
    k_cache[layout.slots, layout.positions] = k.to(k_cache.dtype)
    v_cache[layout.slots, layout.positions] = v.to(v_cache.dtype)
    out = torch.empty_like(q)
    for span in layout.prefills:
        out[span.rows] = prefill_attention(q[span.rows], k_cache, v_cache, span)
    if layout.decode_lens:
        rows = layout.decode_rows
        out[rows] = decode_attention(q[rows], k_cache, v_cache, layout)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Hugging Face LLaMA convention (rotate halves).
    x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim] from `BatchLayout.rope_tables`."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
