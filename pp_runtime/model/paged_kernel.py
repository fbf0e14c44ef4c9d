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
        import triton.language as tl  # noqa: F401
    except Exception:  # noqa: BLE001  absent or broken: the gather path runs
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr,
                            sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, st_d, so_t, so_h,
                            scale, window, group, split_keys, heads, nsplit,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HEAD_P2: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
        kvh = head // group
        n = tl.load(lens_ptr + seq)
        lo = tl.maximum(n - window, 0) + split * split_keys  # no window: window = 2**30
        hi = tl.minimum(n, lo + split_keys)
        d = tl.arange(0, HEAD_P2)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + seq * sq_t + head * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_P2,), tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pmask = pos < hi
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
        if SPLIT:  # this split's running max, sum and output, combined by the second kernel
            at = (seq * heads + head) * nsplit + split
            tl.store(ml_ptr + 2 * at, m_i)
            tl.store(ml_ptr + 2 * at + 1, l_i)
            tl.store(part_ptr + at * HEAD_P2 + d, acc)
        else:
            out = acc / l_i
            tl.store(out_ptr + seq * so_t + head * so_h + d, out.to(out_ptr.dtype.element_ty), mask=dmask)

    @triton.jit
    def combine_kernel(part_ptr, ml_ptr, out_ptr, so_t, so_h, heads, nsplit,
                       HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, NSPLIT_P2: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, NSPLIT_P2)
        smask = sp < nsplit
        at = (seq * heads + head) * nsplit + sp
        m = tl.load(ml_ptr + 2 * at, mask=smask, other=float("-inf"))
        l_s = tl.load(ml_ptr + 2 * at + 1, mask=smask, other=0.0)
        big = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))  # empty splits weigh nothing
        d = tl.arange(0, HEAD_P2)
        acc = tl.load(part_ptr + at[:, None] * HEAD_P2 + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
        tl.store(out_ptr + seq * so_t + head * so_h + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)

    return paged_decode_kernel, combine_kernel


def splits(programs: int, max_keys: int, block_n: int, sms: int) -> tuple[int, int]:
    """(splits per decode and head, keys per split): one split where (decode, head) programs
    already fill the GPU (4 per multiprocessor), else enough splits of at least 2 tiles to
    fill it, at most 16. `max_keys`: the most keys a decode can read (a graph's table width
    times the block size: a fixed number, so a captured graph keeps its launch shape)."""
    want = -(-4 * sms // max(programs, 1))
    if want <= 1 or max_keys <= 2 * block_n:
        return 1, max(max_keys, 1)
    keys = max(2 * block_n, -(-max_keys // min(want, 16)))
    keys = -(-keys // block_n) * block_n  # whole tiles
    return -(-max_keys // keys), keys


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
                 block_n: int = 128, num_warps: int = 2, max_keys: int | None = None,
                 sms: int | None = None) -> torch.Tensor:
    """q: [D, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim] (any
    memory order with the head_dim innermost); tables: [D, width] int32 block ids (only
    the first ceil(n / block_size) of a row are read); lens: [D] int32 keys per decode
    (its own included, >= 1). Returns [D, heads, head_dim] in q's dtype.

    Few decodes (fewer (decode, head) programs than 4 per multiprocessor) split their keys
    (`splits`, flash-decoding): each split's partial softmax goes to fp32 scratch and a
    second kernel combines them. `max_keys` bounds the keys of any decode (default: the
    table width times the block size, fixed for a graph); `sms`: the GPU's
    multiprocessors (default: this device's; 1 on a CPU). BLOCK_N 128 with 2 warps was
    the fastest tile on an H200 at 4 and at 64 decodes (benchmarks/gpu_check.py,
    paged-kernel; docs/gpu.md)."""
    import triton

    D, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode: head_dim must be the innermost dimension")
    out = torch.empty_like(q)
    if D == 0:
        return out
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    if window:
        max_keys = min(max_keys or window, window)
    max_keys = max_keys or tables.shape[1] * block_size
    if sms is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    nsplit, keys = splits(D * heads, max_keys, block_n, sms)
    p2 = triton.next_power_of_2(head_dim)
    part = ml = out  # unused without splits
    if nsplit > 1:
        part = torch.empty(D * heads * nsplit * p2, dtype=torch.float32, device=q.device)
        ml = torch.empty(D * heads * nsplit * 2, dtype=torch.float32, device=q.device)
    decode, combine = _kernels()
    decode[(D, heads, nsplit)](
        q, k_cache, v_cache, tables, lens, out, part, ml,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], tables.stride(0),
        out.stride(0), out.stride(1), head_dim ** -0.5, int(window or 2**30), heads // kv_heads,
        keys, heads, nsplit, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_P2=p2,
        BLOCK_N=block_n, SPLIT=nsplit > 1, num_warps=num_warps)
    if nsplit > 1:
        combine[(D, heads)](part, ml, out, out.stride(0), out.stride(1), heads, nsplit,
                            HEAD_DIM=head_dim, HEAD_P2=p2, NSPLIT_P2=triton.next_power_of_2(nsplit))
    return out
