"""Shared fixtures: tiny random-weight Hugging Face checkpoints written to temp dirs."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub access: every checkpoint is built here

import pytest
import torch

torch.set_num_threads(1)

GPT2_SHAPES = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=300, n_positions=128,
                   bos_token_id=0, eos_token_id=0)
# 8 query heads share 2 KV heads: grouped-query attention
LLAMA_SHAPES = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=96, vocab_size=300,
                    max_position_embeddings=128, bos_token_id=0, eos_token_id=0)


def slot_tables(seqs, cfg) -> tuple:
    """Test shorthand: a SeqChunk whose `blocks` is an int n means whole context n of the
    cache (`pp_runtime.batch.slot_tables` with the config's blocks per context)."""
    from pp_runtime.core.batch import slot_tables as tables

    return tables(seqs, -(-cfg.seq_len // cfg.cache.block_size))


# the llama family's other checkpoints, on LLAMA_SHAPES: (config class, model class, fields)
LLAMA_KIN = {
    # all three llama3 bands at head_dim 8, theta 500: wavelengths 6.3 (kept), 30 (smoothed),
    # 140 and 664 (divided by 8) against 32 / 4 and 32 / 1
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(  # past 32 the base grows
        max_position_embeddings=32, rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),  # q/k/v bias
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # q/k norm; 8 x 16 > 64
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
}


def hf_model(family: str, **changes):
    """A random-weight transformers model; a large init std makes greedy choices decisive.
    `family`: gpt, llama or a key of LLAMA_KIN."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    if family == "gpt":
        model = GPT2LMHeadModel(GPT2Config(**{**GPT2_SHAPES, "initializer_range": 0.2, **changes}))
    else:
        config, cls, fields = LLAMA_KIN.get(family, ("LlamaConfig", "LlamaForCausalLM", {}))
        model = getattr(transformers, cls)(getattr(transformers, config)(**{
            **LLAMA_SHAPES, "initializer_range": 0.2, "rope_theta": 500.0, **fields, **changes}))
        if family in LLAMA_KIN:  # transformers inits biases and norms to 0 and 1: vary them
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.fixture(scope="session", params=["gpt", "llama"])
def hf_checkpoint(request, tmp_path_factory):
    """(family, HF model, directory) with the model saved in safetensors, split in shards."""
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    model.save_pretrained(path, max_shard_size="100KB")
    return request.param, model, path


# ---- the order of files under `-n 2 --dist loadfile` ----------------------------------------
# xdist hands each worker a whole file at a time, by default the files with the most tests
# first: the one-test files that start Ray, servers or torchrun (test_plan_validate: two
# minutes) came last, and one worker ran them alone while the other had nothing left. Files
# with a slow (or slurm) test go first, in collection order, and the many quick files fill
# both workers at the end.
def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist's by-count order, off
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    heavy = {item.path for item in items
             if item.get_closest_marker("slow") or item.get_closest_marker("slurm")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: each file's order kept
