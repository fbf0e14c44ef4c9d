"""The configuration's sections: frozen dataclasses, their derived sizes and overrides.

A `Config` has seven sections (model, parallel, cache, planner, runtime, hardware,
workload). Every field has a default that works on a laptop. Overrides name a field by
itself when the name is unique across sections (`with_overrides(chunk_size=64, pp=2)`),
or as `section.field`. A bare name in two sections means the first (`seed` is
runtime.seed; the workload's is `workload.seed`). Checks: `config/check.py`; YAML:
`config/load.py`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pp_runtime.config.check import LAYER_SPLIT_AUTO, even_split, validate
from pp_runtime.core.dtypes import AUTO_DTYPE, DTYPES
from pp_runtime.core.errors import ConfigError
from pp_runtime.core.workload import WorkloadConfig

DEFAULT_CHUNK = 256  # C of the fixed-budget planners when chunk_size is unset (SARATHI's)
DEFAULT_ROWS = 8  # B of the fixed-B planners with neither max_batch_size nor kv_slots


@dataclass(frozen=True)
class ModelConfig:
    name: str = "gpt2-small"  # label used in reports
    family: str = "gpt"  # "gpt" (learned positions, LayerNorm, GELU) or "llama" (RoPE, RMSNorm,
    #                      SwiGLU, GQA; also Qwen2/2.5, Qwen3 and Mistral, by the fields below)
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
    rope_scaling: str = "default"  # RoPE frequencies as transformers computes them: default,
    #                                linear (positions / factor), dynamic (NTK: the base grows
    #                                with a sequence past rope_original_positions), llama3
    rope_factor: float = 1.0  # the factor of linear, dynamic and llama3 scaling
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / low are / factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept
    rope_original_positions: int | None = None  # llama3: original_max_position_embeddings;
    #                                             dynamic: the context past which the base
    #                                             grows; None = max_positions
    head_size: int | None = None  # width of one head; None = hidden_size / num_heads
    #                               (Qwen3-32B: 128 at hidden 5120 over 64 heads)
    qkv_bias: bool | None = None  # bias on the q, k, v projections; None = `bias` (Qwen2: True
    #                               with bias False: o_proj and the MLP have none)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    sliding_window: int | None = None  # a query sees only the last sliding_window positions,
    #                                    itself included (Mistral v0.1: 4096); None = all
    activation: str | None = None  # None = family default: gelu_new (gpt), silu (llama)
    bias: bool | None = None  # biases on linear layers; None = family default: True (gpt), False (llama)
    tie_embeddings: bool | None = None  # LM head shares the embedding; None = True (gpt), False (llama)
    eos_token_id: int | None = None  # generation stops on this id; None = never

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

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
    def use_qkv_bias(self) -> bool:
        return self.use_bias if self.qkv_bias is None else self.qkv_bias

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
        q, kv = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        bias = self.use_bias
        attn = (h + self.use_qkv_bias) * (q + 2 * kv) + q * h + h * bias
        attn += 2 * self.head_dim * self.qk_norm  # one q and one k norm, shared by the heads
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
    layer_split: list[float] | str | None = None  # decoder layers per stage: a list (one count
    #   per stage, each >= 0.5, summing to num_layers; a half is a layer cut between its
    #   attention and its MLP: docs/distributed.md), "auto" (stage times equalised by the
    #   cost model: stage 0 also embeds, the last stage runs the LM head), "even" (earlier
    #   stages take the remainder) or None: auto with a hardware.profile, else even.
    #   `Config.layers_per_stage` reads it; auto is chosen where a run or a simulation is
    #   built (`costmodel.balance.resolve_layer_split`), and refused here until then.


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
    chunk_size: int | None = None  # prefill tokens per micro-batch (C). The fixed-budget
    #                               planners (sarathi, sarathi-serve, orca...): None = 256,
    #                               tile-aligned with decodes. uniform: an optional cap (its
    #                               budget is time, from tbt_slo_ms)
    max_batch_size: int | None = None  # B: sequences per micro-batch. The fixed-B planners:
    #                                    None = kv_slots / pp (the paper's B from memory),
    #                                    else 8. uniform: an optional cap (KV pages and time
    #                                    bound its rows)
    tile_size: int = 128  # GPU matmul tile; chunk + decodes should be a multiple of it
    tile_align: bool = True  # shrink the chunk by the piggybacked decodes so chunk + decodes = C
    token_budget: int | None = None  # vllm: prefill tokens per micro-batch; None = max_seq_len
    tbt_slo_ms: float | None = None  # uniform: the deployment's p99 time-between-tokens target;
    #                                  each micro-batch is filled to 0.9 x it / in_flight of
    #                                  predicted time. None: the throughput knee (docs/planner.md)
    ttft_slo_ms: float | None = None  # uniform: the p99 time-to-first-token target; the queue's
    #                                   prompts get the share of each micro-batch it needs
    target_ms: float | None = None  # uniform: a micro-batch's predicted ms set by hand (in
    #                                 place of the one derived from tbt_slo_ms)
    chunk_pipelining: bool = True  # a prompt's next chunk may enter the pipeline while its
    #                                previous chunks are in flight (stages run in order, so
    #                                its KV is written first); false: one micro-batch at a time
    pack_prefills: bool = True  # uniform: a prompt's last chunk leaves room -> the next
    #                             prompt's first chunk fills it
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
    # a stage that dies or hangs (past step_timeout_s): the workers are replaced and every
    # running request is computed again from its prompt and tokens (docs/recovery.md), at
    # most recovery_attempts times in any recovery_window_s; past that, or at 0, every
    # open request ends with an error naming the stage
    recovery_attempts: int = 5
    recovery_window_s: float = 60.0
    metrics: bool = True  # export Ray metrics (ray executor)
    compiled_graph: bool | str = "auto"  # ray: every rank's micro-batch call as one Ray
    #                               Compiled Graph execution (docs/distributed.md); "auto":
    #                               where it pays (`ray_graph.graph_pays`: a GPU per worker,
    #                               or tp * pp + 1 CPUs; its polling channels took the
    #                               stages' CPU on this 2-core machine, so off here)
    tp_relay: bool = False  # ray, tp > 1, graph off: call only each stage's TP rank 0, which
    #                         relays the plan to its TP peers (pp task calls a micro-batch,
    #                         not tp * pp); opt-in: on this 2-core machine it cut the driver's
    #                         submit but lengthened every stage's gap between calls
    #                         (docs/distributed.md)
    token_hop: bool | str = "auto"  # pp > 1: the last stage sends each sampled id straight
    #                         to stage 0 and the driver plans decodes ahead with placeholders
    #                         (docs/distributed.md, "Tokens skip the driver"); "auto": on for
    #                         ray's task-per-actor path at any tp, the compiled graph and
    #                         torchrun at tp = 1, off elsewhere (the local executor, the TP
    #                         relay, the graph and torchrun at tp > 1);
    #                         the simulator as the calibrated executor it stands for
    # CPU fast paths (docs/performance.md); neither changes anything on CUDA
    prepack: bool = True  # linear layers on prepacked oneDNN weights (CPU, float32/bfloat16,
    #                       tp = 1 layers; results differ from plain torch by fp32 rounding)
    cpu_decode_kernel: bool = True  # decode attention in one C++ call per layer (built on
    #                                 first use, ~17 s, cached; without a compiler: one SDPA
    #                                 call per decode, as with false)
    kv_layout: str = "auto"  # KV cache order: "heads" ([slot][head][position], each head's
    #                          keys contiguous: decode attention streams them), "tokens"
    #                          ([slot][position][head], the flattened rows FlashAttention's
    #                          varlen decode reads); "auto": heads on a CPU, tokens on CUDA
    # CUDA fast paths (docs/gpu.md)
    decode_attention: str = "auto"  # decodes on CUDA: "paged" (a Triton kernel reads the
    #                                 block tables, model/paged_kernel.py), "gather" (the keys
    #                                 gathered, then FlashAttention-2 varlen); "auto": paged
    #                                 where Triton imports
    cuda_graphs: bool | str = "auto"  # decode-only micro-batches replayed from CUDA graphs,
    #                                   one per bucket of decode counts (worker/graphs.py);
    #                                   "auto": on CUDA at tp = 1 with paged decodes; true on a
    #                                   CPU runs the same static buffers uncaptured (tests)
    graph_max_decodes: int = 256  # the largest bucket; more decodes run eagerly
    compile_small_ops: bool | str = "auto"  # torch.compile RMSNorm, RoPE and SwiGLU's gate
    #                                         (model/transformer.py): fewer, fused kernels;
    #                                         "auto": on CUDA (a CPU run would compile ~40 s)


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
        return self.cache.kv_slots or self.parallel.pp * self.batch_rows

    @property
    def batch_rows(self) -> int:
        """B of the fixed-B planners: planner.max_batch_size, else what the KV slots give a
        micro-batch (kv_slots / pp: the paper's B from memory), else 8."""
        b, slots = self.planner.max_batch_size, self.cache.kv_slots
        return b or (max(1, slots // self.parallel.pp) if slots else DEFAULT_ROWS)

    @property
    def chunk_tokens(self) -> int:
        """C of the fixed-budget planners: planner.chunk_size, else 256 (the paper's)."""
        return self.planner.chunk_size or DEFAULT_CHUNK

    # ---- pipeline stages -----------------------------------------------------------
    @property
    def layer_split_pending(self) -> bool:
        """Whether `parallel.layer_split` is auto and not chosen yet (None counts as auto
        where a profile exists): the cost model chooses it, `costmodel.balance`."""
        split = self.parallel.layer_split
        return self.parallel.pp > 1 and (
            split == LAYER_SPLIT_AUTO or (split is None and bool(self.hardware.profile)))

    def layers_per_stage(self) -> list[int]:
        """Decoder layers of each stage: `parallel.layer_split` resolved. The only reader
        of that field: workers (and so the checkpoint loader), the memory check and the
        cost model all cut the model here. An auto split not chosen yet is refused: the
        boundary that builds a run or a simulation chooses it first
        (`costmodel.balance.resolve_layer_split`), so every reader sees one split."""
        split, m, pp = self.parallel.layer_split, self.model, self.parallel.pp
        if self.layer_split_pending:
            raise ConfigError("parallel.layer_split: auto is not chosen yet; resolve it where "
                              "the run is built (costmodel.balance.resolve_layer_split(cfg))")
        if isinstance(split, (list, tuple)) and pp > 1:
            return list(split)
        return even_split(m.num_layers, pp)

    def stage_units(self, stage: int) -> tuple[int, int]:
        """Half-layer units [lo, hi) of a pipeline stage: unit 2i is layer i's attention
        (its norm, QKV, attention, output projection and residual add), unit 2i + 1 its
        MLP (norm, up, activation, down, add). A whole-layer split has even bounds."""
        counts = self.layers_per_stage()
        lo = round(2 * sum(counts[:stage]))
        return lo, lo + round(2 * counts[stage])

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """Layers [lo, hi) a pipeline stage holds any part of (a layer cut in half at a
        stage boundary is in both stages' ranges: `stage_units` says which half)."""
        lo, hi = self.stage_units(stage)
        return lo // 2, (hi + 1) // 2

    def with_layer_split_resolved(self) -> "Config":
        """A copy whose layer_split is the explicit list (what an executor hands its
        workers, so every process cuts the model the same way); auto must be chosen first."""
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

