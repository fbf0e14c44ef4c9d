"""The paged KV cache of one pipeline stage.

One K and one V tensor per layer of the stage, each [num_blocks, block_size, kv_heads,
head_dim]: a pool of blocks of `cache.block_size` positions. The planner owns the pool
(`planner/blocks.py`) and sends each sequence's block table with the micro-batch, so a
request's KV takes the blocks its real length needs, not a whole context.

That shape is what every reader indexes; the memory order under it is the stage's
`runtime.kv_layout`. "tokens": the shape's own order, so the cache flattens to
[num_blocks * block_size, kv_heads, head_dim] rows (what the CUDA decode path gathers
from). "heads": stored [kv_heads, num_blocks, block_size, head_dim] and shown permuted, so
one head's keys are contiguous within a block and across consecutive blocks (the
allocator hands a prompt's blocks out in a row), and a decode streams them: faster decode
attention on a CPU core than the strided "tokens" order, bit-identical results.

One block past the pool, `scratch_block`, is never handed out: CUDA graphs point their
padded decodes at it (`worker/graphs.py`), so padding writes no request's keys.
"""
from __future__ import annotations

import torch

from pp_runtime.config import Config
from pp_runtime.costmodel.memory import kv_blocks


def heads_major(cfg: Config, device: torch.device) -> bool:
    """Whether `cfg.runtime.kv_layout` stores the cache heads-major on `device`."""
    layout = cfg.runtime.kv_layout
    return layout == "heads" or (layout == "auto" and device.type == "cpu")


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 heads_major: bool = False):
        def one() -> torch.Tensor:  # [num_blocks, block_size, kv_heads, head_dim], either order
            n = num_blocks + 1  # the pool and the scratch block
            if heads_major:  # one head's blocks in a row: [kv_heads, num_blocks, block_size, head_dim]
                return torch.zeros(kv_heads, n, block_size, head_dim, dtype=dtype,
                                   device=device).permute(1, 2, 0, 3)
            return torch.zeros(n, block_size, kv_heads, head_dim, dtype=dtype, device=device)

        self.k = [one() for _ in range(num_layers)]
        self.v = [one() for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks  # written by padded decodes, read by nobody else

    @classmethod
    def for_stage(cls, cfg: Config, num_layers: int, dtype: torch.dtype,
                  device: torch.device) -> "KVCache":
        m = cfg.model
        return cls(num_layers, kv_blocks(cfg), cfg.cache.block_size, m.kv_heads // cfg.parallel.tp,
                   m.head_dim, dtype, device, heads_major(cfg, device))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
