"""The llama family's RMSNorm is transformers' LlamaRMSNorm to the bit, in every dtype a
stage runs in (torch's own `nn.RMSNorm` is not in bf16 / fp16: it rounds once, after the
weight, where transformers rounds before it)."""
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pp_runtime.model.transformer import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_equals_transformers_bit_for_bit(dtype):
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, eps=1e-6).to(dtype), LlamaRMSNorm(64, eps=1e-6).to(dtype)
    weight = torch.randn(64).to(dtype)  # away from 1, so a rounding order shows
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    x = (torch.randn(1000, 64) * 3).to(dtype)  # [rows, hidden]
    assert torch.equal(ours(x), ref(x))
