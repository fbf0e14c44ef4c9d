"""A decoder-only transformer cut into pipeline stages.

`StageModel` holds layers [lo, hi) of the model; the first stage also owns the token (and,
for GPT, position) embedding, the last owns the final norm and the LM head. Two families
share one layer:

- gpt:   learned positions, LayerNorm, GELU MLP, biases (GPT-2, GPT-3)
- llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases

Every linear layer runs once over all rows of a micro-batch (decode-maximal batching);
only attention looks at sequence boundaries (see attention.py).

Linear layers and embeddings come from a `Parallel` (parallel/layers.py): whole at tp = 1,
cut among a stage's tp ranks otherwise (QKV and FFN-up column-parallel, attention output
and FFN-down row-parallel, embedding and LM head vocab-parallel; norms and GPT's position
embedding whole). The model code is the same either way; a rank has `heads / tp` query
heads and `kv_heads / tp` KV heads, matching its KV cache.
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
from pp_runtime.parallel.layers import Parallel, Unsharded, shard_of


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
    def __init__(self, m: ModelConfig, par: Parallel):
        super().__init__()
        self.family, self.rope_theta = m.family, m.rope_theta
        # this rank's heads; the layers below take the FULL widths and cut them
        self.heads, self.kv_heads = m.num_heads // par.tp, m.kv_heads // par.tp
        self.head_dim = m.head_dim
        h, q, kv, ffn = m.hidden_size, m.num_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn
        up_parts = (ffn, ffn) if m.family == "llama" else (ffn,)  # llama: gate | up
        self.attn_norm = make_norm(m)
        # rank r's rows are [q_r; k_r; v_r]: its query heads and its KV-cache heads line up
        self.qkv = par.column(h, q + 2 * kv, m.use_bias, parts=(q, kv, kv))
        self.out = par.row(q, h, m.use_bias)
        self.mlp_norm = make_norm(m)
        self.fc1 = par.column(h, sum(up_parts), m.use_bias, parts=up_parts)
        self.fc2 = par.row(ffn, h, m.use_bias)
        self.act = ACTIVATIONS[m.act]

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                layout: BatchLayout) -> torch.Tensor:
        # x: [T, hidden], T = every token of the micro-batch; q_dim, kv_dim: this rank's
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
        h = self.fc1(self.mlp_norm(x))  # [T, ffn / tp] or [T, 2 * ffn / tp] (gate, up)
        if self.family == "llama":
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return x + self.fc2(h)


class StageModel(nn.Module):
    """Layers [lo, hi) of the model, plus the embedding (first stage) or head (last stage),
    one tp rank's share of each as `par` cuts it."""

    def __init__(self, m: ModelConfig, lo: int, hi: int, par: Parallel = Unsharded()):
        super().__init__()
        self.cfg, self.lo, self.hi, self.par = m, lo, hi, par
        self.is_first, self.is_last = lo == 0, hi == m.num_layers
        if self.is_first:
            self.embed = par.vocab_embedding(m.vocab_size, m.hidden_size)
            if m.family == "gpt":
                self.pos_embed = nn.Embedding(m.max_positions, m.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(m, par) for _ in range(lo, hi))
        if self.is_last:
            self.final_norm = make_norm(m)
            self.lm_head = par.vocab_head(m.vocab_size, m.hidden_size)
            if m.tied and self.is_first:  # same padding and cut as the embedding: share it
                self.lm_head.weight = self.embed.weight

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
        """hidden: [N, hidden] -> logits [N, vocab] in float32, the same on every tp rank
        (last stage only)."""
        local = self.lm_head(self.final_norm(hidden))  # [N, padded_vocab / tp]
        return self.par.gather_vocab(local, self.cfg.vocab_size).float()  # [N, vocab]

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """GPT-2-style init; each layer seeded by its global index, so any cut into
        stages gives the same weights as the whole model. A tp rank draws each full tensor
        and keeps its shard, so any tp gives the same weights too."""
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
                shard = shard_of(p)
                full = torch.randn(shard.full_shape(p.shape), generator=g) * scale
                p.copy_(shard.take(full))
