"""When each running request's next token is due: what `uniform`'s TBT bound reads.

A request's next decode may be planned while its last token is still on its way (the token
hop: `plan_ahead`); then its next token is due after that token's predicted return, not
after the token before it. Per request, when its last token came back (`last_s`) and which
micro-batch in flight brings its next one (`returning`); per micro-batch, how many such
tokens it brings (`carrying`); per micro-batch in flight, the gap each of its tokens was
planned to (`planned`: its predicted return less the previous token's time as then known),
so that when it comes back the planner knows how much of each gap no plan foresaw. The
pipeline clock (`budget.PipelineClock.done`) predicts each micro-batch's return. No torch.
"""
from __future__ import annotations

from pp_runtime.core.batch import MicroBatch

INF = float("inf")


class TokensDue:
    def __init__(self):
        self.last_s: dict[int, float] = {}  # request id -> when its last token came
        self.returning: dict[int, int] = {}  # request id -> mb_id bringing its next token
        self.carrying: dict[int, int] = {}  # mb_id -> requests in `returning` it brings
        self.planned: dict[int, dict[int, float]] = {}  # mb_id -> request id -> planned gap

    def bring(self, mb: MicroBatch, done: dict[int, float]) -> None:
        """The next token of each request that samples in `mb` is on its way in it (the
        one it was waiting for before, if any, came back or was dropped); `done`: the
        clock's predicted returns, `mb`'s included."""
        returning, carrying, mb_id, last = self.returning, self.carrying, mb.mb_id, self.last_s
        back_s, planned = done[mb_id], {}
        for s in mb.seqs:
            if s.sampling is None:
                continue
            rid = s.request_id
            before = returning.pop(rid, None)
            prev = last.get(rid) if before is None else done.get(before)
            if prev is not None:
                planned[rid] = back_s - prev
            if before is not None:
                left = carrying[before] - 1
                if left:
                    carrying[before] = left
                else:
                    del carrying[before]
            returning[rid] = mb_id
            carrying[mb_id] = carrying.get(mb_id, 0) + 1
        self.planned[mb_id] = planned

    def back(self, mb: MicroBatch, tokens, now: float) -> list[float]:
        """`mb` came back at `now` with a token for each request id in `tokens`. Returns
        how much longer than planned each gap to a token before came out (negative:
        shorter; none for a first token or a micro-batch the planner did not time)."""
        last, returning, unplanned = self.last_s, self.returning, []
        planned = self.planned.pop(mb.mb_id, None) or {}
        for rid in tokens:
            gap_s, before = planned.get(rid), last.get(rid)
            if gap_s is not None and before is not None:
                unplanned.append(now - before - gap_s)
            last[rid] = now
        if self.carrying.pop(mb.mb_id, None) is not None:  # its tokens are back (or dropped);
            for s in mb.seqs:  # planned ahead, a request's next token may be on its way
                rid = s.request_id  # in a later micro-batch already: that one stays
                if s.sampling is not None and returning.get(rid) == mb.mb_id:
                    del returning[rid]
        return unplanned

    def finished(self, request_id: int) -> None:
        self.last_s.pop(request_id, None)

    def first_due(self, now: float, decodes: list[int], done: dict[int, float]) -> float:
        """The earliest last token among the ready decodes (for one planned ahead, the
        predicted return of the token on its way) and the predicted returns of every
        micro-batch bringing tokens (those requests are due again after them); inf: none."""
        last, returning = self.last_s, self.returning
        first = INF
        for rid in decodes:
            mb_id = returning.get(rid)
            t = last.get(rid, now) if mb_id is None else done.get(mb_id, now)
            first = t if t < first else first
        for mb_id in self.carrying:
            t = done.get(mb_id, now)
            first = t if t < first else first
        return first
