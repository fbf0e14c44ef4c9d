"""`uniform`: every micro-batch carries the same work, so no stage waits on another.

A pipeline runs at the pace of its slowest micro-batch: one heavier than the rest makes
every later stage wait for it (the `upstream` bubble), one lighter leaves its stages idle
while the heavier one ahead finishes. SARATHI's micro-batches are equal in tokens except
where a prompt ends: its last chunk is short, and that micro-batch is light. `uniform`
composes each micro-batch as SARATHI does, decodes first, then prefill up to the token
budget (C, less one per decode with tile alignment), and:

- packs: when a prompt's last chunk leaves room, the next prompts' chunks fill it
  (`planner.pack_prefills`; Sarathi-Serve and DeepSpeed-FastGen pack the same way), so
  every micro-batch with prefill work carries exactly C tokens: whole matmul tiles, the
  same linear time;
- with `planner.target_ms`, also caps each micro-batch's *predicted time* (attention over
  long KV, the paper's PB3, or a chunk late in a long prompt): the chunk that would
  overshoot is cut to the largest that fits (never under C / 8 tokens).

Measured (benchmarks/planners.py, docs/planner.md): the time cap lowers bubbles and the
p99 time between tokens but costs makespan, because a cut chunk still pays for whole
matmul tiles; so it is off unless asked for. Predicted times come from the one cost model
the simulator uses (`costmodel/`, `build_cost_model`): the same prices plan the real
runtime and the simulated one.
"""
from __future__ import annotations

from pp_runtime.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.sarathi import SarathiPlanner

MAX_PACKED = 4  # prefill chunks in one micro-batch, at most


class UniformPlanner(SarathiPlanner):
    name = "uniform"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        self.pack = cfg.planner.pack_prefills
        self.min_chunk = max(1, self.chunk_size // 8)
        target = cfg.planner.target_ms
        self.target_s = float("inf") if target is None else target / 1e3
        if target is not None and cost_model is None:  # the simulator's, for real runs too
            from pp_runtime.costmodel import build_cost_model
            cost_model = build_cost_model(cfg)
        self.cost = cost_model

    def compose(self, now: float) -> list[SeqChunk]:
        prefilling = self.prefilling()
        limit = self.max_batch - 1 if prefilling else self.max_batch
        ready = [r for r in self.idle() if r.num_scheduled >= r.prefill_len]
        seqs = [self.decode(r) for r in ready[:limit]]
        if prefilling:
            seqs += self.fill([s.kv_len for s in seqs], prefilling)
        return seqs

    def fill(self, kv: list[int], prefilling: list) -> list[SeqChunk]:
        """Prefill chunks beside decodes of these KV lengths, up to the budget (C tokens in
        all with tile alignment, else C prefill tokens) and the time target: the first
        prompt's next chunk, then (packing) the next prompts' first ones."""
        chunks: list[tuple[int, int]] = []
        room = self.chunk_size - (len(kv) if self.tile_align else 0)
        out = []
        for req in prefilling[:MAX_PACKED]:
            start, left = req.num_scheduled, req.prefill_len - req.num_scheduled
            n = self._largest_fit(chunks, kv, start, min(left, room))
            if n < min(left, self.min_chunk):  # too little time left for a useful chunk
                if chunks:
                    break
                n = min(left, self.min_chunk)  # alone: at least C / 8, so prompts move
            chunks.append((start, n))
            out.append(self.prefill(req, n))
            room -= n
            if n < left or not self.pack or room <= 0 or len(kv) + len(out) >= self.max_batch:
                break
        return out

    def _largest_fit(self, chunks: list[tuple[int, int]], kv: list[int], start: int,
                     hi: int) -> int:
        """The largest n <= hi whose chunk (start, n) with `chunks` and the decodes fits
        the time target; 0 when none does. Times grow with n: binary search."""
        if hi <= 0:
            return 0
        if self.target_s == float("inf"):
            return hi
        fits = lambda n: self.cost.microbatch_time([*chunks, (start, n)], kv) <= self.target_s  # noqa: E731
        if fits(hi):
            return hi
        lo, hi = 0, hi - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo
