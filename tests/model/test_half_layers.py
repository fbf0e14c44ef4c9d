"""A stage boundary inside a layer (`parallel.layer_split` in half layers): each worker
holds exactly its halves' weights and KV, the memory count says so, and the tokens are
those of the uncut model (transformers' own check: tests/test_hf_reference.py)."""
import pytest
import torch

from conftest import slot_tables
from pp_runtime import LLM, SamplingParams
from pp_runtime.core.batch import MicroBatch, SeqChunk
from pp_runtime.config import ConfigError, load_config
from pp_runtime.costmodel.memory import stage_memory

PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], [11, 2, 9, 13, 1]]


def llm(**overrides) -> LLM:
    cfg = load_config("tiny", executor="local", chunk_size=4, **overrides)  # tiny-gpt: 4 layers
    return LLM(cfg)


def test_the_workers_hold_the_halves_of_the_cut_layer():
    run = llm(pp=2, layer_split=[2.5, 1.5], prepack=False)  # dense weights: parameters()
    first, second = (w.model for w in run.executor.workers)
    assert (first.lo, first.hi, first.units) == (0, 3, (0, 5))
    assert (second.lo, second.hi, second.units) == (2, 4, (5, 8))
    cut_attn, cut_mlp = first.layers[-1], second.layers[0]  # layer 2, in two pieces
    assert (cut_attn.has_attn, cut_attn.has_mlp, cut_mlp.has_attn, cut_mlp.has_mlp) == (
        True, False, False, True)
    assert hasattr(cut_attn, "qkv") and not hasattr(cut_attn, "fc1")
    assert hasattr(cut_mlp, "fc1") and not hasattr(cut_mlp, "qkv")
    # the KV cache: one layer per attention half (3 on stage 0, layers 0-2; 1 on stage 1)
    assert [len(w.cache.k) for w in run.executor.workers] == [3, 1]
    # the memory check counts what was built, weights and KV
    cfg = run.config
    for s, w in enumerate(run.executor.workers):
        mem = stage_memory(cfg, s, 4)
        assert mem.weight_bytes == sum(p.numel() * 4 for p in w.model.parameters())
        assert mem.kv_bytes_per_block == w.cache.nbytes // w.cache.k[0].shape[0]
    run.shutdown()


def logits(run: LLM, prompt: list[int]) -> torch.Tensor:
    """Every prompt position's logits, the prompt prefilled in chunks of 4 into context 0
    through the stages in turn (as the pipeline passes the hidden states)."""
    workers, out = run.executor.workers, []
    for start in range(0, len(prompt), 4):
        seqs = slot_tables([SeqChunk(0, 0, start, tuple(prompt[start:start + 4]), None)], run.config)
        x = None
        for w in workers:
            x, _ = w.forward(MicroBatch(0, seqs), x)
        out.append(workers[-1].model.logits(x))
    return torch.cat(out)


@pytest.mark.parametrize("split", [[2.5, 1.5], [0.5, 3.5], [3.5, 0.5], [1.5, 1, 1.5]])
def test_a_half_layer_cut_computes_the_uncut_model(split):
    """The logits (to fp32 rounding: packed and plain linears sum in other orders) and the
    greedy tokens of the uncut model."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    whole, cut = llm(pp=1), llm(pp=len(split), layer_split=split)
    torch.testing.assert_close(logits(cut, PROMPTS[0]), logits(whole, PROMPTS[0]),
                               atol=1e-5, rtol=1e-4)
    want = [o.token_ids for o in whole.generate(PROMPTS, params)]
    assert [o.token_ids for o in cut.generate(PROMPTS, params)] == want
    whole.shutdown()
    cut.shutdown()


def test_a_split_that_is_not_whole_or_half_layers_is_refused():
    with pytest.raises(ConfigError, match=r"\[2.25, 1.75\] holds a count that is not a whole or half layer"):
        load_config("tiny", pp=2, layer_split=[2.25, 1.75])
    with pytest.raises(ConfigError, match="leaves a stage with no layer"):
        load_config("tiny", pp=2, layer_split=[4, 0])
