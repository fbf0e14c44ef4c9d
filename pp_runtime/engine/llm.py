"""The public API: `LLM(config)`, `LLM.from_pretrained(path)`, `llm.generate(...)`."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from pp_runtime.core import driver
from pp_runtime.model.checkpoint_fields import check_math_fields
from pp_runtime.config import Config, load_config
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.executors import make_executor
from pp_runtime.model.hf_config import model_config_from_hf, read_hf_config
from pp_runtime.engine.online import Engine
from pp_runtime.telemetry.report import RunResult
from pp_runtime.core.request import (FinishReason, InvalidRequestError, RequestOutput, SamplingParams,
                                check_requests, default_seed)


class LLM:
    """A model served by one planner, one driver loop and one executor.

    `config` is a `Config`, a YAML path or shipped config name, or None for the built-in
    default (GPT-2 small shapes, random weights). Keyword overrides name config fields:
    `LLM(chunk_size=64, max_batch_size=4, pp=2)`.
    """

    def __init__(self, config: Config | str | Path | None = None, *,
                 checkpoint: str | Path | None = None, executor=None, **overrides):
        if isinstance(executor, str):  # a config override (executor="local"), not an object
            overrides["executor"], executor = executor, None
        if config is None:
            config = Config()
        elif not isinstance(config, Config):
            config = load_config(config)
        config = config.with_overrides(**overrides) if overrides else config.validate()
        self.config = resolve_layer_split(config)  # auto chosen once, for every stage
        self.checkpoint = checkpoint
        if checkpoint is not None:  # a field that changes the math and is not implemented
            check_math_fields(read_hf_config(checkpoint), f"{checkpoint}/config.json")
        # an executor built by the caller (the torchrun launcher's), else the config's
        self.executor = executor if executor is not None else make_executor(self.config, checkpoint)
        self._engine: Engine | None = None  # made on first use: `engine`

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides) -> "LLM":
        """Load a Hugging Face-format checkpoint directory (GPT-2, LLaMA, Qwen2, Qwen3 or Mistral). Its
        dtype is "auto": the checkpoint's (config.json's torch_dtype) on a GPU, float32 on
        a CPU (`ModelConfig.dtype_for`); `dtype="float16"` etc. overrides."""
        model = model_config_from_hf(read_hf_config(path), name=Path(path).name,
                                     where=f"{path}/config.json")
        return cls(Config(model=model), checkpoint=path, **overrides)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_microbatch: driver.OnMicroBatch | None = None,
                 arrival_s: Sequence[float] | None = None,
                 generated: Mapping[int, Sequence[int]] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. `arrival_s`
        (non-decreasing seconds from the call) holds requests back until then; `generated`:
        by prompt index, tokens a request already produced (a run resumed from its journal):
        its output starts with them and goes on.

        Every request is checked first: if any is invalid, InvalidRequestError names each
        bad request (by index) and nothing runs. If the executor fails mid-run, every
        unfinished request ends with finish reason `error` and ExecutorFailed is raised
        with the outputs attached (`exc.outputs`).
        """
        prompts, plist, arrivals = check_requests(prompt_token_ids, params, arrival_s,
                                                  self.config.model.vocab_size, self.config.seq_len)
        check_horizon(arrivals)

        if self.executor is None:
            raise RuntimeError("this LLM was shut down (after shutdown() or a failed run)")
        engine = self.engine
        watcher = engine.watch(on_microbatch) if on_microbatch else None
        base = engine.now()  # the call's start on the engine clock; outputs count from it
        handles = []
        try:
            for i, (prompt, sp, at) in enumerate(zip(prompts, plist, arrivals)):
                seed = default_seed(self.config.runtime.seed, i)  # where sp.seed is None
                handles.append(engine.add_request(prompt, sp, seed=seed, arrival_s=base + at,
                                                  watcher=watcher,
                                                  generated=(generated or {}).get(i, ())))
            done = [h.result() for h in handles]
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM: every unfinished request ends now
            engine.abandon(str(exc) or "interrupted")
            self.shutdown()
            exc.outputs = [_from_call(h.result().output, base, at) for h, at in zip(handles, arrivals)]
            raise
        finally:
            if watcher is not None:
                engine.unwatch(watcher)
        outputs = [_from_call(f.output, base, at) for f, at in zip(done, arrivals)]
        if watcher is not None and watcher.error is not None:
            raise watcher.error  # the callback's own error; the engine stays usable
        if engine.failure is not None and any(o.finish_reason == FinishReason.ERROR
                                              for o in outputs):  # torn down: unusable
            self.shutdown()
            exc = driver.ExecutorFailed(str(engine.failure))
            exc.outputs = outputs
            raise exc from engine.failure
        return outputs

    @property
    def engine(self) -> Engine:
        """The one engine (planner + driver loop) over this LLM's executor."""
        if self._engine is None:
            sink = None
            if self.executor.name == "ray" and self.config.runtime.metrics:  # live Ray metrics
                from pp_runtime.telemetry.metrics import default_sink
                sink = default_sink()
            self._engine = Engine(self.config, self.executor, sink=sink,
                                  thread_init=torch_thread_init())
        return self._engine

    def recoveries(self, since: float) -> list[dict]:
        """Each recovery in place so far (`engine/recovery.Recovery`), `at_s` counted from
        `since` (a perf_counter reading): what a report lists."""
        engine = self._engine  # None when nothing ran
        return [dict(r.as_dict(), at_s=r.at_s - since) for r in (engine.recoveries if engine else ())]

    def shutdown(self) -> None:
        """Stop the engine (open requests end `aborted`), then release the workers (Ray
        actors, process groups, KV caches)."""
        if self._engine is not None:
            self._engine.close(timeout=10.0)
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _from_call(out: RequestOutput, base: float, arrival_s: float) -> RequestOutput:
    """An engine output with its times counted from the call's start, as given."""
    def rel(t):
        return None if t is None else t - base
    return replace(out, arrival_s=arrival_s, first_token_s=rel(out.first_token_s),
                   finish_s=rel(out.finish_s))


def torch_thread_init():
    """What the engine thread runs first: torch's CPU threads and CUDA device are per
    thread, so it takes this (the creating) thread's."""
    import torch

    threads = torch.get_num_threads()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None

    def init() -> None:
        torch.set_num_threads(threads)
        if device is not None:
            torch.cuda.set_device(device)
    return init


MAX_WAIT_S = 86_400.0  # a real run holds a request back at most a day (the simulator: any time)


def check_horizon(arrivals: Sequence[float]) -> None:
    """InvalidRequestError when a request would arrive over `MAX_WAIT_S` after the start:
    the real runtime would sit idle until then (a typo, a trace in the wrong unit)."""
    late = [(i, a) for i, a in enumerate(arrivals) if a > MAX_WAIT_S]
    if late:
        i, a = late[0]
        raise InvalidRequestError(
            f"{len(late)} of {len(arrivals)} requests rejected, none run: request {i}: "
            f"arrival_s {a:g} is over a day ({MAX_WAIT_S:g} s) after the start, which a real run "
            "would wait for; shift or rescale the arrivals, or simulate it (pp-runtime simulate)")


def workload_requests(cfg: Config) -> tuple[list, list[list[int]], list[SamplingParams]]:
    """cfg's workload as requests: its specs, random token-id prompts of their lengths
    (seeded by workload.seed) and greedy params generating exactly each output length."""
    from pp_runtime.core.workload import generate as generate_workload, workload_prompts

    specs = generate_workload(cfg.workload)
    prompts = workload_prompts(specs, cfg.model.vocab_size, cfg.workload.seed)
    params = [SamplingParams(max_tokens=s.output_len, ignore_eos=True) for s in specs]
    return specs, prompts, params


def run_workload(cfg: Config, checkpoint: str | Path | None = None,
                 on_microbatch: driver.OnMicroBatch | None = None, executor=None,
                 generated: Mapping[int, Sequence[int]] | None = None) -> RunResult:
    """cfg's workload on the real runtime (random token ids of the workload's lengths, each
    request generating exactly its output length): the counterpart of `simulate(cfg)`,
    with the same report; `run_requests` says what a failed or interrupted run returns.
    `generated`: as `LLM.generate`'s, by workload index."""
    specs, prompts, params = workload_requests(cfg)
    check_horizon([s.arrival_s for s in specs])  # before any worker starts
    llm = LLM(cfg, checkpoint=checkpoint, executor=executor)
    try:
        return run_requests(llm, prompts, params, [s.arrival_s for s in specs], on_microbatch,
                            generated)
    finally:
        llm.shutdown()


def run_requests(llm: LLM, prompts, params, arrival_s: Sequence[float] | None = None,
                 on_microbatch: driver.OnMicroBatch | None = None,
                 generated: Mapping[int, Sequence[int]] | None = None) -> RunResult:
    """The requests through `llm`, recorded, as the run's result (the one home of the
    partial-result rule): a run whose executor failed still returns its result, with its
    unfinished requests in error, `interrupted_by` "worker failure" and the error as
    `failure`; an interrupted one (Ctrl-C, SIGTERM) re-raises with its partial result
    attached (`exc.result`). The config reported holds the layer split that ran."""
    from pp_runtime.core.interrupt import signal_name
    from pp_runtime.telemetry.recorder import RunRecorder

    rec = RunRecorder(time.perf_counter)

    def record(mb, out):
        rec(mb, out)
        if on_microbatch:
            on_microbatch(mb, out)

    name, device, t0 = llm.executor.name, str(llm.executor.device), time.perf_counter()
    ran = getattr(llm.executor, "layer_split", None)  # what the workers hold (Ray reports it)
    cfg = (llm.config.with_overrides(layer_split=list(ran)) if ran
           else llm.config.with_layer_split_resolved())
    failure = None
    try:
        outputs = llm.generate(prompts, params, record, arrival_s, generated)
    except driver.ExecutorFailed as exc:
        outputs, failure = exc.outputs, exc
    except KeyboardInterrupt as exc:  # the caller writes the partial report
        if hasattr(exc, "outputs"):
            exc.result = RunResult(cfg, name, exc.outputs, [rec], time.perf_counter() - t0,
                                   device=device, interrupted_by=signal_name(exc),
                                   recoveries=llm.recoveries(since=t0))
        raise
    return RunResult(cfg, name, outputs, [rec], time.perf_counter() - t0, device=device,
                     interrupted_by="worker failure" if failure else None,
                     recoveries=llm.recoveries(since=t0), failure=failure)
