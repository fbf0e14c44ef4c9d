"""`uniform`: SARATHI whose chunk is sized by predicted time, not by token count.

Equal-token micro-batches still differ in time when their decodes attend to different KV
lengths, or when a chunk sits late in a long prompt (attention grows with KV length;
the paper's PB3). `uniform` composes a micro-batch as SARATHI does (decodes first, then
one chunk), but picks the largest chunk whose predicted micro-batch time stays within a
target (never more than SARATHI's tile-aligned chunk, never less than C / 8 tokens, so
prompts keep moving). Target: `planner.target_ms`, or by default the predicted time of a
full SARATHI micro-batch (B - 1 decodes at half the KV length plus its chunk).
"""
from __future__ import annotations

from pp_runtime.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import AnalyticCost, CostModel
from pp_runtime.planner.sarathi import SarathiPlanner


class UniformPlanner(SarathiPlanner):
    name = "uniform"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg)
        self.cost = cost_model or AnalyticCost.from_config(cfg)
        if cfg.planner.target_ms is not None:
            self.target_s = cfg.planner.target_ms / 1e3
        else:
            d = self.max_batch - 1
            chunk = self.chunk_size - d if self.tile_align else self.chunk_size
            self.target_s = self.cost.microbatch_time([(0, chunk)], [cfg.seq_len // 2] * d)
        self.min_chunk = max(1, self.chunk_size // 8)

    def chunk_budget(self, decodes: list[SeqChunk], start: int) -> int:
        """Largest chunk (binary search) whose micro-batch fits the target time."""
        kv = [s.kv_len for s in decodes]
        lo, hi = self.min_chunk, super().chunk_budget(decodes, start)
        if hi <= lo or self.cost.microbatch_time([(start, hi)], kv) <= self.target_s:
            return max(hi, 1)
        while lo < hi:  # invariant: lo fits or is the floor; hi does not fit
            mid = (lo + hi + 1) // 2
            if self.cost.microbatch_time([(start, mid)], kv) <= self.target_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
