"""Measure a profile of the local device: what `pp-runtime profile` writes.

Times the operations the cost model prices, on this device (CPU, or a GPU when there is
one), for one TP rank's shapes (heads / tp, ffn / tp), in the format of the Vidur project's
tables (milliseconds, `time_stats.OP.median`), so one loader reads both:

  mlp.csv        the linear and small ops of one decoder layer by num_tokens, timed on the
                 runtime's own modules (`StageModel`, `DecoderLayer`)
  attention.csv  `prefill_attention` of a chunk of C tokens after K cached ones; the
                 runtime's decode path (varlen flash on GPU, per-decode views on CPU) for b
                 decodes with K cached tokens each, so they attend to K + 1 keys.
                 kv_cache_size = K = tokens cached before the step, as in Vidur.
  send_recv.csv  one TP rank's activations [num_tokens, hidden / tp] between two spawned
                 processes (ping-pong, half the round trip)
  device.json    device, name, dtype, threads, torch, model, tp, time of measurement

Each point: warm-up, then as many timed calls as fit a small budget (within bounds); the
median is written. The caller's thread count is used as it is. Successive calls go to
successive layers of a stage-sized stack (`cold_layers`), as in a real forward pass: one
layer timed in a loop keeps its weights and KV in the CPU cache and reads 2-3x too fast.
"""
from __future__ import annotations

import csv
import itertools
import json
import os
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from pp_runtime.core.batch import MicroBatch, SeqChunk, slot_blocks
from pp_runtime.config import Config
from pp_runtime.worker.device import resolve_device, torch_dtype
from pp_runtime.model.paged_kernel import use_paged_decode
from pp_runtime.core.errors import ConfigError
from pp_runtime.model.attention import BatchLayout, decode_attention, prefill_attention
from pp_runtime.model.cpu_kernels import (PackedLinear, can_prepack, prepack_linears,
                                          use_decode_kernel, use_prepack)
from pp_runtime.model.kv_cache import KVCache, heads_major
from pp_runtime.model.transformer import DecoderLayer, Rotary, StageModel
from pp_runtime.parallel.layers import LocalShard
from pp_runtime.profile.grid import FULL, QUICK, Effort, ProfileGrid, profile_grid
from pp_runtime.profile.p2p import measure_send_recv
from pp_runtime.telemetry.timer import Op, Timer, device_timer

MLP_OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
           "lm_head")  # lm_head (ours, not Vidur's): the LM head matmul over num_tokens rows
MLP_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size",
               "use_gated_mlp", "num_tokens", "num_tensor_parallel_workers",
               *(f"time_stats.{op}.median" for op in MLP_OPS))
ATTENTION_COLUMNS = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers",
                     "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill",
                     "time_stats.attn_prefill.median", "time_stats.attn_decode.median")
SEND_RECV_COLUMNS = ("n_embd", "num_tokens", "num_tensor_parallel_workers",
                     "time_stats.send_recv.median")

COLD_BYTES = 1 << 30  # at most this much weight (and KV) in the rotated stack


def cold_layers(cfg: Config) -> int:
    """Layers to rotate through: the deepest stage's, within COLD_BYTES of weights."""
    m = cfg.model
    per_layer = (m.num_params() - m.vocab_size * m.hidden_size) / m.num_layers / cfg.parallel.tp
    stage = -(-m.num_layers // cfg.parallel.pp)
    return max(1, min(stage, int(COLD_BYTES // max(1, per_layer * m.dtype_bytes))))


def _rank_model(cfg: Config, device: torch.device, layers: int = 1) -> StageModel:
    """One TP rank's shard of a first stage (embedding + `layers` layers), as the worker
    builds it; on the meta device it only has shapes."""
    with torch.device(device):
        return StageModel(cfg.model, 0, layers, LocalShard(cfg.parallel.tp))


def op_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Weight shapes [out, in] of the matmuls timed for mlp.csv: one TP rank's shard."""
    model = _rank_model(cfg, torch.device("meta"))
    layer: DecoderLayer = model.layers[0]
    return {"emb": tuple(model.embed.weight.shape),
            "attn_pre_proj": tuple(layer.qkv.weight.shape),
            "attn_post_proj": tuple(layer.out.weight.shape),
            "mlp_up_proj": tuple(layer.fc1.weight.shape),
            "mlp_down_proj": tuple(layer.fc2.weight.shape)}


# ---- timing -------------------------------------------------------------------------------
def _timed_ms(fn: Callable[[], object], timer: Timer) -> float:
    """Milliseconds of one call, until the device has finished it: the runtime's own timer
    (`telemetry/timer.py`: CUDA events on GPU, perf_counter on CPU)."""
    rec = timer.record()
    with rec.span(Op.COMPUTE):
        fn()
    return rec.resolve().seconds(Op.COMPUTE) * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, effort: Effort) -> float:
    """Median milliseconds of `fn` after warm-up; the first call also sizes the repeats."""
    timer = device_timer(device)
    first = _timed_ms(fn, timer)
    for _ in range(effort.warmup - 1):
        fn()
    fits = int(effort.budget_s * 1e3 / max(first, 1e-3))
    repeats = min(effort.max_repeats, max(effort.min_repeats, fits))
    return statistics.median(_timed_ms(fn, timer) for _ in range(repeats))


# ---- mlp.csv ------------------------------------------------------------------------------
def _flat_batch(num_tokens: int, seq_len: int, block_size: int) -> MicroBatch:
    """num_tokens prompt tokens from position 0, cut into sequences of at most seq_len."""
    sizes = [min(seq_len, num_tokens - row) for row in range(0, num_tokens, seq_len)]
    per = -(-seq_len // block_size)
    return MicroBatch(0, tuple(SeqChunk(i, slot_blocks(i, per), 0, tuple(range(n)), None)
                               for i, n in enumerate(sizes)))


def _layer_ops(model: StageModel, head: nn.Module, n: int, seq_len: int) -> dict[str, Callable | None]:
    """One call per MLP_OPS entry on inputs of n tokens made beforehand (None: not run);
    each call of an op runs on the next layer of the stack."""
    layer: DecoderLayer = model.layers[0]
    nxt = itertools.cycle(model.layers).__next__  # the layer the next call runs on
    w = layer.qkv.weight
    q_dim, kv_dim = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
    layout = BatchLayout.build(_flat_batch(n, seq_len, 16), w.device, 16)  # positions only
    ids = torch.randint(model.cfg.vocab_size, (n,), device=w.device)  # [n]
    x = torch.randn(n, w.shape[1], dtype=w.dtype, device=w.device)  # [n, hidden]
    y = torch.randn_like(x)  # [n, hidden]
    qkv = layer.qkv(x)  # [n, q_dim + 2 * kv_dim]
    q = qkv[:, :q_dim].view(-1, layer.heads, layer.head_dim)  # [n, heads / tp, head_dim]
    k = qkv[:, q_dim:q_dim + kv_dim].view(-1, layer.kv_heads, layer.head_dim)
    attn = torch.randn(n, q_dim, dtype=w.dtype, device=w.device)  # [n, heads / tp * head_dim]
    up = layer.fc1(x)  # [n, ffn / tp] or [n, 2 * ffn / tp] (gate, up)
    act = layer.mlp_act(up)  # [n, ffn / tp]
    rope_op = None
    if isinstance(layer.rotary, Rotary):  # tables are built once per micro-batch, not per layer
        layer.rotary(q, k, layout)
        rope_op = lambda: layer.rotary(q, k, layout)  # noqa: E731
    return {"emb": lambda: model.embed_tokens(ids, layout),
            "input_layernorm": lambda: nxt().attn_norm(x),
            "attn_pre_proj": lambda: nxt().qkv(x),
            "attn_rope": rope_op,
            "attn_post_proj": lambda: nxt().out(attn),
            "post_attention_layernorm": lambda: nxt().mlp_norm(x),
            "mlp_up_proj": lambda: nxt().fc1(x),
            "mlp_act": lambda: layer.mlp_act(up),
            "mlp_down_proj": lambda: nxt().fc2(act),
            "add": lambda: x + y,
            "lm_head": lambda: head(x)}


def measure_mlp(cfg: Config, model: StageModel, grid: ProfileGrid, effort: Effort,
                bar: tqdm) -> list[dict]:
    m, device, rows = cfg.model, model.layers[0].qkv.weight.device, []
    shape = {"n_head": m.num_heads, "n_kv_head": m.kv_heads, "n_embd": m.hidden_size,
             "n_expanded_embd": m.ffn, "vocab_size": m.vocab_size,
             "use_gated_mlp": m.family == "llama"}  # the full model's sizes, as in Vidur
    with torch.device(device):  # one rank's LM head: [vocab / tp, hidden]
        head = LocalShard(cfg.parallel.tp).vocab_head(m.vocab_size, m.hidden_size)
    head = head.to(model.layers[0].qkv.weight.dtype)
    head.weight.normal_(0.0, 0.02)
    if use_prepack(cfg, device) and can_prepack(head.weight.dtype):
        head = PackedLinear.from_linear(head)  # as the worker's LM head
    for n in grid.num_tokens:
        ops = _layer_ops(model, head, n, cfg.seq_len)
        times = {op: 0.0 if fn is None else median_ms(fn, device, effort) for op, fn in ops.items()}
        rows.append({**shape, "num_tokens": n, "num_tensor_parallel_workers": cfg.parallel.tp,
                     **{f"time_stats.{op}.median": t for op, t in times.items()}})
        bar.update()
    return rows


# ---- attention.csv ------------------------------------------------------------------------
def _prefill_op(layer: DecoderLayer, cache: KVCache, chunk: int, cached: int) -> Callable:
    """`prefill_attention` of `chunk` new tokens after `cached` ones, in context 0."""
    w = layer.qkv.weight
    blocks = slot_blocks(0, cache.num_blocks)  # one context: the whole cache
    mb = MicroBatch(0, (SeqChunk(0, blocks, cached, tuple(range(chunk)), None),))
    span = BatchLayout.build(mb, w.device, cache.block_size).prefills[0]
    q = torch.randn(chunk, layer.heads, layer.head_dim, dtype=w.dtype,
                    device=w.device)  # [C, heads / tp, head_dim]
    kv = itertools.cycle([cache.layer(i) for i in range(len(cache.k))]).__next__
    return lambda: prefill_attention(q, *kv(), span)


def _decode_op(layer: DecoderLayer, cache: KVCache, batch: int, cached: int, per: int,
               cpu_decode: bool = False, paged: bool = False) -> Callable:
    """The runtime's decode path, picked as `hybrid_attention` does (`cpu_decode`: the
    worker's CPU kernel; `paged`: the Triton kernel on CUDA), for `batch` decodes with `cached` tokens already in the cache each
    (decode i in context i, `per` blocks each)."""
    w = layer.qkv.weight
    mb = MicroBatch(0, tuple(SeqChunk(i, slot_blocks(i, per), cached, (0,), None, is_decode=True)
                             for i in range(batch)))
    lay = BatchLayout.build(mb, w.device, cache.block_size, cpu_decode, paged)
    q = torch.randn(batch, layer.heads, layer.head_dim, dtype=w.dtype,
                    device=w.device)  # [b, heads / tp, head_dim]
    kv = itertools.cycle([cache.layer(i) for i in range(len(cache.k))]).__next__
    return lambda: decode_attention(q, *kv(), lay)  # the path hybrid_attention takes


def _filled_cache(layer: DecoderLayer, slots: int, seq_len: int, block_size: int,
                  layers: int, heads_major: bool) -> KVCache:
    """A KV cache of `layers` layers (rotated through, like the weights), within COLD_BYTES."""
    w = layer.qkv.weight
    per = -(-seq_len // block_size)  # blocks of one context: context i has [i * per, (i + 1) * per)
    per_layer = 2 * slots * per * block_size * layer.kv_heads * layer.head_dim * w.element_size()
    layers = max(1, min(layers, COLD_BYTES // max(1, per_layer)))
    cache = KVCache(layers, slots * per, block_size, layer.kv_heads, layer.head_dim, w.dtype,
                    w.device, heads_major)
    for t in (*cache.k, *cache.v):  # [slots * per, block_size, kv_heads / tp, head_dim]
        t.normal_()
    return cache


def measure_attention(cfg: Config, layer: DecoderLayer, grid: ProfileGrid, effort: Effort,
                      bar: tqdm) -> list[dict]:
    m, device, rows = cfg.model, layer.qkv.weight.device, []
    cpu_decode = use_decode_kernel(cfg, device)  # as the worker decides
    paged = use_paged_decode(cfg, device)
    for is_prefill, points in ((True, grid.prefills), (False, grid.decodes)):
        slots = 1 if is_prefill else max((b for b, _ in points), default=1)
        cache = _filled_cache(layer, slots, cfg.seq_len, cfg.cache.block_size, cold_layers(cfg),
                              heads_major(cfg, device))
        for a, cached in points:  # a: the chunk (prefill) or the number of decodes
            op = (_prefill_op(layer, cache, a, cached) if is_prefill else
                  _decode_op(layer, cache, a, cached, -(-cfg.seq_len // cfg.cache.block_size),
                             cpu_decode, paged))
            ms = median_ms(op, device, effort)
            rows.append({"n_embd": m.hidden_size, "n_q_head": m.num_heads,
                         "n_kv_head": m.kv_heads, "num_tensor_parallel_workers": cfg.parallel.tp,
                         "batch_size": 1 if is_prefill else a,
                         "prefill_chunk_size": a if is_prefill else 0, "kv_cache_size": cached,
                         "is_prefill": is_prefill,
                         "time_stats.attn_prefill.median": ms if is_prefill else None,
                         "time_stats.attn_decode.median": None if is_prefill else ms})
            bar.update()
        del cache
    return rows


# ---- the profile --------------------------------------------------------------------------
def _out_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"profile output {str(out)!r} is a file; give a directory "
                          "(it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"profile output {str(out)!r} cannot be created: {exc}") from exc
    if not os.access(out, os.W_OK):
        raise ConfigError(f"profile output {str(out)!r} is not writable; give another directory")
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else (platform.processor() or platform.machine())


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({c: ("" if r[c] is None else r[c]) for c in columns} for r in rows)


def measure_profile(cfg: Config, out_dir: str | Path, *, quick: bool = False,
                    progress: bool = True) -> Path:
    """Measure the cost model's operations on this device for `cfg`'s model at its tp, and
    write mlp.csv, attention.csv, send_recv.csv and device.json into `out_dir` (created if
    missing; files written only once everything is measured). Returns `out_dir`."""
    if not isinstance(cfg, Config):
        raise ConfigError(f"measure_profile needs a Config, got {type(cfg).__name__}")
    cfg.validate()
    out = _out_dir(out_dir)
    try:
        device = resolve_device(cfg.runtime.device)
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from exc
    effort, grid = QUICK if quick else FULL, profile_grid(cfg, quick)
    dtype = cfg.model.dtype_for(device.type)  # "auto": the checkpoint's on a GPU, fp32 on a CPU
    model = _rank_model(cfg, device, cold_layers(cfg)).to(torch_dtype(dtype))
    model.init_random(cfg.runtime.seed)
    if use_prepack(cfg, device):  # the matmuls the workers will run
        prepack_linears(model)
    model = model.eval().requires_grad_(False)
    with tqdm(total=grid.size, desc="profile", unit="pt", disable=not progress) as bar, \
            torch.inference_mode():
        bar.set_description("profile mlp")
        mlp = measure_mlp(cfg, model, grid, effort, bar)
        bar.set_description("profile attention")
        attention = measure_attention(cfg, model.layers[0], grid, effort, bar)
        del model
        bar.set_description("profile send/recv")
        send_recv, p2p = measure_send_recv(cfg, device, grid, effort, bar)
    _write_csv(out / "mlp.csv", MLP_COLUMNS, mlp)
    _write_csv(out / "attention.csv", ATTENTION_COLUMNS, attention)
    _write_csv(out / "send_recv.csv", SEND_RECV_COLUMNS, send_recv)
    info = {"device": device.type, "name": _device_name(device), "dtype": dtype,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "model": cfg.model.name, "tp": cfg.parallel.tp,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "quick": quick, "send_recv_backend": p2p}
    (out / "device.json").write_text(json.dumps(info, indent=2) + "\n")
    return out
