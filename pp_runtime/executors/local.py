"""The in-process executor: every pipeline stage in this process, run one after another.

Hidden states pass from stage to stage in memory. It keeps the interface of the
distributed executors (`submit` a micro-batch, `wait` for its sampled tokens), so the
driver loop and the planner are the same for every deployment. With `runtime.token_hop:
true` (off under auto: here every micro-batch is computed inside `submit`, so there is no
round trip to hide) it fills placeholder decodes from the ids it sampled itself, as stage
0 does from the token hop's messages: the planning-ahead path, tested without processes.
"""
from __future__ import annotations

from pathlib import Path

from pp_runtime.core.batch import MicroBatch, SampledTokens, assemble, fill_placeholders
from pp_runtime.config import Config, ConfigError
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.executors import token_hop_on
from pp_runtime.worker.device import resolve_device
from pp_runtime.worker.stage import StageWorker


class LocalExecutor:
    name = "local"
    path = ""  # one way to reach the stages (driver.Executor)

    def __init__(self, cfg: Config, checkpoint: str | Path | None = None):
        if cfg.parallel.tp != 1:
            raise ConfigError(f"parallel.tp: the local executor runs tp=1, got tp={cfg.parallel.tp}; "
                              "tensor parallelism needs the distributed (ray) executor")
        cfg = resolve_layer_split(cfg)  # an auto split chosen here if no caller chose it
        self.device = resolve_device(cfg.runtime.device)
        self.workers = [StageWorker(cfg, s, self.device, checkpoint) for s in range(cfg.parallel.pp)]
        self._done: dict[int, SampledTokens] = {}
        self.token_hop = token_hop_on(cfg, "local")  # true only where asked for, pp > 1
        self._horizon = cfg.in_flight + 1  # micro-batches a placeholder may look back
        self._sampled: dict[int, dict[int, int]] = {}  # mb id -> request id -> token id

    def submit(self, mb: MicroBatch) -> int:
        if self.token_hop:
            mb = self._fill(mb)
        x, results = None, []
        for worker in self.workers:
            result, x = worker.execute(mb, x)
            results.append(result)
        self._done[mb.mb_id] = out = assemble(mb.mb_id, results)
        if self.token_hop:
            self._sampled[mb.mb_id] = out.tokens
        return mb.mb_id

    def _fill(self, mb: MicroBatch) -> MicroBatch:
        """Placeholders filled from the ids sampled before; this one's ids kept for later."""
        sampled = self._sampled
        mb = fill_placeholders(mb, lambda src, rid: sampled[src][rid])
        for old in [k for k in sampled if k < mb.mb_id - self._horizon]:
            del sampled[old]
        return mb

    def describe(self) -> str:
        return f"{self.device} (local: every stage in this process)"

    def wait(self, handle: int) -> SampledTokens:
        return self._done.pop(handle)

    def shutdown(self) -> None:
        self.workers = []
