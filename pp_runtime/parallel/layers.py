"""The layers the model is built from, whole or cut among the tp ranks of a stage.

`StageModel` asks a `Parallel` for every linear layer and embedding, so the model reads the
same at tp = 1 and tp = 8 (Megatron's scheme):

- `column` (QKV, FFN up): the output features are cut; rank r computes its 1/tp of them and
  nothing is communicated. A fused layer names its `parts` (q, k, v or gate, up): rank r
  holds its 1/tp of each part, so its QKV rows are [q_r; k_r; v_r].
- `row` (attention output, FFN down): the input features are cut; one all-reduce sums the
  partial outputs, and the bias is added once, after it.
- `vocab_embedding`, `vocab_head`: the vocabulary is padded up to a multiple of tp (with
  zero rows) and cut; the embedding all-reduces, the head's logits stay cut until
  `gather_vocab` all-gathers them and drops the padding.

Three implementations: `Unsharded` (tp = 1, plain torch, the in-process executor),
`TensorParallel` (Megatron-core's layers over a process group) and `LocalShard` (one rank's
shapes with plain torch and no collectives: what the cost model times for one rank).
Every parameter they create carries a `Shard` (`shard_of(p)`) saying how it is cut, so
random init and the checkpoint loader can cut a full tensor, or read a slice, for rank r.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Shard:
    """How one parameter is cut among the tp ranks of a stage.

    The full tensor is `parts` stacked along `dim` (one part unless the layer is fused); the
    last part is padded with `pad` zero rows (vocabulary padding). Rank `rank` holds its
    1/tp of each padded part, in order. `dim = None`: every rank holds the whole tensor."""

    dim: int | None = None  # the cut dimension; None = replicated
    parts: tuple[int, ...] = ()  # full sizes of the segments stacked along dim
    pad: int = 0  # zero rows appended to the last part before cutting (vocab padding)
    tp: int = 1
    rank: int = 0

    def ranges(self) -> list[tuple[int, int, int]]:
        """(start, stop, zeros) per part: rank's rows [start, stop) of the full tensor along
        `dim`, then `zeros` rows of padding."""
        out, offset = [], 0
        for i, size in enumerate(self.parts):
            width = (size + (self.pad if i == len(self.parts) - 1 else 0)) // self.tp
            lo = min(offset + self.rank * width, offset + size)
            hi = min(offset + (self.rank + 1) * width, offset + size)
            out.append((lo, hi, width - (hi - lo)))
            offset += size
        return out

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        """The unsharded, unpadded shape of a parameter whose rank shape is `local`."""
        shape = list(local)
        if self.dim is not None:
            shape[self.dim] = sum(self.parts)
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """Rank's piece of the full tensor, zero-padded."""
        if self.dim is None:
            return full
        blocks = []
        for lo, hi, zeros in self.ranges():
            blocks.append(full.narrow(self.dim, lo, hi - lo))
            if zeros:
                shape = list(full.shape)
                shape[self.dim] = zeros
                blocks.append(full.new_zeros(shape))
        return torch.cat(blocks, self.dim)


REPLICATED = Shard()


def shard_of(p: torch.Tensor) -> Shard:
    """How `p` is cut; norms, GPT's position embedding and row-parallel biases are whole."""
    return getattr(p, "shard", REPLICATED)


def _marked(layer: nn.Module, **shards: Shard) -> nn.Module:
    for name, spec in shards.items():
        p = getattr(layer, name)
        if p is not None:
            p.shard = spec  # like Megatron's `partition_dim`: it travels with the parameter
    return layer


class Parallel:
    """The factory the model builds its layers with. Shapes are given FULL; each method
    returns one rank's layer. Subclasses supply `_column`, `_row`, `_embedding` and
    `gather_vocab`."""

    tp: int
    tp_rank: int

    def column(self, in_features: int, out_features: int, bias: bool,
               parts: tuple[int, ...] | None = None) -> nn.Module:
        """y[:, cut] = x @ W[cut].T: weight [out_features / tp, in_features]."""
        parts = tuple(parts or (out_features,))
        if sum(parts) != out_features or any(p % self.tp for p in parts):
            raise ValueError(f"column layer: parts {parts} must sum to {out_features} and "
                             f"each be divisible by tp={self.tp}")
        spec = Shard(0, parts, 0, self.tp, self.tp_rank)
        return _marked(self._column(in_features, out_features, bias), weight=spec, bias=spec)

    def row(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """y = all_reduce(x[:, cut] @ W[:, cut].T) + b: weight [out_features, in_features / tp]."""
        if in_features % self.tp:
            raise ValueError(f"row layer: {in_features} inputs are not divisible by tp={self.tp}")
        spec = Shard(1, (in_features,), 0, self.tp, self.tp_rank)
        return _marked(self._row(in_features, out_features, bias), weight=spec)

    def padded_vocab(self, vocab: int) -> int:
        """The vocabulary rounded up to a multiple of tp (GPT-2's 50257 is odd)."""
        return -(-vocab // self.tp) * self.tp

    def vocab_embedding(self, vocab: int, hidden: int) -> nn.Module:
        """Token embedding cut over the vocabulary: weight [padded_vocab / tp, hidden]."""
        layer = self._embedding(self.padded_vocab(vocab), hidden)
        return _marked(layer, weight=self._vocab_shard(vocab))

    def vocab_head(self, vocab: int, hidden: int) -> nn.Module:
        """LM head cut over the vocabulary, no bias, no gather: [N, hidden] -> [N, padded / tp].
        Cut like `vocab_embedding`, so a tied head may share the embedding's weight."""
        layer = self._column(hidden, self.padded_vocab(vocab), False)
        return _marked(layer, weight=self._vocab_shard(vocab))

    def gather_vocab(self, local_logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """[N, padded / tp] of every rank -> [N, vocab] on every rank."""
        raise NotImplementedError

    def _vocab_shard(self, vocab: int) -> Shard:
        return Shard(0, (vocab,), self.padded_vocab(vocab) - vocab, self.tp, self.tp_rank)

    def _column(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        raise NotImplementedError

    def _row(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        raise NotImplementedError

    def _embedding(self, padded_vocab: int, hidden: int) -> nn.Module:
        raise NotImplementedError


class _PlainTorch(Parallel):
    """Plain `nn.Linear` / `nn.Embedding` at one rank's widths; nothing communicates."""

    def _column(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return nn.Linear(in_features, out_features // self.tp, bias=bias)

    def _row(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return nn.Linear(in_features // self.tp, out_features, bias=bias)


@dataclass(frozen=True)
class Unsharded(_PlainTorch):
    """tp = 1, no process group: the whole model in plain torch (the in-process executor)."""

    tp: ClassVar[int] = 1
    tp_rank: ClassVar[int] = 0

    def _embedding(self, padded_vocab: int, hidden: int) -> nn.Module:
        return nn.Embedding(padded_vocab, hidden)

    def gather_vocab(self, local_logits: torch.Tensor, vocab: int) -> torch.Tensor:
        return local_logits[:, :vocab]  # [N, vocab]: nothing to gather, no padding at tp = 1


class _VocabRows(nn.Embedding):
    """Rows [start, start + n) of a token embedding; other ids embed to zeros (Megatron's
    vocab-parallel lookup without its all-reduce)."""

    def __init__(self, num_rows: int, hidden: int, start: int):
        super().__init__(num_rows, hidden)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0))  # [T, hidden]
        return x.masked_fill(outside[:, None], 0.0)


@dataclass(frozen=True)
class LocalShard(_PlainTorch):
    """Rank `tp_rank`'s layer shapes and compute in plain torch with NO collectives: row
    outputs stay partial sums and logits stay [N, padded / tp]. For timing one rank's
    operations (the cost model prices the collectives separately), never for serving."""

    tp: int
    tp_rank: int = 0

    def _embedding(self, padded_vocab: int, hidden: int) -> nn.Module:
        rows = padded_vocab // self.tp
        return _VocabRows(rows, hidden, self.tp_rank * rows)

    def gather_vocab(self, local_logits: torch.Tensor, vocab: int) -> torch.Tensor:
        return local_logits  # [N, padded / tp]: no group to gather over


class _Megatron(NamedTuple):
    config: type  # ModelParallelConfig
    column: type
    row: type
    embedding: type


@functools.cache
def _megatron() -> _Megatron:
    """Megatron-core's parallel layers, returning the output tensor only (imported on first
    use: the import takes seconds)."""
    with warnings.catch_warnings():  # its optional GPU extensions are absent on CPU
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core import tensor_parallel as mtp
        from megatron.core.model_parallel_config import ModelParallelConfig

    class Column(mtp.ColumnParallelLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x)[0]  # (out, bias): the bias is already added

    class Row(mtp.RowParallelLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x)[0]

    return _Megatron(ModelParallelConfig, Column, Row, mtp.VocabParallelEmbedding)


def _no_init(weight: torch.Tensor) -> None:
    """Megatron's init_method; unused (perform_initialization=False): we init or load."""


@dataclass(frozen=True)
class TensorParallel(Parallel):
    """Megatron-core's `ColumnParallelLinear(gather_output=False)`,
    `RowParallelLinear(input_is_parallel=True)` and `VocabParallelEmbedding` over `tp_group`
    (gloo on CPU, NCCL on CUDA). Parameters are allocated on the default device (build the
    model under `with torch.device(...)`), uninitialized. Megatron's own gathers allocate on
    CUDA, so the vocabulary gather is ours."""

    tp_group: dist.ProcessGroup
    tp: int
    tp_rank: int
    dtype: torch.dtype  # parameter dtype

    def __post_init__(self):
        if (self.tp_group.size(), self.tp_group.rank()) != (self.tp, self.tp_rank):
            raise ValueError(f"TensorParallel: tp={self.tp}, tp_rank={self.tp_rank}, but the group "
                             f"has size {self.tp_group.size()}, rank {self.tp_group.rank()}")

    def _config(self):
        # use_cpu_initialization: allocate on the default device (CUDA's branch hard-codes
        # the current GPU); perform_initialization=False: weights are ours to init or load
        return _megatron().config(tensor_model_parallel_size=self.tp, use_cpu_initialization=True,
                                  params_dtype=self.dtype, perform_initialization=False)

    def _column(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return _megatron().column(in_features, out_features, config=self._config(),
                                  init_method=_no_init, bias=bias, gather_output=False,
                                  tp_group=self.tp_group)

    def _row(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return _megatron().row(in_features, out_features, config=self._config(),
                               init_method=_no_init, bias=bias, input_is_parallel=True,
                               skip_bias_add=False, tp_group=self.tp_group)

    def _embedding(self, padded_vocab: int, hidden: int) -> nn.Module:
        return _megatron().embedding(padded_vocab, hidden, config=self._config(),
                                     init_method=_no_init, tp_group=self.tp_group)

    def gather_vocab(self, local_logits: torch.Tensor, vocab: int) -> torch.Tensor:
        local = local_logits.contiguous()  # [N, padded / tp]
        pieces = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(pieces, local, group=self.tp_group)
        return torch.cat(pieces, dim=-1)[:, :vocab]  # [N, vocab]
