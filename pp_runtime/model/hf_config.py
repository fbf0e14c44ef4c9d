"""A Hugging Face `config.json` -> our `ModelConfig` (no torch: `pp-runtime memory`, `plan`
and the server's first checks read it).

Families: `gpt2` (family gpt), and on the llama family's one layer `llama` (LLaMA 1-3.x,
RoPE scaling `linear`, `dynamic`, `llama3`), `qwen2` (Qwen2 / Qwen2.5: bias on q, k, v
alone), `qwen3` (RMSNorm on each query and key head, its own `head_dim`) and `mistral`
(GQA and, in v0.1, a sliding window). What would change the math and is not implemented is
refused first by `checkpoint_fields.check_math_fields` (one line naming the field); the
rest of the mapping's refusals (a llama with attention_bias != mlp_bias) raise ConfigError.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

from pp_runtime.config import AUTO_DTYPE, DTYPES, ConfigError, ModelConfig
from pp_runtime.core.errors import CheckpointError
from pp_runtime.model.checkpoint_fields import LLAMA_LIKE, check_math_fields, rope_params

_LLAMA_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size", "max_position_embeddings")
REQUIRED_KEYS = {"gpt2": ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"),
                 **{kind: _LLAMA_SIZES for kind in LLAMA_LIKE}}


def read_hf_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory; CheckpointError naming the file when it is
    missing, not JSON, or not an object."""
    cfg_file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise CheckpointError(f"{path}: not a directory; expected a Hugging Face-format "
                              "checkpoint directory (config.json + *.safetensors)")
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face-format directory")
    try:
        hf = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({exc})") from exc
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(hf).__name__}")
    _check_sizes(hf, cfg_file)
    return hf


def _check_sizes(hf: dict, where: object) -> None:
    """The sizes a config.json of a known family must have, as ints >= 1 (CheckpointError)."""
    needed = REQUIRED_KEYS.get(hf.get("model_type"), ())
    missing = [k for k in needed if k not in hf]
    if missing:
        raise CheckpointError(f"{where}: no {', '.join(missing)} (a {hf['model_type']} "
                              f"config needs {', '.join(needed)})")
    bad = [f"{k}={hf[k]!r}" for k in needed
           if not isinstance(hf[k], int) or isinstance(hf[k], bool) or hf[k] < 1]
    if bad:
        raise CheckpointError(f"{where}: {', '.join(bad)}: sizes must be ints >= 1")


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


def checkpoint_dtype(hf: dict) -> str | None:
    """The dtype the checkpoint was saved in: config.json's `torch_dtype` (transformers < 5)
    or `dtype` (transformers >= 5), e.g. "bfloat16" or "torch.float16"; None when absent,
    "auto", or not one we serve in (float64, float8 ...)."""
    value = hf.get("dtype") or hf.get("torch_dtype")
    name = str(value).removeprefix("torch.") if value else None
    return name if name in DTYPES else None


def model_config_from_hf(hf: dict, name: str = "checkpoint",
                         where: str | None = None) -> ModelConfig:
    """Our `ModelConfig` for a config.json of a supported family, with dtype "auto": the
    checkpoint's dtype on a GPU, float32 on a CPU (`ModelConfig.dtype_for`). A missing or
    non-integer size names the key (CheckpointError); a field that changes the math and is
    not implemented names the field (CheckpointError, `check_math_fields`; `where`: the
    config.json's path in that message, default `name`/config.json)."""
    _check_sizes(hf, f"{name}/config.json")
    dtypes = dict(dtype=AUTO_DTYPE, checkpoint_dtype=checkpoint_dtype(hf))
    kind = hf.get("model_type")
    if kind == "gpt2":
        return ModelConfig(
            name=name, family="gpt", num_layers=hf["n_layer"], hidden_size=hf["n_embd"],
            num_heads=hf["n_head"], ffn_size=hf.get("n_inner") or 4 * hf["n_embd"],
            vocab_size=hf["vocab_size"], max_positions=hf["n_positions"],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            activation=hf.get("activation_function", "gelu_new"), bias=True,
            tie_embeddings=hf.get("tie_word_embeddings", True),
            eos_token_id=_eos(hf, hf["vocab_size"], name), **dtypes,
        )
    if kind in LLAMA_LIKE:
        check_math_fields(hf, where or f"{name}/config.json")
        return ModelConfig(name=name, family="llama", eos_token_id=_eos(hf, hf["vocab_size"], name),
                           **_llama_fields(hf, kind, name), **dtypes)
    raise ConfigError(f"model.family: unknown model family {kind!r} in {name}/config.json; "
                      f"supported model_type values: gpt2, {', '.join(LLAMA_LIKE)}")


def _llama_fields(hf: dict, kind: str, name: str) -> dict:
    """ModelConfig fields of a llama-family config.json (llama, qwen2, qwen3, mistral)."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    attention_bias = bool(hf.get("attention_bias", False))
    if kind == "llama" and attention_bias != bool(hf.get("mlp_bias", False)):
        raise ConfigError(f"{name}: attention_bias and mlp_bias must agree")
    head_dim = hf.get("head_dim") or hidden // heads
    rope = rope_params(hf)
    scaling = rope.get("rope_type") or rope.get("type") or "default"
    factor = float(rope.get("factor", 1.0)) if scaling != "default" else 1.0
    max_positions = hf["max_position_embeddings"]
    original = rope.get("original_max_position_embeddings")
    if scaling in ("linear", "dynamic"):  # the context they stretch to, as vLLM derives it
        original, max_positions = max_positions, int(max_positions * factor)
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=head_dim if head_dim != hidden // heads or hidden % heads else None,
        ffn_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_positions=max_positions, norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=scaling, rope_factor=factor,
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_positions=original,
        activation=hf.get("hidden_act", "silu"),
        bias=attention_bias and kind != "qwen2",  # qwen2: q, k, v only, whatever it says
        qkv_bias=True if kind == "qwen2" else None,
        qk_norm=kind == "qwen3",
        sliding_window=hf.get("sliding_window") if kind == "mistral" else None,
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )
