"""Bad requests and bad checkpoints: clear errors, nothing run, nothing lost."""
import json

import pytest

from pp_runtime import LLM, InvalidRequestError, SamplingParams
from pp_runtime.model.loader import CheckpointError


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_positions=64)  # vocab 512


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 2, 512], SamplingParams(), "token id 512 is outside the vocabulary"),
    ([1, -1], SamplingParams(), "token id -1 is outside the vocabulary"),
    ([1] * 60, SamplingParams(max_tokens=5), "65 exceeds max positions 64"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens must be an int >= 1"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p must be a number in"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature must be a finite number >= 0"),
    ("hello", SamplingParams(), "list of int token ids"),
], ids=["empty", "vocab", "negative", "too-long", "max-tokens", "top-p", "temperature", "text"])
def test_bad_request_is_named_and_nothing_runs(llm, prompt, params, message):
    good = [5, 6, 7]
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm.generate([good, prompt, good], [SamplingParams(max_tokens=2), params,
                                            SamplingParams(max_tokens=2)])
    assert "request 1:" in str(err.value) and "request 0" not in str(err.value)
    assert "1 of 3 requests rejected, none run" in str(err.value)
    # the engine is unharmed: the good requests run on the next call
    outs = llm.generate([good, good], SamplingParams(max_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3, 3]


@pytest.mark.parametrize("prompt, params, field, code", [
    ([], SamplingParams(), "prompt", None),
    ([1, 512], SamplingParams(), "prompt", None),
    ([1] * 60, SamplingParams(max_tokens=5), "max_tokens", "context_length_exceeded"),
    ([1] * 64, SamplingParams(max_tokens=1), "prompt", "context_length_exceeded"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens", None),
    ([1, 2], SamplingParams(top_p=0.0), "top_p", None),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature", None),
    ([1, 2], SamplingParams(seed=1.5), "seed", None),
], ids=["empty", "vocab", "max-tokens-over-context", "prompt-fills-context", "max-tokens",
        "top-p", "temperature", "seed"])
def test_the_engines_error_carries_the_field(llm, prompt, params, field, code):
    """`Engine.add_request` raises InvalidRequestError with the field (and a code) set, so
    the server maps it to its 400 without reading the message."""
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request(prompt, params)
    assert (err.value.field, err.value.code) == (field, code), str(err.value)


def test_every_bad_request_is_listed(llm):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[], [1], [999]])
    assert "request 0: prompt is empty" in str(err.value)
    assert "request 2: token id 999" in str(err.value)
    assert "2 of 3 requests rejected" in str(err.value)


def test_mismatched_params_list(llm):
    with pytest.raises(InvalidRequestError, match="2 prompts but 1 SamplingParams"):
        llm.generate([[1], [2]], [SamplingParams()])


def test_checkpoint_whose_shapes_do_not_match_its_config(hf_checkpoint, tmp_path):
    family, model, path = hf_checkpoint
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    key = "vocab_size"
    cfg[key] = 301  # the embedding in the checkpoint has 300 rows
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \(300, 64\).*implies \(301, 64\).*vocab_size"):
        LLM.from_pretrained(tmp_path)


def test_checkpoint_missing_a_tensor(tmp_path):
    from conftest import hf_model
    import torch

    model = hf_model("llama")
    model.config.save_pretrained(tmp_path)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight is missing"):
        LLM.from_pretrained(tmp_path)


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM.from_pretrained(tmp_path)
