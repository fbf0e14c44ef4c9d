"""`gllm`: gLLM's token throttling (SC'25, arXiv 2504.14775), as in gty111/gLLM @bc91d98
(`gllm/scheduler.py`, `Scheduler.token_throttling`): prefill tokens set by free KV pages
and by the prompt tokens waiting, decodes spread evenly over the pp micro-batches.

gLLM has no KV slots: every arrived request waits in one prefill queue and starts when the
pages of its first chunk are free; pages are taken for the tokens scheduled, chunk by chunk
and decode by decode. So this planner always runs on the paged pool (`planner/blocks.py`),
with the bytes of the config's KV (`cache.paged: false` gives the same kv_slots x
max_seq_len tokens as pages); `cache.max_running` and the watermark do not apply.

Each micro-batch (`token_throttling`, scheduler.py 613-696):
  1. reserve: pages held back for the growth of running decodes, sum over decode-phase
     requests (ready or in flight) of ceil((ratio x tokens left to generate - room in their
     last page) / page), at least pp pages; `ratio` starts at 0.7, falls 0.002 per
     micro-batch to 0.1 and rises 0.05 per preemption (`_decode_reserve_pages`, 109-163).
     With `planner.gllm_kvthresh` the reserve is that fixed share of the pages instead (the
     paper's code, `worker_scheduler.py` @1d36e98 27-28, 214-228);
  2. prefill budget P = page x max(free - reserve, 0); if P > 0 and more than one rank:
     P = min(round(maxp x (f - r) / (1 - r)), P) with f, r the free and reserved shares,
     and with several prompts waiting P = min(max(waiting prompt tokens // iterp, minp), P).
     P = 0 is the back-pressure: no prefill while free pages are at the reserve;
  3. prefill chunks, oldest prompt first (preempted ones ahead), each min(prompt left, P
     left), until P or `maxd` rows run out or a chunk's pages do not fit above the reserve;
  4. decodes: D = 1 if R < pp else (R + j) // pp, j a jitter rotating 0 .. pp - 1, with R =
     ready decodes + every sequence of every micro-batch in flight (prefill chunks too);
     D <= maxd - prefill rows. When free pages < the decodes to run, ready decodes are
     preempted (recompute), those holding most pages first (`check_preempt`, 254-314).
     Ready decodes go most recently returned first (gLLM's `appendleft` / `popleft`).
The micro-batch lists the decodes, then the prefill chunks. Rows are also capped by B
(`planner.max_batch_size`, this runtime's micro-batch limit): set B >= maxd for gLLM's own.
A prompt's next chunk may follow its previous one in flight (`planner.chunk_pipelining`,
on in bc91d98: scheduler.py 497-502). docs/baselines.md: every difference left, and why.
"""
from __future__ import annotations

from collections import deque

from pp_runtime.core.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.base import UNBOUNDED_ROWS, BasePlanner
from pp_runtime.planner.blocks import KVBlocks
from pp_runtime.planner.cost import CostModel
from pp_runtime.core.request import Request


class GllmPlanner(BasePlanner):
    name = "gllm"
    INIT_RATIO, MIN_RATIO = 0.7, 0.1  # api_server.py --init/--min-new-token-ratio
    RATIO_STEP, RATIO_DECAY = 0.05, 0.002  # scheduler.py 41-42

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        pl = cfg.planner
        self.maxp, self.minp, self.iterp = pl.gllm_maxp, pl.gllm_minp, pl.gllm_iterp
        self.max_batch = pl.max_batch_size or UNBOUNDED_ROWS  # gLLM has no B: maxd
        self.rows = min(pl.gllm_maxd, self.max_batch)
        self.pp = cfg.parallel.pp
        self.throttle = cfg.parallel.pp * cfg.parallel.tp > 1  # gLLM: get_world_size() > 1
        if not self.kv.paged:  # no slots in gLLM: the same KV bytes, as pages
            self.kv = KVBlocks(cfg.with_overrides(**{"cache.paged": True}))
        self.max_running = float("inf")
        self.pool, self.page = self.kv.pool, self.kv.block_size
        self.kvthresh = pl.gllm_kvthresh
        self.fixed_reserve = (None if self.kvthresh is None
                              else int(self.kvthresh * self.pool.num_blocks))
        self.min_reserve = max(1, self.pp)
        self.ratio = self.INIT_RATIO
        self.jitter = 0  # gLLM's `_decode_budget_jitter`
        self.ready: deque[Request] = deque()  # gLLM's seqs_to_decode: returned, not in flight
        self.rows_in_flight: deque[int] = deque()  # sequences of each micro-batch in flight
        self.in_flight_rows = 0
        self.num_stalls = 0  # micro-batches only the liveness guard could compose

    # ---- gLLM's queues -----------------------------------------------------------------
    def admit(self, now: float) -> None:
        """No slot gate: an arrived request starts when its first chunk's pages fit."""

    def prompts(self, now: float, started: list[Request], stuck: bool = False):
        """gLLM's prefill queue in order, lazily: preempted requests (at the head of
        `waiting`), admitted prompts with tokens left, then arrived requests (`stuck`: the
        admitted ones first). The caller admits each waiting one before asking for the
        next."""
        waiting = self.waiting
        while not stuck and waiting and waiting[0].num_preemptions and waiting[0].arrival_s <= now:
            yield waiting[0]
        yield from started
        while waiting and waiting[0].arrival_s <= now:
            yield waiting[0]

    def waiting_prompts(self, now: float, stop_at: int) -> tuple[int, int]:
        """Prompts in gLLM's prefill queue (admitted with tokens left, or arrived) and their
        tokens left; counting stops past two prompts and `stop_at` tokens (the queue cap
        can no longer bind)."""
        prompts = tokens = 0
        for r in self.running:
            if r.num_scheduled < r.prefill_len:
                prompts, tokens = prompts + 1, tokens + r.prefill_len - r.num_scheduled
        for r in self.waiting:
            if r.arrival_s > now or (prompts > 1 and tokens >= stop_at):
                break
            prompts, tokens = prompts + 1, tokens + r.prefill_len
        return prompts, tokens

    # ---- the budgets ---------------------------------------------------------------------
    def reserve_pages(self) -> int:
        """Pages prefill leaves free for the running decodes (`_decode_reserve_pages`)."""
        if self.fixed_reserve is not None:
            return self.fixed_reserve
        ratio, bs, total = self.ratio, self.page, 0
        for r in self.running:
            if r.num_computed < r.prefill_len:  # gLLM: not computed_prompt
                continue
            generated = len(r.output_token_ids)
            extra = int(ratio * (r.params.max_tokens - generated))
            if extra > 0:
                extra -= max(0, len(r.blocks) * bs - r.prompt_len - generated)
                if extra > 0:
                    total += -(-extra // bs)
        return max(self.min_reserve, total)

    def prefill_budget(self, now: float, reserve: int) -> int:
        """P: page headroom above the reserve, ramped by free share, capped by the queue."""
        free, total = self.pool.num_free, self.pool.num_blocks
        budget = self.page * max(free - reserve, 0)
        if not (self.throttle and budget):
            return min(self.maxp, budget)
        held = self.kvthresh if self.kvthresh is not None else min(0.99, reserve / total)
        ratio = max((free / total - held) / (1 - held), 0.0)
        budget = min(round(ratio * self.maxp), budget)
        prompts, tokens = self.waiting_prompts(now, stop_at=self.iterp * budget)
        if prompts > 1:
            budget = min(max(tokens // self.iterp, self.minp), budget)
        return budget

    def decode_budget(self, running_decodes: int) -> int:
        """Decodes for this micro-batch: the running ones spread over pp micro-batches."""
        if running_decodes < self.pp:
            return 1
        budget = (running_decodes + self.jitter % self.pp) // self.pp
        self.jitter += 1
        return budget

    # ---- composing -----------------------------------------------------------------------
    def prefills(self, now: float, budget: int, reserve: int, stuck: bool = False) -> list[SeqChunk]:
        """Chunks in queue order while P, rows and pages above the reserve last; pages are
        taken here, for the tokens scheduled (`schedule_prefill_batch`)."""
        out, kv = [], self.kv
        for r in self.prompts(now, self.prefilling(), stuck):
            if budget <= 0 or len(out) >= self.rows:
                break
            new = r.blocks is None
            start = 0 if new else r.num_scheduled
            n = min(r.prefill_len - start, budget)
            if kv.blocks_for(start + n) - (0 if new else len(r.blocks)) > self.pool.num_free - reserve:
                break  # the page guard: it waits, first in line
            if new:
                if not kv.admit(r, watermark=False, tokens=n):
                    break
                self.waiting.popleft()
                self.running.append(r)
                n = min(r.prefill_len - r.num_scheduled, budget)  # after any prefix hit
            kv.grow(r, r.num_scheduled + n)
            out.append(self.prefill(r, n))
            budget -= n
        return out

    def decodes(self, budget: int) -> list[SeqChunk]:
        """Up to `budget` ready decodes, most recently returned first, each with the page
        its token needs; first preempt while free pages < the decodes to run."""
        need = min(budget, len(self.ready))
        if self.pool.num_free < need:
            self.check_preempt(need)
        out = []
        for _ in range(min(budget, len(self.ready))):
            r = self.ready.popleft()
            s = self.decode(r)
            if not self.kv.grow(r, s.kv_len):
                raise RuntimeError("gllm: a decode found no page after check_preempt")
            out.append(s)
        return out

    def check_preempt(self, need: int) -> None:
        """Preempt ready decodes, most pages first, until `need` pages are free."""
        victims = sorted(self.ready, key=lambda r: len(r.blocks), reverse=True)
        preempted = False
        for r in victims:
            if self.pool.num_free >= need:
                break
            self.preempt(r)
            preempted = True
        if preempted:
            self.ratio = min(1.0, self.ratio + self.RATIO_STEP)

    def plan(self, now: float, stuck: bool = False) -> list[SeqChunk]:
        """One token_throttling call: prefill chunks, then decodes (listed first). `stuck`:
        the liveness guard's call, every free page and `maxp` for prefill."""
        if stuck:
            reserve, budget = 0, min(self.maxp, self.page * self.pool.num_free)
        else:
            reserve = self.reserve_pages()
            budget = self.prefill_budget(now, reserve)
        chunks = self.prefills(now, budget, reserve, stuck)
        running_decodes = len(self.ready) + self.in_flight_rows
        budget = min(self.decode_budget(running_decodes), self.rows - len(chunks))
        seqs = self.decodes(budget) + chunks
        self.ratio = max(self.MIN_RATIO, self.ratio - self.RATIO_DECAY)
        return seqs

    def compose(self, now: float) -> list[SeqChunk]:
        waiting = self.waiting
        arrived = bool(waiting) and waiting[0].arrival_s <= now
        if not self.ready and not arrived and not self.prefilling():
            return []  # gLLM schedules only with a sequence queued
        seqs = self.plan(now)
        while not seqs and not self.in_flight_rows and self.running:
            # Liveness guard, not in gLLM: nothing in flight and P = 0 (free pages at the
            # reserve, held by prompts part-way through) would stall gLLM for good. Plan
            # with every free page and no ramp, the admitted prompts first; with none free,
            # preempt the newest request.
            self.num_stalls += 1
            seqs = self.plan(now, stuck=True)
            if not seqs:
                self.preempt(self.running[-1])
        return seqs

    # ---- bookkeeping ---------------------------------------------------------------------
    def schedule(self, now: float = 0.0):
        mb = super().schedule(now)
        if mb is not None:
            self.rows_in_flight.append(len(mb.seqs))
            self.in_flight_rows += len(mb.seqs)
        return mb

    def on_result(self, mb, out, now: float) -> list[Request]:
        finished = super().on_result(mb, out, now)
        self.in_flight_rows -= self.rows_in_flight.popleft()
        requests, ready = self.requests, self.ready
        for s in mb.seqs:  # gLLM's process_output: appendleft, in batch order
            r = requests[s.request_id]
            if r.finish_reason is None and r.num_scheduled == r.num_computed >= r.prefill_len:
                ready.appendleft(r)
        return finished

    def preempt(self, req: Request) -> None:
        if req in self.ready:
            self.ready.remove(req)
        super().preempt(req)

    def abort_all(self, reason, now: float) -> list[Request]:
        self.ready.clear()
        return super().abort_all(reason, now)
