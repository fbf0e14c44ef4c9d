"""Hugging Face-format checkpoints: `config.json` + `*.safetensors` or `pytorch_model*.bin`.

`model_config_from_hf` (`hf_config.py`, re-exported here) maps a `config.json` to our
`ModelConfig`; `load_stage_weights` fills one `StageModel` and reads only the tensors that stage needs, and
of each only the slices its tp rank holds (safetensors files are memory-mapped and read
slice by slice), copied straight into the parameters. Every tensor's shape is checked
against the config before it is read, and a mismatch names the tensor, both shapes and the
config field. The model config gets dtype "auto" and the checkpoint's own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pp_runtime.config import CheckpointError, ConfigError, ModelConfig  # noqa: F401
from pp_runtime.model.hf_config import (checkpoint_dtype, model_config_from_hf,  # noqa: F401
                                        read_hf_config)
from pp_runtime.model.transformer import StageModel
from pp_runtime.parallel.layers import shard_of


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor; a parameter is its pieces stacked along its output dim (dim 0):
    LLaMA's q, k, v into our qkv, gate and up into fc1; otherwise one piece."""

    name: str
    shape: tuple[int, ...]  # the shape the config implies, as stored in the file
    hint: str  # the config fields to check when the file disagrees
    transposed: bool = False  # GPT-2's Conv1D stores [in, out]; we use [out, in]

    def rows(self) -> int:
        return self.shape[-1] if self.transposed else self.shape[0]


class TensorReader:
    """Reads tensors, or slices of them, by name from the checkpoint files of a directory.
    Safetensors are read slice by slice (`get_slice`), so a tp rank reads only its share;
    `pytorch_model*.bin` files are memory-mapped and sliced."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        self.index: dict[str, Callable[[], object]] = {}  # name -> a sliceable view
        files = sorted(self.path.glob("*.safetensors"))
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as exc:  # SafetensorError: empty, truncated, not safetensors
                raise CheckpointError(
                    f"{f}: not a readable safetensors file ({_first_line(exc)}): it is "
                    "empty, truncated or corrupt; save or copy it again") from exc
            for key in handle.keys():
                self.index[key] = lambda h=handle, k=key: h.get_slice(k)
        if not files:
            for f in sorted(self.path.glob("pytorch_model*.bin")):
                try:
                    state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                except Exception as exc:
                    raise CheckpointError(f"{f}: not a readable PyTorch checkpoint "
                                          f"({_first_line(exc)}); save or copy it again") from exc
                for key, t in state.items():
                    self.index[key] = lambda t=t: t
        if not self.index:
            raise CheckpointError(f"{path}: no *.safetensors or pytorch_model*.bin files")

    def has(self, name: str) -> bool:
        return name in self.index

    def shape_of(self, piece: Piece):
        """The piece's sliceable view, after checking it exists with the config's shape."""
        if piece.name not in self.index:
            raise CheckpointError(f"{self.path}: tensor {piece.name} is missing")
        view = self.index[piece.name]()
        shape = tuple(view.get_shape() if hasattr(view, "get_shape") else view.shape)
        if shape != piece.shape:
            raise CheckpointError(
                f"{self.path}: tensor {piece.name} has shape {shape}, but the config implies "
                f"{piece.shape} (check {piece.hint})")
        return view

    def read(self, piece: Piece, dim: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """The piece in our layout ([out, in]), only [start, stop) along our `dim` (None: all),
        after checking its full shape against the config."""
        view = self.shape_of(piece)
        if dim is None:  # the whole tensor
            dim, start, stop = 0, 0, piece.rows()
        file_dim = 1 - dim if piece.transposed else dim
        t = view[start:stop] if file_dim == 0 else view[:, start:stop]  # reads only this
        return t.t() if piece.transposed else t


def _copy_shard(reader: TensorReader, pieces: tuple[Piece, ...], param: torch.Tensor) -> None:
    """Copy this rank's part of a parameter into it, block by block (no concatenated copy):
    the rows (or columns) its `Shard` names, read from the pieces they fall in, and zeros
    where the vocabulary was padded. `copy_` casts each block to the parameter's dtype and
    moves it to its device."""
    shard = shard_of(param)
    dim = shard.dim or 0  # a replicated tensor: its pieces stacked along dim 0

    def put(block: torch.Tensor, at: int, row: int = 0) -> None:
        """block -> [at, at + n) along dim; with dim 1, rows [row, ...) (the piece's rows)."""
        where = [slice(None)] * param.dim()
        where[dim] = slice(at, at + block.shape[dim])
        if dim == 1:
            where[0] = slice(row, row + block.shape[0])
        target = param[tuple(where)]
        if target.shape != block.shape:  # our shapes follow the config; a guard for fused ones
            raise CheckpointError(f"{reader.path}: a block {tuple(block.shape)} of "
                                  f"{', '.join(p.name for p in pieces)} does not fit its place "
                                  f"in a parameter of shape {tuple(param.shape)}")
        target.copy_(block)

    pos = 0  # rows (or columns) of param filled
    ranges = shard.ranges() if shard.dim is not None else [(0, sum(p.rows() for p in pieces), 0)]
    for lo, hi, zeros in ranges:
        if dim == 0:  # rows [lo, hi) of the pieces stacked along dim 0
            offset = 0
            for p in pieces:
                a, b = max(lo, offset), min(hi, offset + p.rows())
                if a < b:
                    put(reader.read(p, 0, a - offset, b - offset) if shard.dim is not None
                        else reader.read(p), pos)
                    pos += b - a
                offset += p.rows()
        else:  # columns [lo, hi) of every piece
            row = 0
            for p in pieces:
                put(reader.read(p, dim, lo, hi), pos, row)
                row += p.rows()
            pos += hi - lo
        if zeros:
            param.narrow(dim, pos, zeros).zero_()
            pos += zeros
    if pos != param.shape[dim]:
        raise CheckpointError(f"{reader.path}: {', '.join(p.name for p in pieces)} fill {pos} "
                              f"of the {param.shape[dim]} rows of a parameter of shape "
                              f"{tuple(param.shape)}")


def _gpt_sources(m: ModelConfig, r: TensorReader) -> dict[str, tuple[Piece, ...]]:
    """Our parameter name -> its pieces in a GPT-2 checkpoint."""
    pre = "transformer." if r.has("transformer.wte.weight") else ""
    h, f = m.hidden_size, m.ffn
    H, VH, P = "hidden_size", "vocab_size, hidden_size", "max_positions, hidden_size"  # noqa: N806
    wte = Piece(f"{pre}wte.weight", (m.vocab_size, h), VH)
    src = {
        "embed.weight": (wte,),
        "pos_embed.weight": (Piece(f"{pre}wpe.weight", (m.max_positions, h), P),),
        "final_norm.weight": (Piece(f"{pre}ln_f.weight", (h,), H),),
        "final_norm.bias": (Piece(f"{pre}ln_f.bias", (h,), H),),
        "lm_head.weight": (wte if m.tied else Piece("lm_head.weight", (m.vocab_size, h), VH),),
    }
    convs = {"qkv": ("attn.c_attn", h, 3 * h), "out": ("attn.c_proj", h, h),
             "fc1": ("mlp.c_fc", h, f), "fc2": ("mlp.c_proj", f, h)}
    hint = "hidden_size, num_heads, ffn_size"
    for i in range(m.num_layers):
        p = f"{pre}h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for kind in ("weight", "bias"):
                src[f"layers.{i}.{ours}.{kind}"] = (Piece(f"{p}{theirs}.{kind}", (h,), H),)
        for ours, (theirs, n_in, n_out) in convs.items():  # Conv1D stores [in, out]
            src[f"layers.{i}.{ours}.weight"] = (
                Piece(f"{p}{theirs}.weight", (n_in, n_out), hint, transposed=True),)
            src[f"layers.{i}.{ours}.bias"] = (Piece(f"{p}{theirs}.bias", (n_out,), hint),)
    return src


def _llama_sources(m: ModelConfig, r: TensorReader) -> dict[str, tuple[Piece, ...]]:
    """Our parameter name -> its pieces in a LLaMA, Qwen2/3 or Mistral checkpoint (one
    naming); biases only where the config has them, Qwen3's q/k norms where it has them."""
    h, f = m.hidden_size, m.ffn
    q, kv = m.num_heads * m.head_dim, m.kv_heads * m.head_dim
    hint = "hidden_size, num_heads, num_kv_heads, ffn_size"
    embed = Piece("model.embed_tokens.weight", (m.vocab_size, h), "vocab_size")
    src = {
        "embed.weight": (embed,),
        "final_norm.weight": (Piece("model.norm.weight", (h,), "hidden_size"),),
        "lm_head.weight": (embed if m.tied else Piece("lm_head.weight", (m.vocab_size, h),
                                                      "vocab_size"),),
    }
    parts = {"qkv": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
             "out": [("self_attn.o_proj", h)],
             "fc1": [("mlp.gate_proj", f), ("mlp.up_proj", f)], "fc2": [("mlp.down_proj", h)]}
    n_in = {"qkv": h, "out": q, "fc1": h, "fc2": f}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        src[f"layers.{i}.attn_norm.weight"] = (Piece(f"{p}input_layernorm.weight", (h,), hint),)
        src[f"layers.{i}.mlp_norm.weight"] = (
            Piece(f"{p}post_attention_layernorm.weight", (h,), hint),)
        for ours, pieces in parts.items():  # fused: rows of q, k, v (or gate, up) stacked
            src[f"layers.{i}.{ours}.weight"] = tuple(
                Piece(f"{p}{name}.weight", (rows, n_in[ours]), hint) for name, rows in pieces)
            if m.use_qkv_bias if ours == "qkv" else m.use_bias:
                src[f"layers.{i}.{ours}.bias"] = tuple(
                    Piece(f"{p}{name}.bias", (rows,), hint) for name, rows in pieces)
        if m.qk_norm:
            for ours in ("q_norm", "k_norm"):
                src[f"layers.{i}.{ours}.weight"] = (
                    Piece(f"{p}self_attn.{ours}.weight", (m.head_dim,), "head_dim"),)
    return src


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def check_checkpoint(path: str | Path, m: ModelConfig) -> None:
    """Every file of the checkpoint opens and every tensor the model needs is there with
    the shape the config implies: headers only, no weights read. Runs on the driver before
    any worker starts, so a bad checkpoint is a clear error (exit 2), not a dead worker."""
    reader = TensorReader(path)
    sources = (_gpt_sources if m.family == "gpt" else _llama_sources)(m, reader)
    for pieces in sources.values():
        for piece in pieces:
            if piece.name.endswith(".bias") and not m.use_bias and m.family == "gpt":
                continue
            reader.shape_of(piece)


def _check_finite(stage: StageModel, path: str | Path) -> None:
    """A checkpoint with NaN or infinite weights would 'generate' token 0 until EOS: say
    so at load, naming the parameter. float32 sums of 64K-element blocks, which NaN and inf
    poison: no temporary the size of a parameter (isfinite, or an upcast, would make one)."""
    for name, param in stage.named_parameters():
        sums = [b.sum(dtype=torch.float32) for b in param.detach().reshape(-1).split(1 << 16)]
        if param.is_floating_point() and not bool(torch.isfinite(torch.stack(sums)).all()):
            bad, parts = int((~torch.isfinite(param)).sum()), name.split(".")
            if parts[0] == "layers":  # the model's layer number, not the stage's
                parts[1] = str(int(parts[1]) + stage.lo)
            raise CheckpointError(f"{path}: {bad} of {param.numel()} values of {'.'.join(parts)} "
                                  "are NaN or infinite: the checkpoint is corrupt or was saved "
                                  "from a diverged run")


@torch.no_grad()
def load_stage_weights(stage: StageModel, path: str | Path) -> None:
    """Copy this stage's tensors from the checkpoint at `path` into `stage`'s parameters
    (allocated, in their final dtype and device: `materialize`): only its layers, and of
    each tensor only this tp rank's shard (`shard_of(param)`), copied straight into place
    from the file's pages (`_copy_shard`)."""
    reader = TensorReader(path)
    m = stage.cfg
    sources = (_gpt_sources if m.family == "gpt" else _llama_sources)(m, reader)
    for name, param in stage.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + stage.lo)
        _copy_shard(reader, sources[".".join(parts)], param)
    if m.family == "gpt":
        _fold_gpt2_attention_scale(stage, read_hf_config(path))
    _check_finite(stage, path)


def _fold_gpt2_attention_scale(stage: StageModel, hf: dict) -> None:
    """GPT-2's `scale_attn_weights: false` (scores not divided by sqrt(head_dim)) and
    `scale_attn_by_inverse_layer_idx: true` (layer i's scores divided by i + 1, as
    transformers' GPT2Attention does), folded into the query rows of each layer's qkv
    weight and bias: softmax((s q) k^T / sqrt(d)) is attention with scores scaled by s, on
    every attention path (SDPA, flash, the C++ kernel) and every tp rank (its first rows
    are its query heads)."""
    base = 1.0 if hf.get("scale_attn_weights", True) else stage.cfg.head_dim ** 0.5
    by_layer = bool(hf.get("scale_attn_by_inverse_layer_idx", False))
    if base == 1.0 and not by_layer:
        return
    for j, layer in enumerate(stage.layers):
        if not layer.has_attn:  # the MLP half of a layer cut at the stage boundary
            continue
        scale = base / (stage.lo + j + 1) if by_layer else base
        rows = layer.heads * layer.head_dim  # this rank's query rows
        layer.qkv.weight[:rows] *= scale  # [heads_per_rank * head_dim, hidden]
        if layer.qkv.bias is not None:
            layer.qkv.bias[:rows] *= scale
