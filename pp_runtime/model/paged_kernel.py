"""Paged decode attention on CUDA without a gather: one Triton kernel reads each decode's
keys and values straight from the paged cache through its block table.

The gather path (`attention.decode_attention`'s "varlen": copy every decode's key rows
into one batch, then FlashAttention-2) reads the keys once, writes them once and reads
them again; at 64 decodes of 1024 keys on LLaMA-13B shapes the keys and values are twice
the weights, so that copy was most of a decode-only micro-batch. The kernel here reads
them once, and its inputs have fixed shapes (the block tables padded to a width, the
lengths in a tensor), so a CUDA graph can capture it (`worker/graphs.py`).

One program per (decode, query head): it walks the decode's positions [lo, n) in tiles
of BLOCK_N, finds each position's block in the table (position // block_size) and its
row in the block, and keeps the online softmax (running max, running sum, running
output) in fp32. GQA: query head h reads KV head h // group. A sliding window W starts
at n - W. Triton is an optional extra (it comes with CUDA builds of torch); without it,
or on a CPU, the gather path runs. `TRITON_INTERPRET=1` runs this kernel on a CPU
(numpy), which is how the CPU tests check it against the other paths.
"""
from __future__ import annotations

import functools
import os

import torch

from pp_runtime.config import Config
from pp_runtime.core.errors import ConfigError


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (and, outside its CPU interpreter, a GPU is there to run it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001  absent or broken: the gather path runs
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                            sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, st_d, so_t, so_h,
                            scale, window, group,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HEAD_P2: tl.constexpr, BLOCK_N: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // group
        n = tl.load(lens_ptr + seq)
        lo = tl.maximum(n - window, 0)  # no window: window = 2**30
        d = tl.arange(0, HEAD_P2)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + seq * sq_t + head * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_P2,), tl.float32)
        for start in range(lo, n, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pmask = pos < n
            blk = tl.load(tables_ptr + seq * st_d + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
            row = (pos % BLOCK_SIZE).to(tl.int64)
            mask2 = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + blk[:, None] * sk_b + row[:, None] * sk_s + kvh * sk_h + d[None, :],
                        mask=mask2, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(pmask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + blk[:, None] * sv_b + row[:, None] * sv_s + kvh * sv_h + d[None, :],
                        mask=mask2, other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(out_ptr + seq * so_t + head * so_h + d, out.to(out_ptr.dtype.element_ty), mask=dmask)

    return paged_decode_kernel


def use_paged_decode(cfg: Config, device: torch.device) -> bool:
    """Whether a stage of `cfg` on `device` decodes through this kernel
    (`runtime.decode_attention`): auto on CUDA where Triton imports; paged wherever
    Triton runs (on a CPU only under TRITON_INTERPRET=1, for tests); gather never."""
    mode = cfg.runtime.decode_attention
    if mode == "gather":
        return False
    if mode == "paged":
        if not triton_available():
            raise ConfigError("runtime.decode_attention: paged needs Triton (it comes with "
                              "CUDA builds of torch; on a CPU only with TRITON_INTERPRET=1); "
                              "use auto or gather")
        return True
    return device.type == "cuda" and triton_available()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, window: int | None = None,
                 block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """q: [D, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim] (any
    memory order with the head_dim innermost); tables: [D, width] int32 block ids (only
    the first ceil(n / block_size) of a row are read); lens: [D] int32 keys per decode
    (its own included, >= 1). Returns [D, heads, head_dim] in q's dtype."""
    import triton

    D, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode: head_dim must be the innermost dimension")
    out = torch.empty_like(q)
    if D == 0:
        return out
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    _kernel()[(D, heads)](
        q, k_cache, v_cache, tables, lens, out,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], tables.stride(0),
        out.stride(0), out.stride(1), head_dim ** -0.5, int(window or 2**30), heads // kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_P2=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, num_warps=num_warps)
    return out
