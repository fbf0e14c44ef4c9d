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


def hf_model(family: str, **changes):
    """A random-weight transformers model; a large init std makes greedy choices decisive."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    if family == "gpt":
        model = GPT2LMHeadModel(GPT2Config(**{**GPT2_SHAPES, "initializer_range": 0.2, **changes}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA_SHAPES, "initializer_range": 0.2,
                                                "rope_theta": 500.0, **changes}))
    return model.eval()


@pytest.fixture(scope="session", params=["gpt", "llama"])
def hf_checkpoint(request, tmp_path_factory):
    """(family, HF model, directory) with the model saved in safetensors, split in shards."""
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    model.save_pretrained(path, max_shard_size="100KB")
    return request.param, model, path
