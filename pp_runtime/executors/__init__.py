"""Executors turn a MicroBatch into SampledTokens: local (in process), ray, torchrun, sim."""
from __future__ import annotations

from pathlib import Path

from pp_runtime.config import Config


def make_executor(cfg: Config, checkpoint: str | Path | None = None, cancel=None):
    """The executor `runtime.executor` names; `auto` is ray when tp * pp > 1, else local.
    `cancel` (a threading.Event): setting it gives up a Ray start (StartCancelled)."""
    kind = cfg.runtime.executor
    if checkpoint is not None:  # headers and shapes, before any worker starts
        from pp_runtime.model.loader import check_checkpoint
        check_checkpoint(checkpoint, cfg.model)
    if kind == "auto":
        kind = "ray" if cfg.parallel.tp * cfg.parallel.pp > 1 else "local"
    if kind == "torchrun":
        from pp_runtime.core.errors import ConfigError
        raise ConfigError("runtime.executor: torchrun runs inside torchrun; start it with "
                          "`torchrun ... -m pp_runtime.cli.torchrun --config FILE`")
    if kind == "ray":
        from pp_runtime.executors.ray_executor import RayExecutor
        return RayExecutor(cfg, checkpoint, cancel)
    from pp_runtime.executors.local import LocalExecutor
    return LocalExecutor(cfg, checkpoint)
