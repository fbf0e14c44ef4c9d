"""A checkpoint whose config.json asks for math the model does not implement is refused with
one line naming the field, before anything loads (it used to run with wrong tokens):
LLaMA-family scaling fields; the values that mean "off" load as before. GPT-2's two
attention-scaling flags are implemented (tests/model/test_gpt2_attention_scaling.py)."""
import json
import subprocess
import sys

import pytest

from conftest import hf_model
from pp_runtime.model.checkpoint_fields import check_math_fields
from pp_runtime.core.errors import CheckpointError


def refused_everywhere(path, field: str, value) -> None:
    """LLM.from_pretrained raises one line naming the field; run and serve exit 2 with it."""
    from pp_runtime import LLM

    with pytest.raises(CheckpointError, match=f"{field}: {value!r} is not supported") as info:
        LLM.from_pretrained(path)
    assert "\n" not in str(info.value) and "wrong tokens" in str(info.value)
    for command in ("run", "serve"):  # nothing starts: no worker, no port
        proc = subprocess.run([sys.executable, "-m", "pp_runtime.cli", command, "--checkpoint",
                               str(path)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"error: {info.value}"]


def test_a_llama_partial_rotary_factor_is_refused_in_one_line(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "partial_rotary_factor": 0.5}))
    refused_everywhere(tmp_path, "partial_rotary_factor", 0.5)


def test_the_default_values_load(tmp_path):
    hf_model("gpt", scale_attn_by_inverse_layer_idx=False, scale_attn_weights=True).save_pretrained(tmp_path)
    check_math_fields(json.loads((tmp_path / "config.json").read_text()))  # no error
    check_math_fields({"model_type": "llama", "partial_rotary_factor": 1.0, "pretraining_tp": 2,
                       "attention_dropout": 0.1})


@pytest.mark.parametrize("hf, field", [
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "llama", "logits_scaling": 8.0}, "logits_scaling"),
    ({"model_type": "llama", "residual_multiplier": 0.22}, "residual_multiplier"),
    ({"model_type": "llama", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
])
def test_other_fields_that_change_the_math_are_refused(hf, field):
    with pytest.raises(CheckpointError, match=f"config.json: {field}: "):
        check_math_fields(hf)
