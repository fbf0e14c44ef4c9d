"""The deployments `pp-runtime plan` considers, and why the ones that cannot run are out.

A layout is tp x pp GPUs per replica and replicas = gpus // (tp x pp): tp within a node
and dividing the query heads, the KV heads and the FFN (the cuts tensor parallelism
makes), pp dividing the layers. A candidate is a layout and its knobs: planner, chunk size
C, micro-batches in flight (pp + 1, or pp), layer split (even; `auto`: balanced by the
cost model, resolved here once per layout; `memory`: the most KV blocks, `memory_split`)
and B, sequences per micro-batch.
The KV cache is paged, its blocks what the device leaves after the weights on the fullest
stage (`cache.num_blocks: auto`), so B comes from memory: the requests the blocks hold at
the workload's mean length, shared by the micro-batches in flight (at most `MAX_B`, and
at most half the chunk: the decodes a tile-aligned chunk carries leave it at least half
its prefill tokens). An `auto` split the same as the even one is searched once.
Where `uniform` is searched, beside its fixed-knob deployments every layout and depth gets
the SLO-driven `uniform`
(`planner.tbt_slo_ms` / `ttft_slo_ms` from the plan's SLOs, no C or B: its budget sizes
every micro-batch; "uniform targets" in the tables).

Out before anything is simulated, each with its reason (`Out`):
  memory   the weights do not fit, or the KV blocks left do not hold the longest request;
  SLO      one decode alone through the pipeline (every stage's layers at one token, the
           sends between them) already takes longer than the TBT SLO;
  cost model  nothing prices it (a local profile measured without this tp's shapes).
No torch; pure arithmetic on the cost model and the memory check.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pp_runtime.costmodel import memory
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.config import Config, ConfigError, even_split

MAX_B = 128  # sequences per micro-batch at most (a bigger B only lengthens the decode tail)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    replicas: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.replicas

    @property
    def name(self) -> str:
        return f"tp{self.tp} pp{self.pp} x{self.replicas}"


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    planner: str
    chunk_size: int | None  # None: the SLO-driven uniform (its budget sizes micro-batches)
    max_batch_size: int | None
    in_flight: int
    layer_split: str  # "even" or "auto"
    slo_ms: tuple[float, float] | None = None  # (TBT, TTFT) targets of the SLO-driven uniform

    @property
    def name(self) -> str:
        knobs = "targets" if self.slo_ms else f"C{self.chunk_size} B{self.max_batch_size}"
        return f"{self.layout.name} {self.planner} {knobs} depth {self.in_flight} {self.layer_split}"

    def config(self, base: Config) -> Config:
        """base (model, hardware, cache, workload) deployed as this candidate: one replica
        (the simulator's dp is the layout's replicas, which each serve 1/replicas of the
        traffic: `search` simulates one at that share)."""
        p = self.layout
        tbt, ttft = self.slo_ms or (None, None)
        return base.with_overrides(**{
            "parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.dp": 1,
            "parallel.layer_split": "auto" if self.layer_split == "auto" and p.pp > 1 else "even",
            "planner.planner": self.planner, "planner.chunk_size": self.chunk_size,
            "planner.max_batch_size": self.max_batch_size, "planner.in_flight": self.in_flight,
            "planner.tbt_slo_ms": tbt, "planner.ttft_slo_ms": ttft})


@dataclass(frozen=True)
class Out:
    """A layout or candidate left out before simulation, and why."""

    name: str
    reason: str  # "memory" | "SLO" | "cost model" | "config"
    detail: str


def tp_choices(cfg: Config) -> list[int]:
    """tp sizes that cut the heads, the KV heads and the FFN evenly and tile a node (stages
    are packed node by node, so a group of 6 on 8-GPU nodes would straddle two)."""
    m, per_node = cfg.model, cfg.hardware.gpus_per_node
    cuts = math.gcd(m.num_heads, m.kv_heads, m.ffn)
    return [t for t in range(1, min(cuts, per_node) + 1) if cuts % t == 0 and per_node % t == 0]


def layouts(cfg: Config, gpus: int) -> list[Layout]:
    """Every tp x pp that `gpus` hold at least once, most GPUs used first."""
    n = cfg.model.num_layers
    out = [Layout(tp, pp, gpus // (tp * pp)) for tp in tp_choices(cfg)
           for pp in range(1, n + 1) if n % pp == 0 and tp * pp <= gpus]
    return sorted(out, key=lambda lay: (-lay.gpus, lay.tp * lay.pp, lay.pp))


def memory_out(cfg: Config, layout: Layout, lengths: list[int]) -> Out | None:
    """Why this layout's stages cannot hold the weights and the longest request, or None.
    cfg: a candidate's config (paged, num_blocks auto, the device's memory)."""
    c = cfg.cache
    usable = c.device_memory_gb * memory.GB * c.memory_utilization
    stages = [memory.stage_memory(cfg, s, cfg.model.dtype_bytes, slots=1) for s in range(layout.pp)]
    worst = max(stages, key=lambda s: s.weight_bytes)
    if worst.weight_bytes > usable:
        return Out(layout.name, "memory", f"weights {worst.weight_bytes / memory.GB:.3g} GB "
                   f"on stage {worst.stage} > {usable / memory.GB:.3g} GB usable")
    blocks = memory.kv_blocks(cfg)
    need = -(-max(lengths) // c.block_size)
    if blocks < need:
        return Out(layout.name, "memory", f"{blocks} KV blocks left beside the weights, the "
                   f"longest request ({max(lengths)} tokens) needs {need}")
    return None


def batch_size(cfg: Config, lengths: list[int], in_flight: int) -> int:
    """B from memory: the requests the blocks hold at the mean length, per micro-batch."""
    held = memory.kv_capacity(cfg, lengths).in_flight
    return max(1, min(MAX_B, held // in_flight))


_COSTS: dict = {}
_PRICINGS: dict = {}  # (model, hardware, tp) -> Pricing (`cost_model`)
_SPLITS: dict = {}


def cost_model(cfg: Config, replicas: int = 1):
    """`build_cost_model(cfg)`, one per (model, hardware, runtime, tp, layers per stage) in
    this process: what it prices depends on nothing else (its per-token tables grow on
    demand), and building one reads the profile's tables. With `replicas` > 1 on this
    machine's CPU, priced with the calibration of that many replicas served side by side
    where one was measured (`calibrated.shared`; plan/shared.py)."""
    from pp_runtime.costmodel.model import StageCostModel, build_pricing, find_calibration
    from pp_runtime.plan.calibrated import shared

    cal = shared(cfg, replicas)
    key = (cfg.model, cfg.hardware, cfg.runtime, cfg.parallel.tp, tuple(cfg.layers_per_stage()),
           cal and cal.key)
    if key not in _COSTS:
        # one pricing per (model, hardware, tp): its per-token tables are built once and
        # shared by every layout's cost model (costmodel/model.py `_TABLES`)
        at = (cfg.model, cfg.hardware, cfg.parallel.tp)
        if at not in _PRICINGS:
            _PRICINGS[at] = build_pricing(cfg)
        _COSTS[key] = StageCostModel(cfg, _PRICINGS[at], cal or find_calibration(cfg))
    return _COSTS[key]


def forget() -> None:
    """Drop the cost models and splits built so far (the profile's calibration changed)."""
    _COSTS.clear()
    _PRICINGS.clear()
    _SPLITS.clear()


def resolve_split(cfg: Config) -> Config:
    """cfg with an `auto` layer split written out, chosen once per layout (tp, pp): the
    balance of the micro-batches typical at the planner's default C and B (costmodel/
    balance.py), not again for every knob (0.04 s each, and the cut moves by a layer at
    most between chunk sizes)."""
    if cfg.parallel.layer_split != "auto":
        return cfg
    key = (cfg.parallel.tp, cfg.parallel.pp)
    if key not in _SPLITS:
        plain = cfg.with_overrides(**{"planner.in_flight": None, "planner.tbt_slo_ms": None,
                                      "planner.ttft_slo_ms": None, "planner.chunk_size": None,
                                      "planner.max_batch_size": None})
        _SPLITS[key] = resolve_layer_split(plain).layers_per_stage()
    return cfg.with_overrides(**{"parallel.layer_split": list(_SPLITS[key])})


def decode_floor_s(cost, pp: int) -> float:
    """One decode alone through every stage, sends included: no TBT can be shorter."""
    compute = sum(cost.stage_times([], [1]))
    return compute + sum(cost.send_time(1, s) for s in range(1, pp))


def candidates(base: Config, gpus: int, planners: list[str], chunks: list[int],
               lengths: list[int], slo_s: tuple[float, float]
               ) -> tuple[list[tuple[Candidate, Config]], list[Out]]:
    """Every candidate that may meet the SLOs (TBT, TTFT in s), with its config, and what
    was left out."""
    kept, out = [], []
    tbt_slo = slo_s[0]
    for lay in layouts(base, gpus):
        probe = Candidate(lay, planners[0], chunks[0], 1, lay.pp, "even").config(base)
        why = memory_out(probe, lay, lengths)
        if why is None:
            try:
                floor = decode_floor_s(cost_model(probe), lay.pp)
            except ConfigError as exc:  # e.g. a local profile without this tp's shapes
                out.append(Out(lay.name, "cost model", str(exc)))
                continue
            if floor > tbt_slo:
                why = Out(lay.name, "SLO", f"one decode through the pipeline takes "
                          f"{floor * 1e3:.0f} ms > TBT SLO {tbt_slo * 1e3:.0f} ms")
        if why is not None:
            out.append(why)
            continue
        kept += layout_candidates(base, lay, probe, planners, chunks, lengths, slo_s, out)
    return kept, out


def layout_candidates(base: Config, lay: Layout, probe: Config, planners: list[str],
                      chunks: list[int], lengths: list[int], slo_s: tuple[float, float],
                      out: list[Out]) -> list[tuple[Candidate, Config]]:
    """One layout's candidates: every depth, split and knob (module docstring)."""
    kept, even = [], even_split(base.model.num_layers, lay.pp)
    mem = memory_split(probe) if lay.pp > 1 else None
    for depth in sorted({lay.pp + 1, lay.pp} if lay.pp > 1 else {1}, reverse=True):
        for split in ("even", "auto", "memory") if lay.pp > 1 else ("even",):
            if split == "memory" and mem is None:
                continue
            layers = mem if split == "memory" else None
            b = batch_size(with_layers(probe, layers), lengths, depth)
            knobs = [(p, c, max(1, min(b, c // 2)), None) for p in planners for c in chunks]
            if "uniform" in planners:  # and the SLO-driven uniform, sized by its targets
                knobs.append(("uniform", None, None, (slo_s[0] * 1e3, slo_s[1] * 1e3)))
            for planner, c, rows, targets in knobs:
                cand = Candidate(lay, planner, c, rows, depth, split, targets)
                try:
                    cfg = with_layers(resolve_split(cand.config(base)), layers)
                except ConfigError as exc:  # e.g. a chunk the planner refuses
                    out.append(Out(cand.name, "config", str(exc)))
                    continue
                if split == "auto" and cfg.layers_per_stage() in (even, mem):
                    continue  # balancing chose a split searched anyway: nothing new
                kept.append((cand, cfg))
    return kept


def with_layers(cfg: Config, layers: list[int] | None) -> Config:
    return cfg if layers is None else cfg.with_overrides(**{"parallel.layer_split": list(layers)})


MAX_MOVED = 4  # layers the memory split takes off each end stage, at most


def memory_split(cfg: Config) -> list[int] | None:
    """The layer split that leaves the most KV blocks, or None where the even one does.
    The pool is one size for every stage (`memory.kv_blocks`: what the fullest stage
    leaves), and the first and last stages also hold the embedding and the LM head, so
    they give up to MAX_MOVED layers each to the others (round robin); more KV means more
    requests in flight, and the search prices the slower stages it costs."""
    n, pp = cfg.model.num_layers, cfg.parallel.pp
    even = even_split(n, pp)
    best, most = None, memory.kv_blocks(with_layers(cfg, even))
    for a in range(MAX_MOVED + 1):
        for b in range(MAX_MOVED + 1):
            split = list(even)
            split[0], split[-1] = split[0] - a, split[-1] - b
            takers = list(range(1, pp - 1)) or ([pp - 1] if a else [0])
            for i in range(a + b):
                split[takers[i % len(takers)]] += 1
            if min(split) < 1 or split == even or sum(split) != n:
                continue
            blocks = memory.kv_blocks(with_layers(cfg, split))
            if blocks > most:
                best, most = split, blocks
    return best



def with_share(cfg: Config, replicas: int, qps: float) -> Config:
    """One replica's config at its share of the rate."""
    return replace(cfg, workload=replace(cfg.workload, qps=qps / replicas))
