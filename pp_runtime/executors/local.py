"""The in-process executor: every pipeline stage in this process, run one after another.

Hidden states pass from stage to stage in memory. It keeps the interface of the
distributed executors (`submit` a micro-batch, `wait` for its sampled tokens), so the
driver loop and the planner are the same for every deployment.
"""
from __future__ import annotations

from pathlib import Path

from pp_runtime.core.batch import MicroBatch, SampledTokens, assemble
from pp_runtime.config import Config, ConfigError
from pp_runtime.worker.device import resolve_device
from pp_runtime.worker.stage import StageWorker


class LocalExecutor:
    name = "local"
    path = ""  # one way to reach the stages (driver.Executor)

    def __init__(self, cfg: Config, checkpoint: str | Path | None = None):
        if cfg.parallel.tp != 1:
            raise ConfigError(f"parallel.tp: the local executor runs tp=1, got tp={cfg.parallel.tp}; "
                              "tensor parallelism needs the distributed (ray) executor")
        self.device = resolve_device(cfg.runtime.device)
        self.workers = [StageWorker(cfg, s, self.device, checkpoint) for s in range(cfg.parallel.pp)]
        self._done: dict[int, SampledTokens] = {}

    def submit(self, mb: MicroBatch) -> int:
        x, results = None, []
        for worker in self.workers:
            result, x = worker.execute(mb, x)
            results.append(result)
        self._done[mb.mb_id] = assemble(mb.mb_id, results)
        return mb.mb_id

    def describe(self) -> str:
        return f"{self.device} (local: every stage in this process)"

    def wait(self, handle: int) -> SampledTokens:
        return self._done.pop(handle)

    def shutdown(self) -> None:
        self.workers = []
