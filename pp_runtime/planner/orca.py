"""Orca-style iteration-level scheduling with whole prefills (no chunking), paper §5.2.

- `orca-best`: at most one whole prefill per micro-batch, plus up to B - 1 decodes
  (the best case the paper compares against: the prefill overlaps ongoing decodes).
  It is SARATHI with the chunk size set to the sequence length.
- `orca-worst`: prefills and decodes never share a micro-batch: whole prefills of up to
  B waiting requests go first; otherwise a decode-only batch (the paper's worst case,
  where requests start and end together and nothing overlaps).
"""
from __future__ import annotations

from pp_runtime.core.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.base import BasePlanner
from pp_runtime.planner.sarathi import SarathiPlanner


class OrcaBestPlanner(SarathiPlanner):
    """SARATHI's composition with a chunk as long as any prompt: whole prefills."""

    name = "orca-best"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        BasePlanner.__init__(self, cfg, cost_model)  # no tile warning: chunks are whole prompts

    def chunk_budget(self, decodes: list[SeqChunk], start: int) -> int:
        return self.cfg.seq_len


class OrcaWorstPlanner(BasePlanner):
    name = "orca-worst"

    def compose(self, now: float) -> list[SeqChunk]:
        idle = self.idle()
        prefills = [r for r in idle if r.in_prefill][: self.max_batch]
        if prefills:
            return [self.prefill(r) for r in prefills]
        return [self.decode(r) for r in idle[: self.max_batch]]
