"""Attention cost: closed forms fitted to a measured attention table.

A prefill chunk of n tokens starting at position `start` (so `start` keys already in the
cache: the table's `kv_cache_size`) and a batch of decodes attending to `sum_kv` keys in
all (a decode row's keys are its `kv_cache_size` cached tokens + itself) cost, per layer
and TP rank,

    prefill(start, n)     = a0 + n * (a1 + a2 * start + a3 * n)       # a3: the causal n^2/2
    decode(count, sum_kv) = d0 + d1 * count + d2 * sum_kv              # every K/V byte read once

fitted by least squares of the relative error, refit without any term whose coefficient
came out negative (`lstsq_dropping_negatives`: coefficients >= 0, so cost never falls as
tokens or keys grow). Decodes of mixed KV lengths are priced by their total keys: decode
attention is memory-bound and reads each cached byte once, so the total is what costs.
A fit is carried to another model by the ratio of per-rank widths (query width for the
compute-bound prefill, K/V width for the memory-bound decode) and to another device by the
ratio of peak FLOP/s (prefill) or memory bandwidth (decode); the intercepts (launch
overheads) stay as measured.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pp_runtime.costmodel.profiles import MS, _read_table, median, read_table
from pp_runtime.costmodel.roofline import LayerShape


@dataclass(frozen=True)
class AttentionFit:
    prefill: tuple[float, float, float, float]  # a0 [s], a1 [s/tok], a2 [s/tok/key], a3 [s/tok^2]
    decode: tuple[float, float, float]  # d0 [s], d1 [s/decode], d2 [s/key]
    q_width: int  # per-rank query width of the measured shape
    kv_width: int  # per-rank K/V width of the measured shape
    head_dim: int  # of the measured shape; a fit is only carried to the same head_dim
    label: str  # where it came from

    def prefill_time(self, start: int, n: int) -> float:
        a0, a1, a2, a3 = self.prefill
        return a0 + n * (a1 + a2 * start + a3 * n)

    def decode_time(self, count: int, sum_kv: int) -> float:
        d0, d1, d2 = self.decode
        return d0 + d1 * count + d2 * sum_kv if count else 0.0

    def scaled(self, prefill_ratio: float, decode_ratio: float) -> "AttentionFit":
        """Variable terms times a ratio, intercepts kept."""
        a0, a1, a2, a3 = self.prefill
        d0, d1, d2 = self.decode
        r, q = prefill_ratio, decode_ratio
        return AttentionFit((a0, a1 * r, a2 * r, a3 * r), (d0, d1 * q, d2 * q),
                            self.q_width, self.kv_width, self.head_dim, self.label)


def lstsq_dropping_negatives(x: np.ndarray, y: np.ndarray, relative: bool = True) -> np.ndarray:
    """Least squares of relative error (else of the error itself), then refit without every
    feature whose coefficient came out negative, until none is: coefficients >= 0, but not
    the optimum of non-negative least squares (`scipy.optimize.nnls`, not a dependency here,
    may keep a feature this drops). Few features, so few refits."""
    w = 1.0 / np.maximum(y, 1e-9) if relative else np.ones_like(y)
    active = list(range(x.shape[1]))
    while active:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(x.shape[1])
            out[active] = coef
            return out
        active = [a for a, c in zip(active, coef) if c >= 0]
    return np.zeros(x.shape[1])


def fit_attention(path: Path, shape: LayerShape, label: str,
                  exact: bool) -> AttentionFit | None:
    """Fit the rows of `path` for `shape` (exact: n_embd, heads and tp all equal; else any
    rows with the same head_dim, the first shape found). None when no rows fit, or too few
    (4 prefill and 3 decode points at least). Fitted once per file version (its mtime) and
    arguments in a process."""
    return _fit_attention(str(path), path.stat().st_mtime, shape, label, exact)


@functools.lru_cache(maxsize=64)
def _fit_attention(path: str, mtime: float, shape: LayerShape, label: str,
                   exact: bool) -> AttentionFit | None:
    t = _read_table(path, mtime)
    keys = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers")
    if not len(t.get("n_embd", ())):
        return None
    cols = np.stack([t[k] for k in keys], axis=1)
    want = (shape.n_embd, shape.n_head, shape.n_kv_head, shape.tp)
    found = [k for k in {tuple(r) for r in cols.tolist()}
             if (k == want if exact else int(k[0]) // int(k[1]) == shape.head_dim)]
    if not found:
        return None
    e, h, kv, tp = (int(v) for v in sorted(found)[0])
    rows = np.all(cols == (e, h, kv, tp), axis=1)
    pre = rows & (t["is_prefill"] == 1) & ~np.isnan(t[median("attn_prefill")])
    dec = rows & (t["is_prefill"] == 0) & ~np.isnan(t[median("attn_decode")])
    if pre.sum() < 4 or dec.sum() < 3:
        return None
    n, start = t["prefill_chunk_size"][pre], t["kv_cache_size"][pre]
    a = lstsq_dropping_negatives(np.stack([np.ones_like(n), n, n * start, n * n], axis=1),
                   t[median("attn_prefill")][pre] * MS)
    b, keys = t["batch_size"][dec], t["kv_cache_size"][dec] + 1  # cached + the new token
    d = lstsq_dropping_negatives(np.stack([np.ones_like(b), b, b * keys], axis=1),
                   t[median("attn_decode")][dec] * MS)
    hd = e // h
    return AttentionFit(tuple(a.tolist()), tuple(d.tolist()), h // tp * hd, kv // tp * hd, hd,
                        f"{label} (n_embd={e} heads={h}/{kv} tp={tp})")
