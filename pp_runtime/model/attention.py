"""Attention for hybrid micro-batches over the paged KV cache: prefill chunks one by one,
then the decodes.

All tokens of a micro-batch are flattened into rows of one tensor. `BatchLayout` says, once
per micro-batch, which rows belong to which sequence and where each position lives in the
cache (block table[p // block_size], offset p % block_size); every layer reuses it.

- A prefill chunk at positions [start, start + n) attends causally to its own earlier KV
  (already cached) plus itself (paper Fig. 6), so chunked prefill equals full prefill. Its
  keys are gathered from its blocks into one [kv_heads, start + n, head_dim] tensor (one
  copy per layer, small beside the chunk's attention), then one SDPA call: plain causal
  for the first chunk, the lower-right causal bias for a later one.
- A decode (one token) reads exactly its first kv_len keys. On a CPU one call of our C++
  kernel per layer walks every decode's block table in place (`cpu_kernels`, when the
  worker has it); on CUDA one Triton kernel per layer does the same (`paged_kernel`,
  when Triton imports; `runtime.decode_attention`); the fallback on CUDA (fp16/bf16)
  gathers the decodes' keys once per layer into a varlen batch for one FlashAttention-2
  call; elsewhere one SDPA call per decode on its gathered keys.
- A sliding window W (Mistral; `window`, fixed per layer) keeps query p on keys
  (p - W, p]: a prefill chunk that reaches past W gets that band as its mask and only the
  keys it can see; a decode past W reads its last W keys on every path (the C++ kernel
  starts at them in its block table; varlen rows and lengths are cut to them).

`attention_paths()` counts the calls per path, so a check can see which kernels ran.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pp_runtime.core.batch import MicroBatch
from pp_runtime.model.cpu_kernels import decode_attention_cpu
from pp_runtime.model.paged_kernel import paged_decode
from pp_runtime.model.rope import Rope, rope  # noqa: F401  (rope: for the profiler)

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what FlashAttention's CUDA kernels take

# calls per path since import: prefill one per span and layer, decode_views one per decode
# and layer, decode_varlen, decode_cpu and decode_paged one per layer; a dict increment, cheap on the hot path
_path_calls = {"prefill_causal": 0, "prefill_lower_right": 0, "prefill_window": 0, "decode_views": 0,
               "decode_varlen": 0, "decode_cpu": 0, "decode_paged": 0}


def attention_paths() -> dict[str, int]:
    """Attention calls per path since import; the difference of two readings says which paths
    a forward pass took."""
    return dict(_path_calls)


@dataclass
class PrefillSpan:
    rows: slice  # rows of this chunk in the flattened batch
    blocks: torch.Tensor  # [ceil((start + n) / block_size)] long: blocks of positions [0, start + n)
    start: int  # tokens [0, start) are already cached


@dataclass
class BatchLayout:
    """Per micro-batch index tensors, built once and shared by every layer."""

    positions: torch.Tensor  # [num_tokens] position of every row
    seq_ends: torch.Tensor  # [num_tokens] kv_len of each row's sequence (dynamic RoPE)
    write_blocks: torch.Tensor  # [num_tokens] the block each row's K and V go to
    write_offsets: torch.Tensor  # [num_tokens] the offset in that block
    prefills: list[PrefillSpan]
    decode_rows: torch.Tensor  # [D] rows of the decode tokens
    decode_seqlens: torch.Tensor  # [D] int32 keys each decode attends to, its own included
    decode_tables: torch.Tensor  # [D, max blocks] int32 block tables (padded with 0)
    sample_rows: torch.Tensor  # [num_sampling] last row of each sequence that samples
    decode_block_lists: list[list[int]]  # the tables as plain ints (per-decode gathers)
    decode_lens: list[int]  # decode_seqlens as plain ints
    block_size: int
    cpu_decode: bool = False  # decodes through the CPU kernel (the worker has it built)
    paged: bool = False  # decodes through the paged Triton kernel (`model/paged_kernel.py`)
    token_ids: torch.Tensor | None = None  # [num_tokens] input ids (built for the first stage)
    _cache: dict = field(default_factory=dict)  # per-micro-batch tables built on first use

    def rope_tables(self, spec: Rope, dtype: torch.dtype):
        """cos, sin [T, 1, head_dim] for every row; computed once per micro-batch and
        shared by every layer (and by q and k)."""
        key = ("rope", spec, dtype)
        if key not in self._cache:
            self._cache[key] = spec.tables(self.positions, self.seq_ends, dtype)
        return self._cache[key]

    def decode_key_rows(self, window: int | None = None):
        """Rows of every decode's keys in the cache flattened to [blocks * block_size, ...],
        decode after decode (its last `window` keys with a window), the int32 offsets
        [D + 1] of each decode's first row, and the int32 keys per decode [D]."""
        key = ("rows", window)
        if key not in self._cache:
            bs, rows, cu = self.block_size, [], [0]
            for blocks, n in zip(self.decode_block_lists, self.decode_lens):
                first = max(0, n - window) if window else 0
                rows.extend(blocks[j // bs] * bs + j % bs for j in range(first, n))
                cu.append(len(rows))
            used = [b - a for a, b in zip(cu, cu[1:])]
            rows_t, cu_t, used_t = to_device(self.positions.device, rows, cu, used)
            self._cache[key] = (rows_t, cu_t.int(), used_t.int())
        return self._cache[key]

    def window_mask(self, span: PrefillSpan, n: int, window: int) -> tuple[int, torch.Tensor]:
        """(first key, mask [n, kv_len - first]) of a chunk whose queries reach past the
        window: query i (position start + i) sees keys (start + i - window, start + i]."""
        key = ("window", span.start, n, window)
        if key not in self._cache:
            first = max(0, span.start + 1 - window)  # no query sees a key before this one
            q = torch.arange(span.start, span.start + n, device=self.positions.device)[:, None]
            k = torch.arange(first, span.start + n, device=self.positions.device)[None, :]
            self._cache[key] = (first, (k <= q) & (k > q - window))  # [n, kv_len - first]
        return self._cache[key]

    @classmethod
    def build(cls, mb: MicroBatch, device: torch.device, block_size: int,
              cpu_decode: bool = False, paged: bool = False, ids: bool = False) -> "BatchLayout":
        """The layout of `mb` on `device`, its index tensors in one copy (`to_device`);
        with `ids`, the input token ids too (the first stage's input)."""
        positions, ends, wb, wo, spans, sample_rows, decodes = [], [], [], [], [], [], []
        row, bs = 0, block_size
        for s in mb.seqs:
            n, blocks = s.num_tokens, s.blocks
            used = blocks[:-(-s.kv_len // bs)]  # the blocks of positions [0, kv_len)
            positions.extend(range(s.start, s.start + n))
            ends.extend([s.kv_len] * n)
            for j in range(s.start // bs, (s.start + n - 1) // bs + 1):  # block by block
                a, b = max(s.start, j * bs), min(s.start + n, (j + 1) * bs)
                wb.extend([blocks[j]] * (b - a))
                wo.extend(range(a - j * bs, b - j * bs))
            if s.is_decode:
                decodes.append((row, s.kv_len, list(used)))
            else:
                spans.append((slice(row, row + n), list(used), s.start))
            row += n
            if s.sampling is not None:
                sample_rows.append(row - 1)
        width = max((len(t) for _, _, t in decodes), default=0)
        tables = [b for _, _, t in decodes for b in t + [0] * (width - len(t))]
        lens = [n for _, n, _ in decodes]
        token_ids = [t for s in mb.seqs for t in s.token_ids] if ids else []
        (token_ids, positions, ends, wb, wo, decode_rows, seqlens, tables, sample_rows,
         *span_blocks) = to_device(device, token_ids, positions, ends, wb, wo,
                                   [r for r, _, _ in decodes], lens, tables, sample_rows,
                                   *(b for _, b, _ in spans))
        prefills = [PrefillSpan(rows, blocks, start)
                    for (rows, _, start), blocks in zip(spans, span_blocks)]
        return cls(positions, ends, wb, wo, prefills, decode_rows, seqlens.int(),
                   tables.int().reshape(len(decodes), width), sample_rows,
                   [t for _, _, t in decodes], lens, bs, cpu_decode, paged,
                   token_ids if ids else None)


def to_device(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """int64 tensors of `lists` on `device`. On CUDA all of them travel as ONE pinned host
    buffer and one non-blocking copy (a blocking copy per tensor would make the host wait
    for the GPU's queue at every micro-batch); the tensors are views of the one on the
    device. torch's pinned-memory cache keeps a host buffer until its copy has run."""
    if device.type != "cuda":
        return [torch.tensor(xs, dtype=torch.long, device=device) for xs in lists]
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long).pin_memory()
    return list(flat.to(device, non_blocking=True).split([len(xs) for xs in lists]))


def gather_kv(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first n positions held by `blocks` (in table order) of a cache [num_blocks,
    block_size, kv_heads, head_dim] as [1, kv_heads, n, head_dim], one copy."""
    kv = cache.index_select(0, blocks)  # [nb, block_size, kv_heads, head_dim]
    return kv.flatten(0, 1)[:n].transpose(0, 1)[None]


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      span: PrefillSpan, layout: BatchLayout | None = None,
                      window: int | None = None) -> torch.Tensor:
    """q: [n, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim] (this
    chunk already written). Returns [n, heads, head_dim].

    Query i sits at position start + i and sees keys [0, start + i]. In the [n, start + n]
    score matrix that is the causal triangle anchored at the bottom-right corner
    (`causal_lower_right`); for the first chunk (start = 0) it is plain `is_causal`. GQA:
    `enable_gqa` maps each KV head to its query heads, no copy. With a `window` the chunk
    reaches past, the band mask of `layout.window_mask` over the keys it can see."""
    n = q.shape[0]
    kv_len = span.start + n
    qh = q.transpose(0, 1)[None]  # [1, heads, n, head_dim]
    k = gather_kv(k_cache, span.blocks, kv_len)  # [1, kv_heads, kv_len, head_dim]
    v = gather_kv(v_cache, span.blocks, kv_len)
    if window is not None and kv_len > window:
        _path_calls["prefill_window"] += 1
        first, mask = layout.window_mask(span, n, window)  # mask: [n, kv_len - first]
        o = F.scaled_dot_product_attention(qh, k[:, :, first:], v[:, :, first:], attn_mask=mask,
                                           enable_gqa=True)
    elif span.start == 0:
        _path_calls["prefill_causal"] += 1
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
    else:
        _path_calls["prefill_lower_right"] += 1
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=lower_right(n, kv_len, q.device),
                                           enable_gqa=True)
    return o[0].transpose(0, 1)  # [n, heads, head_dim]


def lower_right(n: int, kv_len: int, device: torch.device):
    """The causal triangle anchored at the bottom-right corner of the [n, kv_len] scores.
    On CPU the boolean mask that torch's `causal_lower_right` materializes there (no fused
    kernel takes it: `CausalBias._dispatch`), built here: importing torch.nn.attention.bias
    imports torch._dynamo, a second per process, in every stage worker. Elsewhere torch's
    bias itself (flash and memory-efficient kernels take it without a mask), imported then."""
    if device.type == "cpu":
        return torch.ones(n, kv_len, dtype=torch.bool).tril(kv_len - n)
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n, kv_len)


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
    """The decode path: "cpu" (one call of our C++ kernel) where the layout says the worker
    has it; "paged" (one Triton kernel reading the block tables, `paged_kernel.py`) where
    the layout says the worker runs it (CUDA with Triton, by default); "varlen" (one FlashAttention-2 call over the gathered keys) for CUDA fp16/bf16,
    a head_dim it takes (a multiple of 8 up to 256) and a cache in "tokens" order (it
    gathers rows of the flattened cache; kv_cache.py); else "views". Every path honours a
    sliding `window`."""
    if layout.cpu_decode and q.dtype in (torch.float32, torch.bfloat16):
        return "cpu"
    if layout.paged:
        return "paged"
    head_dim = q.shape[-1]
    if (q.is_cuda and q.dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256
            and k_cache.is_contiguous() and _torch_has_flash_varlen()):
        return "varlen"
    return "views"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     layout: BatchLayout, window: int | None = None) -> torch.Tensor:
    """Every decode of the micro-batch over the first kv_len keys of its block table (the
    last `window` of them with a window). q: [D, heads, head_dim], decodes in micro-batch
    order; caches: [num_blocks, block_size, kv_heads, head_dim]. Returns [D, heads, head_dim].

    "varlen": the keys of all decodes gathered, decode after decode, into one
    [sum(keys read), kv_heads, head_dim] varlen key batch (`decode_key_rows`)."""
    kernel = decode_kernel(q, k_cache, layout)
    if kernel == "cpu":
        _path_calls["decode_cpu"] += 1
        return decode_attention_cpu(q, k_cache, v_cache, layout.decode_tables,
                                    layout.decode_seqlens, window)
    if kernel == "paged":
        _path_calls["decode_paged"] += 1
        return paged_decode(q, k_cache, v_cache, layout.decode_tables, layout.decode_seqlens, window)
    if kernel == "varlen":
        _path_calls["decode_varlen"] += 1
        kv_heads, head_dim = k_cache.shape[2:]
        rows, cu_k, used = layout.decode_key_rows(window)
        k = k_cache.view(-1, kv_heads, head_dim).index_select(0, rows)  # [sum(used), kv_heads, head_dim]
        v = v_cache.view(-1, kv_heads, head_dim).index_select(0, rows)
        cu_q = torch.arange(len(layout.decode_lens) + 1, dtype=torch.int32, device=q.device)
        max_k = max(min(n, window or n) for n in layout.decode_lens)
        return flash_varlen(q, k, v, cu_q, cu_k, 1, max_k, used)
    return decode_attention_views(q, k_cache, v_cache, layout, window)


def decode_attention_views(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           layout: BatchLayout, window: int | None = None) -> torch.Tensor:
    """One SDPA call per decode on its gathered keys (no mask, so the fused kernels take it;
    with a window, its last `window` keys). q: [D, heads, head_dim]. Returns [D, heads, head_dim]."""
    out = torch.empty_like(q)
    device = k_cache.device
    for i, (blocks, n) in enumerate(zip(layout.decode_block_lists, layout.decode_lens)):
        table = torch.tensor(blocks, dtype=torch.long, device=device)
        first = max(0, n - window) if window else 0
        k = gather_kv(k_cache, table, n)[:, :, first:]  # [1, kv_heads, n - first, head_dim]
        v = gather_kv(v_cache, table, n)[:, :, first:]
        qi = q[i][None, :, None, :]  # [1, heads, 1, head_dim]
        out[i] = F.scaled_dot_product_attention(qi, k, v, enable_gqa=True)[0, :, 0, :]
    _path_calls["decode_views"] += len(layout.decode_lens)
    return out


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor,
                     layout: BatchLayout, window: int | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] for every row of the batch.
    Writes k, v into their blocks, then attends (each query to its last `window`
    positions with a window). Returns [T, heads, head_dim]."""
    k_cache[layout.write_blocks, layout.write_offsets] = k.to(k_cache.dtype)
    v_cache[layout.write_blocks, layout.write_offsets] = v.to(v_cache.dtype)
    if not layout.prefills:  # decodes only (rows in order): no scatter into an output
        return decode_attention(q, k_cache, v_cache, layout, window)
    out = torch.empty_like(q)
    for span in layout.prefills:
        out[span.rows] = prefill_attention(q[span.rows], k_cache, v_cache, span, layout, window)
    if layout.decode_lens:
        rows = layout.decode_rows
        out[rows] = decode_attention(q[rows], k_cache, v_cache, layout, window)
    return out

