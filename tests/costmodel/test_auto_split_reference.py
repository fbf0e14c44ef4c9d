"""The new default split against `transformers`: with a profile of this machine,
`layer_split` left unset is `auto` (issue 22); PP = 2 and 3 in one process, token for
token equal to Hugging Face's greedy generation (GPT-2 and LLaMA checkpoints)."""
import pytest

from test_hf_reference import NEW_TOKENS, hf_greedy, make_prompts
from pp_runtime import LLM, SamplingParams
from pp_runtime.config import Config
from pp_runtime.profile.measure import measure_profile
from pp_runtime.model.loader import model_config_from_hf, read_hf_config


@pytest.mark.parametrize("pp", [2, 3])
def test_auto_split_by_default_equals_transformers(hf_checkpoint, tmp_path, pp):
    family, model, path = hf_checkpoint
    cfg = Config(model=model_config_from_hf(read_hf_config(path)))
    profile = measure_profile(cfg.with_overrides(pp=pp, chunk_size=8, max_batch_size=3),
                              tmp_path / "profile", quick=True, progress=False)
    llm = LLM.from_pretrained(path, pp=pp, executor="local", chunk_size=8, max_batch_size=3,
                              **{"hardware.profile": str(profile)})
    split = llm.config.parallel.layer_split  # unset: auto, chosen once as the LLM was built
    assert isinstance(split, list) and llm.config.layers_per_stage() == split
    assert sum(split) == model.config.num_hidden_layers and len(split) == pp
    # what the stages hold, in half layers (a layer cut at a boundary is in both ranges)
    assert [(w.model.units[1] - w.model.units[0]) / 2 for w in llm.executor.workers] == split
    prompts = make_prompts(model.config.vocab_size)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
