"""Our model against Hugging Face `transformers` on the same random-weight checkpoints,
loaded through `LLM.from_pretrained` (GPT-2, and LLaMA with grouped-query attention)."""
import pytest
import torch

from conftest import slot_tables
from pp_runtime import LLM, SamplingParams
from pp_runtime.core.batch import MicroBatch, SeqChunk
from pp_runtime.planner import PLANNERS

PROMPT_LENS = (23, 9, 40, 17)
NEW_TOKENS = 12


def make_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("overrides", [
    dict(chunk_size=8, max_batch_size=3),  # chunks smaller than every prompt but one
    dict(chunk_size=5, max_batch_size=4, pp=3, executor="local"),  # three stages in one process
    dict(chunk_size=16, max_batch_size=2, tile_align=False),
    # stage 0 ends after layer 1's attention, stage 1 starts with its MLP (a half-layer cut)
    dict(chunk_size=5, max_batch_size=4, pp=2, layer_split=[1.5, 1.5], executor="local"),
], ids=["chunk8", "chunk5-pp3", "chunk16-untiled", "half-layer-pp2"])
def test_greedy_generation_equals_transformers(hf_checkpoint, overrides):
    family, model, path = hf_checkpoint
    prompts = make_prompts(model.config.vocab_size)
    llm = LLM.from_pretrained(path, dtype="float32", **overrides)  # fp32 on a GPU too (auto: bf16)
    assert llm.config.model.family == family
    batches = []
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                        on_microbatch=lambda mb, _: batches.append(mb))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
        assert out.finish_reason == "length"
    # the run really mixed chunked prefills with piggybacked decodes
    assert any(mb.num_decodes and mb.num_prefill_tokens for mb in batches)
    assert any(s.start > 0 and not s.is_decode for mb in batches for s in mb.seqs)


def assert_chunked_prefill_logits_equal(model, path, prompt: list[int]) -> None:
    """Our logits of every prompt position, the prompt prefilled in chunks of 8 into slot 0
    on the CPU (where the reference runs), equal `model`'s."""
    llm = LLM.from_pretrained(path, chunk_size=8, device="cpu")
    worker = llm.executor.workers[0]
    ours = []
    for start in range(0, len(prompt), 8):  # chunks of 8 into slot 0
        seqs = slot_tables([SeqChunk(0, 0, start, tuple(prompt[start:start + 8]), None)], worker.cfg)
        hidden, _ = worker.forward(MicroBatch(0, seqs), None)
        ours.append(worker.model.logits(hidden))
    llm.shutdown()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(torch.cat(ours), ref, atol=5e-5, rtol=1e-4)


def test_prefill_logits_equal_transformers(hf_checkpoint):
    family, model, path = hf_checkpoint
    assert_chunked_prefill_logits_equal(model, path, make_prompts(model.config.vocab_size)[2])


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_greedy_tokens_survive_preemption(hf_checkpoint, planner):
    """A pool of 16 blocks of 4 positions (64 tokens: one request's context) for four
    requests: they are preempted and computed again, several times, and every token is
    still transformers' greedy one."""
    family, model, path = hf_checkpoint
    prompts = make_prompts(model.config.vocab_size)
    llm = LLM.from_pretrained(path, dtype="float32", planner=planner, chunk_size=8, max_batch_size=3,
                              max_seq_len=64, block_size=4, num_blocks=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    if planner != "request-level":  # its groups hold their whole length from admission
        assert sum(o.num_preemptions for o in outs) >= 1


def test_prefix_cache_hits_give_the_tokens_of_misses(hf_checkpoint):
    """Prompts sharing a 24-token prefix, one call after another on one engine with prefix
    caching: later calls find the prefix's blocks cached, and the tokens equal
    transformers'. Then a pool too small to keep them: evicted blocks are recomputed,
    nothing is lost."""
    family, model, path = hf_checkpoint
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(1, model.config.vocab_size, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 9, 3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [hf_greedy(model, p, 6) for p in prompts]
    for blocks, hits in ((64, True), (16, False)):
        llm = LLM.from_pretrained(path, dtype="float32", chunk_size=8, max_seq_len=64, block_size=4,
                                  num_blocks=blocks, prefix_caching=True)
        outs = [llm.generate([p], params)[0] for p in prompts]
        assert [o.token_ids for o in outs] == want
        assert outs[0].num_cached_tokens == 0
        if hits:
            assert [o.num_cached_tokens for o in outs[1:]] == [24, 24]
        llm.shutdown()


def test_pytorch_bin_checkpoint_loads(tmp_path):
    """`pytorch_model.bin` checkpoints load too (GPT-2 with its tied LM head)."""
    from conftest import hf_model

    model = hf_model("gpt")
    model.config.save_pretrained(tmp_path)
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
               tmp_path / "pytorch_model.bin")
    prompt = make_prompts(300)[0]
    out = LLM.from_pretrained(tmp_path, chunk_size=8).generate(
        [prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 6)


def test_eos_stops_generation(hf_checkpoint):
    """With the EOS id set to the first greedy token, generation stops right there."""
    family, model, path = hf_checkpoint
    prompt = make_prompts(model.config.vocab_size)[1]
    first = hf_greedy(model, prompt, 1)[0]
    llm = LLM.from_pretrained(path, chunk_size=8, eos_token_id=first)
    out = llm.generate([prompt], SamplingParams(max_tokens=10))[0]
    assert (out.token_ids, out.finish_reason) == ([first], "eos")
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
