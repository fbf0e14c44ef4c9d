"""`uniform`: micro-batches sized by the deployment's latency target, not by hand knobs.

The budget (`planner/budget.py`): K, the cost model's throughput knee (tokens per
micro-batch, decodes included, past which more tokens stop lowering the time per token),
and with a TBT target S (`planner.tbt_slo_ms`) the pipeline clock: a micro-batch may come
back no later than margin x S after the last token of each decode it carries (its predicted
return includes the wait behind every micro-batch in flight; the margin is 0.95, less where
the tokens' gaps come out longer than planned: `TimeBudget.unplanned`; S, or the round the
KV pages sustain at the measured load where that is shorter: `MemoryRound`, a looser target
would lengthen every life until the pages fill and arrivals queue). With no target only K
bounds it, so an offline batch runs at the knee. Each micro-batch:

  1. decodes first, spread evenly: at most ceil(R / pp) of the R requests decoding, oldest
     first (gLLM's balanced decode budget), so every micro-batch of a round carries its
     share instead of the ones the tokens came back in;
  2. then prefill chunks, oldest prompt first, up to K tokens in all and half of the
     slack before the round's deadline (binary search on the cost model; the rest is left
     to the micro-batches behind it), and while prompt tokens wait, up to the level of
     the micro-batches in flight (the largest of their predicted times) where all of the
     slack allows it: a micro-batch that half the slack leaves short would run lighter
     than the ones ahead of it while prompts wait (the pipeline stays level); past the
     deadline (to the level, or to T) it broke GPT-3's 2x TBT target at low load
     (docs/planner.md, "The round"), so only a round already late (its decodes alone
     past the deadline) with a round of knee-sized micro-batches of prompt tokens
     waiting fills to the level regardless: under load a lighter micro-batch would not
     bring those decodes back in time, it would leave the prompts waiting; when the
     admitted prompts hold fewer tokens than the round can take, an even share of them
     per micro-batch (left / depth, held for the round), so prompt work spreads over the
     round instead of making a few micro-batches heavy.
     A prompt's last chunk leaves room to the next prompts (packing: whatever the room
     holds, however small, as beside decodes); its next chunk may follow the previous
     ones in flight (chunk pipelining). Alone (no decode aboard) at
     least K / 8 tokens go (with a target, at most what fits in T), or with a token due
     none unless the TTFT target needs them: a few tokens would hold one of the
     pipeline's slots, and the decode that comes back next would wait for it. Beside
     decodes, whatever fits, however small. A last chunk that does not end its
     prompt gives back the tokens past the micro-batch's last whole tile when they cost
     more per token than the micro-batch does on average (`overhang`): a partly filled
     tile costs nearly a whole one.
Rows are bounded by KV pages and by time, not by a hand count:
  - admission takes arrived requests first come first served under a latency target; with
    none (the makespan), least slack first: longest first among requests arriving together,
    so the longest decode tails start first instead of ending the run alone (`order.py`);
  - admission takes a request when its prompt's pages are free beyond a share (adaptive:
    `GrowthReserve`) of the growth running requests owe (expected: `max_tokens` x `out_share`);
  - with a TBT target, admission also stops at the rows the period holds: depth x the
    decodes d that fit in 0.95 S / depth alone (the margin's cuts left out), at the running
    requests' mean mid-life KV length (more would break the target with no prompt token
    aboard; a burst of arrivals is admitted, not queued); with a TTFT target
    `planner.ttft_slo_ms`, what the prompts need per micro-batch to reach their first
    tokens in time (admitted ones first, then the queue) may take the micro-batch up to T,
    past the round's deadline: a first token at risk outranks one time between tokens, and
    T bounds how far it stretches.
`chunk_size` and `max_batch_size` are optional caps (tokens and rows per micro-batch);
`target_ms` sets T by hand. Predictions are corrected by what comes back: the pipeline
clock shifts by each returned micro-batch's error, and `TimeBudget.observe` scales stage
times by measured / predicted, so a slower pipeline than priced gets smaller micro-batches.
docs/planner.md has the measurements (benchmarks/goodput.py).
"""
from __future__ import annotations

from pp_runtime.config import Config
from pp_runtime.core.batch import MicroBatch, SampledTokens, SeqChunk
from pp_runtime.core.request import Request
from pp_runtime.planner.admit import INF, UniformAdmission
from pp_runtime.planner.base import UNBOUNDED_ROWS, BasePlanner
from pp_runtime.planner.blocks import GrowthReserve
from pp_runtime.planner.budget import PipelineClock, TimeBudget, largest_at_most
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.due import TokensDue
from pp_runtime.planner.memory import MemoryRound
from pp_runtime.planner.order import SlackOrder

MAX_PACKED = 16  # prefill chunks in one micro-batch, at most
SLACK_SHARE = 0.5  # of the slack before the round's deadline, what one micro-batch takes
#                    (a steady round of depth d fills d s / (1 + (d - 1) s) of it; a quarter
#                    and all of it measured worse: docs/planner.md, "The round")


class UniformPlanner(UniformAdmission, BasePlanner):
    name = "uniform"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        pl = cfg.planner
        if cost_model is None:
            from pp_runtime.costmodel import build_cost_model  # the simulator's, for real runs too
            cost_model = build_cost_model(cfg)
        self.pp, self.depth = cfg.parallel.pp, cfg.in_flight
        ms = lambda v: None if v is None else v / 1e3  # noqa: E731
        self._budget_args = (cost_model, pl.tile_size, ms(pl.tbt_slo_ms), ms(pl.ttft_slo_ms),
                             ms(pl.target_ms))
        self.budget = self._time_budget(self.depth)
        self.bounded = pl.tbt_slo_ms is not None or pl.target_ms is not None
        self.pack, self.tile = pl.pack_prefills, pl.tile_size
        self.max_batch = pl.max_batch_size or UNBOUNDED_ROWS  # rows: pages and T bound them
        self.top = min(pl.chunk_size or self.budget.knee_tokens, self.budget.knee_tokens)
        self.min_chunk = max(1, self.top // 8)
        self.seq_len = cfg.seq_len
        self.out_share = 1.0  # of max_tokens, what finished requests generated (moving average)
        self.reserve = GrowthReserve()  # share of the owed growth admission keeps free
        self.predicted: dict[int, float] = {}  # mb_id -> predicted seconds
        self.quota, self.quota_mbs = 0, 0  # even share of prompt tokens, micro-batches left
        self.backlog = 0  # admitted prompt tokens not yet planned, as `compose` counted them
        self.clock = PipelineClock(cost_model, self.pp)
        send = getattr(cost_model, "send_time", None)  # a sampled token's hop to stage 0
        self.hop_s = send(1, 1) if send is not None and self.pp > 1 else 0.0
        self.due = TokensDue()  # when each request's next token is due (planner/due.py)
        self.urgent = 0  # prompt tokens this micro-batch needs for the queue's TTFT target
        self.memory = MemoryRound(cfg.seq_len, self.kv)  # the round the KV pages sustain
        self.row_s: dict[tuple[int, int], float] = {}  # `row_cap`'s (decodes, KV length)
        #                   -> the cost model's seconds, priced once
        batch = not self.bounded and pl.ttft_slo_ms is None  # no target: for the makespan
        self.order = (SlackOrder(self.waiting, self.rounds, self.depth * self.budget.knee_s)
                      if batch else None)  # arrived requests longest first (planner/order.py)

    def _time_budget(self, depth: int) -> TimeBudget:
        cost, tile, tbt, ttft, target = self._budget_args
        return TimeBudget(cost, depth, tile, tbt, ttft, target)

    def plan_ahead(self, on: bool) -> bool:
        """With the token hop a request's next decode may enter stage 0 as its token leaves
        the last stage, pp micro-batches after the one that sampled it (`ahead_gap`): the
        round between its tokens is pp micro-batches, not the pp + 1 the driver's return
        made it, so the time budget divides the TBT target by pp."""
        ahead = super().plan_ahead(on)
        depth = self.ahead_gap if ahead else self.cfg.in_flight
        if depth != self.depth:
            self.depth, self.budget = depth, self._time_budget(depth)
            if self.order is not None:
                self.order.round_s = depth * self.budget.knee_s
        return ahead

    def add(self, req: Request) -> None:
        super().add(req)
        self.memory.add(req)
        if self.order is not None:
            self.order.add(req)

    def rounds(self, r: Request) -> float:
        """Rounds through the pipeline `r` needs from admission: one per token it may make
        (its `max_tokens`, within the context), and its prompt's chunks at the knee (a round
        carries depth of them). Fixed for a request, so the queue's order is too."""
        made = r.output_cap(self.seq_len)
        return made + r.prefill_len / (self.top * self.depth)

    # ---- composing ---------------------------------------------------------------------
    def compose(self, now: float) -> list[SeqChunk]:
        decoding, ready, left, prefilling, pipelining = 0, [], 0, [], self.pipelining
        for r in self.running:  # one pass: this runs for every micro-batch
            scheduled = r.num_scheduled
            if scheduled >= r.prefill_len:
                decoding += 1
                if scheduled == r.num_computed:
                    ready.append(r)
            else:
                left += r.prefill_len - scheduled
                if pipelining or scheduled == r.num_computed:  # `prefilling()`, in this pass
                    prefilling.append(r)
        share = -(-decoding // self.pp)  # an even share of the decodes over the round
        limit = min(share, self.max_batch - 1 if prefilling else self.max_batch)
        seqs = [self.decode(r) for r in ready[:limit]]
        kv = [s.start + 1 for s in seqs]  # a decode's kv_len
        bound = self.round_bound(now, [r.request_id for r in ready])
        self.backlog = left
        if prefilling:  # scarce prompt tokens: an even share over the round, not a few full ones
            even = max(self.min_chunk, self.even_share(left))
            self.urgent = self.prefill_need(now, left, prefilling)  # compose's pass counted them
            returning = self.due.returning
            start = (self.tokens_back(now, [returning.get(s.request_id) for s in seqs])
                     if self.ahead else now)  # (`tokens_back`'s answer when not ahead)
            seqs += self.fill(start, kv, prefilling, bound, even)
        return seqs

    def even_share(self, left: int) -> int:
        """Scarce prompt tokens per micro-batch: `left` / depth, held for the round and
        raised when new prompts bring more (recomputed each time, one prompt went 256, 155,
        77, 39, 32, 6)."""
        fresh = -(-left // self.depth)
        if self.quota_mbs <= 0 or fresh > self.quota:
            self.quota, self.quota_mbs = fresh, self.depth
        self.quota_mbs -= 1
        return self.quota

    def tokens_back(self, now: float, sources) -> float:
        """The earliest stage 0 may start a micro-batch whose decodes planned ahead wait for
        the tokens of micro-batches `sources` (None: none on its way): the latest one's
        predicted return plus one token's hop to stage 0 (as the simulator prices it);
        `now` when not planning ahead."""
        if not self.ahead:
            return now
        return self.clock.start_after(now, sources, self.hop_s)

    # the tokens-due dicts under their names (read by tests/planner/test_uniform_fast.py)
    last_token_s = property(lambda self: self.due.last_s)
    returning = property(lambda self: self.due.returning)
    carrying = property(lambda self: self.due.carrying)

    def round_bound(self, now: float, decodes: list[int]) -> float:
        """The latest the next micro-batch may come back (inf without a TBT target): margin x
        S after the last token of each ready decode (those it carries and those left to the
        micro-batches behind it) and after the predicted return of each token on its way,
        or margin x the round the KV pages sustain at the measured load where that is less
        (`MemoryRound`). The clock's completion includes the wait behind every micro-batch
        in flight."""
        b = self.budget
        if b.tbt_slo_s is None:
            return INF
        room = min(b.tbt_slo_s, self.memory.round_s(now, self.out_share))  # (planner/memory.py)
        return self.due.first_due(now, decodes, self.clock.done) + room * b.margin

    def fill(self, now: float, kv: list[int], prefilling: list[Request],
             bound: float, even: int) -> list[SeqChunk]:
        """Prefill chunks beside decodes of these KV lengths, up to K tokens in all and, with
        a TBT target, while the micro-batch comes back by `bound`: the first prompt's next
        chunk, then (packing) the next prompts', each whatever fits. With no token due
        anywhere at least `alone_chunk()` tokens, so prompts always move; else only what
        fits, and alone (no decode aboard) K / 8 or what the TTFT target needs, or nothing."""
        chunks: list[tuple[int, int]] = []
        room = min(self.top - len(kv), even)
        picks, tokens = [], len(kv)
        for req in prefilling[:MAX_PACKED]:
            start, left = req.num_scheduled, req.prefill_len - req.num_scheduled
            n = self.largest_chunk(now, chunks, kv, start, min(left, room), bound, tokens)
            if n < min(left, 1 if chunks else self.min_chunk):  # packed: whatever fits
                if chunks or (n <= 0 and (kv or bound < INF)):
                    break
                if not kv and bound < INF and n > self.urgent:  # alone, not for a first
                    break  # token: a slot of the pipeline is worth more than n tokens
                if bound == INF and not kv:  # alone, no token due: prompts always move
                    n = min(left, self.alone_chunk())  # (else what fits, however small)
            chunks.append((start, n))
            picks.append(req)
            room, tokens = room - n, tokens + n
            if n < left or not self.pack or room <= 0 or len(kv) + len(picks) >= self.max_batch:
                break
        if picks and picks[-1].num_scheduled + chunks[-1][1] < picks[-1].prefill_len:
            chunks[-1] = (chunks[-1][0], chunks[-1][1] - self.overhang(chunks, kv, tokens))
        return [self.prefill(req, n) for req, (_, n) in zip(picks, chunks) if n > 0]

    def overhang(self, chunks: list[tuple[int, int]], kv: list[int], tokens: int) -> int:
        """Tokens to take off a micro-batch's last chunk (one that does not end its prompt):
        the r past its last whole tile, when they cost more per token than the micro-batch
        does on average (a partly filled tile: LLaMA-2-70B on H100, 256 tokens 2.67 ms a
        stage, 282 tokens 3.3 ms). They go first in the next micro-batch instead."""
        r = tokens % self.tile
        if r == 0 or r >= chunks[-1][1] or tokens <= self.tile:
            return 0
        start, n = chunks[-1]
        time = self.time_with(chunks[:-1], kv)
        full, trimmed = time(start, n), time(start, n - r)
        return r if (full - trimmed) / r > full / tokens else 0

    def time_with(self, chunks: list[tuple[int, int]], kv: list[int]):
        """(start, n) -> `budget.time([*chunks, (start, n)], kv)`, the same seconds, with
        what does not depend on the last chunk priced once where the cost model can."""
        b = self.budget
        with_chunk = getattr(b.cost, "with_chunk", None)
        priced = with_chunk(chunks, kv) if with_chunk is not None else None
        if priced is None:
            return lambda start, n: b.time([*chunks, (start, n)], kv)

        def time(start: int, n: int) -> float:  # b.time's max over the stages
            a, m, c = priced(start, n)
            return max(a, c) if m is None else max(a, m, c)
        return time

    def alone_chunk(self) -> int:
        """A prompt's chunk when nothing else fits: K / 8, or with a target what fits in T
        (at least one token, so prompts always move)."""
        b = self.budget
        if not self.bounded:
            return self.min_chunk
        return max(1, b.largest(lambda n: b.time([(0, n)], []) <= b.period_s, self.min_chunk))

    def largest_chunk(self, now: float, chunks: list, kv: list[int], start: int, hi: int,
                      bound: float, tokens: int) -> int:
        b = self.budget
        if bound == INF and b.tbt_slo_s is None and b.base_s < INF:  # target_ms: a time cap
            return b.largest(lambda n: b.time([*chunks, (start, n)], kv) <= b.period_s, hi)
        if bound == INF or hi <= 0:
            return max(hi, 0)
        clock, scale = self.clock, self.budget.residual
        base = clock.end(now, chunks, kv, scale, tokens)
        ends = clock.ends_with_chunk(now, chunks, kv, scale, start, tokens)
        fits = lambda share: largest_at_most(  # noqa: E731  (b.largest, without a lambda)
            ends, base + max(0.0, bound - base) * share, hi)
        n, need = fits(SLACK_SHARE), self.urgent - sum(c for _, c in chunks)
        if n >= hi or (n >= need and not self.predicted):
            return n
        time = self.time_with(chunks, kv)  # (priced only where a rule below may use it)
        if n < need:  # a share of the round's slack; the prompts' TTFT needs more:
            n = max(n, min(largest_at_most(lambda m: time(start, m), b.period_s, hi), need))
        if n < hi and self.predicted:  # up to T, past the round's deadline (module doc);
            level = max(self.predicted.values())  # prompt tokens wait: up to the level of
            if level > b.period_s:  # the micro-batches in flight, within T and within the
                level = b.period_s  # round's deadline (module doc, 2.)
            if time(start, n + 1) <= level:  # (one price where it is at the level already)
                m = largest_at_most(lambda m: time(start, m), level, hi)
                if base >= bound and self.backlog >= self.depth * self.top:  # (module doc, 2.)
                    n = max(n, m)  # a late round under load: its decodes are late already
                else:
                    n = max(n, largest_at_most(ends, base + max(0.0, bound - base), m))
        return n

    # ---- feedback ----------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> MicroBatch | None:
        mb = super().schedule(now)
        if mb is not None:  # SeqChunk's num_tokens and kv_len written out (the hot path)
            self.reserve.step(self.num_preemptions)
            prefills, kv, tokens = [], [], 0
            for s in mb.seqs:
                n = len(s.token_ids)
                tokens += n
                if s.is_decode:
                    kv.append(s.start + n)
                else:
                    prefills.append((s.start, n))
            times = self.clock.committed_times(prefills, kv)
            self.predicted[mb.mb_id] = max(times)
            residual = self.budget.residual
            scaled = [t * residual for t in times]
            start = self.tokens_back(now, [src for _, src in mb.placeholders])
            self.clock.commit(mb.mb_id, self.clock.completion(start, scaled, tokens))
            if self.budget.tbt_slo_s is not None:
                self.due.bring(mb, self.clock.done)
        return mb

    def on_result(self, mb: MicroBatch, out: SampledTokens, now: float) -> list[Request]:
        predicted = self.predicted.pop(mb.mb_id, 0.0)
        self.clock.returned(mb.mb_id, now)
        if out.timings:  # the stage that took longest (StageTiming.compute_s, written out)
            self.budget.observe(predicted, max([t.compute_end_s - t.compute_start_s
                                                for t in out.timings]))
        self.budget.unplanned(self.due.back(mb, out.tokens, now))
        finished = super().on_result(mb, out, now)
        for r in finished:
            self.due.finished(r.request_id)
            share = len(r.output_token_ids) / r.params.max_tokens
            self.out_share += 0.05 * (share - self.out_share)
        return finished
