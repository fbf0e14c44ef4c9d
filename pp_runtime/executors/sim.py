"""The simulated executor: the pipeline on a virtual clock, priced by a cost model. No torch.

It has the interface of the real executors (`submit` a micro-batch, `wait` for its sampled
tokens), so the planner and the driver loop are the ones real deployments run. A stage
behaves as a real stage worker does (worker/stage.py, parallel/p2p.py): it takes calls in order,
receives, computes, then waits until the next stage took its previous send before posting
this one (one send outstanding; gloo and NCCL sends complete when the receiver receives).
For one micro-batch submitted at virtual time `now`, stage by stage:

  take_s   = max(free_s, now)                          stage s takes the call
  posted_0 = ... ; wait_s = max(0, posted_{s-1} - take_s)        upstream (s > 0)
  start_s  = max(take_s, posted_{s-1}) + send(s)       after the transfer (s > 0)
  end_s    = start_s + cost_s
  block_s  = max(0, received_{s+1} - end_s)            downstream: the next stage received
                                                       the previous micro-batch at its start
  posted_s = free_s = end_s + block_s

The last stage returns one synthetic token (0) per sampling sequence: a request stops at
the output length its workload gave it (`max_tokens`, EOS ignored). `wait` advances the
clock to the end of the micro-batch on the last stage, when the driver would get its result.

Host costs (`cost.host`, a `costmodel.calibration.HostCost` measured on the real executor;
none: all zero) are charged where the real pipeline pays them:

  the driver's clock    += plan + submit                 at every submit (the driver's turn)
  arrival               = now + plan + dispatch          the call reaches the stages
  take_s                = max(free_s + call(s), arrival) a stage's time between two calls
  the driver's result   = max_s(free_s) + return         at `wait` (every stage answers)

so a stage holding no micro-batch in between shows as `dependency`, as on the real one.

With the token hop (`token_hop`: the engine plans decodes ahead, `planner/base.py`), a
micro-batch's placeholder decodes wait on stage 0 for their tokens, which leave the last
stage at the end of the micro-batch that sampled them and cross one hop:

  start_0 = max(take_0, max over its placeholders' sources k of end_last(k) + hop)

where `hop` is the cost model's price of a one-token message between two stages
(`send_time(1, 1)`). The wait falls before the call's start, a `dependency` gap, as the
real stage waits for a token outside its spans (worker/stage.py); start_0 - take_0 is the
timing's `token_wait_s`, the real stage's measured wait.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from pp_runtime.core.batch import MicroBatch, SampledTokens, StageTiming, sampled_tokens


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
    path = ""  # one way to reach the stages (driver.Executor)
    device = "sim"  # nothing real: the cost model's stages on a virtual clock

    def __init__(self, cost: StageCost, pp: int, clock: VirtualClock, token_hop: bool = False):
        self.cost, self.clock, self.token_hop = cost, clock, token_hop and pp > 1
        self.hop = cost.send_time(1, 1) if self.token_hop else 0.0
        self._tokens_at: dict[int, float] = {}  # mb id -> when its sampled ids reach stage 0
        host = getattr(cost, "host", None)
        self.call = [host.between_calls(s) if host else 0.0 for s in range(pp)]
        self.plan, self.submit_s, self.dispatch, self.ret = (
            (host.plan_s, host.submit_s, host.dispatch_s, host.return_s) if host else (0.0,) * 4)
        self._sends: dict[int, list[float]] = {}  # num_tokens -> each stage's receive (0: none)
        self.free = [float("-inf")] * pp  # when each stage ended its last call (compute + send wait)
        self.received = [0.0] * pp  # when each stage finished receiving its last micro-batch
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
        free, received, timings, call = self.free, self.received, [], self.call
        now = self.clock.now + self.plan + self.dispatch  # the call reaches the stages
        self.clock.now += self.plan + self.submit_s  # the driver's turn
        num_tokens, posted, end, done = sum(n for _, n in prefills) + len(decodes), 0.0, 0.0, 0.0
        costs = self.cost.stage_times(prefills, decodes)
        last = len(costs) - 1
        sends = self._sends.get(num_tokens)
        if sends is None:  # the same sizes come again and again: priced once each
            sends = self._sends[num_tokens] = [0.0] + [
                self.cost.send_time(num_tokens, s) for s in range(1, len(costs))]
        mb_id, add = mb.mb_id, timings.append
        for stage, compute in enumerate(costs):
            ready = free[stage] + call[stage]  # -inf before its first call
            take = ready if ready > now else now
            if stage == 0:
                wait = transfer = 0.0
                start = take
                for _, src in mb.placeholders:  # the token hop: each placeholder's token
                    start = max(start, self._tokens_at[src])
                token = start - take  # holding the call, its tokens on the hop
            else:
                transfer = sends[stage]
                if posted > take:
                    wait, start = posted - take, posted + transfer
                else:
                    wait, start = 0.0, take + transfer
            end = start + compute
            nxt = received[stage + 1] if stage < last else 0.0
            block = nxt - end if nxt > end else 0.0
            posted = free[stage] = end + block
            done = posted if posted > done else done
            received[stage] = start
            add(StageTiming(mb_id, stage, 0, wait, transfer, start, end, block,
                            token if stage == 0 else 0.0))
        self._done[mb_id] = (done + self.ret, sampled_tokens(mb_id, sampled, tuple(timings)))
        if self.token_hop:
            self._tokens_at[mb_id] = end + self.hop  # end: the last stage's
            self._tokens_at.pop(mb_id - 8 * len(costs), None)  # long past any placeholder's reach
        return mb_id

    def wait(self, handle: int) -> SampledTokens:
        end, out = self._done.pop(handle)
        self.clock.advance_to(end)
        return out

    def describe(self) -> str:
        return f"sim ({len(self.free)} stages priced by the cost model, virtual clock)"

    def shutdown(self) -> None:
        self._done.clear()
