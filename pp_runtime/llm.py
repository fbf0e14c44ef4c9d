"""The public API: `LLM(config)`, `LLM.from_pretrained(path)`, `llm.generate(...)`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from pp_runtime import driver
from pp_runtime.config import Config, load_config
from pp_runtime.executors.local import LocalExecutor
from pp_runtime.model.loader import model_config_from_hf, read_hf_config
from pp_runtime.planner import make_planner
from pp_runtime.request import (InvalidRequestError, Request, RequestOutput, SamplingParams,
                                check_prompt)


class LLM:
    """A model served by one planner, one driver loop and one executor.

    `config` is a `Config`, a YAML path or shipped config name, or None for the built-in
    default (GPT-2 small shapes, random weights). Keyword overrides name config fields:
    `LLM(chunk_size=64, max_batch_size=4, pp=2)`.
    """

    def __init__(self, config: Config | str | Path | None = None, *,
                 checkpoint: str | Path | None = None, **overrides):
        if config is None:
            config = Config()
        elif not isinstance(config, Config):
            config = load_config(config)
        self.config = config.with_overrides(**overrides) if overrides else config.validate()
        self.checkpoint = checkpoint
        self.executor = LocalExecutor(self.config, checkpoint)
        self._next_id = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides) -> "LLM":
        """Load a Hugging Face-format checkpoint directory (GPT-2 or LLaMA family)."""
        model = model_config_from_hf(read_hf_config(path), name=Path(path).name)
        return cls(Config(model=model), checkpoint=path, **overrides)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_microbatch: driver.OnMicroBatch | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

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
            req = Request(self._next_id, prompt, sp, seed, arrival_s=0.0)
            self._next_id += 1
            requests.append(req)
            planner.add(req)
        try:
            driver.run(planner, self.executor, self.config.parallel.pp, clock, on_microbatch)
        except driver.ExecutorFailed as exc:
            exc.outputs = [_output(r, str(exc)) for r in requests]
            raise
        return [_output(r) for r in requests]

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _output(req: Request, error: str | None = None) -> RequestOutput:
    return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                         req.finish_reason, req.arrival_s, req.first_token_s, req.finish_s,
                         error if req.finish_reason == "error" else None)
