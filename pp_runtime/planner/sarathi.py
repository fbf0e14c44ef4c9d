"""SARATHI: chunked prefills + decode-maximal batching (paper §4.2-4.4).

Each micro-batch, in this order:
  1. admit waiting requests (FCFS) while a KV slot is free;
  2. decodes first: every admitted request whose prompt is done and that is not in flight,
     up to B - 1 when a prefill is waiting (B when none is);
  3. then one prefill chunk of the oldest unfinished prompt not in flight: C tokens, less
     one per piggybacked decode when tile alignment is on (chunk + decodes = C).
A request is in at most one in-flight micro-batch: its next token needs the last one back.
"""
from __future__ import annotations

import warnings
from collections import deque

from pp_runtime.batch import MicroBatch, SampledTokens, Sampling, SeqChunk
from pp_runtime.config import Config
from pp_runtime.request import FinishReason, Request


class SarathiPlanner:
    def __init__(self, cfg: Config, eos_token_id: int | None = None):
        pl = cfg.planner
        self.chunk_size, self.max_batch, self.tile_align = pl.chunk_size, pl.max_batch_size, pl.tile_align
        if pl.chunk_size % pl.tile_size:
            warnings.warn(f"planner.chunk_size {pl.chunk_size} is not a multiple of tile_size "
                          f"{pl.tile_size}: matmuls waste part of a tile", stacklevel=2)
        self.eos = eos_token_id
        self.free_slots = deque(range(cfg.num_slots))
        self.waiting: deque[Request] = deque()  # not yet admitted
        self.running: list[Request] = []  # admitted, in admission order
        self.requests: dict[int, Request] = {}
        self._next_mb = 0

    # ---- intake ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.popleft()
            self.running.append(req)

    # ---- planning --------------------------------------------------------------------
    @staticmethod
    def _sampling(req: Request) -> Sampling:
        return Sampling(req.params.temperature, req.params.top_p, req.seed)

    def schedule(self) -> MicroBatch | None:
        """The next micro-batch, or None when every admitted request is in flight."""
        self._admit()
        idle = [r for r in self.running if not r.in_flight]
        prefill = next((r for r in idle if r.in_prefill), None)
        limit = self.max_batch - 1 if prefill else self.max_batch
        decodes = [r for r in idle if not r.in_prefill][:limit]
        seqs = []
        for r in decodes:
            pos = r.num_scheduled  # the last generated token goes in at this position
            seqs.append(SeqChunk(r.request_id, r.slot, pos, (r.token_at(pos),),
                                 self._sampling(r), is_decode=True))
            r.num_scheduled += 1
        if prefill:
            budget = self.chunk_size - len(decodes) if self.tile_align else self.chunk_size
            start = prefill.num_scheduled
            n = min(budget, prefill.prompt_len - start)
            last = start + n == prefill.prompt_len
            seqs.append(SeqChunk(prefill.request_id, prefill.slot, start,
                                 tuple(prefill.prompt_token_ids[start:start + n]),
                                 self._sampling(prefill) if last else None))
            prefill.num_scheduled += n
        if not seqs:
            return None
        mb = MicroBatch(self._next_mb, tuple(seqs))
        self._next_mb += 1
        return mb

    def on_result(self, mb: MicroBatch, out: SampledTokens, now: float) -> list[Request]:
        """Record a finished micro-batch; returns the requests it finished."""
        finished = []
        for s in mb.seqs:
            req = self.requests[s.request_id]
            req.num_computed += s.num_tokens
            if s.sampling is None:
                continue
            token = out.tokens[s.request_id]
            req.output_token_ids.append(token)
            if req.first_token_s is None:
                req.first_token_s = now
            if token == self.eos and not req.params.ignore_eos:
                self._finish(req, FinishReason.EOS, now)
            elif len(req.output_token_ids) >= req.params.max_tokens:
                self._finish(req, FinishReason.LENGTH, now)
            if req.finished:
                finished.append(req)
        return finished

    def _finish(self, req: Request, reason: FinishReason, now: float) -> None:
        req.finish_reason, req.finish_s = reason, now
        self.running.remove(req)
        self.free_slots.append(req.slot)

    def abort_all(self, reason: FinishReason, now: float) -> list[Request]:
        """End every unfinished request (e.g. after an executor failure)."""
        ended = list(self.running) + list(self.waiting)
        for req in ended:
            req.finish_reason, req.finish_s = reason, now
        self.running, self.waiting = [], deque()
        return ended
