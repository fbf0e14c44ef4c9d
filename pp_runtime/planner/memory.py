"""The round the KV pages sustain at the measured load (`uniform`, with a TBT target).

A request holds pages from admission to its last token: about D rounds of R seconds for
its D output tokens, at a mean of P + D / 2 positions over that life (its prompt, then one
more each token). The requests holding pages are then a Poisson count of mean
x = lambda x D x R (arrivals at rate lambda, each staying its life: an M/G/inf queue), and
the pages hold them at the 99th percentile while x + z sqrt(x) <= n (z = 2.326, the
normal's p99; n = the positions admission may fill / (P + D / 2), or with whole contexts
(no paging) the contexts the cache holds). The longest round that
keeps it is R = x / (lambda D) at the largest such x. A looser TBT target lets rounds grow
past it: every life lengthens in the same pages, they fill, and arrivals queue for them
(GPT-3 TP8 x PP8 P:D 3 with the 5x target: its capacity was below the 3x target's; docs/
planner.md, "The round"). lambda, P and D are the last `ARRIVALS` arrivals' (D: each one's
`max_tokens` within the context, times the share of it finished requests made).
"""
from __future__ import annotations

from collections import deque

from pp_runtime.core.request import Request
from pp_runtime.planner.blocks import KVBlocks

ARRIVALS = 64  # arrivals whose rate and lengths price the round (the last ones)
MIN_ARRIVALS = 16  # fewer: no reading (the round is the target's)
Z_P99 = 2.326  # the normal's 99th percentile: the pages hold the p99 of the requests in flight
INF = float("inf")


class MemoryRound:
    """`round_s(now, ...)`: the longest round (seconds between a request's tokens) that the
    KV pages sustain at the measured arrival rate and lengths; inf before enough arrivals."""

    def __init__(self, seq_len: int, kv: KVBlocks):
        self.seq_len, self.kv = seq_len, kv
        self.ahead: deque[Request] = deque()  # added, not arrived yet (the simulator adds all)
        self.seen: deque[tuple[float, int, int]] = deque()  # (arrival, prompt, output cap)
        self.prompt = self.output = 0  # sums over `seen`

    def add(self, req: Request) -> None:
        self.ahead.append(req)

    def _arrive(self, now: float) -> None:
        ahead, seen = self.ahead, self.seen
        while ahead and ahead[0].arrival_s <= now:
            r = ahead.popleft()
            cap = r.output_cap(self.seq_len)
            seen.append((r.arrival_s, r.prompt_len, cap))
            self.prompt += r.prompt_len
            self.output += cap
            if len(seen) > ARRIVALS:
                _, p, c = seen.popleft()
                self.prompt -= p
                self.output -= c

    def held(self, prompt: float, output: float) -> float:
        """Requests the cache holds at these mean lengths: the positions admission may fill
        (all blocks but the watermark) over the mean over a life, P + D / 2; or whole
        contexts."""
        kv = self.kv
        if not kv.paged:
            return kv.pool.num_blocks // kv.per_context
        return (kv.pool.num_blocks - kv.watermark) * kv.block_size / (prompt + output / 2)

    def round_s(self, now: float, out_share: float) -> float:
        """The round at `now`, finished requests having made `out_share` of their caps."""
        self._arrive(now)
        seen = self.seen
        if len(seen) < MIN_ARRIVALS or now <= seen[0][0]:
            return INF
        k = len(seen)
        rate = (k - 1) / (now - seen[0][0])  # arrivals per second since the oldest kept
        prompt, output = self.prompt / k, max(1.0, self.output / k * out_share)
        n = self.held(prompt, output)
        x = ((Z_P99 * Z_P99 + 4 * n) ** 0.5 - Z_P99) ** 2 / 4
        return x / (rate * output)
