"""A decoder-only transformer cut into pipeline stages.

`StageModel` holds layers [lo, hi) of the model; the first stage also owns the token (and,
for GPT, position) embedding, the last owns the final norm and the LM head. Two families
share one layer:

- gpt:   learned positions, LayerNorm, GELU MLP, biases (GPT-2, GPT-3)
- llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases

Every linear layer runs once over all rows of a micro-batch (decode-maximal batching);
only attention looks at sequence boundaries (see attention.py).
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from pp_runtime.config import ModelConfig
from pp_runtime.model.attention import BatchLayout, hybrid_attention, rope
from pp_runtime.model.kv_cache import KVCache

def stage_layers(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Layers [lo, hi) of a stage: as even as possible, earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def make_norm(m: ModelConfig) -> nn.Module:
    if m.family == "llama":
        return RMSNorm(m.hidden_size, m.norm_eps)
    return nn.LayerNorm(m.hidden_size, eps=m.norm_eps)


ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class DecoderLayer(nn.Module):
    def __init__(self, m: ModelConfig, tp: int = 1):
        super().__init__()
        self.family, self.rope_theta = m.family, m.rope_theta
        self.heads, self.kv_heads, self.head_dim = m.num_heads // tp, m.kv_heads // tp, m.head_dim
        q_dim, kv_dim, ffn = self.heads * self.head_dim, self.kv_heads * self.head_dim, m.ffn // tp
        gated = m.family == "llama"
        self.attn_norm = make_norm(m)
        self.qkv = nn.Linear(m.hidden_size, q_dim + 2 * kv_dim, bias=m.use_bias)
        self.out = nn.Linear(q_dim, m.hidden_size, bias=m.use_bias)
        self.mlp_norm = make_norm(m)
        self.fc1 = nn.Linear(m.hidden_size, (2 if gated else 1) * ffn, bias=m.use_bias)
        self.fc2 = nn.Linear(ffn, m.hidden_size, bias=m.use_bias)
        self.act = ACTIVATIONS[m.act]

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                layout: BatchLayout) -> torch.Tensor:
        # x: [T, hidden], T = every token of the micro-batch
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv = self.qkv(self.attn_norm(x))  # [T, q_dim + 2 * kv_dim]
        q = qkv[:, :q_dim].view(-1, self.heads, self.head_dim)  # [T, heads, head_dim]
        k = qkv[:, q_dim:q_dim + kv_dim].view(-1, self.kv_heads, self.head_dim)
        v = qkv[:, q_dim + kv_dim:].view(-1, self.kv_heads, self.head_dim)
        if self.family == "llama":
            cos, sin = layout.rope_tables(self.rope_theta, self.head_dim, q.dtype)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        attn = hybrid_attention(q, k, v, k_cache, v_cache, layout)  # [T, heads, head_dim]
        x = x + self.out(attn.reshape(-1, q_dim))
        h = self.fc1(self.mlp_norm(x))  # [T, ffn] or [T, 2 * ffn] (gate, up)
        if self.family == "llama":
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return x + self.fc2(h)


class StageModel(nn.Module):
    """Layers [lo, hi) of the model, plus the embedding (first stage) or head (last stage)."""

    def __init__(self, m: ModelConfig, lo: int, hi: int, tp: int = 1):
        super().__init__()
        self.cfg, self.lo, self.hi = m, lo, hi
        self.is_first, self.is_last = lo == 0, hi == m.num_layers
        if self.is_first:
            self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
            if m.family == "gpt":
                self.pos_embed = nn.Embedding(m.max_positions, m.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(m, tp) for _ in range(lo, hi))
        if self.is_last:
            self.final_norm = make_norm(m)
            self.lm_head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def embed_tokens(self, token_ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        x = self.embed(token_ids)  # [T, hidden]
        if self.cfg.family == "gpt":
            x = x + self.pos_embed(layout.positions)
        return x

    def forward(self, x: torch.Tensor, cache: KVCache, layout: BatchLayout) -> torch.Tensor:
        """x: token ids [T] on the first stage, else hidden states [T, hidden].
        Returns hidden states [T, hidden] after this stage's layers."""
        if self.is_first:
            x = self.embed_tokens(x, layout)
        for i, layer in enumerate(self.layers):
            x = layer(x, *cache.layer(i), layout)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32 (last stage only)."""
        return self.lm_head(self.final_norm(hidden)).float()

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """GPT-2-style init; each layer seeded by its global index, so any cut into
        stages gives the same weights as the whole model."""
        std = 0.02
        for name, p in self.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":  # the global layer index, whatever the stage
                parts[1] = str(int(parts[1]) + self.lo)
            canonical = ".".join(parts)
            if canonical == "lm_head.weight" and self.cfg.tied:
                canonical = "embed.weight"
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{canonical}".encode()))
            if parts[-1] == "bias":
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:  # residual projections scaled down with depth, as in GPT-2
                scale = std / math.sqrt(2 * self.cfg.num_layers) if parts[-2] in ("out", "fc2") else std
                p.copy_(torch.randn(p.shape, generator=g) * scale)
