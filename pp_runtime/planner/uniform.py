"""`uniform`: SARATHI whose chunk is sized by predicted time, not by token count alone.

Equal-token micro-batches still differ in time: decodes attend to different KV lengths
(the paper's PB3) and a chunk late in a long prompt attends to more keys. The slowest
micro-batch sets the pace of the whole pipeline. `uniform` composes a micro-batch as
SARATHI does (decodes first, then one chunk) and takes SARATHI's chunk when its predicted
time fits the target; otherwise the largest smaller chunk that fits (never under C / 8
tokens, so prompts keep moving).

Target: `planner.target_ms`, or by default the predicted time of a full SARATHI
micro-batch whose B - 1 decodes attend to half the KV length (a typical heavy batch).
"""
from __future__ import annotations

from pp_runtime.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import AnalyticCost, CostModel
from pp_runtime.planner.sarathi import SarathiPlanner


class UniformPlanner(SarathiPlanner):
    name = "uniform"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        self.cost = cost_model or AnalyticCost.from_config(cfg)
        if cfg.planner.target_ms is not None:
            self.target_s = cfg.planner.target_ms / 1e3
        else:
            d = self.max_batch - 1
            chunk = self.chunk_size - d if self.tile_align else self.chunk_size
            self.target_s = self.cost.microbatch_time([(0, chunk)], [cfg.seq_len // 2] * d)
        self.min_chunk = max(1, self.chunk_size // 8)

    def chunk_budget(self, decodes: list[SeqChunk], start: int) -> int:
        """SARATHI's chunk if it fits the target, else the largest that does."""
        kv = [s.kv_len for s in decodes]
        fits = lambda n: self.cost.microbatch_time([(start, n)], kv) <= self.target_s  # noqa: E731
        lo, hi = self.min_chunk, super().chunk_budget(decodes, start)
        if hi <= lo or fits(hi):
            return max(hi, 1)
        hi -= 1
        while lo < hi:  # largest n in [lo, hi] that fits (lo when none does)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo
