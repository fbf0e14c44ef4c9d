"""Validation of a `Config`: field types by pydantic (`_check_types`), ranges and cross-field
rules by `_check`.

Every problem raises `ConfigError` as "section.field: problem; fix". No I/O, and no import
of the sections (they call `validate`): it reads a config by its fields.
"""
from __future__ import annotations

import typing
from dataclasses import fields
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pp_runtime.core.dtypes import AUTO_DTYPE, DTYPES
from pp_runtime.core.errors import ConfigError

FAMILIES = ("gpt", "llama")
ROPE_SCALINGS = ("default", "linear", "dynamic", "llama3")  # model/rope.py
# The names a config may give; each package maps them to its implementation
# (planner/__init__.py: PLANNERS, model/transformer.py: ACTIVATIONS), and
# tests/config/test_names.py checks that the two agree.
PLANNERS = ("sarathi", "orca-best", "orca-worst", "request-level", "vllm", "uniform",
            "sarathi-serve", "gllm")
ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")  # the MLP's (model.activation)

LAYER_SPLIT_AUTO = "auto"  # parallel.layer_split chosen by costmodel/balance.py
LAYER_SPLIT_EVEN = "even"  # even, also where a profile exists (None: auto there)


def even_split(num_layers: int, pp: int) -> list[int]:
    """Layers per stage, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _check(ok: bool, field_name: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {problem}; {fix}")


# fields whose own check below gives the better message and fix
_OWN_CHECK = {"parallel": {"layer_split"}}


@cache
def _field_types(cls: type) -> tuple[tuple[str, Any, TypeAdapter], ...]:
    """(name, annotation as written, pydantic adapter) of each field of a section."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, f.type, TypeAdapter(hints[f.name])) for f in fields(cls))


def _check_types(section: str, obj: Any) -> None:
    """Each field's value against its annotation, by pydantic in strict mode: "3", true or
    3.0 for an int are refused, an int for a float is taken."""
    for name, annotation, adapter in _field_types(type(obj)):
        if name in _OWN_CHECK.get(section, ()):
            continue
        value = getattr(obj, name)
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            _check(False, f"{section}.{name}", f"got {value!r}", f"expected {annotation}")


def validate(cfg) -> None:  # a sections.Config (not imported: the sections import this)
    """Raise ConfigError for any configuration that cannot work: the field types (pydantic),
    then each section's ranges, in the order a reader meets them."""
    for section in fields(cfg):
        _check_types(section.name, getattr(cfg, section.name))
    _check_model(cfg.model)
    _check_parallel(cfg.parallel, cfg.hardware)
    cfg.workload.validate()
    _check_parallel_fits(cfg.model, cfg.parallel)
    _check_planner(cfg.planner)
    _check_cache_section(cfg.cache, cfg.model, cfg.seq_len)
    _check_runtime(cfg.runtime, cfg.parallel)


def _check_model(m) -> None:
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
    _check(m.head_size is not None or m.hidden_size % m.num_heads == 0, "model.num_heads",
           f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads}",
           "pick num_heads that divides hidden_size, or set head_size")
    _check(m.head_size is None or m.head_size >= 1, "model.head_size",
           f"must be >= 1, got {m.head_size}", "leave it unset for hidden_size / num_heads")
    _check(m.kv_heads >= 1 and m.num_heads % m.kv_heads == 0, "model.num_kv_heads",
           f"num_heads {m.num_heads} is not a multiple of num_kv_heads {m.kv_heads}",
           "pick num_kv_heads that divides num_heads")
    _check(m.family != "llama" or m.head_dim % 2 == 0, "model.hidden_size",
           f"RoPE needs an even head dim, got {m.head_dim}", "change hidden_size or num_heads")
    _check_llama_fields(m)
    _check(m.ffn >= 1, "model.ffn_size", f"must be >= 1, got {m.ffn}", "set a positive value")
    _check(m.act in ACTIVATIONS, "model.activation", f"unknown activation {m.act!r}",
           f"use one of {', '.join(ACTIVATIONS)}")
    _check(m.eos_token_id is None or 0 <= m.eos_token_id < m.vocab_size, "model.eos_token_id",
           f"{m.eos_token_id} is outside the vocabulary [0, {m.vocab_size})", "fix or unset it")


def _check_llama_fields(m) -> None:
    """RoPE scaling, q/k norm and the sliding window: llama family only, in range."""
    llama = m.family == "llama"
    _check(m.rope_scaling in ROPE_SCALINGS, "model.rope_scaling",
           f"unknown RoPE scaling {m.rope_scaling!r}", f"use one of {', '.join(ROPE_SCALINGS)}")
    _check(llama or (m.rope_scaling == "default" and not m.qk_norm), "model.family",
           "rope_scaling and qk_norm need RoPE (the llama family)", "use family: llama")
    _check(m.rope_factor >= 1.0, "model.rope_factor", f"must be >= 1, got {m.rope_factor}",
           "use 1.0 for no scaling")
    _check(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor",
           f"must exceed rope_low_freq_factor {m.rope_low_freq_factor}", "use llama3's 4.0 and 1.0")
    _check(m.rope_original_positions is None or m.rope_original_positions >= 1,
           "model.rope_original_positions", f"must be >= 1, got {m.rope_original_positions}",
           "leave it unset for max_positions")
    _check(m.sliding_window is None or (llama and m.sliding_window >= 1), "model.sliding_window",
           f"must be >= 1 on the llama family, got {m.sliding_window}", "leave it unset for none")


def _check_parallel(p, hw) -> None:
    _check(p.tp >= 1, "parallel.tp", f"must be >= 1, got {p.tp}", "use 1 for no tensor parallelism")
    _check(p.pp >= 1, "parallel.pp", f"must be >= 1, got {p.pp}", "use 1 for no pipeline")
    _check(p.dp >= 1, "parallel.dp", f"must be >= 1, got {p.dp}", "use 1 for one replica")
    _check(hw.gpus_per_node >= 1, "hardware.gpus_per_node", f"must be >= 1, got {hw.gpus_per_node}",
           "use e.g. 8 (a DGX node)")


def _check_parallel_fits(m, p) -> None:
    """The model cut by tp and pp: heads, KV heads and ffn divisible, a layer per stage."""
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


def _check_planner(pl) -> None:
    _check(pl.planner in PLANNERS, "planner.planner", f"unknown planner {pl.planner!r}",
           f"use one of {', '.join(PLANNERS)}")
    _check(pl.chunk_size is None or pl.chunk_size >= 1, "planner.chunk_size",
           f"must be >= 1, got {pl.chunk_size}", "use e.g. 256 (tile-aligned), or leave it unset")
    _check(pl.max_batch_size is None or pl.max_batch_size >= 1, "planner.max_batch_size",
           f"must be >= 1, got {pl.max_batch_size}", "use e.g. 8, or leave it unset")
    _check(pl.tile_size >= 1, "planner.tile_size", f"must be >= 1, got {pl.tile_size}", "use 128")
    _check(pl.planner not in ("sarathi", "uniform") or not pl.tile_align
           or pl.chunk_size is None or pl.max_batch_size is None
           or pl.chunk_size >= pl.max_batch_size, "planner.chunk_size",
           f"chunk_size {pl.chunk_size} leaves no prefill token beside "
           f"{(pl.max_batch_size or 1) - 1} piggybacked decodes",
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
    for slo in ("tbt_slo_ms", "ttft_slo_ms"):
        v = getattr(pl, slo)
        _check(v is None or v > 0, f"planner.{slo}", f"must be > 0 ms, got {v}",
               "leave it unset for no target (uniform then fills to the throughput knee)")
    _check(pl.target_ms is None or pl.target_ms > 0, "planner.target_ms",
           f"must be > 0, got {pl.target_ms}", "leave it unset for the default target")


def _check_cache_section(c, m, seq_len: int) -> None:
    _check(c.kv_slots is None or c.kv_slots >= 1, "cache.kv_slots",
           f"must be >= 1, got {c.kv_slots}", "leave it unset for pp * max_batch_size")
    _check(c.max_seq_len is None or 1 <= c.max_seq_len <= m.max_positions, "cache.max_seq_len",
           f"{c.max_seq_len} is outside [1, max_positions={m.max_positions}]",
           "leave it unset for max_positions")
    _check_cache(c, seq_len)
    _check(0 < c.memory_utilization <= 1, "cache.memory_utilization",
           f"must be in (0, 1], got {c.memory_utilization}", "use e.g. 0.9")
    _check(c.device_memory_gb is None or c.device_memory_gb > 0, "cache.device_memory_gb",
           f"must be > 0, got {c.device_memory_gb}", "give the memory of one device in GB")


def _check_runtime(rt, p) -> None:
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
    _check(isinstance(rt.compiled_graph, bool) or rt.compiled_graph == "auto",
           "runtime.compiled_graph", f"unknown value {rt.compiled_graph!r}",
           "use auto, true or false")
    _check(isinstance(rt.token_hop, bool) or rt.token_hop == "auto",
           "runtime.token_hop", f"unknown value {rt.token_hop!r}", "use auto, true or false")
    _check(rt.kv_layout in ("auto", "heads", "tokens"), "runtime.kv_layout",
           f"unknown layout {rt.kv_layout!r}", "use auto, heads or tokens")
    _check(rt.decode_attention in ("auto", "paged", "gather"), "runtime.decode_attention",
           f"unknown kernel {rt.decode_attention!r}", "use auto, paged or gather")
    _check(isinstance(rt.cuda_graphs, bool) or rt.cuda_graphs == "auto", "runtime.cuda_graphs",
           f"unknown value {rt.cuda_graphs!r}", "use auto, true or false")
    _check(isinstance(rt.compile_small_ops, bool) or rt.compile_small_ops == "auto",
           "runtime.compile_small_ops", f"unknown value {rt.compile_small_ops!r}",
           "use auto, true or false")
    _check(isinstance(rt.graph_max_decodes, int) and rt.graph_max_decodes >= 1,
           "runtime.graph_max_decodes", f"must be a whole number >= 1, got {rt.graph_max_decodes!r}",
           "set it to the most decodes a graph replays, e.g. 256")
    _check(rt.step_timeout_s > 0 and rt.startup_timeout_s > 0, "runtime.step_timeout_s",
           "timeouts must be > 0", "use e.g. 120 and 300 seconds")
    _check(rt.recovery_attempts >= 0, "runtime.recovery_attempts",
           f"must be >= 0, got {rt.recovery_attempts}", "use 0 to end every request on a failure")
    _check(rt.recovery_window_s > 0, "runtime.recovery_window_s",
           f"must be > 0, got {rt.recovery_window_s}", "use e.g. 60 seconds")


def _check_cache(c, seq_len: int) -> None:  # c: CacheConfig
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


def _check_layer_split(num_layers: int, p) -> None:  # p: ParallelConfig
    split, where = p.layer_split, "parallel.layer_split"
    fix = (f"give {p.pp} counts (one per stage, whole or half layers, each >= 0.5) summing "
           f"to model.num_layers = "
           f"{num_layers}, e.g. {even_split(num_layers, p.pp)}, or use auto (balanced by the "
           f"cost model), even, or null (auto with a hardware.profile, else even)")
    if split is None or split in (LAYER_SPLIT_AUTO, LAYER_SPLIT_EVEN):
        return
    _check(isinstance(split, (list, tuple)), where,
           f"unknown value {split!r}" if isinstance(split, str) else f"got {split!r}", fix)
    _check(all(isinstance(k, (int, float)) and not isinstance(k, bool) and float(2 * k).is_integer()
               for k in split), where, f"{list(split)} holds a count that is not a whole or half layer", fix)
    _check(len(split) == p.pp, where, f"{list(split)} has {len(split)} entries for pp = {p.pp}",
           fix)
    _check(min(split) >= 0.5, where, f"{list(split)} leaves a stage with no layer", fix)
    _check(sum(split) == num_layers, where,
           f"{list(split)} sums to {sum(split)} layers, the model has {num_layers}", fix)

