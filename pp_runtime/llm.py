"""The public API: `LLM(config)`, `LLM.from_pretrained(path)`, `llm.generate(...)`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from pp_runtime import driver
from pp_runtime.config import Config, load_config
from pp_runtime.executors import make_executor
from pp_runtime.model.loader import model_config_from_hf, read_hf_config
from pp_runtime.planner import make_planner
from pp_runtime.telemetry.report import RunResult
from pp_runtime.request import (InvalidRequestError, Request, RequestOutput, SamplingParams,
                                check_prompt)


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
        self.config = config.with_overrides(**overrides) if overrides else config.validate()
        self.checkpoint = checkpoint
        # an executor built by the caller (the torchrun launcher's), else the config's
        self.executor = executor if executor is not None else make_executor(self.config, checkpoint)
        self._next_id = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides) -> "LLM":
        """Load a Hugging Face-format checkpoint directory (GPT-2 or LLaMA family). Its
        dtype is "auto": the checkpoint's (config.json's torch_dtype) on a GPU, float32 on
        a CPU (`ModelConfig.dtype_for`); `dtype="float16"` etc. overrides."""
        model = model_config_from_hf(read_hf_config(path), name=Path(path).name)
        return cls(Config(model=model), checkpoint=path, **overrides)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_microbatch: driver.OnMicroBatch | None = None,
                 arrival_s: Sequence[float] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. `arrival_s`
        (non-decreasing seconds from the call) holds requests back until then.

        Every request is checked first: if any is invalid, InvalidRequestError names each
        bad request (by index) and nothing runs. If the executor fails mid-run, every
        unfinished request ends with finish reason `error` and ExecutorFailed is raised
        with the outputs attached (`exc.outputs`).
        """
        prompts = [list(p) if isinstance(p, (list, tuple)) else p for p in prompt_token_ids]
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        arrivals = [0.0] * len(prompts) if arrival_s is None else [float(a) for a in arrival_s]
        if len(arrivals) != len(prompts) or any(b < a for a, b in zip(arrivals, arrivals[1:])):
            raise InvalidRequestError("arrival_s needs one non-decreasing time per prompt")
        m = self.config.model
        problems = [f"request {i}: {'; '.join(errs)}" for i, (p, sp) in enumerate(zip(prompts, plist))
                    if (errs := check_prompt(p, sp, m.vocab_size, self.config.seq_len))]
        if problems:
            raise InvalidRequestError(f"{len(problems)} of {len(prompts)} requests rejected, "
                                      "none run:\n  " + "\n  ".join(problems))

        planner = make_planner(self.config)
        start = time.perf_counter()
        clock = lambda: time.perf_counter() - start  # noqa: E731  seconds since the call began
        requests = []
        for i, (prompt, sp) in enumerate(zip(prompts, plist)):
            seed = sp.seed if sp.seed is not None else self.config.runtime.seed * 1_000_003 + i
            req = Request(self._next_id, prompt, sp, seed, arrival_s=arrivals[i])
            self._next_id += 1
            requests.append(req)
            planner.add(req)
        self.run_requests(requests, planner, clock, on_microbatch)
        return [r.output() for r in requests]

    def run_requests(self, requests: list[Request], planner, clock,
                     on_microbatch: driver.OnMicroBatch | None = None) -> None:
        """Run requests already added to `planner` to the end. On an executor failure the
        executor is torn down (this LLM cannot run again), every unfinished request ends
        with finish reason error, and ExecutorFailed carries the outputs (`exc.outputs`)."""
        if self.executor is None:
            raise RuntimeError("this LLM was shut down (after shutdown() or a failed run)")
        executor = self.executor
        if executor.name == "ray" and self.config.runtime.metrics:  # live Ray metrics
            executor, on_microbatch = self._with_metrics(requests, planner, clock, on_microbatch)
        try:
            driver.run(planner, executor, self.config.parallel.pp, clock, on_microbatch)
        except driver.ExecutorFailed as exc:
            self.shutdown()
            exc.outputs = [r.output(str(exc)) for r in requests]
            raise

    def _with_metrics(self, requests: list[Request], planner, clock, on_microbatch):
        """The executor and callback of a run that records a `RuntimeMetrics` (monitoring.md)."""
        from itertools import takewhile

        from pp_runtime.telemetry.metrics import RuntimeMetrics

        def queue_depth() -> int:  # arrived, waiting for a KV slot (planner.waiting is FCFS)
            now = clock()
            return sum(1 for _ in takewhile(lambda r: r.arrival_s <= now, planner.waiting))

        metrics = RuntimeMetrics.for_config(self.config, {r.request_id: r for r in requests},
                                            clock, queue_depth)
        return metrics.watch(self.executor), metrics.chain(on_microbatch)

    def shutdown(self) -> None:
        """Release the workers (Ray actors, process groups, KV caches)."""
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()



def run_workload(cfg: Config, checkpoint: str | Path | None = None,
                 on_microbatch: driver.OnMicroBatch | None = None, executor=None) -> RunResult:
    """cfg's workload on the real runtime (random token ids of the workload's lengths, each
    request generating exactly its output length): the counterpart of `simulate(cfg)`,
    with the same report. A failed run still returns its result, with error requests."""
    import random

    from pp_runtime.telemetry.recorder import RunRecorder
    from pp_runtime.workload import generate as generate_workload

    specs = generate_workload(cfg.workload)
    rng = random.Random(cfg.workload.seed)
    prompts = [[rng.randrange(cfg.model.vocab_size) for _ in range(s.prompt_len)] for s in specs]
    params = [SamplingParams(max_tokens=s.output_len, ignore_eos=True) for s in specs]
    rec = RunRecorder(time.perf_counter)

    def record(mb, out):
        rec(mb, out)
        if on_microbatch:
            on_microbatch(mb, out)

    llm = LLM(cfg, checkpoint=checkpoint, executor=executor)
    name, device, t0 = llm.executor.name, str(llm.executor.device), time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, record, [s.arrival_s for s in specs])
    except driver.ExecutorFailed as exc:
        outputs = exc.outputs
    finally:
        llm.shutdown()
    return RunResult(cfg, name, outputs, [rec], time.perf_counter() - t0, device=device)
