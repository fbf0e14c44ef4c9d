"""`uniform`: every micro-batch carries the same work, so no stage waits on another.

A pipeline runs at the pace of its slowest micro-batch: one heavier than the rest makes
every later stage wait for it (the `upstream` bubble), one lighter leaves its stages idle
while the heavier one ahead finishes. SARATHI's micro-batches are equal in tokens except
where a prompt ends: its last chunk is short, and that micro-batch is light. `uniform`
composes each micro-batch as SARATHI does, decodes first, then prefill up to the token
budget (C, less one per decode with tile alignment), and:

- packs: when a prompt's last chunk leaves room, the next prompts' chunks fill it
  (`planner.pack_prefills`; Sarathi-Serve and DeepSpeed-FastGen pack the same way), so
  every micro-batch with prefill work carries exactly C tokens: whole matmul tiles, the
  same linear time;
- spreads (`planner.spread`, pp > 1): with R requests decoding, each micro-batch takes at
  most ceil(R / pp) of the ready decodes, so decodes ride in every micro-batch of a round
  instead of in a few (gLLM's balanced decode budget); and when the prompt tokens left
  are fewer than fill the next `spread` rounds of the pipeline (spread x in_flight
  micro-batches; decode-heavy traffic, a batch's tail), their even share over those
  micro-batches sets a predicted time T = time(ceil(R / pp) decodes at the mean KV length,
  the share of prefill) and every micro-batch's prefill is sized so that the micro-batch
  takes T: lighter where its decodes attend to long KV, heavier where few decodes were
  ready. With prompt tokens to spare every micro-batch gets its full chunk, as SARATHI's;
- with `planner.target_ms`, also caps each micro-batch's *predicted time* (attention over
  long KV, the paper's PB3, or a chunk late in a long prompt): the chunk that would
  overshoot is cut to the largest that fits (never under C / 8 tokens).

Measured (benchmarks/planners.py, docs/planner.md): the time cap lowers bubbles and the
p99 time between tokens but costs makespan, because a cut chunk still pays for whole
matmul tiles; so it is off unless asked for. Predicted times come from the one cost model
the simulator uses (`costmodel/`, `build_cost_model`): the same prices plan the real
runtime and the simulated one.
"""
from __future__ import annotations

from pp_runtime.core.batch import SeqChunk
from pp_runtime.config import Config
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.sarathi import SarathiPlanner

MAX_PACKED = 4  # prefill chunks in one micro-batch, at most
INF = float("inf")


class UniformPlanner(SarathiPlanner):
    name = "uniform"

    def __init__(self, cfg: Config, cost_model: CostModel | None = None):
        super().__init__(cfg, cost_model)
        self.pack = cfg.planner.pack_prefills
        self.min_chunk = max(1, self.chunk_size // 8)
        target = cfg.planner.target_ms
        self.target_s = INF if target is None else target / 1e3
        self.pp, self.depth = cfg.parallel.pp, cfg.in_flight
        self.spread = cfg.planner.spread if self.pp > 1 else 0  # rounds; 0 = off
        if (target is not None or self.spread) and cost_model is None:
            from pp_runtime.costmodel import build_cost_model  # the simulator's, for real runs too
            cost_model = build_cost_model(cfg)
        self.cost = cost_model

    def compose(self, now: float) -> list[SeqChunk]:
        prefilling = self.prefilling()
        limit = self.max_batch - 1 if prefilling else self.max_batch
        ready = [r for r in self.idle() if r.num_scheduled >= r.prefill_len]
        target = self.target_s
        if self.spread:
            share, target = self.even_shares(limit)
            limit = min(limit, share)
        seqs = [self.decode(r) for r in ready[:limit]]
        if prefilling:
            seqs += self.fill([s.kv_len for s in seqs], prefilling, target)
        return seqs

    def even_shares(self, limit: int) -> tuple[int, float]:
        """The decodes one micro-batch takes (ceil(R / pp) of the R decoding requests) and
        the predicted time its prefill fills up to: the time cap when prompt tokens are
        plentiful, else the time of a micro-batch with that many decodes at the mean KV
        length and its even share of the prompt tokens left over the next `spread` rounds."""
        kv_sum = decoding = left = 0
        start = None
        for r in self.running:  # one pass: this runs for every micro-batch
            if r.num_scheduled >= r.prefill_len:
                decoding, kv_sum = decoding + 1, kv_sum + r.num_scheduled
            else:
                left += r.prefill_len - r.num_scheduled
                start = r.num_scheduled if start is None else start
        share = max(1, -(-decoding // self.pp))
        horizon = self.spread * self.depth  # micro-batches the prompt tokens left spread over
        decodes = min(share, limit)
        room = self.chunk_size - (decodes if self.tile_align else 0)
        if start is None or decoding < self.pp or left >= horizon * room:  # (no decodes to
            return share, self.target_s  # ride along: fill the pipeline with full chunks)
        kv = [kv_sum // decoding + 1] * decodes
        even = self.cost.microbatch_time([(start, -(-left // horizon))], kv)
        return share, min(even, self.target_s)

    def fill(self, kv: list[int], prefilling: list, target: float = INF) -> list[SeqChunk]:
        """Prefill chunks beside decodes of these KV lengths, up to the budget (C tokens in
        all with tile alignment, else C prefill tokens) and the predicted-time `target`:
        the first prompt's next chunk, then (packing) the next prompts' first ones. A
        micro-batch without decodes takes at least C / 8 tokens, so prompts move."""
        chunks: list[tuple[int, int]] = []
        room = self.chunk_size - (len(kv) if self.tile_align else 0)
        out = []
        for req in prefilling[:MAX_PACKED]:
            start, left = req.num_scheduled, req.prefill_len - req.num_scheduled
            n = self._largest_fit(chunks, kv, start, min(left, room), target)
            if n < min(left, self.min_chunk):  # too little time left for a useful chunk
                if chunks or (kv and target < self.target_s):
                    break  # (spread: the decodes alone reach the even time)
                n = min(left, self.min_chunk)  # alone: at least C / 8, so prompts move
            chunks.append((start, n))
            out.append(self.prefill(req, n))
            room -= n
            if n < left or not self.pack or room <= 0 or len(kv) + len(out) >= self.max_batch:
                break
        return out

    def _largest_fit(self, chunks: list[tuple[int, int]], kv: list[int], start: int,
                     hi: int, target: float) -> int:
        """The largest n <= hi whose chunk (start, n) with `chunks` and the decodes fits
        the time target; 0 when none does. Times grow with n: binary search."""
        if hi <= 0:
            return 0
        if target == INF:
            return hi
        fits = lambda n: self.cost.microbatch_time([*chunks, (start, n)], kv) <= target  # noqa: E731
        if fits(hi):
            return hi
        lo, hi = 0, hi - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo
