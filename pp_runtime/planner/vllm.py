"""vLLM before chunked prefill: prefill-first iteration-level scheduling, token budget.

Each micro-batch: whole prefills of waiting requests, in order, while they fit the token
budget (a prompt longer than the budget goes alone) and B sequences; if no prefill can
go, a decode-only batch of up to B. Prefills and decodes never mix.
"""
from __future__ import annotations

from pp_runtime.core.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.base import BasePlanner


class VllmPlanner(BasePlanner):
    name = "vllm"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        self.token_budget = cfg.planner.token_budget or cfg.seq_len

    def compose(self, now: float) -> list[SeqChunk]:
        idle = self.idle()
        seqs, tokens = [], 0
        for r in (r for r in idle if r.in_prefill):
            n = r.prefill_len - r.num_scheduled
            if len(seqs) == self.max_batch or (seqs and tokens + n > self.token_budget):
                break
            seqs.append(self.prefill(r))
            tokens += n
        if seqs:
            return seqs
        return [self.decode(r) for r in idle[: self.max_batch]]
