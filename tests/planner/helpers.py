"""A fake pipeline for planner tests: pure Python, `depth` micro-batches in flight."""
from collections import deque

from pp_runtime.core.batch import SampledTokens
from pp_runtime.config import Config
from pp_runtime.planner import make_planner
from pp_runtime.core.request import Request, SamplingParams


def planner(name: str, **overrides):
    """A planner of `Config()` with overrides. The hand-computed schedules of the policy
    tests admit by whole contexts (`paged: false`, the paper's slots) unless a test asks
    for the paged cache; test_blocks.py computes paged schedules."""
    overrides.setdefault("paged", False)
    return make_planner(Config().with_overrides(planner=name, **overrides))


def add(p, rid, prompt_len, max_tokens, arrival=0.0):
    p.add(Request(rid, [rid % 100] * prompt_len, SamplingParams(max_tokens=max_tokens),
                  seed=0, arrival_s=arrival))


def drive(p, depth: int, token=lambda rid, step: 1, max_steps=100_000):
    """Run the planner against a pipeline `depth` deep; the clock ticks 1 per micro-batch.
    `token(rid, step)` is the sampled token. Returns every micro-batch, in order."""
    in_flight, log, now = deque(), [], 0.0
    while p.has_work():
        while len(in_flight) < depth and (mb := p.schedule(now)) is not None:
            in_flight.append(mb)
            log.append(mb)
        if not in_flight:
            now = p.next_arrival_s()
            continue
        mb = in_flight.popleft()
        now += 1.0
        sampled = {s.request_id: token(s.request_id, len(p.requests[s.request_id].output_token_ids))
                   for s in mb.seqs if s.sampling}
        p.on_result(mb, SampledTokens(mb.mb_id, sampled), now)
        assert len(log) < max_steps, "planner does not finish"
    return log


def contents(log):
    """Each micro-batch as a list of (request, start, tokens, is_decode)."""
    return [[(s.request_id, s.start, s.num_tokens, s.is_decode) for s in mb.seqs] for mb in log]
