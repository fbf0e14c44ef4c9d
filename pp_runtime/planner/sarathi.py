"""SARATHI: chunked prefills + decode-maximal batching (paper §4.2-4.4, Fig. 8).

Each micro-batch, after admitting arrived requests while KV slots are free:
  1. decodes first: every admitted request past its prompt and not in flight, up to B - 1
     when a prefill is waiting (B when none is);
  2. then one prefill chunk of the oldest unfinished prompt (not in flight, or with chunk
     pipelining whether or not its previous chunk is): C tokens, less one per piggybacked
     decode when tile alignment is on (chunk + decodes = C, §4.4);
  3. no prefill waiting: a decode-only batch; no decode ready: the chunk alone.
"""
from __future__ import annotations

from pp_runtime.core.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.base import BasePlanner, warn_untiled


class SarathiPlanner(BasePlanner):
    name = "sarathi"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        warn_untiled(cfg)

    def chunk_budget(self, decodes: list[SeqChunk], start: int) -> int:
        """Prefill tokens to put beside these decodes."""
        return self.chunk_size - len(decodes) if self.tile_align else self.chunk_size

    def compose(self, now: float) -> list[SeqChunk]:
        # `num_scheduled < prefill_len` is `in_prefill`, spelled out on this hot path (base.py)
        prefill = next(iter(self.prefilling()), None)
        limit = self.max_batch - 1 if prefill else self.max_batch
        ready = [r for r in self.idle() if r.num_scheduled >= r.prefill_len]
        seqs = [self.decode(r) for r in ready[:limit]]
        if prefill:
            seqs.append(self.prefill(prefill, self.chunk_budget(seqs, prefill.num_scheduled)))
        return seqs
