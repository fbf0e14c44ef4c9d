"""GPT-2's two attention-scaling flags (transformers' GPT2Config / GPT2Attention) against
transformers on random-weight checkpoints: `scale_attn_by_inverse_layer_idx: true` divides
layer i's scores by i + 1, `scale_attn_weights: false` drops the 1/sqrt(head_dim); both are
folded into the query rows at load (model/loader.py). Three stages in one process, so
a stage's first layer is not the model's."""
import pytest
import torch

from conftest import hf_model
from pp_runtime import LLM, SamplingParams
from test_hf_reference import hf_greedy, make_prompts

FLAGS = [dict(scale_attn_by_inverse_layer_idx=True), dict(scale_attn_weights=False),
         dict(scale_attn_by_inverse_layer_idx=True, scale_attn_weights=False)]


@pytest.mark.parametrize("flags", FLAGS, ids=["inverse-layer-idx", "unscaled", "both"])
def test_greedy_tokens_and_logits_equal_transformers(tmp_path, flags):
    model = hf_model("gpt", **flags)
    model.save_pretrained(tmp_path)
    prompts = make_prompts(model.config.vocab_size)
    want = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM.from_pretrained(tmp_path, chunk_size=8, max_batch_size=3, pp=3, executor="local")
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert [o.token_ids for o in outs] == want
    finally:
        llm.shutdown()
    one = LLM.from_pretrained(tmp_path, chunk_size=64, device="cpu")
    worker, prompt = one.executor.workers[0], prompts[2]
    from conftest import slot_tables
    from pp_runtime.core.batch import MicroBatch, SeqChunk
    seqs = slot_tables([SeqChunk(0, 0, 0, tuple(prompt), None)], worker.cfg)
    hidden, _ = worker.forward(MicroBatch(0, seqs), None)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(worker.model.logits(hidden), ref, atol=5e-5, rtol=1e-4)
    one.shutdown()
    with torch.no_grad():  # the same weights with default scaling give other logits
        plain = hf_model("gpt")(torch.tensor([prompt])).logits[0]
    assert (plain - ref).abs().max() > 1e-2
