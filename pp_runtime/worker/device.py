"""Device and backend chosen at run time: CUDA + NCCL when there is a GPU, else CPU + gloo."""
from __future__ import annotations

import time

import torch

from pp_runtime.core.errors import ConfigError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device: {name!r} asked for, but CUDA is not available; "
                           "use device: auto or cpu")
    return device


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def now(device: torch.device) -> float:
    """Wall-clock seconds after the device has finished its queued work (a device-wide
    synchronize on CUDA): for host-side round trips such as the profiler's send/recv
    ping-pong (`profile/p2p.py`). Stage work is timed with `telemetry/timer.py`
    (CUDA events, no synchronize per operation)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
