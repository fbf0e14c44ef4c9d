"""Planner tests' pipeline: the runtime's driver loop over a scripted executor, pure Python,
`depth` micro-batches in flight."""
from dataclasses import replace

from pp_runtime.core.batch import SampledTokens
from pp_runtime.core.driver import run
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


class Scripted:
    """The executor `drive` runs: `token(rid, step)` is each sampling row's token, and the
    clock ticks 1 per micro-batch as its result comes back."""

    name, device, path = "scripted", "none", ""

    def __init__(self, p, token):
        self.p, self.token, self.now = p, token, 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:  # idle until the next arrival
        self.now += max(0.0, seconds)

    def submit(self, mb):
        return mb

    def wait(self, mb) -> SampledTokens:
        self.now += 1.0
        return SampledTokens(mb.mb_id, {
            s.request_id: self.token(s.request_id, len(self.p.requests[s.request_id].output_token_ids))
            for s in mb.seqs if s.sampling})

    def describe(self) -> str:
        return "scripted"

    def shutdown(self) -> None:
        pass


def drive(p, depth: int, token=lambda rid, step: 1, max_steps=100_000):
    """Run the planner through the runtime's own loop (`core.driver.run`) against a pipeline
    `depth` deep whose clock ticks 1 per micro-batch; `token(rid, step)` is the sampled
    token. Returns every micro-batch submitted, in order."""
    ex, log = Scripted(p, token), []

    def submitted(mb):
        log.append(replace(mb, idle_before_s=0.0))  # as the planner made it (the loop stamps idle)
        assert len(log) < max_steps, "planner does not finish"

    run(p, ex, depth, clock=ex.clock, sleep=ex.sleep, on_submit=submitted)
    return log


def contents(log):
    """Each micro-batch as a list of (request, start, tokens, is_decode)."""
    return [[(s.request_id, s.start, s.num_tokens, s.is_decode) for s in mb.seqs] for mb in log]
