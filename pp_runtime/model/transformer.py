"""A decoder-only transformer cut into pipeline stages.

`StageModel` holds layers [lo, hi) of the model; the first stage also owns the token (and,
for GPT, position) embedding, the last owns the final norm and the LM head. Two families
share one layer:

- gpt:   learned positions, LayerNorm, GELU MLP, biases (GPT-2, GPT-3)
- llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases; with the model
  config's fields also LLaMA-3.x (RoPE scaling: `rope.py`), Qwen2/2.5 (bias on q, k, v
  alone), Qwen3 (RMSNorm over each query and key head, `head_size`) and Mistral (a
  sliding window, `attention.py`)

What differs is chosen when a layer is built (its norms, rotary, MLP activation and
window are modules or fields), so `DecoderLayer.forward` is one path for every family.

Every linear layer runs once over all rows of a micro-batch (decode-maximal batching);
only attention looks at sequence boundaries (see attention.py).

Linear layers and embeddings come from a `Parallel` (parallel/layers.py): whole at tp = 1,
cut among a stage's tp ranks otherwise (QKV and FFN-up column-parallel, attention output
and FFN-down row-parallel, embedding and LM head vocab-parallel; norms and GPT's position
embedding whole). The model code is the same either way; a rank has `heads / tp` query
heads and `kv_heads / tp` KV heads, matching its KV cache.

A stage is built on the meta device (shapes only), then `materialize` allocates each
parameter once, in its final dtype on its device, and `init_random` (only this rank's
shard is drawn) or the loader fills it in place.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from pp_runtime.config import ModelConfig
from pp_runtime.model.attention import BatchLayout, hybrid_attention
from pp_runtime.model.rope import Rope, rope
from pp_runtime.model.kv_cache import KVCache
from pp_runtime.parallel.layers import Parallel, Unsharded, shard_of


_COMPILED: dict[str, object] = {}  # name -> torch.compile'd small op (`compile_small_ops`)
_USE_COMPILED = [False]


def compile_small_ops(on: bool = True) -> None:
    """Run the small elementwise ops (RMSNorm, RoPE, SwiGLU's gate) through torch.compile'd
    versions in this process, or not (`runtime.compile_small_ops`; process-wide, the last
    stage built decides): each one fused kernel instead of several passes over the rows.
    Shapes are marked dynamic, so a new token count does not recompile; the first call of
    each compiles (seconds)."""
    if on and not _COMPILED:
        for name, fn in (("rms_norm", _rms_norm), ("rope", rope), ("swiglu", _swiglu)):
            _COMPILED[name] = torch.compile(fn, dynamic=True)
    _USE_COMPILED[0] = on


def _op(name: str, fn):
    return _COMPILED[name] if _USE_COMPILED[0] else fn


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)  # [T, ffn / tp] each
    return F.silu(gate) * up


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm (`F.rms_norm` in fp32), the weight applied after the cast back to
    the input dtype, as transformers' LlamaRMSNorm does: bit-equal to it in fp32, bf16 and
    fp16 (`nn.RMSNorm` alone scales before the cast, and in bf16 its greedy tokens part
    from transformers' sooner: tests/model/test_norm.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _op("rms_norm", _rms_norm)(x, self.weight, self.eps)  # normed in fp32


def make_norm(m: ModelConfig) -> nn.Module:
    if m.family == "llama":
        return RMSNorm(m.hidden_size, eps=m.norm_eps)
    return nn.LayerNorm(m.hidden_size, eps=m.norm_eps)


ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class Rotary(nn.Module):
    """RoPE on q and k at the micro-batch's positions (llama family); no parameters."""

    def __init__(self, spec: Rope):
        super().__init__()
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, layout: BatchLayout):
        cos, sin = layout.rope_tables(self.spec, q.dtype)  # [T, 1, head_dim]
        fn = _op("rope", rope)
        return fn(q, cos, sin), fn(k, cos, sin)


class NoRotary(nn.Module):
    """gpt: positions were added to the embeddings on stage 0."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, layout: BatchLayout):
        return q, k


class Gated(nn.Module):
    """SwiGLU's act(gate) * up over fc1's [gate | up] output (llama family)."""

    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu:  # SwiGLU: one compiled kernel where compile_small_ops ran
            return _op("swiglu", _swiglu)(h)
        gate, up = h.chunk(2, dim=-1)  # [T, ffn / tp] each
        return self.act(gate) * up


class Plain(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.act(h)


class DecoderLayer(nn.Module):
    """One transformer layer, or one half of it at a stage boundary cut inside the layer
    (`attn`: its attention half, norm to residual add; `mlp`: its MLP half): a half holds
    only its own weights, and the residual stream between them is what the stages send."""

    def __init__(self, m: ModelConfig, par: Parallel, attn: bool = True, mlp: bool = True):
        super().__init__()
        self.has_attn, self.has_mlp = attn, mlp
        llama = m.family == "llama"
        # this rank's heads; the layers below take the FULL widths and cut them
        self.heads, self.kv_heads = m.num_heads // par.tp, m.kv_heads // par.tp
        self.head_dim, self.window = m.head_dim, m.sliding_window
        h, q, kv, ffn = m.hidden_size, m.num_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn
        up_parts = (ffn, ffn) if llama else (ffn,)  # llama: gate | up
        if attn:
            self.attn_norm = make_norm(m)
            # rank r's rows are [q_r; k_r; v_r]: its query heads and its KV-cache heads line up
            self.qkv = par.column(h, q + 2 * kv, m.use_qkv_bias, parts=(q, kv, kv))
            qk_norm = (lambda: RMSNorm(m.head_dim, eps=m.norm_eps)) if m.qk_norm else nn.Identity
            self.q_norm, self.k_norm = qk_norm(), qk_norm()  # per head, whole on every rank
            self.rotary = Rotary(Rope.of(m)) if llama else NoRotary()
            self.out = par.row(q, h, m.use_bias)
        if mlp:
            self.mlp_norm = make_norm(m)
            self.fc1 = par.column(h, sum(up_parts), m.use_bias, parts=up_parts)
            self.fc2 = par.row(ffn, h, m.use_bias)
            self.mlp_act = (Gated if llama else Plain)(ACTIVATIONS[m.act])

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                layout: BatchLayout) -> torch.Tensor:
        # x: [T, hidden], T = every token of the micro-batch; q_dim, kv_dim: this rank's
        if self.has_attn:
            x = x + self.attention(x, k_cache, v_cache, layout)
        if self.has_mlp:
            h = self.fc1(self.mlp_norm(x))  # [T, ffn / tp] or [T, 2 * ffn / tp] (gate, up)
            x = x + self.fc2(self.mlp_act(h))  # mlp_act: [T, ffn / tp]
        return x

    def attention(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  layout: BatchLayout) -> torch.Tensor:
        """The attention half's output projection [T, hidden], before the residual add."""
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv = self.qkv(self.attn_norm(x))  # [T, q_dim + 2 * kv_dim]
        q = self.q_norm(qkv[:, :q_dim].view(-1, self.heads, self.head_dim))  # [T, heads, head_dim]
        k = self.k_norm(qkv[:, q_dim:q_dim + kv_dim].view(-1, self.kv_heads, self.head_dim))
        v = qkv[:, q_dim + kv_dim:].view(-1, self.kv_heads, self.head_dim)
        q, k = self.rotary(q, k, layout)
        attn = hybrid_attention(q, k, v, k_cache, v_cache, layout, self.window)  # [T, heads, head_dim]
        return self.out(attn.reshape(-1, q_dim))


class StageModel(nn.Module):
    """Layers [lo, hi) of the model, plus the embedding (first stage) or head (last stage),
    one tp rank's share of each as `par` cuts it. `units` (half-layer units [ulo, uhi),
    `Config.stage_units`) cut the end layers in half where the split does: the first layer
    may hold only its MLP, the last only its attention."""

    def __init__(self, m: ModelConfig, lo: int, hi: int, par: Parallel = Unsharded(),
                 units: tuple[int, int] | None = None):
        super().__init__()
        ulo, uhi = units if units is not None else (2 * lo, 2 * hi)
        if (ulo // 2, (uhi + 1) // 2) != (lo, hi):
            raise ValueError(f"half-layer units {units} are not layers [{lo}, {hi})")
        self.cfg, self.lo, self.hi, self.par, self.units = m, lo, hi, par, (ulo, uhi)
        self.is_first, self.is_last = ulo == 0, uhi == 2 * m.num_layers
        if self.is_first:
            self.embed = par.vocab_embedding(m.vocab_size, m.hidden_size)
            if m.family == "gpt":
                self.pos_embed = nn.Embedding(m.max_positions, m.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(m, par, ulo <= 2 * i < uhi, ulo <= 2 * i + 1 < uhi)
                                    for i in range(lo, hi))
        self.num_attention = sum(layer.has_attn for layer in self.layers)  # KV-cache layers
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
        k = 0  # the cache holds the attention halves' layers only
        for layer in self.layers:
            if layer.has_attn:
                x = layer(x, *cache.layer(k), layout)
                k += 1
            else:
                x = layer(x, None, None, layout)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32, the same on every tp rank
        (last stage only)."""
        local = self.lm_head(self.final_norm(hidden))  # [N, padded_vocab / tp]
        return self.par.gather_vocab(local, self.cfg.vocab_size).float()  # [N, vocab]

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """GPT-2-style init, in place: weights normal(0, 0.02), the residual projections
        (out, fc2) scaled down by sqrt(2 * num_layers); norms 1, biases 0.

        Each tensor is drawn in runs of rows along its cut dimension (`fill_normal`), every
        run from its own generator seeded by (seed, the tensor's model-wide name, its first
        row): a tp rank draws only its shard, and any cut into stages and tp ranks gives the
        same full tensors."""
        m = self.cfg
        cuts = math.gcd(m.num_heads, m.kv_heads, m.ffn)  # every valid tp divides this
        tps = [t for t in range(1, cuts + 1) if cuts % t == 0]
        for name, p in self.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":  # the global layer index, whatever the stage
                parts[1] = str(int(parts[1]) + self.lo)
            canonical = ".".join(parts)
            if canonical == "lm_head.weight" and m.tied:
                canonical = "embed.weight"
            if parts[-1] == "bias":
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:  # residual projections scaled down with depth, as in GPT-2
                std = 0.02 / math.sqrt(2 * m.num_layers) if parts[-2] in ("out", "fc2") else 0.02
                fill_normal(p, f"{seed}/{canonical}", std, tps)


STAGING_ELEMENTS = 1 << 20  # float32 drawn on the CPU per copy into place (4 MB)


def cut_points(size: int, tps: list[int]) -> list[int]:
    """Rows of a part of `size` rows where some tp in `tps` starts or ends a rank's share
    (ceil(size / tp) rows a rank: a padded vocabulary's last rank holds fewer)."""
    return sorted({min(r * -(-size // t), size) for t in tps for r in range(t + 1)})


@torch.no_grad()
def fill_normal(p: torch.Tensor, key: str, std: float, tps: list[int]) -> None:
    """Fill `p`, one tp rank's shard (`shard_of(p)`), with its part of a normal(0, std)
    full tensor that depends only on `key` and `tps` (the tps the model allows), not on
    the rank or its tp.

    Along the cut dimension every part of the full tensor is split at the `cut_points` of
    all tps in `tps`, so a rank's share is a run of whole blocks; each block is drawn in
    runs of at most STAGING_ELEMENTS, each run from a generator seeded by (key, its first
    row). A rank draws only its own runs, on the CPU in float32, and copies each into `p`
    (any dtype, any device). A replicated tensor is drawn whole, seeded by `key`."""
    shard, base = shard_of(p), zlib.crc32(key.encode())
    gen = torch.Generator()
    if shard.dim is None:
        p.copy_(torch.randn(p.shape, generator=gen.manual_seed(base)) * std)
        return
    d = shard.dim
    rest = p.shape[:d] + p.shape[d + 1:]  # one row along the cut dimension
    step = max(1, STAGING_ELEMENTS // math.prod(rest))  # rows drawn at once
    pos = offset = 0  # rows of p filled; first row of the current part in the full tensor
    for size, (lo, hi, zeros) in zip(shard.parts, shard.ranges()):
        cuts = [offset + c for c in cut_points(size, tps)]
        if lo not in cuts or hi not in cuts:
            raise ValueError(f"{key}: tp={shard.tp} is not one of {tps}, the tps this model "
                             "allows (they divide gcd(num_heads, num_kv_heads, ffn_size))")
        for start, end in zip(cuts, cuts[1:]):  # the blocks: each wholly this rank's or not
            for first in range(start, end, step) if lo <= start and end <= hi else ():
                n = min(step, end - first)
                rows = torch.randn((n, *rest), generator=gen.manual_seed((base + first) % 2**32))
                p.narrow(d, pos, n).copy_(rows.mul_(std).movedim(0, d))  # rows: [n, *rest]
                pos += n
        if zeros:  # vocabulary padding
            p.narrow(d, pos, zeros).zero_()
            pos += zeros
        offset += size


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give each parameter of a model built on the meta device its storage: allocated once,
    on `device`, in `dtype`, uninitialized (fill it with `init_random` or
    `load_stage_weights`). A parameter two modules share (a tied LM head) stays shared, and
    every attribute on it (`shard`, Megatron's) is kept."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in done:
                q = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                 requires_grad=False)
                q.__dict__.update(p.__dict__)
                done[id(p)] = q
            module._parameters[key] = done[id(p)]
    if any(b.is_meta for b in model.buffers()):
        raise ValueError("materialize: the model has buffers on the meta device; give them values")


class ShapesOnly(torch.overrides.TorchFunctionMode):
    """Inside `with torch.device("meta"), ShapesOnly():` modules get their shapes and skip
    their own random init (`torch.nn.init`'s functions return the tensor untouched):
    `init_random` or the checkpoint sets every weight afterwards. On meta tensors those
    inits run torch's Python references, whose first call imports torch._dynamo: a second
    of CPU in every stage worker for draws that are thrown away."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))
