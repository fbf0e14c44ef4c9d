"""config.json fields that change a checkpoint's math but that the model does not implement:
refused with one line (CheckpointError) before anything loads, instead of running with
wrong tokens. No torch; `LLM(checkpoint=...)` and `pp-runtime serve` call it first.

Each family's fields fall in three groups. Implemented: read by `model/hf_config.py` into
`ModelConfig` (sizes, head_dim, norm eps, activation, biases, tied embeddings, RoPE theta
and scaling `linear` / `dynamic` / `llama3`, Qwen3's q/k norm, Mistral's sliding window).
Harmless at inference: dropout rates, `use_cache`, GPT-2's `reorder_and_upcast_attn` (an
fp16 overflow guard, the same math), LLaMA's `pretraining_tp` (the same matmuls, split),
`add_cross_attention` (used only with encoder states, which a decoder-only run never
passes), Qwen's `max_window_layers` and `sliding_window` while `use_sliding_window` is
off. Not implemented: `REFUSED` below, each with the value that means "off" and what it
would change, and RoPE types other than `ROPE_TYPES` (yarn, longrope, ...: their
attention scaling and frequencies are not built).
"""
from __future__ import annotations

from pp_runtime.core.errors import CheckpointError

LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")  # model_types on the llama family's layer
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")  # model/rope.py

_SCALING = {  # fields of the llama-like families
    "partial_rotary_factor": ((1, 1.0, None), "rotates only part of each head"),
    "attn_logit_softcapping": ((None,), "caps the attention logits"),
    "final_logit_softcapping": ((None,), "caps the output logits"),
    "attention_multiplier": ((None,), "rescales the attention scores"),
    "logits_scaling": ((None, 1, 1.0), "rescales the output logits"),
    "embedding_multiplier": ((None, 1, 1.0), "rescales the embeddings"),
    "residual_multiplier": ((None, 1, 1.0), "rescales every residual branch"),
}
_QWEN_WINDOW = {"use_sliding_window": ((False, None), "gives some layers a sliding window")}

# model_type -> {field: (values that need nothing, what a different value changes)}
REFUSED: dict[str, dict[str, tuple[tuple, str]]] = {
    "llama": _SCALING,
    "mistral": _SCALING,
    "qwen2": {**_SCALING, **_QWEN_WINDOW},
    "qwen3": {**_SCALING, **_QWEN_WINDOW, "attention_bias": (
        (False, None), "adds biases to q, k, v and o but not the MLP")},
}


def rope_params(hf: dict) -> dict:
    """The RoPE fields: `rope_parameters` (transformers >= 5) over `rope_scaling` (< 5)."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def check_math_fields(hf: dict, where: str = "config.json") -> None:
    """CheckpointError naming the first field of `hf` (a config.json) that changes the
    model's math in a way this runtime does not implement."""
    if hf.get("model_type") in LLAMA_LIKE:
        rope = rope_params(hf)
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise CheckpointError(
                f"{where}: rope_type: {kind!r} is not supported (it changes the RoPE "
                f"frequencies and attention scale; only {', '.join(ROPE_TYPES)} are "
                "implemented): the model would run with wrong tokens")
    for name, (off, effect) in REFUSED.get(hf.get("model_type"), {}).items():
        value = hf.get(name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in off):
            raise CheckpointError(
                f"{where}: {name}: {value!r} is not supported (it {effect}; only "
                f"{off[0]!r} is implemented): the model would run with wrong tokens")
