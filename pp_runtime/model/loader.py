"""Hugging Face-format checkpoints: `config.json` + `*.safetensors` or `pytorch_model*.bin`.

`model_config_from_hf` maps a GPT-2 or LLaMA `config.json` to our `ModelConfig`;
`load_stage_weights` fills one `StageModel` and reads only the tensors that stage needs
(safetensors files are opened lazily). Every tensor's shape is checked against the config
before it is copied, and a mismatch names the tensor, both shapes and the config field.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable

import torch

from pp_runtime.config import CheckpointError, ConfigError, ModelConfig  # noqa: F401
from pp_runtime.model.transformer import StageModel


def read_hf_config(path: str | Path) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face-format directory")
    return json.loads(cfg_file.read_text())


def _first(value):
    return value[0] if isinstance(value, list) else value


def _eos(hf: dict, vocab_size: int, name: str) -> int | None:
    """The first EOS id; one outside the vocabulary (random test configs) is dropped."""
    eos = _first(hf.get("eos_token_id"))
    if eos is not None and not 0 <= eos < vocab_size:
        warnings.warn(f"{name}: eos_token_id {eos} is outside the vocabulary [0, {vocab_size}); "
                      "generation will stop on max_tokens only", stacklevel=3)
        return None
    return eos


def model_config_from_hf(hf: dict, name: str = "checkpoint") -> ModelConfig:
    kind = hf.get("model_type")
    if kind == "gpt2":
        return ModelConfig(
            name=name, family="gpt", num_layers=hf["n_layer"], hidden_size=hf["n_embd"],
            num_heads=hf["n_head"], ffn_size=hf.get("n_inner") or 4 * hf["n_embd"],
            vocab_size=hf["vocab_size"], max_positions=hf["n_positions"],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            activation=hf.get("activation_function", "gelu_new"), bias=True,
            tie_embeddings=hf.get("tie_word_embeddings", True),
            eos_token_id=_eos(hf, hf["vocab_size"], name),
        )
    if kind == "llama":
        rope_params = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope_params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        if rope_type not in (None, "default"):
            raise ConfigError(f"{name}: rope type {rope_type!r} is not supported (only default RoPE)")
        head_dim = hf.get("head_dim")
        if head_dim and head_dim != hf["hidden_size"] // hf["num_attention_heads"]:
            raise ConfigError(f"{name}: head_dim {head_dim} != hidden_size / num_attention_heads "
                              "is not supported")
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            raise ConfigError(f"{name}: attention_bias and mlp_bias must agree")
        return ModelConfig(
            name=name, family="llama", num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            ffn_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            max_positions=hf["max_position_embeddings"], norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_params.get("rope_theta", hf.get("rope_theta", 10000.0))),
            activation=hf.get("hidden_act", "silu"), bias=bool(hf.get("attention_bias", False)),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_id=_eos(hf, hf["vocab_size"], name),
        )
    raise ConfigError(f"model.family: unknown model family {kind!r} in {name}/config.json; "
                      "supported model_type values: gpt2, llama")


class TensorReader:
    """Reads single tensors by name from the checkpoint files of a directory."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        self.index: dict[str, Callable[[], torch.Tensor]] = {}
        files = sorted(self.path.glob("*.safetensors"))
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for key in handle.keys():
                self.index[key] = lambda h=handle, k=key: h.get_tensor(k)
        if not files:
            for f in sorted(self.path.glob("pytorch_model*.bin")):
                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                for key, t in state.items():
                    self.index[key] = lambda t=t: t
        if not self.index:
            raise CheckpointError(f"{path}: no *.safetensors or pytorch_model*.bin files")

    def has(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str, shape: tuple[int, ...], field_hint: str) -> torch.Tensor:
        if name not in self.index:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        t = self.index[name]()
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name} has shape {tuple(t.shape)}, but the config implies "
                f"{tuple(shape)} (check {field_hint})"
            )
        return t


def _gpt_sources(m: ModelConfig, r: TensorReader) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name -> how to build it from a GPT-2 checkpoint."""
    pre = "transformer." if r.has("transformer.wte.weight") else ""
    h, f = m.hidden_size, m.ffn
    H, V, P = "hidden_size", "vocab_size", "max_positions"  # noqa: N806
    src = {
        "embed.weight": lambda: r.get(f"{pre}wte.weight", (m.vocab_size, h), f"{V}, {H}"),
        "pos_embed.weight": lambda: r.get(f"{pre}wpe.weight", (m.max_positions, h), f"{P}, {H}"),
        "final_norm.weight": lambda: r.get(f"{pre}ln_f.weight", (h,), H),
        "final_norm.bias": lambda: r.get(f"{pre}ln_f.bias", (h,), H),
        "lm_head.weight": lambda: r.get(f"{pre}wte.weight" if m.tied else "lm_head.weight",
                                        (m.vocab_size, h), f"{V}, {H}"),
    }
    convs = {"qkv": ("attn.c_attn", h, 3 * h), "out": ("attn.c_proj", h, h),
             "fc1": ("mlp.c_fc", h, f), "fc2": ("mlp.c_proj", f, h)}
    for i in range(m.num_layers):
        p = f"{pre}h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for kind in ("weight", "bias"):
                src[f"layers.{i}.{ours}.{kind}"] = lambda n=f"{p}{theirs}.{kind}": r.get(n, (h,), H)
        for ours, (theirs, n_in, n_out) in convs.items():  # Conv1D stores [in, out]
            hint = "hidden_size, num_heads, ffn_size"
            src[f"layers.{i}.{ours}.weight"] = (
                lambda n=f"{p}{theirs}.weight", s=(n_in, n_out): r.get(n, s, hint).t())
            src[f"layers.{i}.{ours}.bias"] = lambda n=f"{p}{theirs}.bias", s=(n_out,): r.get(n, s, hint)
    return src


def _llama_sources(m: ModelConfig, r: TensorReader) -> dict[str, Callable[[], torch.Tensor]]:
    """Our parameter name -> how to build it from a LLaMA checkpoint."""
    h, f, kv = m.hidden_size, m.ffn, m.kv_heads * m.head_dim
    hint = "hidden_size, num_heads, num_kv_heads, ffn_size"
    src = {
        "embed.weight": lambda: r.get("model.embed_tokens.weight", (m.vocab_size, h), "vocab_size"),
        "final_norm.weight": lambda: r.get("model.norm.weight", (h,), "hidden_size"),
        "lm_head.weight": lambda: r.get("lm_head.weight" if not m.tied else
                                        "model.embed_tokens.weight", (m.vocab_size, h), "vocab_size"),
    }
    parts = {"qkv": [("self_attn.q_proj", h), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
             "out": [("self_attn.o_proj", h)],
             "fc1": [("mlp.gate_proj", f), ("mlp.up_proj", f)], "fc2": [("mlp.down_proj", h)]}
    n_in = {"qkv": h, "out": h, "fc1": h, "fc2": f}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        src[f"layers.{i}.attn_norm.weight"] = lambda n=f"{p}input_layernorm.weight": r.get(n, (h,), hint)
        src[f"layers.{i}.mlp_norm.weight"] = (
            lambda n=f"{p}post_attention_layernorm.weight": r.get(n, (h,), hint))
        for ours, pieces in parts.items():  # fused: rows of q, k, v (or gate, up) stacked
            src[f"layers.{i}.{ours}.weight"] = lambda ps=pieces, k=n_in[ours], p=p: torch.cat(
                [r.get(f"{p}{name}.weight", (rows, k), hint) for name, rows in ps])
            src[f"layers.{i}.{ours}.bias"] = lambda ps=pieces, p=p: torch.cat(
                [r.get(f"{p}{name}.bias", (rows,), hint) for name, rows in ps])
    return src


@torch.no_grad()
def load_stage_weights(stage: StageModel, path: str | Path) -> None:
    """Copy this stage's tensors from the checkpoint at `path` into `stage`."""
    reader = TensorReader(path)
    m = stage.cfg
    sources = (_gpt_sources if m.family == "gpt" else _llama_sources)(m, reader)
    for name, param in stage.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + stage.lo)
        tensor = sources[".".join(parts)]()
        if tensor.shape != param.shape:  # our shapes follow the config; a guard for fused tensors
            raise CheckpointError(f"{path}: {name} built with shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(param.shape)}")
        param.copy_(tensor.to(param.dtype))
