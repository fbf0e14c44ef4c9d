"""What every planner shares: admission by KV blocks, the two counters, finishing.

A planner is pure Python with the clock passed in. Each policy only says which sequences
go into the next micro-batch (`compose`); the rules below hold for all of them:

- a request is admitted (FCFS, once it has arrived) only when the blocks of its prefill
  are free (`planner/blocks.py`; a whole context with `cache.paged: false`);
- a decode that enters a new block takes one when the micro-batch is placed (`place`);
  when none is free, the most recently admitted request not in flight is preempted: its
  blocks go back and it waits again at the head of the queue, to prefill its prompt and
  the tokens it generated (its output is the same as without preemption);
- a request is in at most one in-flight micro-batch (`in_flight`: scheduled > computed),
  except that with `planner.chunk_pipelining` a prompt's next prefill chunk may follow its
  previous ones into the pipeline before they come back (`prefilling()`): stages run
  micro-batches in order, so chunk k's KV is written on every stage before chunk k+1
  reaches it. Consecutive chunks only; a decode still waits for its sampled token;
- every prompt token is scheduled exactly once, in order; every request ends with a
  finish reason (length, eos, or error).

Planning ahead (`plan_ahead`, on with the token hop: docs/distributed.md): a request whose
one sampling chunk is in flight in micro-batch k may get its next decode in micro-batch
j >= k + pp, before its token is back, with a placeholder input (`MicroBatch.placeholders`:
stage 0 takes the id straight from the last stage). At most one such decode per request,
never past max_tokens; it never preempts (with no block free it waits for its token). The
policies are unchanged: while one composes, such a request looks idle (`_lend`). A request
that ends (EOS) with a decode still in flight is finished at once; that decode's result is
discarded and its KV blocks go back when it returns (`_draining`).
"""
from __future__ import annotations

import warnings
from collections import deque

from pp_runtime.core.batch import (PLACEHOLDER, MicroBatch, SampledTokens, SeqChunk, micro_batch,
                                   seq_chunk)
from pp_runtime.config import Config
from pp_runtime.planner.blocks import KVBlocks
from pp_runtime.planner.cost import CostModel
from pp_runtime.core.request import FinishReason, Request


UNBOUNDED_ROWS = 1 << 30  # rows of a planner with no B (slices take it: not float inf)
PLACEHOLDER_IDS = (PLACEHOLDER,)  # a placeholder decode's token_ids
# policies that read the counters beyond "is it in flight" (gllm: whether the prompt is
# computed; request-level: a whole group at once): they plan as before, never ahead
NOT_AHEAD = frozenset({"gllm", "request-level"})


class BasePlanner:
    name = "base"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        pl = cfg.planner
        self.cfg = cfg
        self.chunk_size, self.max_batch, self.tile_align = cfg.chunk_tokens, cfg.batch_rows, pl.tile_align
        self.pipelining = pl.chunk_pipelining
        self.eos = cfg.model.eos_token_id
        self.kv = KVBlocks(cfg)
        c = cfg.cache  # paged: as many as the blocks hold; slots: one per reserved context
        self.max_running = c.max_running or (cfg.num_slots if not c.paged else float("inf"))
        self.num_preemptions = 0
        self.waiting: deque[Request] = deque()  # arrived or not, not yet admitted (FCFS)
        self.running: list[Request] = []  # admitted, in admission order
        self.requests: dict[int, Request] = {}
        self._next_mb = 0
        self.ahead, self.ahead_gap = False, cfg.parallel.pp  # planning ahead: `plan_ahead`
        self._sample_mb: dict[int, int] = {}  # request -> micro-batch of its last sampling chunk
        self._draining: dict[int, Request] = {}  # finished, a decode planned ahead in flight

    def plan_ahead(self, on: bool) -> bool:
        """Plan decodes before their input token is back (the executor's token hop carries
        it from the last stage to stage 0); True where this policy does."""
        self.ahead = bool(on) and self.name not in NOT_AHEAD
        return self.ahead

    def continue_from(self, other: "BasePlanner") -> None:
        """Number micro-batches on from `other`'s (a fresh planner on the same workers:
        stage 0 matches the token hop's messages by micro-batch id)."""
        self._next_mb = max(self._next_mb, other._next_mb)

    # ---- intake ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self.waiting and req.arrival_s < self.waiting[-1].arrival_s:
            raise ValueError(f"request {req.request_id}: requests must be added in arrival order")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._draining)

    def next_arrival_s(self) -> float | None:
        """When the next waiting request arrives (None when none waits)."""
        return self.waiting[0].arrival_s if self.waiting else None

    def num_waiting(self) -> int:
        """Requests not admitted yet, arrived or not (preempted ones included)."""
        return len(self.waiting)

    def queued(self, now: float) -> list[Request]:
        """Requests that have arrived by `now` and hold no KV blocks, first in line first."""
        return [r for r in self.waiting if r.arrival_s <= now and r.blocks is None]

    def abort(self, req: Request, reason: FinishReason, now: float) -> bool:
        """End `req` now unless a micro-batch in flight carries it (False: try again once
        that micro-batch is back): one still waiting leaves the queue, an admitted one is
        finished and its KV blocks freed. Planning ahead, one in flight ends at once too
        (its results are dropped, its blocks go back when they return: `finish`)."""
        if req.finished:
            return True
        if req.blocks is None:  # admitted to nothing (yet, or again: preempted)
            self.waiting.remove(req)
            req.finish_reason, req.finish_s = reason, now
        elif req.in_flight and not self.ahead:
            return False
        elif req.in_flight:  # planning ahead a decoding request is nearly always in
            self.finish(req, reason, now)  # flight: it ends now, its KV once back (`finish`)
        else:
            self.finish(req, reason, now)
        return True

    def adopt(self, requests: list[Request]) -> None:
        """Take over unfinished requests another planner held (a recovery: that planner's
        micro-batches in flight are lost), in this order, before any waiting here: each
        holds no blocks and computes everything it knows again (`Request.restart`)."""
        for req in reversed(requests):
            if req.blocks is not None or req.num_scheduled:
                req.restart()
            self.requests[req.request_id] = req
            self.waiting.appendleft(req)

    def unfinished(self) -> list[Request]:
        """Every request not ended: admitted ones in admission order, then the waiting."""
        return list(self.running) + list(self.waiting)

    def forget(self, request_id: int) -> None:
        """Drop an ended request's record (an online engine ends requests without end)."""
        self.requests.pop(request_id, None)

    def admit(self, now: float) -> None:
        """Arrived requests, first come first served, while their blocks are free (beyond the
        watermark unless nothing runs: a lone request may take the whole pool)."""
        waiting, running, kv = self.waiting, self.running, self.kv
        while waiting and waiting[0].arrival_s <= now and len(running) < self.max_running:
            if not kv.admit(waiting[0], watermark=bool(running)):
                return
            running.append(waiting.popleft())

    # ---- building blocks for policies --------------------------------------------------
    # The building blocks below run for every sequence of every micro-batch (10^7 times in
    # a large simulation): they read Request's counters directly rather than through its
    # properties (`in_flight`, `in_prefill`), whose calls cost more than the comparisons.
    def idle(self) -> list[Request]:
        """Admitted requests not in flight, in admission order."""
        return [r for r in self.running if r.num_scheduled == r.num_computed]  # not in flight

    def prefilling(self) -> list[Request]:
        """Admitted requests with prompt tokens left to schedule that may get their next
        chunk now, in admission order: with chunk pipelining every one (its earlier chunks
        may still be in flight), else only those not in flight."""
        if self.pipelining:
            return [r for r in self.running if r.num_scheduled < r.prefill_len]
        return [r for r in self.running if r.num_scheduled == r.num_computed < r.prefill_len]

    def fill_prefills(self, seqs: list[SeqChunk], prompts: list[Request], budget: int) -> list[SeqChunk]:
        """Append chunks of `prompts`, in order, each taking what is left of its prompt or of
        the token `budget`, until the budget or B sequences run out (the multi-chunk
        policies: sarathi-serve, gllm)."""
        for r in prompts:
            if budget <= 0 or len(seqs) == self.max_batch:
                break
            chunk = self.prefill(r, budget)
            budget -= chunk.num_tokens
            seqs.append(chunk)
        return seqs

    @staticmethod
    def decode(req: Request) -> SeqChunk:
        """Feed the last generated token back (advances the scheduled counter). The chunk
        holds the request's block table itself: `place` may add the block this token needs."""
        pos = req.num_scheduled
        req.num_scheduled = pos + 1
        n, made = req.prompt_len, req.output_token_ids
        if pos >= n:  # req.token_at(pos), written out
            ids = (made[pos - n],) if pos < n + len(made) else PLACEHOLDER_IDS  # planned
        else:  # ahead (`_lend`): stage 0 fills it in
            ids = (req.prompt_token_ids[pos],)
        return seq_chunk(req.request_id, req.blocks, pos, ids, req.sampling(), True)  # is_decode

    @staticmethod
    def prefill(req: Request, n: int | None = None) -> SeqChunk:
        """The next n prefill tokens (all that remain when n is None); their blocks were
        taken at admission."""
        start = req.num_scheduled
        end = req.prefill_len if n is None else min(req.prefill_len, start + n)
        req.num_scheduled = end
        sampling = req.sampling() if end == req.prefill_len else None  # the prefill's last chunk
        return seq_chunk(req.request_id, req.blocks, start, req.token_range(start, end), sampling)

    def compose(self, now: float) -> list[SeqChunk]:
        """The policy: sequences of the next micro-batch (may be empty)."""
        raise NotImplementedError

    # ---- the planner interface ---------------------------------------------------------
    def schedule(self, now: float = 0.0) -> MicroBatch | None:
        """The next micro-batch, or None when nothing can run now."""
        self.admit(now)
        if self.ahead:
            return self._schedule_ahead(now)
        seqs = self.place(self.compose(now))
        if not seqs:
            return None
        mb = micro_batch(self._next_mb, tuple(seqs))
        self._next_mb += 1
        return mb

    def _schedule_ahead(self, now: float) -> MicroBatch | None:
        """`schedule` planning ahead: the policy composes with the requests `_lend` lets
        look idle; each placeholder decode names the micro-batch its input comes from."""
        mb_id = self._next_mb
        lent = self._lend(mb_id)
        try:
            seqs = self.compose(now)
        finally:
            for req, computed in lent:
                req.num_computed = computed
        seqs = self.place(seqs)
        if not seqs:
            return None
        sample_mb = self._sample_mb
        holes = tuple((i, sample_mb[s.request_id]) for i, s in enumerate(seqs)
                      if s.token_ids == PLACEHOLDER_IDS)
        for s in seqs:
            if s.sampling is not None:
                sample_mb[s.request_id] = mb_id
        self._next_mb += 1
        return micro_batch(mb_id, tuple(seqs), holes)

    def _lend(self, mb_id: int) -> list[tuple[Request, int]]:
        """Requests that may get a decode in micro-batch `mb_id` before their token is
        back, made to look idle (computed = scheduled) while the policy composes; returns
        each with its real computed count. Eligible: the prompt all scheduled, exactly one
        sampling chunk in flight, in a micro-batch at least pp before (its token leaves
        the last stage about when this one reaches stage 0), and room for two more tokens
        under max_tokens (the one in flight and this one)."""
        lent, gap, sample_mb = [], self.ahead_gap, self._sample_mb
        for r in self.running:
            scheduled, computed = r.num_scheduled, r.num_computed
            if scheduled == computed or scheduled < r.prefill_len:
                continue
            if scheduled - max(computed, r.prefill_len - 1) != 1:  # sampling chunks in flight
                continue
            if mb_id - sample_mb.get(r.request_id, mb_id) < gap:
                continue
            if len(r.output_token_ids) + 2 > r.params.max_tokens:
                continue
            lent.append((r, computed))
            r.num_computed = scheduled
        return lent

    def place(self, seqs: list[SeqChunk]) -> list[SeqChunk]:
        """Give every decode that enters a new block that block. When none is free, preempt
        the most recently admitted request not in flight (its sequences leave this
        micro-batch; it may be the decode's own request) until one is."""
        kv, requests = self.kv, self.requests
        if not kv.paged:  # a whole context was reserved at admission
            return seqs
        first: dict[int, int] | None = None  # request -> start of its first sequence here
        out, dropped, bs = [], set(), kv.block_size
        for s in seqs:
            req = requests[s.request_id]
            kv_len = s.start + len(s.token_ids)
            if s.request_id not in dropped and len(req.blocks) * bs >= kv_len:
                out.append(s)  # its blocks cover it already (what kv.grow finds first)
                continue
            while s.request_id not in dropped and not kv.grow(req, kv_len):
                if s.token_ids == PLACEHOLDER_IDS:  # planned ahead: waits for its token
                    req.num_scheduled -= 1  # instead of preempting anyone
                    dropped.add(s.request_id)
                    break
                if first is None:  # only a preemption reads it
                    first = {}
                    for t in seqs:
                        first.setdefault(t.request_id, t.start)
                victim = self.victim(first)
                self.preempt(victim)
                dropped.add(victim.request_id)
            if s.request_id not in dropped:
                out.append(s)
        return [s for s in out if s.request_id not in dropped] if dropped else out

    def victim(self, first: dict[int, int]) -> Request:
        """The request to preempt: the most recently admitted one with nothing in flight but
        its sequences in the micro-batch being placed (`first`: where they start)."""
        return next(r for r in reversed(self.running)
                    if r.num_computed == first.get(r.request_id, r.num_scheduled))

    def preempt(self, req: Request) -> None:
        """Take its blocks back; it waits again first in line, to compute all it knows."""
        self.kv.free(req)
        req.preempted()
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def on_result(self, mb: MicroBatch, out: SampledTokens, now: float) -> list[Request]:
        """Record a finished micro-batch; returns the requests it finished."""
        finished = []
        requests, tokens, eos = self.requests, out.tokens, self.eos
        keyed = self.kv.pool.prefix_caching
        for s in mb.seqs:
            req = requests.get(s.request_id)
            if req is None or req.finish_reason is not None:  # a wasted decode (`_draining`):
                self._drained(s)  # its token is no output: taken out of the result, so no
                tokens.pop(s.request_id, None)  # callback (streams, journal, report) sees it
                continue
            req.num_computed += len(s.token_ids)
            if keyed:
                self.kv.key_computed(req)
            if s.sampling is None:
                continue
            token = tokens[s.request_id]
            generated = req.output_token_ids
            generated.append(token)
            if req.first_token_s is None:
                req.first_token_s = now
            if token == eos and not req.params.ignore_eos:
                reason = FinishReason.EOS
            elif len(generated) >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            else:
                continue
            self.finish(req, reason, now)
            finished.append(req)
        return finished

    def finish(self, req: Request, reason: FinishReason, now: float) -> None:
        req.finish_reason, req.finish_s = reason, now
        self.running.remove(req)
        if req.num_scheduled > req.num_computed:  # a decode planned ahead is in flight:
            self._draining[req.request_id] = req  # its blocks go back when it returns
        else:
            self.kv.free(req)
        self._sample_mb.pop(req.request_id, None)

    def _drained(self, s: SeqChunk) -> None:
        """A finished request's decode planned ahead came back: its output is discarded;
        once none of its decodes is in flight its KV blocks go back."""
        req = self._draining.get(s.request_id)
        if req is None:
            raise KeyError(f"request {s.request_id}: a result for a request this planner "
                           "does not hold")
        req.num_computed += len(s.token_ids)
        if req.num_computed >= req.num_scheduled:
            del self._draining[s.request_id]
            self.kv.free(req)

    def abort_all(self, reason: FinishReason, now: float) -> list[Request]:
        """End every unfinished request (e.g. after an executor failure)."""
        ended = list(self.running) + list(self.waiting)
        for req in ended:
            req.finish_reason, req.finish_s = reason, now
            self.kv.free(req)
        for req in self._draining.values():  # already ended: only their blocks go back
            self.kv.free(req)
        self.running, self.waiting, self._draining = [], deque(), {}
        self._sample_mb.clear()
        return ended


def warn_untiled(cfg: Config) -> None:
    pl = cfg.planner
    if pl.tile_align and pl.chunk_size and pl.chunk_size % pl.tile_size:
        warnings.warn(f"planner.chunk_size {pl.chunk_size} is not a multiple of tile_size "
                      f"{pl.tile_size}: matmuls waste part of a tile", stacklevel=3)
