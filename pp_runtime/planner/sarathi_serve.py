"""`sarathi-serve`: Sarathi-Serve's stall-free batching (OSDI'24), one token budget per
micro-batch that counts the decodes, as in microsoft/sarathi-serve @96f9911
(`sarathi/core/scheduler/sarathi_scheduler.py`, `SarathiScheduler._schedule`).

Each micro-batch fills a budget of C tokens (`planner.chunk_size`, Sarathi-Serve's own
`chunk_size`; its default is 512, the SARATHI paper's 256):
  1. decodes first: every admitted request past its prompt and not in flight, one token
     each, counted against the budget (`_schedule` 130-160); Sarathi-Serve caps them only
     through `max_num_seqs`;
  2. then partial prefills (prompts already started), oldest first, each taking
     min(prompt left, budget left) (165-187, `_get_seq_next_num_prefill_tokens` 74-96);
  3. then new prompts, oldest first, the same way (196-235). A new prompt is admitted here
     and only here, when the budget has room for its first chunk, its prompt's blocks are
     free beyond the watermark (`can_allocate`, base_block_space_manager.py 76-82) and
     fewer than `max_num_seqs` requests run (`cache.max_running`; Sarathi-Serve's default
     128; paged: none = what the blocks hold).
A prompt that ends mid-budget leaves the rest to the next one, so several prefill chunks
share a micro-batch. A decode that needs a block it cannot get preempts the most recently
admitted request not in flight (recompute; `BasePlanner.place`). Rows are also capped by B
(`planner.max_batch_size`, this runtime's micro-batch limit; Sarathi-Serve has none: set
B >= max_num_seqs for its own). With `planner.chunk_pipelining` a started prompt's next
chunk may go while its previous one is in flight; Sarathi-Serve waits (`is_paused`, 133).
`tile_align` does not apply: the budget always counts the decodes. docs/baselines.md.
"""
from __future__ import annotations

from pp_runtime.core.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.base import UNBOUNDED_ROWS, BasePlanner, warn_untiled
from pp_runtime.planner.cost import CostModel


class SarathiServePlanner(BasePlanner):
    name = "sarathi-serve"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        warn_untiled(cfg)  # C is the whole micro-batch: a multiple of the tile wastes nothing
        self.max_batch = cfg.planner.max_batch_size or UNBOUNDED_ROWS  # none in Sarathi-Serve

    def admit(self, now: float) -> None:
        """Nothing before composing: phase 3 admits a prompt only with a chunk to run."""

    def compose(self, now: float) -> list[SeqChunk]:
        # `num_scheduled >= prefill_len` is `not in_prefill`, spelled out on this hot path (base.py)
        ready = [r for r in self.idle() if r.num_scheduled >= r.prefill_len]
        seqs = [self.decode(r) for r in ready[: self.max_batch]]
        seqs = self.fill_prefills(seqs, self.prefilling(), self.chunk_size - len(seqs))
        budget = self.chunk_size - sum(s.num_tokens for s in seqs)
        waiting, running, kv = self.waiting, self.running, self.kv
        while (budget > 0 and len(seqs) < self.max_batch and waiting
               and waiting[0].arrival_s <= now and len(running) < self.max_running):
            req = waiting[0]
            if not kv.admit(req, watermark=bool(running)):
                break
            running.append(waiting.popleft())
            chunk = self.prefill(req, budget)
            budget -= chunk.num_tokens
            seqs.append(chunk)
        return seqs
