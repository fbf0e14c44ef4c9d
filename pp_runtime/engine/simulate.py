"""Simulate a deployment: the real planner and driver loop, the simulated executor.

`simulate(cfg)` generates the workload of `cfg.workload`, routes each request to a
data-parallel replica (the one with the least work assigned so far, in tokens: with
all-at-once arrivals that is the least-loaded replica), runs one planner + driver loop +
`SimExecutor` per replica on its own virtual clock, and returns a `RunResult` that
`telemetry.report` writes. No torch.
"""
from __future__ import annotations

import time
from typing import Callable

from tqdm import tqdm

from pp_runtime.core import driver
from pp_runtime.costmodel import memory
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.config import Config, ConfigError
from pp_runtime.costmodel.devices import device_spec
from pp_runtime.executors.sim import SimExecutor, StageCost, VirtualClock
from pp_runtime.planner import make_planner
from pp_runtime.core.request import FinishReason, RepeatedTokens, Request, SamplingParams
from pp_runtime.telemetry.recorder import RunRecorder
from pp_runtime.telemetry.report import RunResult
from pp_runtime.core.workload import RequestSpec, generate


def route(specs: list[RequestSpec], replicas: int) -> list[list[int]]:
    """Request indices per replica: each goes to the replica with the least work assigned."""
    load, out = [0] * replicas, [[] for _ in range(replicas)]
    for i, spec in enumerate(specs):
        r = min(range(replicas), key=load.__getitem__)
        load[r] += spec.prompt_len + spec.output_len
        out[r].append(i)
    return out


def check_fits(cfg: Config, specs: list[RequestSpec]) -> None:
    longest = max(s.prompt_len + s.output_len for s in specs)
    if longest > cfg.seq_len:
        raise ConfigError(f"workload: a request of {longest} tokens exceeds the {cfg.seq_len} KV "
                          "tokens of a slot; lower workload.max_len or raise model.max_positions")


def check_memory(cfg: Config) -> None:
    """ConfigError unless every stage's weights and KV fit on one simulated GPU:
    cache.device_memory_gb if set, else hardware.gpu's memory, times memory_utilization."""
    cfg = resolve_layer_split(cfg)
    gb = cfg.cache.device_memory_gb or device_spec(cfg.hardware.gpu).mem_gb
    util = cfg.cache.memory_utilization
    memory.check_fits(cfg, gb * memory.GB * util, cfg.model.dtype_bytes,
                      f"one {cfg.hardware.gpu} ({gb:g} GB x cache.memory_utilization {util:g})")


def sim_depth(cfg: Config, cost: StageCost) -> Config:
    """cfg with `uniform`'s in-flight depth resolved for a simulated pipeline: pp + 1 hides
    the return of a result to the planner (host time), so where the cost model prices none
    (no calibration) `uniform` runs pp in flight, and a decode's round is pp micro-batches,
    not pp + 1. The fixed-B planners keep pp + 1 (their extra micro-batch adds B rows)."""
    host = getattr(cost, "host", None)
    if (cfg.planner.planner != "uniform" or cfg.planner.in_flight is not None
            or cfg.parallel.pp == 1 or host is not None):
        return cfg
    return cfg.with_overrides(in_flight=cfg.parallel.pp)


def sim_token_hop(cfg: Config, cost: StageCost) -> bool:
    """Whether the simulated pipeline runs the token hop: where the cost model carries a
    calibration of a real executor (its host costs) on which `runtime.token_hop` resolves
    on (`executors.token_hop_on`; auto: Ray's task path at any tp, the compiled graph
    and torchrun at tp = 1). Without one the simulator prices no driver round trip to
    skip (no host costs): the hop is off."""
    from pp_runtime.executors import token_hop_on

    cal = getattr(cost, "calibration", None)
    if cal is None or getattr(cost, "host", None) is None:
        return False
    path = "torchrun" if cal.executor == "torchrun" else (cal.path or "ray")
    return token_hop_on(cfg, path)


def _watched(bar: tqdm, watch: Callable, rec: RunRecorder, requests: list[Request],
             clock: VirtualClock) -> Callable[[int], None]:
    """The recorder's per-micro-batch callback with `watch` after the progress bar."""
    def on_tokens(n: int) -> None:
        bar.update(n)
        watch(rec, requests, clock())

    return on_tokens


def simulate(cfg: Config, cost: StageCost | None = None, progress: bool = True,
             watch: Callable[[RunRecorder, list[Request], float], None] | None = None,
             recorder: Callable[..., RunRecorder] = RunRecorder) -> RunResult:
    """Run cfg's workload through cfg's planner on the simulated pipeline; ConfigError first
    if the deployment does not fit in the simulated GPUs' memory or its KV slots. `watch`
    (recorder, requests, virtual now) is called after every micro-batch's tokens; what it
    raises ends the run and propagates (`pp-runtime plan` stops a probe whose SLO miss is
    already certain). `recorder`: what records each replica, called as RunRecorder is
    (`pp-runtime plan` keeps only what a probe reports). Ctrl-C
    (or SIGTERM under `interrupt.handled()`) re-raises with the partial result attached
    (`exc.result`): every request not finished by then ends with finish reason error."""
    cfg = resolve_layer_split(cfg)  # auto chosen once, before anything is priced
    check_memory(cfg)
    if cost is None:
        from pp_runtime.costmodel import build_cost_model
        cost = build_cost_model(cfg)
    cfg = sim_depth(cfg, cost)
    hop = sim_token_hop(cfg, cost)
    specs = generate(cfg.workload)
    check_fits(cfg, specs)
    # prompts of token 0 in O(1) memory each: only their lengths matter to the simulator
    requests = [Request(i, RepeatedTokens(0, s.prompt_len), SamplingParams(max_tokens=s.output_len, ignore_eos=True),
                        seed=0, arrival_s=s.arrival_s) for i, s in enumerate(specs)]
    pp, t0 = cfg.parallel.pp, time.perf_counter()
    bar = tqdm(total=sum(s.output_len for s in specs), unit="tok", disable=not progress,
               desc=f"simulate {cfg.planner.planner}", leave=False, mininterval=0.5)
    replicas, sources = [], cost.sources if hasattr(cost, "sources") else lambda: None
    try:
        for r, ids in enumerate(route(specs, cfg.parallel.dp)):
            clock = VirtualClock()
            planner = make_planner(cfg, cost)
            ahead = planner.plan_ahead(hop)  # as the engine does with the hop (online.py)
            for i in ids:
                planner.add(requests[i])
            rec = recorder(clock, replica=r, on_tokens=bar.update)
            if watch is not None:
                rec.on_tokens = _watched(bar, watch, rec, requests, clock)
            replicas.append(rec)
            driver.run(planner, SimExecutor(cost, pp, clock, token_hop=ahead),
                       cfg.in_flight + (1 if ahead else 0), clock, rec, sleep=clock.sleep)
    except KeyboardInterrupt as exc:
        from pp_runtime.core.interrupt import reason, signal_name
        for req in requests:  # of the replicas not run yet (the driver ended the current one's)
            if req.finish_reason is None:
                req.finish_reason = FinishReason.ERROR  # finish_s None: it never ran
        exc.result = RunResult(cfg, "sim", [r.output(reason(exc)) for r in requests], replicas,
                               time.perf_counter() - t0, sources(), interrupted_by=signal_name(exc))
        raise
    finally:
        bar.close()
    return RunResult(cfg, "sim", [r.output() for r in requests], replicas,
                     time.perf_counter() - t0, sources())
