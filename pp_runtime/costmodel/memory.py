"""Device memory: the paper's batch-size formula (§4.3), and the check that a deployment's
weights and KV cache fit before anything is allocated.

`memory_plan` is the paper's B: all parameters spread evenly over tp x pp devices.
`stage_memory` is exact for one tp rank of one stage, as `StageModel` builds it (the
first stage holds the embedding, the last the head, the vocabulary is padded to a
multiple of tp, norms are whole on every rank). `check_fits` compares it with the memory a
device offers and raises `ConfigError` with the largest batch that fits: the worker
before it allocates (the device's free memory), the simulator before it runs (the
simulated GPU's capacity). No torch here: `free_bytes` imports it when asked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pp_runtime.config import Config, ConfigError, ModelConfig, even_split

GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """B = floor((M_G - M_S) / (L * m_kv)), per device of one pipeline stage."""

    device_bytes: float  # M_G: usable memory of one device (capacity * utilization)
    param_bytes: float  # M_S: parameters held by one device
    seq_len: int  # L: KV tokens per request
    kv_bytes_per_token: int  # m_kv: K and V of one token for this device's layers and heads
    max_requests: int  # B over the whole stage: requests whose KV fits at once
    batch_per_microbatch: int  # B / pp: with pp micro-batches in flight

    def summary(self) -> str:
        gib = 2**30
        return (
            f"M_G={self.device_bytes / gib:.2f} GiB, M_S={self.param_bytes / gib:.2f} GiB, "
            f"L={self.seq_len}, m_kv={self.kv_bytes_per_token} B/token -> "
            f"B={self.max_requests} requests per device, "
            f"{self.batch_per_microbatch} per micro-batch"
        )


def kv_bytes_per_token(m: ModelConfig, layers: int, tp: int = 1,
                       dtype_bytes: int | None = None) -> int:
    """K and V of one token for `layers` layers on one of `tp` ranks (its kv_heads / tp
    heads): the one KV-size rule (`memory_plan`, `stage_memory`, `kv_cache_bytes`)."""
    dtype_bytes = m.dtype_bytes if dtype_bytes is None else dtype_bytes
    return 2 * layers * (m.kv_heads // tp) * m.head_dim * dtype_bytes


def kv_cache_bytes(cfg: Config) -> int:
    """The KV cache over all workers: `kv_blocks` per stage of every layer and head."""
    m = cfg.model
    return kv_blocks(cfg) * cfg.cache.block_size * kv_bytes_per_token(m, m.num_layers)


def memory_plan(cfg: Config, device_memory_gb: float | None = None) -> MemoryPlan:
    """The paper's maximum batch size for this model and parallel layout.

    A device of stage s holds 1/tp of the parameters of 1/pp of the layers and the K/V of
    its layers and heads; with pp micro-batches in flight each micro-batch gets 1/pp of the
    slots (paper §4.3; GPT-3 on A100-80GB gives 27 for TP8xPP8 and 11 for TP8).
    """
    m, p = cfg.model, cfg.parallel
    gb = device_memory_gb if device_memory_gb is not None else cfg.cache.device_memory_gb
    if gb is None:
        raise ConfigError("cache.device_memory_gb: not set; give the memory of one device in GB")
    usable = gb * GB * cfg.cache.memory_utilization
    params = m.num_params() * m.dtype_bytes / (p.tp * p.pp)
    layers = math.ceil(m.num_layers / p.pp)
    kv_token = kv_bytes_per_token(m, layers, p.tp)
    total = max(0, math.floor((usable - params) / (cfg.seq_len * kv_token)))
    return MemoryPlan(usable, params, cfg.seq_len, kv_token, total, total // p.pp)


# ---- exact, per stage ----------------------------------------------------------------------
def stage_params(m: ModelConfig, tp: int, lo: int, hi: int,
                 units: tuple[int, int] | None = None) -> int:
    """Parameters of one tp rank of the stage holding layers [lo, hi), as `StageModel` builds
    them: QKV (and its bias), FFN-up and the vocabulary (padded to a multiple of tp) cut;
    norms (Qwen3's q/k norms too), GPT's position embedding and row-parallel biases whole.
    `units`: half-layer units [ulo, uhi) (`Config.stage_units`), where a boundary layer is
    cut between its attention half and its MLP half."""
    h, f, b, bq = m.hidden_size, m.ffn, int(m.use_bias), int(m.use_qkv_bias)
    q = m.num_heads * m.head_dim  # the attention width (Qwen3: not hidden)
    qkv = q + 2 * m.kv_heads * m.head_dim
    up = 2 * f if m.family == "llama" else f  # llama: gate | up
    norm = 2 * h if m.family == "gpt" else h  # LayerNorm has a bias
    qk_norm = 2 * m.head_dim * m.qk_norm
    attn = (h + bq) * qkv // tp + q * h // tp + b * h + norm + qk_norm
    mlp = (h + b) * up // tp + f * h // tp + b * h + norm
    ulo, uhi = units if units is not None else (2 * lo, 2 * hi)
    n_attn, n_mlp = attention_layers(ulo, uhi), (uhi // 2) - (ulo // 2)
    vocab_rows = -(-m.vocab_size // tp)  # padded_vocab / tp
    first, last = ulo == 0, uhi == 2 * m.num_layers
    n = n_attn * attn + n_mlp * mlp
    if first:
        n += vocab_rows * h + (m.max_positions * h if m.family == "gpt" else 0)
    if last:
        n += norm + (0 if m.tied and first else vocab_rows * h)  # a tied head on stage 0 is shared
    return n


def attention_layers(ulo: int, uhi: int) -> int:
    """Layers whose attention half (unit 2i) lies in half-layer units [ulo, uhi): the
    stage's KV-cache layers."""
    return (uhi + 1) // 2 - (ulo + 1) // 2


@dataclass(frozen=True)
class StageMemory:
    """What one tp rank of a pipeline stage allocates at startup."""

    stage: int
    weight_bytes: int  # this rank's shard of the stage's parameters
    kv_bytes_per_block: int  # K and V of one block: block_size positions, the stage's layers and rank's heads
    blocks: int  # KV blocks (`kv_blocks`: the same on every stage)
    blocks_per_slot: int  # blocks of one whole context (max_seq_len tokens)

    @property
    def kv_bytes_per_slot(self) -> int:
        return self.blocks_per_slot * self.kv_bytes_per_block

    @property
    def slots(self) -> int:
        """The KV memory in whole contexts."""
        return self.blocks // self.blocks_per_slot

    @property
    def kv_bytes(self) -> int:
        """The pool and the one scratch block past it (`KVCache.scratch_block`)."""
        return (self.blocks + 1) * self.kv_bytes_per_block

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def blocks_that_fit(self, usable_bytes: float) -> int:
        return max(0, math.floor((usable_bytes - self.weight_bytes) / self.kv_bytes_per_block) - 1)

    def slots_that_fit(self, usable_bytes: float) -> int:
        return self.blocks_that_fit(usable_bytes) // self.blocks_per_slot


def stage_memory(cfg: Config, stage: int, dtype_bytes: int, tp: int | None = None,
                 pp: int | None = None, slots: int | None = None) -> StageMemory:
    """Weights and KV of one tp rank of `stage` (tp, pp: the config's unless given; the KV:
    `slots` whole contexts if given, else the config's blocks; layers: the config's split
    at its own pp, else the even split of the pp given)."""
    m, bs = cfg.model, cfg.cache.block_size
    tp, pp = tp or cfg.parallel.tp, pp or cfg.parallel.pp
    if pp == cfg.parallel.pp:
        ulo, uhi = cfg.stage_units(stage)
    else:
        counts = even_split(m.num_layers, pp)
        ulo, uhi = 2 * sum(counts[:stage]), 2 * sum(counts[:stage + 1])
    per_block = kv_bytes_per_token(m, attention_layers(ulo, uhi), tp, dtype_bytes) * bs
    per_slot = -(-cfg.seq_len // bs)
    blocks = slots * per_slot if slots else kv_blocks(cfg)
    params = stage_params(m, tp, ulo // 2, (uhi + 1) // 2, (ulo, uhi))
    return StageMemory(stage, params * dtype_bytes, per_block, blocks, per_slot)


def kv_blocks(cfg: Config) -> int:
    """KV blocks per stage, one number for the whole pipeline (the planner's pool and every
    stage's cache): cache.num_blocks; None (or paged: false) = kv_slots whole contexts;
    "auto" = what cache.device_memory_gb x memory_utilization leaves beside the weights on
    the stage with the least room."""
    c = cfg.cache
    per_slot = -(-cfg.seq_len // c.block_size)
    if not c.paged or c.num_blocks is None:
        return cfg.num_slots * per_slot
    if c.num_blocks != "auto":
        return c.num_blocks
    usable = c.device_memory_gb * GB * c.memory_utilization
    one = [stage_memory(cfg, s, cfg.model.dtype_bytes, slots=1) for s in range(cfg.parallel.pp)]
    return min(s.blocks_that_fit(usable) for s in one)


@dataclass(frozen=True)
class KVCapacity:
    """What one stage's KV memory holds, paged and as whole contexts, for a workload."""

    blocks: int  # KV blocks per stage (the stage with the least room sets it)
    block_size: int
    slots: int  # whole contexts of max_seq_len that the same memory holds
    mean_tokens: float  # the workload's mean request, prompt + output
    mean_blocks: float  # blocks that request holds when it ends
    pp: int

    @property
    def in_flight(self) -> int:
        """Requests in flight, paged, at the workload's mean length."""
        return math.floor(self.blocks / self.mean_blocks) if self.mean_blocks else 0

    def summary(self) -> str:
        ratio = f"{self.in_flight / self.slots:.2f}x" if self.slots else "n/a"
        return (f"paged KV: {self.blocks} blocks of {self.block_size} tokens per stage; the "
                f"workload's mean request ({self.mean_tokens:.0f} tokens, {self.mean_blocks:.1f} "
                f"blocks) -> {self.in_flight} requests in flight ({self.in_flight // self.pp} "
                f"per micro-batch), against {self.slots} whole contexts in the same memory "
                f"({ratio})")


def kv_capacity(cfg: Config, lengths: list[int], device_memory_gb: float | None = None
                ) -> KVCapacity:
    """Blocks per stage (from `device_memory_gb` if given, else the config's pool) and the
    requests in flight at the mean of `lengths` (prompt + output of each request)."""
    if device_memory_gb is not None:
        cfg = cfg.with_overrides(paged=True, num_blocks="auto", device_memory_gb=device_memory_gb)
    bs = cfg.cache.block_size
    blocks = kv_blocks(cfg)
    mean_tokens = sum(lengths) / len(lengths) if lengths else 0.0
    mean_blocks = sum(-(-n // bs) for n in lengths) / len(lengths) if lengths else 0.0
    return KVCapacity(blocks, bs, blocks // -(-cfg.seq_len // bs), mean_tokens, mean_blocks,
                      cfg.parallel.pp)


def smallest_deployment(cfg: Config, usable_bytes: float,
                        dtype_bytes: int) -> tuple[int, int] | None:
    """The fewest GPUs (tp, pp) whose every stage holds its weights and the KV of this
    config's batch (max_batch_size per micro-batch, or kv_slots); tp stays within a node
    and divides the heads and the FFN. Among equal counts, the fewest stages."""
    m, c = cfg.model, cfg.cache
    cuts = math.gcd(m.num_heads, m.kv_heads, m.ffn)
    tps = [t for t in range(1, min(cuts, cfg.hardware.gpus_per_node) + 1) if cuts % t == 0]
    for tp, pp in sorted(((t, p) for t in tps for p in range(1, m.num_layers + 1)),
                         key=lambda d: (d[0] * d[1], d[1])):
        slots = c.kv_slots or pp * cfg.batch_rows
        if all(stage_memory(cfg, s, dtype_bytes, tp, pp, slots).total_bytes <= usable_bytes
               for s in range(pp)):
            return tp, pp
    return None


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def check_fits(cfg: Config, usable_bytes: float, dtype_bytes: int, device: str,
               stages: list[int] | None = None, tp_rank: int | None = None) -> None:
    """Raise ConfigError if a stage's weights and KV exceed `usable_bytes` (one device's, as
    `device` describes it), naming the stage, both sizes, the largest max_batch_size (and
    kv_slots) that fits, and the other fixes. `stages`: those to check (default all)."""
    need = [stage_memory(cfg, s, dtype_bytes) for s in (stages if stages is not None
                                                       else range(cfg.parallel.pp))]
    worst = max(need, key=lambda s: s.total_bytes - usable_bytes)
    if worst.total_bytes <= usable_bytes:
        return
    pp, L, c = cfg.parallel.pp, cfg.seq_len, cfg.cache  # noqa: N806
    slots = min(s.slots_that_fit(usable_bytes) for s in need)
    blocks = min(s.blocks_that_fit(usable_bytes) for s in need)
    where = f"stage {worst.stage}" + (f" (tp rank {tp_rank})" if tp_rank is not None else "")
    head = (f"{where} needs {_gb(worst.total_bytes)} (weights {_gb(worst.weight_bytes)} + KV "
            f"{_gb(worst.kv_bytes)} for {worst.blocks} blocks of {c.block_size} tokens, "
            f"{worst.slots} requests of {L}), but {device} offers {_gb(usable_bytes)}")
    fixes, reason = [], ""
    if c.paged and isinstance(c.num_blocks, int) and blocks * c.block_size >= L:
        field = "cache.num_blocks"
        fixes.append(f"the most blocks that fit are {blocks}: --set num_blocks={blocks}")
    elif slots >= 1 and (c.kv_slots or slots >= pp):
        field = "cache.kv_slots" if c.kv_slots else "planner.max_batch_size"
        best = (f"kv_slots={slots}" if c.kv_slots
                else f"max_batch_size={slots // pp} (kv_slots={slots // pp * pp})")
        fixes.append(f"the largest batch that fits is {best}: --set {best.split(' ')[0]}")
    else:
        field = "parallel.tp, parallel.pp"
        reason = ("The weights alone do not fit. " if worst.weight_bytes >= usable_bytes
                  else "No batch fits beside the weights. ")
    smallest = smallest_deployment(cfg, usable_bytes, dtype_bytes)
    if smallest and smallest != (cfg.parallel.tp, pp):
        tp_s, pp_s = smallest
        fixes.append(f"the fewest devices that hold this batch are tp={tp_s} x pp={pp_s}: "
                     f"--set tp={tp_s} --set pp={pp_s}")
    longest = min(max(0, math.floor((usable_bytes - s.weight_bytes) * L
                                    / (s.slots * s.kv_bytes_per_slot))) for s in need)
    if longest >= 1:  # tokens of KV per slot that fit beside every stage's weights
        fixes.append(f"slots of {longest} tokens fit: --set max_seq_len={longest}")
    raise ConfigError(f"{field}: {head}. {reason}Fix: " + ("; or ".join(fixes) or
                      "none within hardware.gpus_per_node x num_layers devices"))


def check_stage_fits(cfg: Config, stage: int, tp_rank: int, dtype_bytes: int, device) -> None:
    """The worker's check before it allocates: this stage's weights and KV against the
    torch device's free memory (`free_bytes`) times cache.memory_utilization."""
    free, util = free_bytes(device), cfg.cache.memory_utilization
    check_fits(cfg, free * util, dtype_bytes,
               f"{device} ({_gb(free)} free x cache.memory_utilization {util:g})", [stage], tp_rank)


def free_bytes(device) -> int:
    """Memory free on a torch device now: `torch.cuda.mem_get_info` on a GPU, the kernel's
    MemAvailable (RAM that can be had without swapping) on a CPU."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
