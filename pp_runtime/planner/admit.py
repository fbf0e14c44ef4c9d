"""`uniform`'s admission and its TTFT need (a mixin of `UniformPlanner`, planner/uniform.py).

Rows are bounded by KV pages and by time, not by a hand count: arrived requests are
admitted first come first served (least slack first with no target: `order.py`) while the
prompt's pages are free beyond a share (`GrowthReserve`) of the growth the running requests
owe, and with a TBT target while their decodes alone fit the period (`row_cap`).
`prefill_need` is what the prompts need per micro-batch to reach their first tokens within
the TTFT target.
"""
from __future__ import annotations

from pp_runtime.core.request import Request
from pp_runtime.planner.budget import MARGIN

INF = float("inf")
QUEUE_LOOKAHEAD = 8  # waiting requests whose TTFT deadlines set the prefill share


class UniformAdmission:
    """Admission by pages and time, for `UniformPlanner` (its state: `budget`, `kv`,
    `waiting`, `running`, `reserve`, `out_share`, `row_s`, `order`)."""

    def expected_len(self, r: Request) -> float:
        """KV length at the end: the prompt and the output the request is expected to make."""
        cap = r.output_cap(self.seq_len)
        return r.prompt_len + max(len(r.output_token_ids), self.out_share * cap)

    def admit(self, now: float) -> None:
        """FCFS while the prompt's pages are free beyond the running requests' expected
        growth, and (with a TBT target) while the rows fit the time budget."""
        waiting, running, kv = self.waiting, self.running, self.kv
        if self.order is not None:
            self.order.order(now)
        if not waiting or waiting[0].arrival_s > now:
            return
        if running and self.kv_short(waiting[0]):  # what the loop below would find first
            return
        owed, life = 0, 0.0
        reserve = self.reserve.share
        share, seq_len, bs = self.out_share, self.seq_len, kv.block_size
        for r in running:  # expected_len(r), written out (min and max too): this runs for
            p = r.prompt_len  # every micro-batch while an arrived request waits
            cap, room = r.params.max_tokens, seq_len - p
            if room < cap:
                cap = room
            made, expect = len(r.output_token_ids), share * cap
            end = p + (made if made >= expect else expect)
            grow = -(-int(end) // bs) - len(r.blocks)
            owed += (grow if grow > 0 else 0) * reserve
            life += (p + end) / 2
        free = kv.pool.num_free - int(owed)
        kv_len = life / len(running) if running else waiting[0].prompt_len + 1
        rows = self.row_cap(now, int(kv_len))
        while waiting and waiting[0].arrival_s <= now and len(running) < min(self.max_running, rows):
            req = waiting[0]
            need = kv.need(req)
            final = kv.blocks_for(int(self.expected_len(req))) if kv.paged else need
            growth = (final - need) * reserve
            if running and need + growth > free - kv.watermark:
                return
            if not kv.admit(req, watermark=bool(running)):
                return
            free -= need + growth
            running.append(waiting.popleft())

    def kv_short(self, req: Request) -> bool:
        """Whether the pool lacks the blocks admission asks of `req` beside running
        requests (its prompt's and a share of its growth) even before the running
        requests' owed growth is set aside: then nothing is admitted now."""
        kv = self.kv
        need = kv.need(req)
        final = kv.blocks_for(int(self.expected_len(req))) if kv.paged else need
        return need + (final - need) * self.reserve.share > kv.pool.num_free - kv.watermark

    def row_cap(self, now: float, kv: int) -> float:
        """Requests that may run at once under the time budget: depth x the largest d such
        that d decodes at the running requests' mean mid-life KV length fit in the period
        alone. More would break the TBT target with no prompt token aboard; fewer is a queue
        the prompts pay for in TTFT. Rows that also leave the prompts they bring room to keep
        pace (d x prompt tokens per output token beside the d decodes, until 2026-11-28) is
        what a steady load sustains, not a bound to hold at every micro-batch: applied at
        once it turned Poisson bursts away while pages were free (LLaMA-3.1-8B tp1 x pp4,
        P:D 10: 48 rows, up to 16 arrivals waiting, p99 TTFT 1.3 s against 0.73 s without
        it; docs/planner.md)."""
        if not self.bounded:
            return INF
        b, period = self.budget, self.budget.pace_s  # not T: late returns are noise
        same = getattr(b.cost, "with_chunk_decodes", None)
        if same is not None and same((), 1, kv) is not None:  # the same seconds, no lists
            seconds = self.row_s  # the same micro-batches come back call after call

            def fits(d: int) -> bool:
                t = seconds.get((d, kv))
                if t is None:
                    first, mid, last = same((), d, kv)(0, 0)  # b.time's stages
                    t = seconds[d, kv] = max(first, last) if mid is None else max(first, mid, last)
                return t <= period
        else:
            def fits(d: int) -> bool:
                return b.time([(0, 0)], [kv] * d) <= period  # as `same` prices it
        return max(1, b.largest(fits, 4096)) * self.depth

    def prefill_need(self, now: float, left: int, prefilling: list[Request]) -> int:
        """Prompt tokens per micro-batch that bring the admitted prompts (`prefilling`, in
        order, `left` tokens in all) and then the first waiting requests to their first token
        within 0.95 of the TTFT target (0 without one): for each, the prompt tokens up to and
        including its own over the micro-batches left before its deadline (admitted ones
        count: with pages plentiful a request waits for its first chunk, not in the queue)."""
        b = self.budget
        if b.ttft_slo_s is None:
            return 0
        per_mb, need, tokens = b.base_s, 0.0, 0  # seconds of one micro-batch
        ttft = MARGIN * b.ttft_slo_s  # the p99's room, as the TBT target keeps

        def share(tokens: int, r: Request) -> float:  # over the micro-batches left for r
            return tokens * per_mb / max(ttft - (now - r.arrival_s) - self.pp * per_mb, per_mb)
        for r in prefilling:
            tokens += r.prefill_len - r.num_scheduled
            need = max(need, share(tokens, r))
        tokens = left
        for i, r in enumerate(self.waiting):
            if i == QUEUE_LOOKAHEAD or r.arrival_s > now:
                break
            tokens += r.prefill_len
            need = max(need, share(tokens, r))
        return int(need)
