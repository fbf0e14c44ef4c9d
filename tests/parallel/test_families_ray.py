"""The llama family's other checkpoints on Ray (gloo, 127.0.0.1 only): greedy tokens equal
`transformers`' for Qwen2 (its q/k/v biases cut with their rows) and Qwen3 (q/k norms whole
on every rank, 8 heads of 16 cut 4 + 4) at TP2 on Megatron-core's parallel layers, Mistral
(the window on every stage) and LLaMA-3 RoPE scaling (positions on a later stage) at PP2,
with chunked prefills beside decodes on paged KV. Each family at the parallelism its
feature lives in: two actors, not four (TP2 x PP2 for every path: test_ray_runtime.py;
the 1 x 1 runs: tests/model/test_families.py)."""
import pytest

from pp_runtime import LLM, SamplingParams
from test_ray_runtime import PLAN, PROMPTS, local_ray  # noqa: F401  (the module's Ray)

pytestmark = pytest.mark.slow  # two Ray actors per checkpoint (pytest.ini)

NEW = 6


@pytest.mark.parametrize("family, tp, pp", [("llama3", 1, 2), ("qwen2", 2, 1), ("qwen3", 2, 1),
                                            ("mistral", 1, 2)])
def test_greedy_equals_transformers(family, tp, pp, tmp_path):
    import torch

    from conftest import hf_model

    model = hf_model(family, eos_token_id=None)  # no EOS: transformers suppresses nothing
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    batches = []
    with LLM.from_pretrained(tmp_path, **PLAN, tp=tp, pp=pp, block_size=4) as llm:
        assert llm.executor.name == "ray"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True),
                            on_microbatch=lambda mb, _: batches.append(mb))
    assert any(mb.num_decodes and mb.num_prefill_tokens for mb in batches)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()
