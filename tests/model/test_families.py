"""The llama family's other checkpoints against `transformers`, each built here with
transformers' own config class and random weights (norms and biases varied too), saved in
safetensors: LLaMA-3.x RoPE scaling (`llama3`, `linear`, `dynamic`), Qwen2 (bias on q, k, v
alone, tied embeddings), Qwen3 (RMSNorm on each query and key head, head_dim 16 over
hidden 64 / 8 heads) and Mistral (sliding window 16, which every prompt and chunk here
reaches past).

Through `LLM.from_pretrained` on the CPU (paged KV, the C++ decode kernel): greedy tokens
equal transformers' under chunked prefills mixed with decodes, for every planner; chunked
prefill logits equal its logits (fp32 tolerance). The window really cut attention
(prefill band masks; the C++ decode kernel from each decode's last 16 keys). A field that changes the
math and is still not built is refused in one line (exit 2). TP2 x PP2:
tests/parallel/test_families_ray.py."""
import json

import pytest
import torch

from pp_runtime import LLM, SamplingParams
from pp_runtime.core.batch import SeqChunk
from pp_runtime.model.attention import attention_paths
from pp_runtime.model.checkpoint_fields import check_math_fields
from pp_runtime.core.errors import CheckpointError
from pp_runtime.planner import PLANNERS
from test_checkpoint_fields import refused_everywhere
from test_hf_reference import (NEW_TOKENS, assert_chunked_prefill_logits_equal, hf_greedy,
                               make_prompts)

KIN = ["llama3", "llama-linear", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=KIN)
def kin_checkpoint(request, tmp_path_factory):
    """(family, transformers model, directory), saved in shards; no EOS, so transformers'
    `min_new_tokens` suppresses nothing and token 0 may be chosen like any other."""
    from conftest import hf_model

    model = hf_model(request.param, eos_token_id=None)
    path = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    model.save_pretrained(path, max_shard_size="100KB")
    return request.param, model, path


def test_each_checkpoint_maps_to_its_fields(kin_checkpoint):
    family, _, path = kin_checkpoint
    m = LLM.from_pretrained(path, device="cpu").config.model
    assert m.family == "llama"
    got = (m.rope_scaling, m.use_qkv_bias, m.use_bias, m.tied, m.qk_norm, m.head_dim,
           m.sliding_window)
    assert got == {"llama3": ("llama3", False, False, False, False, 8, None),
                   "llama-linear": ("linear", False, False, False, False, 8, None),
                   "qwen2": ("default", True, False, True, False, 8, None),
                   "qwen3": ("default", False, False, False, True, 16, None),
                   "mistral": ("default", False, False, False, False, 8, 16)}[family]


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_greedy_tokens_equal_transformers(kin_checkpoint, planner):
    """Chunks of 8 beside decodes; on a pool of one context (16 blocks of 4) for four
    requests, so they are preempted and computed again too."""
    family, model, path = kin_checkpoint
    prompts = make_prompts(model.config.vocab_size)
    llm = LLM.from_pretrained(path, planner=planner, chunk_size=8, max_batch_size=3,
                              max_seq_len=64, block_size=4, num_blocks=16)
    before, batches = attention_paths(), []
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                        on_microbatch=lambda mb, _: batches.append(mb))
    calls = {k: v - before[k] for k, v in attention_paths().items()}
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    if planner == "sarathi":  # later chunks really ran beside decodes
        assert any(s.start > 0 and not s.is_decode for mb in batches for s in mb.seqs)
        assert any(mb.num_decodes and mb.num_prefill_tokens for mb in batches)
    assert calls["decode_cpu"] and not calls["decode_views"]  # the C++ kernel, window or not
    assert bool(calls["prefill_window"]) == (family == "mistral")  # chunks past its window
    llm.shutdown()


def test_chunked_prefill_logits_equal_transformers(kin_checkpoint):
    family, model, path = kin_checkpoint
    prompt = make_prompts(model.config.vocab_size)[2]  # 40 tokens: past Mistral's window
    assert_chunked_prefill_logits_equal(model, path, prompt)


def test_dynamic_rope_past_the_original_context_equals_transformers(tmp_path):
    """Dynamic NTK: max_position_embeddings 32, factor 2 (the runtime serves 64). A
    40-token prompt prefilled in one chunk, then 12 decodes, each past 32: transformers
    grows the base with every step, and so do we (a fresh transformers model: its cached
    base depends on the calls before)."""
    from conftest import hf_model

    hf_model("llama-dynamic", eos_token_id=None).save_pretrained(tmp_path)
    prompt = make_prompts(300)[2]
    llm = LLM.from_pretrained(tmp_path, planner="sarathi", chunk_size=64, max_batch_size=1)
    assert (llm.config.model.max_positions, llm.config.model.rope_original_positions) == (64, 32)
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf_model("llama-dynamic", eos_token_id=None), prompt, NEW_TOKENS)
    # default RoPE on the same weights gives other tokens: the scaling was exercised
    plain = LLM.from_pretrained(tmp_path, planner="sarathi", chunk_size=64, max_batch_size=1,
                                rope_scaling="default")
    assert plain.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[
        0].token_ids != out.token_ids
    plain.shutdown()
    llm.shutdown()


def test_a_qwen_sliding_window_is_refused_in_one_line(tmp_path):
    """Qwen's use_sliding_window gives some layers a window (max_window_layers): not built."""
    from conftest import hf_model

    hf_model("qwen2").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True,
                                                      "sliding_window": 16}))
    refused_everywhere(tmp_path, "use_sliding_window", True)


@pytest.mark.parametrize("hf, field", [
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"model_type": "qwen2", "rope_parameters": {"rope_type": "longrope"}}, "rope_type"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"model_type": "mistral", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_other_unbuilt_fields_are_refused(hf, field):
    with pytest.raises(CheckpointError, match=f"config.json: {field}: .* is not supported"):
        check_math_fields(hf)


def test_windowed_varlen_decodes_equal_the_views(kin_checkpoint, monkeypatch):
    """The CUDA decode path's window (rows and lengths cut to each decode's last 16 keys),
    handed to a reference of FlashAttention's varlen contract on the CPU: the logits of the
    per-decode views, for decodes past the window beside a chunk past it."""
    from pp_runtime.model import attention
    from test_fused_attention import GREEDY, make_worker, prompts, reference_flash_varlen, run

    family, model, path = kin_checkpoint
    if family != "mistral":
        pytest.skip("the window is Mistral's")
    p = prompts(model.config.vocab_size)  # 45, 30, 21, 12 tokens
    worker = make_worker(path, kv_layout="tokens", cpu_decode_kernel=False)
    for s in (1, 2, 3):
        run(worker, [SeqChunk(s, s, 0, tuple(p[s][:-1]), None)])
    run(worker, [SeqChunk(0, 0, 0, tuple(p[0][:20]), None)])
    seqs = [SeqChunk(s, s, len(p[s]) - 1, (p[s][-1],), GREEDY, is_decode=True)
            for s in (1, 2, 3)] + [SeqChunk(0, 0, 20, tuple(p[0][20:40]), None)]
    views = run(worker, seqs)
    monkeypatch.setattr(attention, "flash_varlen", reference_flash_varlen)
    monkeypatch.setattr(attention, "decode_kernel", lambda *args: "varlen")
    before = attention_paths()
    varlen = run(worker, seqs)
    assert attention_paths()["decode_varlen"] - before["decode_varlen"] == 3  # one per layer
    torch.testing.assert_close(varlen, views, atol=2e-5, rtol=1e-5)
