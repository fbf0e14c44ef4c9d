"""CUDA graphs for decode-only micro-batches: one captured replay per bucket of decode
counts instead of a few hundred kernel launches from Python.

A decode-only micro-batch of a stage is small work (one row per request) spread over many
small kernels: on an H100, 4 decodes on 4 LLaMA-13B layers took 5.3 ms eagerly where
reading the weights takes ~0.9 ms (docs/gpu.md). A graph replays the whole stage, from
the embedding (stage 0) or the received hidden states, through every layer, to the
logits (last stage), in one launch.

- **Buckets.** A graph has fixed shapes, so decode counts are rounded up to a bucket
  (`buckets`: 1, 2, 4, then every 8 up to `max_decodes`); each bucket is captured the
  first time a micro-batch needs it, into one memory pool shared by all buckets.
- **Static buffers.** Every input the stage reads (token ids or hidden states, positions,
  the KV rows to write, the block tables padded to the widest context and the key
  counts) lives in buffers that the graph captured; a micro-batch's values go in with one
  host-to-device copy (`pack`), then the graph replays.
- **Padding.** Rows past the real decodes are decodes of one key at position 0 whose K
  and V go to a scratch block the planner never hands out (the KV cache's last,
  `KVCache.scratch_block`), so they touch no request's cache; their outputs are dropped.
- **Outside the graph**: the stage-boundary receive and send (engines that captured
  them hung in multi-node PP), sampling, and every micro-batch with a prompt chunk.
- **What a micro-batch needs** to replay (`bucket`): only decodes, at most
  `max_decodes`, every context within the table width, on the last stage every row
  sampling. Decode attention must read the block table from a tensor: the paged Triton
  kernel on CUDA (`model/paged_kernel.py`); on a CPU the C++ kernel, where `true` runs
  the same static-buffer path without capture (what the CPU tests check the padding with).
"""
from __future__ import annotations

import torch

from pp_runtime.core.batch import MicroBatch
from pp_runtime.model.attention import BatchLayout
from pp_runtime.model.kv_cache import KVCache
from pp_runtime.model.transformer import StageModel

_replays = {"replays": 0, "captures": 0, "uncaptured": 0, "padded_rows": 0}


def graph_counts() -> dict[str, int]:
    """Graph replays and captures since import (all workers of this process); uncaptured:
    static-buffer runs without a graph (a CPU); padded_rows: rows replayed as padding."""
    return dict(_replays)


def buckets(max_decodes: int) -> list[int]:
    """Decode counts a graph is captured for: 1, 2, 4, then every 8 up to `max_decodes`
    (the last bucket is max_decodes itself)."""
    out = [b for b in (1, 2, 4) if b < max_decodes] + list(range(8, max_decodes, 8))
    return out + [max_decodes]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n decodes, None past the largest."""
    return next((b for b in sizes if b >= n), None)


class DecodeGraphs:
    """Decode-only micro-batches of one stage replayed from CUDA graphs (`capture` False:
    the same static buffers run eagerly, for CPU tests)."""

    def __init__(self, model: StageModel, cache: KVCache, block_size: int, max_decodes: int,
                 max_blocks: int, dtype: torch.dtype, device: torch.device, capture: bool,
                 cpu_decode: bool = False, paged: bool = False):
        self.model, self.cache, self.block_size = model, cache, block_size
        self.cpu_decode, self.paged = cpu_decode, paged
        self.sizes, self.width, self.capture = buckets(max_decodes), max_blocks, capture
        self.device = device
        m, w = max_decodes, max_blocks
        # [6, m]: ids, positions, ends, write blocks, write offsets, lens; the block
        # tables apart ([m, w]: a row's columns past its blocks are never read)
        self.ints = torch.zeros(6, m, dtype=torch.long, device=device)
        self.tables = torch.zeros(m, w, dtype=torch.long, device=device)
        self.x = None if model.is_first else torch.zeros(m, model.cfg.hidden_size, dtype=dtype, device=device)
        self.rows = torch.arange(m, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, mb: MicroBatch) -> int | None:
        """The bucket this micro-batch replays in, None when it runs eagerly."""
        seqs = mb.seqs
        if not seqs or any(not s.is_decode or s.kv_len > self.width * self.block_size for s in seqs):
            return None
        if self.model.is_last and any(s.sampling is None for s in seqs):
            return None
        return bucket_for(len(seqs), self.sizes)

    def _views(self, b: int):
        ids, pos, ends, wb, wo, lens = self.ints[:, :b]
        return ids, pos, ends, wb, wo, lens, self.tables[:b]

    def pack(self, mb: MicroBatch | None, b: int) -> None:
        """Write the micro-batch's decodes (and b - n padded ones) into the static buffers:
        two host-to-device copies, the six per-row columns and the used columns of the
        block tables (u, the widest decode's blocks; nothing reads past a row's own).
        mb None: all padding (the capture's inputs)."""
        bs, scratch = self.block_size, self.cache.scratch_block
        seqs = mb.seqs if mb is not None else ()
        pad = b - len(seqs)
        u = max((-(-s.kv_len // bs) for s in seqs), default=1)
        cols = [[], [], [], [], [], []]  # ids, positions, ends, write blocks, offsets, lens
        tables = []
        for s in seqs:
            p = s.kv_len - 1  # the decode's own position
            cols[0].append(s.token_ids[0])
            cols[1].append(p)
            cols[2].append(s.kv_len)
            cols[3].append(s.blocks[p // bs])
            cols[4].append(p % bs)
            cols[5].append(s.kv_len)
            used = s.blocks[:-(-s.kv_len // bs)]
            tables.extend(used)
            tables.extend([scratch] * (u - len(used)))
        for col, v in zip(cols, (0, 0, 1, scratch, 0, 1)):  # padding: one key, the scratch block
            col.extend([v] * pad)
        tables.extend([scratch] * (u * pad))
        ints, table = torch.tensor(cols, dtype=torch.long), torch.tensor(tables, dtype=torch.long)
        if self.device.type == "cuda":  # pinned: the copies do not wait for the GPU's queue
            ints, table = ints.pin_memory(), table.pin_memory()
        self.ints[:, :b].copy_(ints, non_blocking=True)  # [6, b]
        self.tables[:b, :u].copy_(table.view(b, u), non_blocking=True)

    def _stage(self, b: int) -> torch.Tensor:
        """The stage over b static rows: logits [b, vocab] on the last stage, else hidden."""
        ids, pos, ends, wb, wo, lens, tables = self._views(b)
        rows = self.rows[:b]
        layout = BatchLayout(pos, ends, wb, wo, [], rows, lens.int(), tables.int(), rows,
                             [[]] * b, [1] * b, self.block_size, cpu_decode=self.cpu_decode,
                             paged=self.paged)
        x = ids if self.model.is_first else self.x[:b]
        hidden = self.model(x, self.cache, layout)
        return self.model.logits(hidden) if self.model.is_last else hidden

    def _capture(self, b: int) -> None:
        self.pack(None, b)  # padding only: the warm-up and capture write the scratch block
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton compiles and cuBLAS picks its kernels outside capture
                self._stage(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._stage(b)
        self.graphs[b] = (graph, out)
        _replays["captures"] += 1

    def run(self, mb: MicroBatch, x: torch.Tensor | None, b: int) -> torch.Tensor:
        """The stage over mb's n decodes in bucket b: logits [n, vocab] (last stage) or
        hidden states [n, hidden] (a copy: the next replay overwrites the graph's own)."""
        n = len(mb.seqs)
        if self.capture and b not in self.graphs:
            self._capture(b)
        self.pack(mb, b)
        if x is not None and self.x is not None:
            self.x[:n].copy_(x)
        _replays["padded_rows"] += b - n
        if not self.capture:
            out = self._stage(b)
            _replays["uncaptured"] += 1
        else:
            graph, out = self.graphs[b]
            graph.replay()
            _replays["replays"] += 1
        return out[:n] if self.model.is_last else out[:n].clone()
