"""Balanced pipeline stages: `parallel.layer_split: auto`.

Every stage runs its layers over the same micro-batch, but stage 0 also embeds the tokens
and the last stage also runs the final norm, the LM head and sampling; with an even split
the last stage is the slowest and sets the pace (DynaPipe; Megatron's uneven first and
last stages; vLLM's layer partition). `auto` prices with the cost model the micro-batches
a SARATHI run is made of, per prefill chunk of the workload:

  - one full micro-batch: a chunk of C (less the B - 1 decodes when tile-aligned) plus
    B - 1 decodes at half the KV length (the micro-batch `uniform` targets);
  - the decodes that do not ride along with chunks, B to a decode-only micro-batch:
    (C * D / P - (B - 1)) / B of them per chunk (P:D from the workload; none if <= 0).

Decode-only micro-batches are cheap per layer but pay the whole LM head (its weights are
read whatever the row count), so they are what makes the last stage busier; one full
micro-batch alone misses most of it. A stage's busy time over the run is linear in its
layer count, so summing the three parts (layer, embedding, head) over that mix and then

    minimise over contiguous splits (k_0 .. k_pp-1, each >= 1, summing to num_layers)
        max_s  k_s * layer + [s = 0] * embedding + [s = pp - 1] * head

by dynamic programming over (stage, layers so far); among the splits that reach the
minimum, the one with the most even stage times (least sum of squares; ties: earlier
stages take more layers, as the even split does). Where whole layers cannot balance the
stages, the same search over half layers (each layer an attention half and an MLP half,
priced apart: `StageCostModel.attention_half`) may cut one layer at a boundary; it is
taken only where it lowers the slowest stage. No torch.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from pp_runtime.config import Config

_CHOSEN: dict[tuple, list[int]] = {}  # auto splits chosen in this process, by what prices them
_REL = 1e-9  # stage times within this relative distance are equal (float noise)


def typical_microbatches(cfg: Config) -> list[tuple[float, list[tuple[int, int]], list[int]]]:
    """(weight, prefills, decode KV lengths) of the micro-batches per prefill chunk of a
    SARATHI run of this workload: one full micro-batch, and the decode-only ones."""
    pl, w = cfg.planner, cfg.workload
    rows, size = cfg.batch_rows, cfg.chunk_tokens
    decodes, kv = rows - 1, max(1, cfg.seq_len // 2)
    chunk = max(1, size - decodes if pl.tile_align else size)
    d_per_p = w.output_len / w.prompt_len if w.kind == "fixed" else 1 / w.pd_ratio
    decode_only = max(0.0, chunk * d_per_p - decodes) / rows
    mix = [(1.0, [(0, chunk)], [kv] * decodes)]
    if decode_only > 0:
        mix.append((decode_only, [], [kv] * rows))
    return mix


def balanced_split(num_layers: int, layer_s: float, extra_s: Sequence[float]) -> list[int]:
    """Layers per stage minimising the slowest stage, where stage s holding k layers costs
    k * layer_s + extra_s[s] (len(extra_s) stages, each >= 1 layer); see the module doc."""
    return balanced_units([layer_s] * num_layers, extra_s)


def balanced_half_split(num_layers: int, attn_s: float, mlp_s: float,
                        extra_s: Sequence[float]) -> list[float]:
    """`balanced_split` where a stage boundary may also cut a layer between its attention
    half (attn_s) and its MLP half (mlp_s): the half-layer split where it lowers the
    slowest stage, else the whole-layer one (counts in layers: 6.5 is six layers and an
    attention half, or an MLP half and six layers)."""
    whole = balanced_split(num_layers, attn_s + mlp_s, extra_s)
    units = balanced_units([attn_s, mlp_s] * num_layers, extra_s)

    def slowest(counts: Sequence[float], first_unit_costs: Sequence[float]) -> float:
        out, at = 0.0, 0
        for s, k in enumerate(counts):
            n = round(k * len(first_unit_costs) / num_layers)
            out = max(out, sum(first_unit_costs[at:at + n]) + extra_s[s])
            at += n
        return out

    halves = [k / 2 for k in units]
    if slowest(halves, [attn_s, mlp_s] * num_layers) < slowest(whole, [attn_s + mlp_s] * num_layers) * (1 - _REL):
        return [int(k) if float(k).is_integer() else k for k in halves]
    return whole


def balanced_units(unit_s: Sequence[float], extra_s: Sequence[float]) -> list[int]:
    """Contiguous units per stage minimising the slowest stage, stage s costing the sum of
    its units' unit_s plus extra_s[s] (each stage >= 1 unit); among the splits that reach
    the minimum, the least sum of squared stage times (ties: earlier stages take more)."""
    pp, total = len(extra_s), len(unit_s)
    if not 1 <= pp <= total:
        raise ValueError(f"{total} layers cannot fill {pp} stages")
    prefix = [0.0]
    for u in unit_s:
        prefix.append(prefix[-1] + u)

    def cost(s: int, n: int, k: int) -> float:  # stage s holding units [n - k, n)
        return prefix[n] - prefix[n - k] + extra_s[s]

    def choices(s: int, n: int) -> range:  # units stage s may take when stages 0..s hold n
        return range(1, n - s + 1) if s else range(n, n + 1)

    inf = float("inf")
    # pass 1: least slowest stage over stages 0..s holding n units (`cost`, max and min
    # written out: the same floats; the plan resolves dozens of splits before it searches)
    worst = [[inf] * (total + 1) for _ in range(pp)]
    for s in range(pp):
        row, extra = worst[s], extra_s[s]
        if not s:
            for n in range(1, total - pp + 2):
                row[n] = prefix[n] - prefix[0] + extra
            continue
        before = worst[s - 1]
        for n in range(s + 1, total - (pp - 1 - s) + 1):
            top, best = prefix[n], inf
            for k in range(1, n - s + 1):
                w, c = before[n - k], top - prefix[n - k] + extra
                m = c if c > w else w
                if m < best:
                    best = m
            row[n] = best
    cap = worst[pp - 1][total] * (1 + _REL) + 1e-15
    # pass 2: least sum of squared stage times with every stage within the cap
    squares = [[inf] * (total + 1) for _ in range(pp)]
    take = [[0] * (total + 1) for _ in range(pp)]
    for s in range(pp):
        for n in range(s + 1, total - (pp - 1 - s) + 1):
            for k in choices(s, n):  # ascending: on a tie the earlier stages keep more
                t = cost(s, n, k)
                if t > cap:
                    break  # cost grows with k
                total_sq = (squares[s - 1][n - k] if s else 0.0) + t * t
                if total_sq < squares[s][n] * (1 - _REL):
                    squares[s][n], take[s][n] = total_sq, k
    split, n = [], total
    for s in reversed(range(pp)):
        split.append(take[s][n])
        n -= take[s][n]
    return split[::-1]


def profile_stamp(profile: str | None) -> tuple:
    """When a profile's files last changed (a new calibration changes the split)."""
    if not profile:
        return ()
    path = Path(profile).expanduser()
    return tuple(f.stat().st_mtime_ns if f.is_file() else 0
                 for f in (path / "mlp.csv", path / "attention.csv", path / "calibration.json"))


def resolve_layer_split(cfg: Config) -> Config:
    """`cfg` with an auto layer split chosen (`auto_layer_split`), once, where a run or a
    simulation is built (`LLM`, `simulate`, a torchrun rank, the plan's candidates, the
    calibrator); any other split is returned as it is. `Config` refuses an auto split
    that was not chosen (`Config.layers_per_stage`)."""
    if not cfg.layer_split_pending:
        return cfg
    return cfg.with_overrides(layer_split=auto_layer_split(cfg))


def auto_layer_split(cfg: Config) -> list[int]:
    """`parallel.layer_split: auto` for this config: `balanced_split` of the per-layer,
    embedding and head times summed over `typical_microbatches` (cached per process)."""
    from pp_runtime.costmodel.model import build_cost_model

    w = cfg.workload
    key = (cfg.model, cfg.parallel.tp, cfg.parallel.pp, cfg.planner, cfg.seq_len, cfg.hardware,
           cfg.runtime.executor, w.kind, w.pd_ratio, w.prompt_len, w.output_len,
           profile_stamp(cfg.hardware.profile))
    if key not in _CHOSEN:
        even = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, layer_split="even"))
        cost = build_cost_model(even)
        layer = emb = head = attn = 0.0
        for weight, prefills, decode_kv_lens in typical_microbatches(cfg):
            parts = cost.parts(prefills, decode_kv_lens)
            layer, emb, head = (x + weight * y for x, y in zip((layer, emb, head), parts))
            attn += weight * cost.attention_half(prefills, decode_kv_lens)
        pp = cfg.parallel.pp
        extra = [0.0] * pp
        extra[0] += emb
        extra[-1] += head
        _CHOSEN[key] = balanced_half_split(cfg.model.num_layers, attn, layer - attn, extra)
    return list(_CHOSEN[key])
