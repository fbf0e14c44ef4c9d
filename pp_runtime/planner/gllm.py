"""`gllm`: gLLM's token throttling (SC'25, arXiv 2504.14775): decodes spread evenly over the
micro-batches in flight, prefill tokens set by free KV and by the prompt tokens waiting.

Each micro-batch, after admitting arrived requests while KV slots are free:
  1. decodes first, at most D of them: with R running decodes (decode-phase requests, ready
     or in flight), D = 1 when R < pp, else (R + j) // pp with a jitter j rotating through
     0 .. pp - 1 so the remainder is spread; D <= B (gLLM's `maxd`);
  2. then prefill chunks, oldest prompt first, several per micro-batch, each taking what is
     left of its prompt or of the budget P, up to B sequences in all. With f the free share
     of the KV cache and T = KVTHRESH: P = min(round(MAXP * (f - T) / (1 - T)), free KV
     tokens - T * all KV tokens); when more than one prompt waits, P is further capped by
     max(waiting prompt tokens // ITERP, MINP). With a single rank (pp * tp = 1) gLLM skips
     the throttle: P = min(MAXP, free KV tokens - T * all KV tokens).
With `planner.chunk_pipelining` a prompt's next chunk may go while its previous one is in
flight (`BasePlanner.prefilling`), as in gLLM. Free KV is counted as gLLM does, in tokens
scheduled (not blocks); a prompt's blocks are taken when it is admitted, so P never drops
under MINP (gLLM's "minimum prefill token count per batch"), else a prompt filling the
cache would wait forever.
Source: gty111/gLLM, gllm/scheduler.py (`token_throttling`,
`get_balanced_decode_token_budget`, `schedule_prefill_batch`; the KVTHRESH form of the KV
ramp as published, gllm/worker_scheduler.py before its rename).
"""
from __future__ import annotations

from pp_runtime.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.base import BasePlanner
from pp_runtime.planner.cost import CostModel


class GllmPlanner(BasePlanner):
    name = "gllm"
    # gLLM's defaults (gllm/entrypoints/api_server.py); `maxd` is B here
    MAXP = 8192  # prefill tokens per micro-batch at most
    MINP = 32  # prefill tokens per micro-batch at least, while prompts wait
    ITERP = 8  # micro-batches over which the waiting prompt tokens should drain
    KVTHRESH = 0.05  # share of the KV cache the prefill ramp holds back for decodes

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        self.pp = cfg.parallel.pp
        self.throttle = cfg.parallel.pp * cfg.parallel.tp > 1  # gLLM: get_world_size() > 1
        self.kv_tokens = self.kv.pool.num_blocks * self.kv.block_size
        self.jitter = 0  # advances once per budget split, as gLLM's `_decode_budget_jitter`

    def decode_budget(self, running_decodes: int) -> int:
        """Decodes for this micro-batch: the running ones spread over pp micro-batches."""
        if running_decodes < self.pp:
            budget = 1
        else:
            budget = (running_decodes + self.jitter % self.pp) // self.pp
            self.jitter += 1
        return min(budget, self.max_batch)

    def prefill_budget(self, now: float) -> int:
        """Prefill tokens for this micro-batch, from free KV and the prompt tokens waiting."""
        free = self.kv_tokens - sum(r.num_scheduled for r in self.running)
        budget = max(free - int(self.KVTHRESH * self.kv_tokens), 0)
        if not self.throttle:
            return max(min(self.MAXP, budget), self.MINP)
        ratio = max((free / self.kv_tokens - self.KVTHRESH) / (1 - self.KVTHRESH), 0.0)
        budget = min(round(ratio * self.MAXP), budget)
        prompts, tokens = self.waiting_prompts(now, stop_at=self.ITERP * budget)
        if prompts > 1:
            budget = min(max(tokens // self.ITERP, self.MINP), budget)
        return max(budget, self.MINP)

    def waiting_prompts(self, now: float, stop_at: int) -> tuple[int, int]:
        """Prompts with tokens still to schedule, admitted or arrived, and those tokens;
        counting stops past two prompts and `stop_at` tokens (the cap can no longer bind)."""
        prompts = tokens = 0
        for r in self.running:
            if r.num_scheduled < r.prefill_len:
                prompts, tokens = prompts + 1, tokens + r.prefill_len - r.num_scheduled
        for r in self.waiting:  # not admitted yet: no free KV slot
            if r.arrival_s > now or (prompts > 1 and tokens >= stop_at):
                break
            prompts, tokens = prompts + 1, tokens + r.prefill_len
        return prompts, tokens

    def compose(self, now: float) -> list[SeqChunk]:
        # `num_scheduled >= prefill_len` is `not in_prefill`, spelled out on this hot path (base.py)
        ready = [r for r in self.idle() if r.num_scheduled >= r.prefill_len]
        prompts = self.prefilling()
        if not ready and not prompts:  # gLLM plans only when a sequence can go: the jitter
            return []  #                 advances once per micro-batch it could compose
        running_decodes = sum(1 for r in self.running if r.num_scheduled >= r.prefill_len)
        seqs = [self.decode(r) for r in ready[: self.decode_budget(running_decodes)]]
        return self.fill_prefills(seqs, prompts, self.prefill_budget(now))
