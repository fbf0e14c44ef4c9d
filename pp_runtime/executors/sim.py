"""The simulated executor: the pipeline on a virtual clock, priced by a cost model. No torch.

It has the interface of the real executors (`submit` a micro-batch, `wait` for its sampled
tokens), so the planner and the driver loop are the ones real deployments run. The rule
for one micro-batch submitted at virtual time `now`:

  stage 0 takes it when it is free:       start_0 = max(free_0, now)
  stage s takes the call when it is free  take_s  = max(free_s, now)
  and computes once the activations of stage s-1 arrived:
                                          start_s = max(take_s, end_{s-1}) + send(s)
  wait_s = max(0, end_{s-1} - take_s)  (a bubble), transfer = send(s), end_s = start_s + cost_s

Sends do not block the sender (the link, not the GPU, moves the activations). The last
stage returns one synthetic token (0) per sampling sequence: a request stops at the
output length its workload gave it (`max_tokens`, EOS ignored). `wait` advances the clock
to the end of the micro-batch on the last stage, when the driver would get its result.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from pp_runtime.batch import MicroBatch, SampledTokens, StageTiming


class StageCost(Protocol):
    def stage_times(self, prefills: Sequence[tuple[int, int]],
                    decode_kv_lens: Sequence[int]) -> list[float]: ...
    def send_time(self, num_tokens: int, stage: int) -> float: ...


class VirtualClock:
    """Seconds of simulated time; the driver reads it and sleeps on it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class SimExecutor:
    name = "sim"

    def __init__(self, cost: StageCost, pp: int, clock: VirtualClock):
        self.cost, self.clock = cost, clock
        self.free = [0.0] * pp  # when each stage finishes the last micro-batch it took
        self._done: dict[int, tuple[float, SampledTokens]] = {}

    def submit(self, mb: MicroBatch) -> int:
        prefills, decodes, sampled = [], [], {}
        for s in mb.seqs:
            if s.is_decode:
                decodes.append(s.start + 1)  # its KV length
            else:
                prefills.append((s.start, len(s.token_ids)))
            if s.sampling is not None:
                sampled[s.request_id] = 0
        now, free, timings = self.clock.now, self.free, []
        num_tokens, end = sum(n for _, n in prefills) + len(decodes), 0.0
        for stage, compute in enumerate(self.cost.stage_times(prefills, decodes)):
            take = free[stage] if free[stage] > now else now
            if stage == 0:
                wait = transfer = 0.0
                start = take
            else:
                wait = end - take if end > take else 0.0
                transfer = self.cost.send_time(num_tokens, stage)
                start = (end if end > take else take) + transfer
            end = start + compute
            free[stage] = end
            timings.append(StageTiming(mb.mb_id, stage, 0, wait, transfer, start, end))
        self._done[mb.mb_id] = (end, SampledTokens(mb.mb_id, sampled, tuple(timings)))
        return mb.mb_id

    def wait(self, handle: int) -> SampledTokens:
        end, out = self._done.pop(handle)
        self.clock.advance_to(end)
        return out

    def shutdown(self) -> None:
        self._done.clear()
