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
"""
from __future__ import annotations

import warnings
from collections import deque

from pp_runtime.core.batch import MicroBatch, SampledTokens, SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.blocks import KVBlocks
from pp_runtime.planner.cost import CostModel
from pp_runtime.core.request import FinishReason, Request


UNBOUNDED_ROWS = 1 << 30  # rows of a planner with no B (slices take it: not float inf)


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

    # ---- intake ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self.waiting and req.arrival_s < self.waiting[-1].arrival_s:
            raise ValueError(f"request {req.request_id}: requests must be added in arrival order")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
        finished and its KV blocks freed."""
        if req.finished:
            return True
        if req.blocks is None:  # admitted to nothing (yet, or again: preempted)
            self.waiting.remove(req)
            req.finish_reason, req.finish_s = reason, now
        elif req.in_flight:
            return False
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
        return SeqChunk(req.request_id, req.blocks, pos, (req.token_at(pos),), req.sampling(),
                        True)  # is_decode, positional: a keyword costs ~0.1 us, 10^7 times

    @staticmethod
    def prefill(req: Request, n: int | None = None) -> SeqChunk:
        """The next n prefill tokens (all that remain when n is None); their blocks were
        taken at admission."""
        start = req.num_scheduled
        end = req.prefill_len if n is None else min(req.prefill_len, start + n)
        req.num_scheduled = end
        sampling = req.sampling() if end == req.prefill_len else None  # the prefill's last chunk
        return SeqChunk(req.request_id, req.blocks, start, req.token_range(start, end), sampling)

    def compose(self, now: float) -> list[SeqChunk]:
        """The policy: sequences of the next micro-batch (may be empty)."""
        raise NotImplementedError

    # ---- the planner interface ---------------------------------------------------------
    def schedule(self, now: float = 0.0) -> MicroBatch | None:
        """The next micro-batch, or None when nothing can run now."""
        self.admit(now)
        seqs = self.place(self.compose(now))
        if not seqs:
            return None
        mb = MicroBatch(self._next_mb, tuple(seqs))
        self._next_mb += 1
        return mb

    def place(self, seqs: list[SeqChunk]) -> list[SeqChunk]:
        """Give every decode that enters a new block that block. When none is free, preempt
        the most recently admitted request not in flight (its sequences leave this
        micro-batch; it may be the decode's own request) until one is."""
        kv, requests = self.kv, self.requests
        if not kv.paged:  # a whole context was reserved at admission
            return seqs
        first: dict[int, int] = {}  # request -> start of its first sequence here
        for s in seqs:
            first.setdefault(s.request_id, s.start)
        out, dropped = [], set()
        for s in seqs:
            req = requests[s.request_id]
            while s.request_id not in dropped and not kv.grow(req, s.kv_len):
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
            req = requests[s.request_id]
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
        self.kv.free(req)

    def abort_all(self, reason: FinishReason, now: float) -> list[Request]:
        """End every unfinished request (e.g. after an executor failure)."""
        ended = list(self.running) + list(self.waiting)
        for req in ended:
            req.finish_reason, req.finish_s = reason, now
            self.kv.free(req)
        self.running, self.waiting = [], deque()
        return ended


def warn_untiled(cfg: Config) -> None:
    pl = cfg.planner
    if pl.tile_align and pl.chunk_size and pl.chunk_size % pl.tile_size:
        warnings.warn(f"planner.chunk_size {pl.chunk_size} is not a multiple of tile_size "
                      f"{pl.tile_size}: matmuls waste part of a tile", stacklevel=3)
