"""Executors turn a MicroBatch into SampledTokens: local (in process), ray, torchrun, sim."""
from __future__ import annotations

from pathlib import Path

from pp_runtime.config import Config


def resolve(cfg: Config, gpus: int | None = None) -> tuple[str, str | None]:
    """(executor, device) that a run of cfg gets: the one decision `make_executor` and the
    first line `run` and `serve` print share. Executor: `runtime.executor`; auto is ray when
    tp * pp > 1, else local. Device ("cpu", "cuda", or runtime.device as given): in this
    process, CUDA when there is a GPU; a Ray started here, CUDA when this machine has a GPU
    per worker (`ray_executor.ray_device`, the rule the Ray executor applies to its
    cluster); None for the Ray cluster at runtime.ray_address, which decides once joined.
    `gpus`: this machine's GPUs (default: torch's count, torch imported only then)."""
    p, rt = cfg.parallel, cfg.runtime
    kind = rt.executor
    if kind == "auto":
        kind = "ray" if p.tp * p.pp > 1 else "local"
    if kind == "ray":
        if rt.ray_address is not None:
            return kind, None
        from pp_runtime.executors.ray_executor import ray_device
        n = gpus if gpus is not None else (0 if rt.device == "cpu" else local_gpus())
        return kind, ray_device(cfg, {"GPU": n})
    if rt.device != "auto":
        return kind, rt.device
    return kind, "cuda" if (gpus if gpus is not None else local_gpus()) >= 1 else "cpu"


TOKEN_HOP_AUTO = ("ray", "graph", "torchrun")  # where token_hop: auto is on (tp = 1): tested there
TOKEN_HOP_AUTO_TP = ("ray",)  # and at tp > 1: measured there (docs/distributed.md)


def token_hop_on(cfg: Config, path: str) -> bool:
    """`runtime.token_hop` resolved for an executor that reaches its stages by `path`:
    "ray" (a task per actor), "relay", "graph", "torchrun" or "local". Off with pp = 1
    (no hop to skip); auto: on for ray's task path at any tp, the compiled graph and
    torchrun at tp = 1 (where it is tested and measured), off elsewhere."""
    setting, p = cfg.runtime.token_hop, cfg.parallel
    if p.pp < 2:
        return False
    if setting == "auto":
        return path in (TOKEN_HOP_AUTO if p.tp == 1 else TOKEN_HOP_AUTO_TP)
    return bool(setting)


def local_gpus() -> int:
    """GPUs torch sees on this machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_executor(cfg: Config, checkpoint: str | Path | None = None, cancel=None):
    """The executor `resolve` names (runtime.executor; auto is ray when tp * pp > 1, else
    local). `cancel` (a threading.Event): setting it gives up a Ray start (StartCancelled)."""
    if checkpoint is not None:  # headers and shapes, before any worker starts
        from pp_runtime.model.loader import check_checkpoint
        check_checkpoint(checkpoint, cfg.model)
    kind, _ = resolve(cfg)
    if kind == "torchrun":
        from pp_runtime.core.errors import ConfigError
        raise ConfigError("runtime.executor: torchrun runs inside torchrun; start it with "
                          "`torchrun ... -m pp_runtime.cli.torchrun --config FILE`")
    if kind == "ray":
        from pp_runtime.executors.ray_executor import RayExecutor
        return RayExecutor(cfg, checkpoint, cancel)
    from pp_runtime.executors.local import LocalExecutor
    return LocalExecutor(cfg, checkpoint)
