"""`sarathi-serve`: Sarathi-Serve's stall-free batching (OSDI'24), one token budget per
micro-batch that counts the decodes.

Each micro-batch, after admitting arrived requests while KV slots are free, fills a budget
of C tokens (`planner.chunk_size`, Sarathi-Serve's own `chunk_size`):
  1. decodes first: every admitted request past its prompt and not in flight (up to B), one
     token each, counted against the budget;
  2. then partial prefills (prompts already started), oldest first, each taking what is
     left of its prompt or of the budget, whichever is smaller;
  3. then new prompts, oldest first, the same way, until the budget or B runs out.
A prompt that ends mid-budget leaves the rest to the next one, so several prefill chunks
share a micro-batch and one that carries a prefill totals C tokens unless prompts run out.
With `planner.chunk_pipelining` a started prompt's next chunk may go while its previous one
is in flight (`BasePlanner.prefilling`); Sarathi-Serve itself waits for it.
Source: microsoft/sarathi-serve, sarathi/core/scheduler/sarathi_scheduler.py (`_schedule`,
`_get_seq_next_num_prefill_tokens`). `tile_align` does not apply: the budget always
counts the decodes.
"""
from __future__ import annotations

from pp_runtime.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.base import BasePlanner, warn_untiled
from pp_runtime.planner.cost import CostModel


class SarathiServePlanner(BasePlanner):
    name = "sarathi-serve"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        warn_untiled(cfg)  # C is the whole micro-batch: a multiple of the tile wastes nothing

    def compose(self, now: float) -> list[SeqChunk]:
        # `num_scheduled >= prefill_len` is `not in_prefill`, spelled out on this hot path (base.py)
        ready = [r for r in self.idle() if r.num_scheduled >= r.prefill_len]
        seqs = [self.decode(r) for r in ready[: self.max_batch]]
        budget = self.chunk_size - len(seqs)
        prompts = self.prefilling()
        started = [r for r in prompts if r.num_scheduled > 0]
        new = [r for r in prompts if r.num_scheduled == 0]
        return self.fill_prefills(seqs, started + new, budget)
