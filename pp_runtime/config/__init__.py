"""Configuration: frozen dataclasses, YAML loading and validation.

A `Config` has seven sections (model, parallel, cache, planner, runtime, hardware,
workload). Every field has a default that works on a laptop. Overrides name a field by
itself when the name is unique across sections (`with_overrides(chunk_size=64, pp=2)`),
or as `section.field`. A bare name in two sections means the first (`seed` is
runtime.seed; the workload's is `workload.seed`).

`validate()` raises `ConfigError` naming the field and the fix; it does no I/O.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

FAMILIES = ("gpt", "llama")
PLANNERS = ("sarathi", "orca-best", "orca-worst", "request-level", "vllm", "uniform",
            "sarathi-serve", "gllm")
from pp_runtime.config.shipped import CONFIG_DIR  # noqa: E402  the shipped configs: configs/ at the root


from pp_runtime.core.dtypes import AUTO_DTYPE, DTYPES  # noqa: F401  (re-exported)
from pp_runtime.core.errors import CheckpointError, ConfigError  # noqa: F401  (re-exported)
from pp_runtime.core.workload import WorkloadConfig


@dataclass(frozen=True)
class ModelConfig:
    name: str = "gpt2-small"  # label used in reports
    family: str = "gpt"  # "gpt" (learned positions, LayerNorm, GELU) or "llama" (RoPE, RMSNorm, SwiGLU, GQA)
    num_layers: int = 12  # decoder layers; cut into pp stages
    hidden_size: int = 768  # model width
    num_heads: int = 12  # query heads
    num_kv_heads: int | None = None  # key/value heads (GQA); None = num_heads
    ffn_size: int | None = None  # FFN inner width; None = 4 * hidden_size
    vocab_size: int = 50257  # token ids are in [0, vocab_size)
    max_positions: int = 1024  # longest sequence (prompt + output) in tokens
    dtype: str = "float32"  # float32, float16, bfloat16, or "auto" (`dtype_for`): the
    #                         checkpoint's dtype on a GPU, float32 on a CPU (bf16 is ~8x
    #                         slower there); from_pretrained sets "auto"
    checkpoint_dtype: str | None = None  # what the checkpoint was saved in (config.json's
    #                                      torch_dtype, or dtype); None = unknown or random
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base (llama only)
    activation: str | None = None  # None = family default: gelu_new (gpt), silu (llama)
    bias: bool | None = None  # biases on linear layers; None = family default: True (gpt), False (llama)
    tie_embeddings: bool | None = None  # LM head shares the embedding; None = True (gpt), False (llama)
    eos_token_id: int | None = None  # generation stops on this id; None = never

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn(self) -> int:
        return self.ffn_size or 4 * self.hidden_size

    @property
    def act(self) -> str:
        return self.activation or ("gelu_new" if self.family == "gpt" else "silu")

    @property
    def use_bias(self) -> bool:
        return self.family == "gpt" if self.bias is None else self.bias

    @property
    def tied(self) -> bool:
        return self.family == "gpt" if self.tie_embeddings is None else self.tie_embeddings

    def dtype_for(self, device_type: str) -> str:
        """The dtype the weights and KV cache get on a device of this type ("cuda", "cpu"):
        an explicit `dtype` always; "auto" is float32 on a CPU and, on a GPU, the
        checkpoint's float16 or bfloat16, else bfloat16 (a float32 or unknown checkpoint
        is served in bfloat16: fp32's range at half the bytes, as vLLM's "auto" halves it)."""
        if self.dtype != AUTO_DTYPE:
            return self.dtype
        if device_type != "cuda":
            return "float32"
        half = ("float16", "bfloat16")
        return self.checkpoint_dtype if self.checkpoint_dtype in half else "bfloat16"

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the weights and KV; for "auto", on a GPU (what the
        simulator and the paper's formula price)."""
        return DTYPES[self.dtype_for("cuda")]

    def num_params(self) -> int:
        """Parameter count (embeddings, layers, final norm, untied LM head)."""
        h, f, v = self.hidden_size, self.ffn, self.vocab_size
        kv = self.kv_heads * self.head_dim
        bias = self.use_bias
        attn = h * (h + 2 * kv) + h * h + (h + 2 * kv + h) * bias
        if self.family == "gpt":
            mlp, norms = 2 * h * f + (f + h) * bias, 4 * h
        else:
            mlp, norms = 3 * h * f + (3 * f if bias else 0), 2 * h
        emb = v * h + (self.max_positions * h if self.family == "gpt" else 0)
        head = 0 if self.tied else v * h
        final_norm = 2 * h if self.family == "gpt" else h
        return emb + self.num_layers * (attn + mlp + norms) + final_norm + head


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel ranks per stage
    pp: int = 1  # pipeline stages; planner.in_flight (pp + 1) micro-batches are in flight
    dp: int = 1  # data-parallel replicas of the tp x pp deployment (the simulator routes
    #              each request to the least-loaded one)
    layer_split: list[int] | str | None = None  # decoder layers per stage: a list (one count
    #   per stage, each >= 1, summing to num_layers), "auto" (stage times equalised by the
    #   cost model: stage 0 also embeds, the last stage runs the LM head), "even" (earlier
    #   stages take the remainder) or None: auto with a hardware.profile, else even.
    #   `Config.layers_per_stage` reads it.


LAYER_SPLIT_AUTO = "auto"  # parallel.layer_split chosen by costmodel/balance.py
LAYER_SPLIT_EVEN = "even"  # even, also where a profile exists (None: auto there)


def even_split(num_layers: int, pp: int) -> list[int]:
    """Layers per stage, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


@dataclass(frozen=True)
class CacheConfig:
    kv_slots: int | None = None  # KV memory in whole contexts of max_seq_len tokens (and, with
    #                              paged: false, the requests admitted at once); None = pp * B
    max_seq_len: int | None = None  # longest request, prompt + output (L in the paper); None = max_positions
    device_memory_gb: float | None = None  # M_G: memory of one device, for the paper's B formula
    memory_utilization: float = 0.9  # share of device memory given to weights + KV (rest: activations)
    paged: bool = True  # admit by free KV blocks and grow with the tokens (docs/engine.md);
    #                     false: every request reserves a whole context at admission (the paper)
    block_size: int = 16  # token positions per KV block; a power of two
    num_blocks: int | str | None = None  # KV blocks per stage: None = the memory of kv_slots
    #                                      contexts; "auto" = what device_memory_gb leaves after
    #                                      the weights on the fullest stage (memory.kv_blocks)
    watermark: float = 0.01  # share of blocks admission leaves free for running requests to grow
    prefix_caching: bool = False  # reuse computed blocks of a shared prefix (serve turns it on)
    max_running: int | None = None  # requests admitted at once; None = as many as the blocks
    #                                 hold (paged), kv_slots (paged: false)


@dataclass(frozen=True)
class PlannerConfig:
    planner: str = "uniform"  # micro-batch policy (docs/planner.md; uniform: measured best)
    chunk_size: int = 256  # prefill tokens per micro-batch (C); tile-aligned with decodes
    #                        (sarathi-serve: the whole token budget, decodes included)
    max_batch_size: int = 8  # B: sequences per micro-batch (1 prefill chunk + B-1 decodes)
    tile_size: int = 128  # GPU matmul tile; chunk + decodes should be a multiple of it
    tile_align: bool = True  # shrink the chunk by the piggybacked decodes so chunk + decodes = C
    token_budget: int | None = None  # vllm: prefill tokens per micro-batch; None = max_seq_len
    target_ms: float | None = None  # uniform: cap on a micro-batch's predicted ms (the
    #                                 simulator's cost model); None = no cap (docs/planner.md)
    chunk_pipelining: bool = True  # a prompt's next chunk may enter the pipeline while its
    #                                previous chunks are in flight (stages run in order, so
    #                                its KV is written first); false: one micro-batch at a time
    pack_prefills: bool = True  # uniform: a prompt's last chunk leaves room -> the next
    #                             prompt's first chunk fills it
    spread: int = 4  # uniform: ceil(R / pp) of R running decodes per micro-batch, and when
    #                  prompt tokens are scarce an even share of them over this many rounds
    #                  of the pipeline, each micro-batch filled to the same predicted time
    #                  (docs/planner.md); 0 = off (SARATHI's budget)
    in_flight: int | None = None  # micro-batches in the pipeline at once; None = pp + 1
    #                               (pp > 1: one more hides the return of results to the
    #                               planner, as vLLM's async scheduling does), 1 with pp = 1
    # gllm: gLLM's token-throttling knobs, defaults of gty111/gLLM @bc91d98 (docs/baselines.md)
    gllm_maxp: int = 8192  # prefill tokens per micro-batch at most
    gllm_minp: int = 32  # prefill tokens per micro-batch at least while several prompts wait
    gllm_iterp: int = 8  # micro-batches over which the waiting prompt tokens should drain
    gllm_maxd: int = 512  # sequences (rows) per micro-batch at most (and at most B)
    gllm_kvthresh: float | None = None  # None: bc91d98's adaptive decode reserve; a share of
    #                                     the KV pages: the fixed reserve of the paper's code


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"  # "auto" (cuda if present, else cpu), "cpu", "cuda", "cuda:N"
    seed: int = 0  # random weights and default sampling seed
    executor: str = "auto"  # "local": every stage in this process (tp = 1); "ray": one Ray
    #                         actor per (stage, tp rank); "auto": ray when tp * pp > 1;
    #                         "torchrun": set by `python -m pp_runtime.cli.torchrun`
    ray_address: str | None = None  # None: start a local Ray on 127.0.0.1; "auto": join the
    #                                 running cluster; or "HOST:PORT" of its head
    dist_addr: str | None = None  # torch.distributed rendezvous host; None: the node of rank 0
    #                               (127.0.0.1 when Ray runs locally)
    dist_port: int = 0  # rendezvous port on that host; 0: a free one
    threads_per_worker: int | None = None  # torch CPU threads per worker; None: cores / workers
    step_timeout_s: float = 120.0  # a micro-batch no rank finishes within this ends the run
    startup_timeout_s: float = 300.0  # actors placed, groups formed and weights loaded within this
    metrics: bool = True  # export Ray metrics (ray executor)
    compiled_graph: bool = False  # ray: every rank's micro-batch call as one Ray Compiled
    #                               Graph execution (0.36 ms a call on this machine's 3
    #                               actors against 5.3 ms of one Ray task per rank); opt-in:
    #                               no faster end to end here, and in Ray 2.60 an actor dying
    #                               while the graph is idle can crash the driver
    #                               (docs/distributed.md)
    # CPU fast paths (docs/performance.md); neither changes anything on CUDA
    prepack: bool = True  # linear layers on prepacked oneDNN weights (CPU, float32/bfloat16,
    #                       tp = 1 layers; results differ from plain torch by fp32 rounding)
    cpu_decode_kernel: bool = True  # decode attention in one C++ call per layer (built on
    #                                 first use, ~25 s, cached; without a compiler: one SDPA
    #                                 call per decode, as with false)
    kv_layout: str = "auto"  # KV cache order: "heads" ([slot][head][position], each head's
    #                          keys contiguous: decode attention streams them), "tokens"
    #                          ([slot][position][head], the flattened rows FlashAttention's
    #                          varlen decode reads); "auto": heads on a CPU, tokens on CUDA


@dataclass(frozen=True)
class HardwareConfig:
    """What the simulator prices: the GPU, how GPUs sit in nodes, which profile to use."""

    gpu: str = "a100-80gb"  # a100-80gb | h100 | h200 (spec sheet + shipped profiles)
    gpus_per_node: int = 8  # a stage's TP group stays in one node; stages fill nodes in order
    profile: str | None = None  # directory written by `pp-runtime profile` (measured here);
    #                             None = the shipped A100/H100 profiles, then the roofline


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "planner": PlannerConfig,
    "runtime": RuntimeConfig,
    "hardware": HardwareConfig,
    "workload": WorkloadConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """KV tokens per slot (L)."""
        return self.cache.max_seq_len or self.model.max_positions

    @property
    def in_flight(self) -> int:
        """Micro-batches the driver keeps in the pipeline: planner.in_flight, else pp + 1
        (1 with pp = 1). benchmarks/planners.py measures pp against pp + 1."""
        pp = self.parallel.pp
        return self.planner.in_flight or (pp + 1 if pp > 1 else 1)

    @property
    def num_slots(self) -> int:
        """KV memory in whole contexts of seq_len tokens (cache.kv_slots, else pp * B); with
        cache.paged: false also the requests admitted at once. Blocks: `memory.kv_blocks`."""
        return self.cache.kv_slots or self.parallel.pp * self.planner.max_batch_size

    # ---- pipeline stages -----------------------------------------------------------
    def layers_per_stage(self) -> list[int]:
        """Decoder layers of each stage: `parallel.layer_split` resolved. The only reader
        of that field: workers (and so the checkpoint loader), the memory check and the
        cost model all cut the model here. "auto" prices the workload's micro-batches with
        the cost model (the one import pointing up, deferred; cached per process)."""
        split, m, pp = self.parallel.layer_split, self.model, self.parallel.pp
        if split == LAYER_SPLIT_EVEN or (split is None and not self.hardware.profile) or pp == 1:
            return even_split(m.num_layers, pp)
        if split is None or split == LAYER_SPLIT_AUTO:  # None: auto where a profile exists
            from pp_runtime.costmodel.balance import auto_layer_split

            return auto_layer_split(self)
        return list(split)

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """Layers [lo, hi) of a pipeline stage."""
        counts = self.layers_per_stage()
        lo = sum(counts[:stage])
        return lo, lo + counts[stage]

    def with_layer_split_resolved(self) -> "Config":
        """A copy whose layer_split is the explicit list ("auto" chosen here, once: what
        an executor hands its workers, so every process cuts the model the same way)."""
        if isinstance(self.parallel.layer_split, (list, tuple)):
            return self
        return self.with_overrides(layer_split=self.layers_per_stage())

    # ---- construction ----------------------------------------------------------------
    def with_overrides(self, **overrides: Any) -> "Config":
        """A copy with fields replaced by name, e.g. `chunk_size=64, pp=2` or
        `**{"workload.seed": 3}`; validated."""
        by_section: dict[str, dict[str, Any]] = {}
        owners: dict[str, list[str]] = {}
        for s, cls in SECTIONS.items():
            for f in fields(cls):
                owners.setdefault(f.name, []).append(s)
        for name, value in overrides.items():
            section, _, fname = name.rpartition(".")
            found = owners.get(fname, [])
            if not found or (section and section not in found):
                raise ConfigError(
                    f"unknown config field {name!r}; known fields: {', '.join(sorted(owners))}"
                )
            by_section.setdefault(section or found[0], {})[fname] = value
        cfg = replace(
            self, **{s: replace(getattr(self, s), **kv) for s, kv in by_section.items()}
        )
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "Config":
        validate(self)
        return self


def _check(ok: bool, field_name: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {problem}; {fix}")


def _check_types(section: str, obj: Any) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
        wanted = [k for k in kinds if k in str(f.type)]
        optional = "None" in str(f.type)
        if (value is None and optional) or "list[" in str(f.type):  # lists: checked by field
            continue
        ok = any(
            isinstance(value, kinds[k]) and not (k in ("int", "float") and isinstance(value, bool))
            for k in wanted
        )
        _check(ok, f"{section}.{f.name}", f"got {value!r}", f"expected {f.type}")


def validate(cfg: Config) -> None:
    """Raise ConfigError for any configuration that cannot work."""
    for section in SECTIONS:
        _check_types(section, getattr(cfg, section))
    m, p, c, pl, rt, hw = cfg.model, cfg.parallel, cfg.cache, cfg.planner, cfg.runtime, cfg.hardware
    _check(m.family in FAMILIES, "model.family", f"unknown model family {m.family!r}",
           f"use one of {', '.join(FAMILIES)}")
    _check(m.dtype in DTYPES or m.dtype == AUTO_DTYPE, "model.dtype", f"unknown dtype {m.dtype!r}",
           f"use {AUTO_DTYPE} or one of {', '.join(DTYPES)}")
    _check(m.checkpoint_dtype is None or m.checkpoint_dtype in DTYPES, "model.checkpoint_dtype",
           f"unknown dtype {m.checkpoint_dtype!r}",
           f"use one of {', '.join(DTYPES)} or leave it unset")
    for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_positions"):
        _check(getattr(m, name) >= 1, f"model.{name}", f"must be >= 1, got {getattr(m, name)}",
               "set a positive value")
    _check(m.hidden_size % m.num_heads == 0, "model.num_heads",
           f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}",
           "pick num_heads that divides hidden_size")
    _check(m.kv_heads >= 1 and m.num_heads % m.kv_heads == 0, "model.num_kv_heads",
           f"num_heads {m.num_heads} is not a multiple of num_kv_heads {m.kv_heads}",
           "pick num_kv_heads that divides num_heads")
    _check(m.family != "llama" or m.head_dim % 2 == 0, "model.hidden_size",
           f"RoPE needs an even head dim, got {m.head_dim}", "change hidden_size or num_heads")
    _check(m.ffn >= 1, "model.ffn_size", f"must be >= 1, got {m.ffn}", "set a positive value")
    _check(m.act in ("gelu_new", "gelu", "relu", "silu"), "model.activation",
           f"unknown activation {m.act!r}", "use gelu_new, gelu, relu or silu")
    _check(m.eos_token_id is None or 0 <= m.eos_token_id < m.vocab_size, "model.eos_token_id",
           f"{m.eos_token_id} is outside the vocabulary [0, {m.vocab_size})", "fix or unset it")
    _check(p.tp >= 1, "parallel.tp", f"must be >= 1, got {p.tp}", "use 1 for no tensor parallelism")
    _check(p.pp >= 1, "parallel.pp", f"must be >= 1, got {p.pp}", "use 1 for no pipeline")
    _check(p.dp >= 1, "parallel.dp", f"must be >= 1, got {p.dp}", "use 1 for one replica")
    _check(hw.gpus_per_node >= 1, "hardware.gpus_per_node", f"must be >= 1, got {hw.gpus_per_node}",
           "use e.g. 8 (a DGX node)")
    cfg.workload.validate()
    _check(m.num_heads % p.tp == 0, "parallel.tp",
           f"num_heads {m.num_heads} is not divisible by tp {p.tp}", "pick tp that divides num_heads")
    _check(m.kv_heads % p.tp == 0, "parallel.tp",
           f"num_kv_heads {m.kv_heads} is not divisible by tp {p.tp}",
           "pick tp that divides num_kv_heads")
    _check(m.ffn % p.tp == 0, "parallel.tp", f"ffn_size {m.ffn} is not divisible by tp {p.tp}",
           "pick tp that divides ffn_size")
    _check(m.num_layers >= p.pp, "parallel.pp",
           f"{m.num_layers} layers cannot fill {p.pp} pipeline stages",
           f"use pp <= {m.num_layers}")
    _check_layer_split(m.num_layers, p)
    _check(pl.planner in PLANNERS, "planner.planner", f"unknown planner {pl.planner!r}",
           f"use one of {', '.join(PLANNERS)}")
    _check(pl.chunk_size >= 1, "planner.chunk_size", f"must be >= 1, got {pl.chunk_size}",
           "use e.g. 256 (tile-aligned)")
    _check(pl.max_batch_size >= 1, "planner.max_batch_size",
           f"must be >= 1, got {pl.max_batch_size}", "use e.g. 8")
    _check(pl.tile_size >= 1, "planner.tile_size", f"must be >= 1, got {pl.tile_size}", "use 128")
    _check(pl.planner not in ("sarathi", "uniform") or not pl.tile_align
           or pl.chunk_size >= pl.max_batch_size, "planner.chunk_size",
           f"chunk_size {pl.chunk_size} leaves no prefill token beside "
           f"{pl.max_batch_size - 1} piggybacked decodes",
           "raise chunk_size above max_batch_size or set tile_align: false")
    _check(pl.token_budget is None or pl.token_budget >= 1, "planner.token_budget",
           f"must be >= 1, got {pl.token_budget}", "leave it unset for max_seq_len")
    _check(pl.in_flight is None or pl.in_flight >= 1, "planner.in_flight",
           f"must be >= 1, got {pl.in_flight}", "leave it unset for pp")
    for knob in ("gllm_maxp", "gllm_minp", "gllm_iterp", "gllm_maxd"):
        _check(getattr(pl, knob) >= 1, f"planner.{knob}", f"must be >= 1, got {getattr(pl, knob)}",
               "use gLLM's default (maxp 8192, minp 32, iterp 8, maxd 512)")
    _check(pl.gllm_kvthresh is None or 0 <= pl.gllm_kvthresh < 1, "planner.gllm_kvthresh",
           f"must be in [0, 1), got {pl.gllm_kvthresh}", "use e.g. 0.05, or leave it unset")
    _check(pl.spread >= 0, "planner.spread", f"must be >= 0 rounds, got {pl.spread}",
           "0 turns it off; 4 is the default")
    _check(pl.target_ms is None or pl.target_ms > 0, "planner.target_ms",
           f"must be > 0, got {pl.target_ms}", "leave it unset for the default target")
    _check(c.kv_slots is None or c.kv_slots >= 1, "cache.kv_slots",
           f"must be >= 1, got {c.kv_slots}", "leave it unset for pp * max_batch_size")
    _check(c.max_seq_len is None or 1 <= c.max_seq_len <= m.max_positions, "cache.max_seq_len",
           f"{c.max_seq_len} is outside [1, max_positions={m.max_positions}]",
           "leave it unset for max_positions")
    _check_cache(c, cfg.seq_len)
    _check(0 < c.memory_utilization <= 1, "cache.memory_utilization",
           f"must be in (0, 1], got {c.memory_utilization}", "use e.g. 0.9")
    _check(c.device_memory_gb is None or c.device_memory_gb > 0, "cache.device_memory_gb",
           f"must be > 0, got {c.device_memory_gb}", "give the memory of one device in GB")
    _check(rt.device == "auto" or rt.device == "cpu" or rt.device.split(":")[0] == "cuda",
           "runtime.device", f"unknown device {rt.device!r}", "use auto, cpu, cuda or cuda:N")
    _check(rt.executor in ("auto", "local", "ray", "torchrun"), "runtime.executor",
           f"unknown executor {rt.executor!r}", "use auto, local, ray or torchrun")
    _check(rt.executor != "local" or p.tp == 1, "runtime.executor",
           f"the local executor runs tp=1, got tp={p.tp}", "use executor: ray (or auto)")
    _check(rt.dist_port >= 0, "runtime.dist_port", f"must be >= 0, got {rt.dist_port}",
           "use 0 for a free port")
    _check(rt.threads_per_worker is None or rt.threads_per_worker >= 1, "runtime.threads_per_worker",
           f"must be >= 1, got {rt.threads_per_worker}", "leave it unset for cores / workers")
    _check(rt.kv_layout in ("auto", "heads", "tokens"), "runtime.kv_layout",
           f"unknown layout {rt.kv_layout!r}", "use auto, heads or tokens")
    _check(rt.step_timeout_s > 0 and rt.startup_timeout_s > 0, "runtime.step_timeout_s",
           "timeouts must be > 0", "use e.g. 120 and 300 seconds")


def _check_cache(c: CacheConfig, seq_len: int) -> None:
    bs = c.block_size
    _check(bs >= 1 and bs & (bs - 1) == 0 and bs <= seq_len, "cache.block_size",
           f"{bs} is not a power of two in [1, max_seq_len={seq_len}]", "use e.g. 16")
    n = c.num_blocks
    _check(n is None or n == "auto" or (isinstance(n, int) and n * bs >= seq_len),
           "cache.num_blocks", f"{n!r} blocks of {bs} tokens hold less than one request of "
           f"max_seq_len={seq_len} tokens", f"use at least {-(-seq_len // bs)}, auto (from "
           "cache.device_memory_gb), or leave it unset for kv_slots contexts")
    _check(n != "auto" or c.device_memory_gb is not None, "cache.num_blocks",
           "auto sizes the pool from cache.device_memory_gb, which is not set",
           "set device_memory_gb or give num_blocks")
    _check(c.paged or n is None, "cache.num_blocks", "paged: false reserves kv_slots whole "
           "contexts; num_blocks does not apply", "set kv_slots instead")
    _check(0 <= c.watermark < 1, "cache.watermark", f"must be in [0, 1), got {c.watermark}",
           "use e.g. 0.01")
    _check(c.paged or not c.prefix_caching, "cache.prefix_caching",
           "needs the paged cache", "set paged: true or prefix_caching: false")
    _check(c.max_running is None or c.max_running >= 1, "cache.max_running",
           f"must be >= 1, got {c.max_running}", "leave it unset for what the blocks hold")


def _check_layer_split(num_layers: int, p: ParallelConfig) -> None:
    split, where = p.layer_split, "parallel.layer_split"
    fix = (f"give {p.pp} counts (one per stage, each >= 1) summing to model.num_layers = "
           f"{num_layers}, e.g. {even_split(num_layers, p.pp)}, or use auto (balanced by the "
           f"cost model), even, or null (auto with a hardware.profile, else even)")
    if split is None or split in (LAYER_SPLIT_AUTO, LAYER_SPLIT_EVEN):
        return
    _check(isinstance(split, (list, tuple)), where,
           f"unknown value {split!r}" if isinstance(split, str) else f"got {split!r}", fix)
    _check(all(isinstance(k, int) and not isinstance(k, bool) for k in split), where,
           f"{list(split)} holds a non-integer", fix)
    _check(len(split) == p.pp, where, f"{list(split)} has {len(split)} entries for pp = {p.pp}",
           fix)
    _check(min(split) >= 1, where, f"{list(split)} leaves a stage with no layer", fix)
    _check(sum(split) == num_layers, where,
           f"{list(split)} sums to {sum(split)} layers, the model has {num_layers}", fix)


# ---- YAML --------------------------------------------------------------------------------
def _section(cls: type, data: Any, where: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return cls(**data)


def find_config(name_or_path: str | Path, kind: str = "") -> Path:
    """A YAML path as given, or a shipped config by name (e.g. 'gpt3-175b')."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidates = [CONFIG_DIR / kind / f"{name_or_path}.yaml", CONFIG_DIR / f"{name_or_path}.yaml"]
    for cand in candidates:
        if cand.is_file():
            return cand
    shipped = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(
        f"config {str(name_or_path)!r} not found: not a file, and not a shipped "
        f"{kind or 'config'} name ({', '.join(shipped) or 'none shipped'})"
    )


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    path = find_config(name_or_path, "models")
    return _section(ModelConfig, yaml.safe_load(path.read_text()), str(path))


def config_from_dict(data: dict[str, Any], where: str = "config") -> Config:
    data = dict(data or {})
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}"
        )
    model = data.get("model")
    if isinstance(model, str):  # a shipped model by name, e.g. `model: gpt3-175b`
        data["model"] = dataclasses.asdict(load_model_config(model))
    elif isinstance(model, dict) and "preset" in model:  # a shipped model with overrides
        model = dict(model)
        base = dataclasses.asdict(load_model_config(model.pop("preset")))
        data["model"] = {**base, **model}
    cfg = Config(**{s: _section(cls, data.get(s), f"{where}: {s}") for s, cls in SECTIONS.items()})
    cfg.validate()
    return cfg


def load_config(name_or_path: str | Path, **overrides: Any) -> Config:
    """Load a YAML config (a path, or a shipped name) and apply keyword overrides."""
    path = find_config(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (model:, parallel:, "
                          f"planner: ...), got a YAML {type(data).__name__}")
    cfg = config_from_dict(data, str(path))
    return cfg.with_overrides(**overrides) if overrides else cfg
