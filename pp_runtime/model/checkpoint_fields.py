"""config.json fields that change a checkpoint's math but that the model does not implement:
refused with one line (CheckpointError) before anything loads, instead of running with
wrong tokens. No torch; `LLM(checkpoint=...)` and `pp-runtime serve` call it first.

Each family's fields fall in three groups. Implemented: read by `model/loader.py` into
`ModelConfig` (sizes, norm eps, activation, biases, tied embeddings, RoPE theta; RoPE
scaling and a head_dim that differs are refused there). Harmless at inference: dropout
rates, `use_cache`, GPT-2's `reorder_and_upcast_attn` (an fp16 overflow guard, the same
math), LLaMA's `pretraining_tp` (the same matmuls, split), `add_cross_attention` (used
only with encoder states, which a decoder-only run never passes). Not implemented:
`REFUSED` below, each with the value that means "off" and what it would change.
"""
from __future__ import annotations

from pp_runtime.core.errors import CheckpointError

# model_type -> {field: (values that need nothing, what a different value changes)}
REFUSED: dict[str, dict[str, tuple[tuple, str]]] = {
    "llama": {
        "partial_rotary_factor": ((1, 1.0, None), "rotates only part of each head"),
        "attn_logit_softcapping": ((None,), "caps the attention logits"),
        "final_logit_softcapping": ((None,), "caps the output logits"),
        "attention_multiplier": ((None,), "rescales the attention scores"),
        "logits_scaling": ((None, 1, 1.0), "rescales the output logits"),
        "embedding_multiplier": ((None, 1, 1.0), "rescales the embeddings"),
        "residual_multiplier": ((None, 1, 1.0), "rescales every residual branch"),
    },
}


def check_math_fields(hf: dict, where: str = "config.json") -> None:
    """CheckpointError naming the first field of `hf` (a config.json) that changes the
    model's math in a way this runtime does not implement."""
    for name, (off, effect) in REFUSED.get(hf.get("model_type"), {}).items():
        value = hf.get(name)
        if not any(value is v or (type(value) is type(v) and value == v) for v in off):
            raise CheckpointError(
                f"{where}: {name}: {value!r} is not supported (it {effect}; only "
                f"{off[0]!r} is implemented): the model would run with wrong tokens")
