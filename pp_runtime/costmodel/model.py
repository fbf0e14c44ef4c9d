"""The cost of one pipeline stage for one micro-batch.

A stage runs its layers over all tokens of the micro-batch at once (the prefill chunks'
tokens plus one per decode: SARATHI's fused linear layers), so per layer

    linear(T) + other(T) + 2 all-reduces(T)      T = tokens, from per-T tables
  + sum over chunks of prefill_attention(start, n)
  + decode_attention(count, sum of KV lengths)

times the stage's layers (`Config.layers_per_stage`: even, explicit or balanced); the
first stage adds the embedding, the last the final norm and LM head over the rows that
sample (every decode and, for simplicity, every prefill chunk). With a calibration of the
executor in the profile (`calibration.py`) each part is corrected by its compute fit
(contention, per-layer and per-row work the tables leave out), and `host` carries the
host costs the simulator charges.
The simulator calls `stage_times` for every micro-batch, so everything that depends on T
alone is a Python list indexed by T (grown on demand); the rest are closed forms.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Sequence

import numpy as np

from pp_runtime.costmodel import calibration
from pp_runtime.costmodel.calibration import Calibration, ComputeFit
from pp_runtime.costmodel.devices import device_spec
from pp_runtime.costmodel.network import all_reduce, gather, send
from pp_runtime.costmodel.pricing import (Priced, Pricing, Target, attention, layer_ops,
                                          linear_sources, load_profile, price_op)
from pp_runtime.costmodel.roofline import LayerShape

ATTENTION_HALF = ("qkv_proj", "out_proj")  # LAYER_OPS of a layer's attention half; the
SHARED = ("other", "tp_all_reduce")  # norms, adds, all-reduces: half in each half; the rest MLP

if TYPE_CHECKING:  # annotations only: the config consults the cost model for `auto`
    from pp_runtime.config import Config


def build_pricing(cfg: Config) -> Pricing:
    """Every operation of this config priced by its best source (pricing.py)."""
    hw = cfg.hardware
    dev = device_spec(hw.gpu)
    profile = load_profile(hw.profile, dev) if hw.profile else None
    t = Target(LayerShape.of(cfg.model, cfg.parallel.tp), profile.device if profile else dev,
               profile, hw.gpus_per_node)
    sources = linear_sources(t)
    layer = layer_ops(t, sources)
    ar = all_reduce(t)
    if ar is not None:
        layer["tp_all_reduce"] = Priced(lambda n: 2 * ar[0](n), f"2 per layer x {ar[0].source}")
    norm = price_op("input_layernorm", t, sources)
    lm = price_op("lm_head", t, sources)  # measured in local profiles, else the roofline
    head = Priced(lambda r: norm(r) + lm(r), f"final norm: {norm.source}; LM head matmul: {lm.source}")
    return Pricing(layer, price_op("emb", t, sources), head, attention(t), send(t, True),
                   send(t, False), gather(t, ar))


def build_cost_model(cfg: Config) -> "StageCostModel":
    return StageCostModel(cfg, build_pricing(cfg), find_calibration(cfg))


def find_calibration(cfg: Config) -> Calibration | None:
    """The profile's calibration of the executor this config runs on, at its tp and pp, on
    the path its settings ask for (None without a profile, or when that was never calibrated).
    Ray under `compiled_graph: auto` takes what auto chose where it was calibrated (a
    calibration from before paths were recorded: a task per actor)."""
    if not cfg.hardware.profile:
        return None
    p, rt, prof = cfg.parallel, cfg.runtime, cfg.hardware.profile
    kind = calibration.executor_kind(rt.executor, p.tp, p.pp)
    if kind != "ray":
        return calibration.load(prof, kind, p.pp, tp=p.tp)
    if rt.compiled_graph == calibration.AUTO:
        return (calibration.load(prof, kind, p.pp, calibration.AUTO, p.tp)
                or calibration.load(prof, kind, p.pp, tp=p.tp))
    path = "graph" if rt.compiled_graph else "relay" if rt.tp_relay and p.tp > 1 else ""
    return calibration.load(prof, kind, p.pp, path, p.tp)


def table(p: Priced | None, size: int) -> np.ndarray:
    """p at 0 .. size-1: zero at 0 (an empty micro-batch costs nothing) and non-decreasing
    (a running maximum irons out the small wiggles of a roofline ratio between tiles)."""
    if p is None:
        return np.zeros(size)
    values = np.broadcast_to(np.asarray(p(np.arange(size)), dtype=float), (size,)).copy()
    values[0] = 0.0
    return np.maximum.accumulate(values)


_TABLES: "weakref.WeakKeyDictionary[Pricing, tuple]" = weakref.WeakKeyDictionary()


def _tables(p: Pricing, size: int) -> tuple:
    """`StageCostModel._grow`'s tables for token counts [0, size) of one pricing."""
    ops = {name: table(op, size) for name, op in p.layer.items()}
    attn = sum((ops[n] for n in ATTENTION_HALF if n in ops), np.zeros(size))
    shared = sum((ops[n] for n in SHARED if n in ops), np.zeros(size))
    return ({name: values.tolist() for name, values in ops.items()},  # s per layer, by op
            sum(ops.values(), np.zeros(size)).tolist(),  # all of them, one layer
            (attn + shared / 2).tolist(),  # one layer's attention half, less attention
            table(p.embedding, size).tolist(),
            table(p.lm_head, size).tolist(),  # by sampling rows
            {True: table(p.send_inter, size).tolist(), False: table(p.send_intra, size).tolist()},
            table(p.gather, size).tolist())


class StageCostModel:
    """Seconds of compute per stage for a micro-batch; seconds to send it between stages."""

    def __init__(self, cfg: Config, pricing: Pricing, cal: Calibration | None = None):
        pp, tp = cfg.parallel.pp, cfg.parallel.tp
        self.pricing, self.calibration = pricing, cal
        self.fit = cal.compute if cal else ComputeFit()  # identity without a calibration
        self.stage_f = self.fit.stage_factors(pp)  # each stage's own calibration, or None
        self.host = cal.host if cal else None  # the simulator's host costs (executors/sim.py)
        self.layers = cfg.layers_per_stage()  # layers per stage (whole or half layers)
        self.deepest = self.layers.index(max(self.layers))  # stage that breakdown() reports
        # (attention halves, MLP halves) per stage where the split cuts a layer in two
        units = [cfg.stage_units(s) for s in range(pp)]
        self.halves = (None if all(lo % 2 == 0 and hi % 2 == 0 for lo, hi in units) else
                       [((hi + 1) // 2 - (lo + 1) // 2, hi // 2 - lo // 2) for lo, hi in units])
        # stage s holds GPUs [s*tp, (s+1)*tp); a send crosses nodes when first GPUs differ
        self.node = [s * tp // cfg.hardware.gpus_per_node for s in range(pp)]
        self._prefill = pricing.attention.prefill  # (start, n) -> s per layer
        self._decode = pricing.attention.decode  # (count, sum_kv) -> s per layer
        self._chunkable = self.chunkable()  # `with_chunk` applies
        self._size = 0
        self._kept: tuple | None = None  # (prefills, decode KV lengths, stage times): `keep_stage_times`
        longest = max(cfg.seq_len, cfg.chunk_tokens, cfg.planner.token_budget or 0)
        self._grow(longest + cfg.batch_rows + 1)

    def _grow(self, size: int) -> None:
        """Per-token-count tables (Python lists: no numpy scalars on the hot path), shared by
        every cost model built on the same `Pricing` object (`_TABLES`: the plan builds one
        per layout on a few pricings) and never written after they are built."""
        kept = _TABLES.get(self.pricing)
        if kept is None or kept[0] < size:
            kept = _TABLES[self.pricing] = (size, _tables(self.pricing, size))
        (self._ops, self._layer, self._attn_half, self._emb, self._head, self._send,
         self._gather) = kept[1]
        self._size = kept[0]

    # ---- the hot path -----------------------------------------------------------------
    def parts(self, prefills: Sequence[tuple[int, int]],
              decode_kv_lens: Sequence[int]) -> tuple[float, float, float]:
        """Seconds of (one layer, the first stage's embedding, the last stage's final norm +
        LM head) for a micro-batch. prefills: (start, n) chunks; decode_kv_lens: the KV
        length each decode attends to (itself included)."""
        tokens = nd = len(decode_kv_lens)
        attn = self._decode(nd, sum(decode_kv_lens)) if nd else 0.0
        for start, n in prefills:
            tokens += n
            attn += self._prefill(start, n)
        if tokens >= self._size:
            self._grow(2 * tokens)
        rows, fit = nd + len(prefills), self.fit
        scale = fit.scale  # fit.per_layer and fit.extra, written out (the hot path)
        return (scale * (self._layer[tokens] + attn) + fit.per_layer_s, scale * self._emb[tokens],
                scale * self._head[rows] + fit.per_row_s * rows)

    def stage_times(self, prefills: Sequence[tuple[int, int]],
                    decode_kv_lens: Sequence[int]) -> list[float]:
        """Seconds of compute on each stage: its layers, plus `parts`' extras at the ends."""
        kept = self._kept
        if kept is not None and kept[1] == decode_kv_lens and kept[0] == prefills:
            return kept[2][:]  # the micro-batch `keep_stage_times` priced last
        per_layer, emb, head = self.parts(prefills, decode_kv_lens)
        if self.halves is None:
            times = [k * per_layer for k in self.layers]
        else:  # a layer cut in two: each stage's attention and MLP halves priced apart
            attn = self.attention_half(prefills, decode_kv_lens)
            times = [a * attn + m * (per_layer - attn) for a, m in self.halves]
        times[0] += emb
        times[-1] += head
        if self.stage_f is not None:
            return [t * f for t, f in zip(times, self.stage_f)]
        return times

    def keep_stage_times(self, prefills: list[tuple[int, int]],
                         decode_kv_lens: list[int]) -> list[float]:
        """`stage_times`, kept for the next call asking for the same micro-batch (the
        simulated executor prices the one the planner just priced): the caller's lists are
        kept as they are, so it must not change them afterwards."""
        times = self.stage_times(prefills, decode_kv_lens)
        self._kept = (prefills, decode_kv_lens, times[:])
        return times

    def with_chunk(self, prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]):
        """`stage_times(prefills + [(start, n)], decode_kv_lens)` for many (start, n), what
        does not depend on them priced once (a binary search over n asks ~10 times per
        micro-batch): a function (start, n) -> (stage 0's time, a middle stage's time
        (None where the middle stages' layers differ), the last stage's time), or None
        where a layer is cut in two (`halves`: use `stage_times`). The same floats in the
        same order as `parts` and `stage_times`, so the same seconds to the bit."""
        if not self._chunkable:
            return None
        return self._with_chunk(prefills, len(decode_kv_lens), sum(decode_kv_lens))

    def with_chunk_decodes(self, prefills: Sequence[tuple[int, int]], count: int, kv_len: int):
        """`with_chunk(prefills, [kv_len] * count)` without building the list (the same
        floats: the sum of the KV lengths is an int)."""
        if not self._chunkable:
            return None
        return self._with_chunk(prefills, count, kv_len * count)

    def chunkable(self) -> bool:
        """No layer cut in two, and the middle stages (between the first and the last)
        all of the same layers (kept as `_chunkable` at the start: none of them changes)."""
        f = self.stage_f
        return (self.halves is None and len(set(self.layers[1:-1])) <= 1
                and (f is None or len(set(f[1:-1])) <= 1))

    def _with_chunk(self, prefills: Sequence[tuple[int, int]], nd: int, sum_kv: int):
        layers = self.layers
        k0, kl, km = layers[0], layers[-1], (layers[1] if len(layers) > 2 else None)
        fixed = nd
        attn0 = self._decode(nd, sum_kv) if nd else 0.0
        for start, n in prefills:
            fixed += n
            attn0 += self._prefill(start, n)
        rows, fit, prefill, one = nd + len(prefills) + 1, self.fit, self._prefill, len(self.layers) == 1
        scale, per_layer_s, per_row = fit.scale, fit.per_layer_s, fit.per_row_s * (nd + len(prefills) + 1)
        f = self.stage_f
        f0, fm, fl = (1.0, 1.0, 1.0) if f is None else (f[0], f[1] if len(f) > 2 else 1.0, f[-1])

        def times(start: int, n: int) -> tuple[float, float | None, float]:
            tokens = fixed + n
            attn = attn0 + prefill(start, n)
            if tokens >= self._size:
                self._grow(2 * tokens)
            per_layer = scale * (self._layer[tokens] + attn) + per_layer_s
            emb = scale * self._emb[tokens]
            head = scale * self._head[rows] + per_row
            if f is None:
                if one:
                    t = k0 * per_layer + emb + head
                    return t, None, t
                return k0 * per_layer + emb, None if km is None else km * per_layer, kl * per_layer + head
            if one:  # the stages' own factors, applied as `stage_times` does (the same floats)
                t = (k0 * per_layer + emb + head) * f0
                return t, None, t
            return ((k0 * per_layer + emb) * f0, None if km is None else km * per_layer * fm,
                    (kl * per_layer + head) * fl)

        return times

    def attention_half(self, prefills: Sequence[tuple[int, int]],
                       decode_kv_lens: Sequence[int]) -> float:
        """Seconds of one layer's attention half (its QKV and output projections, the
        attention itself, half the norms, adds and all-reduces, half the per-layer fit);
        the rest of `parts`' layer is its MLP half."""
        tokens = len(decode_kv_lens) + sum(n for _, n in prefills)
        attn = self._decode(len(decode_kv_lens), sum(decode_kv_lens)) if decode_kv_lens else 0.0
        attn += sum(self._prefill(start, n) for start, n in prefills)
        if tokens >= self._size:
            self._grow(2 * tokens)
        fit = self.fit
        return fit.scale * (self._attn_half[tokens] + attn) + fit.per_layer_s / 2

    def microbatch_time(self, prefills: Sequence[tuple[int, int]],
                        decode_kv_lens: Sequence[int]) -> float:
        """The slowest stage: the CostModel protocol of pp_runtime/planner/cost.py."""
        return max(self.stage_times(prefills, decode_kv_lens))

    def send_time(self, num_tokens: int, stage: int) -> float:
        """Seconds to move a micro-batch of num_tokens from stage - 1 to stage: each TP rank
        sends its 1/tp slice (over InfiniBand when the stages sit on different nodes, else
        NVLink), then the receiving ranks all-gather the slices."""
        if not 1 <= stage < len(self.layers):
            raise ValueError(f"stage {stage} has no previous stage (pp = {len(self.layers)})")
        if num_tokens >= self._size:
            self._grow(2 * num_tokens)
        cross = self.node[stage - 1] != self.node[stage]
        return self._send[cross][num_tokens] + self._gather[num_tokens]

    def crosses_nodes(self, stage: int) -> bool:
        """Whether the send into `stage` goes between nodes."""
        return self.node[stage - 1] != self.node[stage]

    # ---- reports ----------------------------------------------------------------------
    def breakdown(self, prefills: Sequence[tuple[int, int]],
                  decode_kv_lens: Sequence[int]) -> dict[str, float]:
        """Seconds per operation on the stage with the most layers (the first such: stage 0,
        which also runs the embedding; with pp = 1 the LM head too). Sums to its stage time."""
        s, k = self.deepest, self.layers[self.deepest]
        tokens = sum(n for _, n in prefills) + len(decode_kv_lens)
        rows = len(decode_kv_lens) + len(prefills)
        if tokens >= self._size:
            self._grow(2 * tokens)
        out = {name: k * values[tokens] for name, values in self._ops.items()}
        out["attn_prefill"] = k * sum(self._prefill(st, n) for st, n in prefills)
        out["attn_decode"] = k * (self._decode(len(decode_kv_lens), sum(decode_kv_lens))
                                  if decode_kv_lens else 0.0)
        if s == 0:
            out["embedding"] = self._emb[tokens]
        if s == len(self.layers) - 1:
            out["lm_head"] = self._head[rows]
        fit = self.fit
        if self.calibration is not None:  # contention and what the tables leave out
            out = {name: fit.scale * t for name, t in out.items()}
            out["calibrated_overhead"] = k * fit.per_layer_s + (
                fit.per_row_s * rows if s == len(self.layers) - 1 else 0.0)
            if self.stage_f is not None:
                out = {name: self.stage_f[s] * t for name, t in out.items()}
        return out

    def sources(self) -> dict[str, str]:
        """Operation -> which source priced it."""
        p = self.pricing
        out = {name: op.source for name, op in p.layer.items()}
        out["attn_prefill"] = out["attn_decode"] = p.attention.source
        out["embedding"] = p.embedding.source
        out["lm_head"] = p.lm_head.source
        out["send_inter_node"] = p.send_inter.source
        out["send_intra_node"] = p.send_intra.source
        if p.gather is not None:
            out["send_all_gather"] = p.gather.source
        if self.calibration is not None:
            out["calibration"] = calibration.describe(self.calibration)
        return out
