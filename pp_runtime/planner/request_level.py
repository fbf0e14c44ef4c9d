"""Request-level scheduling, as in FasterTransformer (paper §2.3).

Requests run in groups of up to B, one group per micro-batch slot of the pipeline. A group
is prefilled together (whole prompts, one micro-batch), then decoded together until every
member has finished; only then are its KV blocks released and the next group admitted.
Each member holds the blocks of its longest possible sequence (prompt + max_tokens) from
admission, as FasterTransformer allocates, so a group never grows or preempts. Members
that finish early drop out of the batches (FasterTransformer would pad them), but keep
their blocks until the group ends.
"""
from __future__ import annotations

from itertools import islice, takewhile

from pp_runtime.core.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.base import BasePlanner
from pp_runtime.core.request import FinishReason, Request


class RequestLevelPlanner(BasePlanner):
    name = "request-level"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        self.groups: list[list[Request]] = []  # active groups, oldest first

    def admit(self, now: float) -> None:
        """Form a new group from arrived requests when the blocks of all of them are free
        (a group takes at most B requests, and no more than an empty pool holds); requests
        never join a running group."""
        kv = self.kv
        while self.waiting and self.waiting[0].arrival_s <= now:
            size, total = 0, 0
            for r in islice(self.waiting, self.arrived(now, self.max_batch)):
                need = kv.need(r, self.longest(r))
                if size and total + need > kv.pool.num_blocks:
                    break
                size, total = size + 1, total + need
            if total > kv.pool.num_free:
                return
            group = [self.waiting.popleft() for _ in range(size)]
            for req in group:
                kv.admit(req, watermark=False, tokens=self.longest(req))
            self.running.extend(group)
            self.groups.append(group)

    @staticmethod
    def longest(req: Request) -> int:
        return req.prompt_len + req.params.max_tokens

    def arrived(self, now: float, limit: int) -> int:
        """Waiting requests that have arrived, counted up to `limit`: `waiting` is in arrival
        order, so they are a prefix of it (counting all of them would cost O(waiting) per
        micro-batch, O(N^2) for a run)."""
        return sum(1 for _ in islice(takewhile(lambda r: r.arrival_s <= now, self.waiting), limit))

    def compose(self, now: float) -> list[SeqChunk]:
        for group in self.groups:  # the counters spelled out, as in base.py: a hot path
            live = [r for r in group if r.finish_reason is None]
            if not live or any(r.num_scheduled > r.num_computed for r in live):  # in flight
                continue
            if any(r.num_scheduled < r.prefill_len for r in live):  # in prefill
                return [self.prefill(r) for r in live]
            return [self.decode(r) for r in live]
        return []

    def finish(self, req: Request, reason: FinishReason, now: float) -> None:
        req.finish_reason, req.finish_s = reason, now
        self.running.remove(req)
        group = next(g for g in self.groups if req in g)
        if all(r.finished for r in group):  # the whole group is done: release its blocks
            self.groups.remove(group)
            for r in group:
                self.kv.free(r)

    def abort_all(self, reason: FinishReason, now: float) -> list[Request]:
        self.groups = []
        return super().abort_all(reason, now)
