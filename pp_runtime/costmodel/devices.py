"""Spec sheets of the devices the cost model prices: peak FLOP/s, memory bandwidth, links.

The roofline (`roofline.py`) prices an operation from these numbers alone; the measured
tables (`profiles.py`) say which device they were measured on, and a table measured on one
device is carried to another by the ratio of the two devices' roofline times.
"""
from __future__ import annotations

from dataclasses import dataclass

from pp_runtime.core.errors import ConfigError


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s in one direction, per GPU
    latency: float  # seconds per message (launch + wire)


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # label used in sources(), e.g. "a100-80gb"
    peak_flops: float  # dense fp16/bf16 tensor-core FLOP/s
    peak_flops_fp32: float  # dense fp32 FLOP/s (no TF32): prices float32 models
    mem_bandwidth: float  # HBM (or DRAM) bytes/s
    mem_gb: float  # device memory in GB
    nvlink: Link  # between GPUs of one node
    network: Link  # between nodes, per GPU (InfiniBand)
    tile: int = 128  # matmul rows are rounded up to a multiple of this (tile quantization)
    tables: str | None = None  # shipped measured tables to use ("a100", "h100"), None = none

    def flops(self, dtype_bytes: int) -> float:
        """Peak FLOP/s for a dtype of this many bytes."""
        return self.peak_flops_fp32 if dtype_bytes >= 4 else self.peak_flops


NVLINK3 = Link(bandwidth=300e9, latency=10e-6)  # A100: 12 links x 25 GB/s per direction
NVLINK4 = Link(bandwidth=450e9, latency=8e-6)  # H100/H200: 18 links x 25 GB/s per direction
HDR_IB = Link(bandwidth=200e9 / 8, latency=20e-6)  # DGX A100: one 200 Gb/s HDR NIC per GPU
NDR_IB = Link(bandwidth=400e9 / 8, latency=15e-6)  # DGX H100: one 400 Gb/s NDR NIC per GPU
LOOPBACK = Link(bandwidth=3e9, latency=50e-6)  # gloo between processes of one CPU host

DEVICES: dict[str, DeviceSpec] = {
    "a100-80gb": DeviceSpec("a100-80gb", 312e12, 19.5e12, 2.039e12, 80, NVLINK3, HDR_IB,
                            tables="a100"),
    "h100": DeviceSpec("h100", 989e12, 67e12, 3.35e12, 80, NVLINK4, NDR_IB, tables="h100"),
    # no H200 tables exist: the H100 tables are carried over by the roofline ratio
    "h200": DeviceSpec("h200", 989e12, 67e12, 4.8e12, 141, NVLINK4, NDR_IB, tables="h100"),
    # a rough CPU (a few AVX2 cores): only a fallback for ops a local profile lacks
    "cpu": DeviceSpec("cpu", 1.5e10, 1e11, 2e10, 16, LOOPBACK, LOOPBACK, tile=1),
}
ALIASES = {"a100": "a100-80gb", "a100-sxm": "a100-80gb", "h100-sxm": "h100"}


def device_spec(name: str, field_name: str = "hardware.gpu") -> DeviceSpec:
    """The spec of a device by name (case-insensitive), or ConfigError naming the field."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise ConfigError(f"{field_name}: unknown device {name!r}; use one of "
                          f"{', '.join(d for d in DEVICES if d != 'cpu')}")
    return DEVICES[key]


def spec_for_profile(device: str, name: str, fallback: DeviceSpec) -> DeviceSpec:
    """The device a local profile was measured on, from its device.json ("cpu" or "cuda"
    plus the device's name, e.g. "NVIDIA H100 80GB HBM3"); `fallback` for an unknown GPU."""
    if device == "cpu":
        return DEVICES["cpu"]
    upper = name.upper()
    for marker, key in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb")):
        if marker in upper:
            return DEVICES[key]
    return fallback
