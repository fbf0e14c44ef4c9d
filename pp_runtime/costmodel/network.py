"""Network operations: the TP all-reduce inside a stage, the stage-to-stage send of one
TP rank's 1/tp slice of the activations, and the receiver's all-gather of the slices.

Sources in order: a local profile's `all_reduce.csv` / `send_recv.csv`, the shipped tables
(A100: by n_embd and tokens; H100, also used for H200 whose NVLink and InfiniBand are the
same: by message size), then the roofline of the links (latency + bytes / bandwidth; a ring
all-reduce moves 2 (tp - 1) / tp of the message, an all-gather (tp - 1) / tp).
"""
from __future__ import annotations

import numpy as np

from pp_runtime.costmodel.devices import Link
from pp_runtime.costmodel.pricing import TABLE_DEVICE, Priced, Target
from pp_runtime.costmodel.profiles import DATA_DIR, Curve, nembd_curve, size_curve

SHIPPED = {  # table set -> operation -> file in data/
    "a100": {"all_reduce": "a100_all_reduce.csv", "inter": "a100_send_recv_inter_node.csv",
             "intra": "a100_send_recv_intra_node.csv"},
    "h100": {"all_reduce": "h100_all_reduce.csv", "inter": "h100_send_recv.csv",
             "intra": "h100_send_recv.csv"},
}


def by_bytes(curve: Curve, bytes_per_token: float, source: str) -> Priced:
    return Priced(lambda n: curve(np.asarray(n, dtype=float) * bytes_per_token), source)


def over_link(link: Link, share: float, bytes_per_token: float, source: str) -> Priced:
    return Priced(lambda n: link.latency + share * np.asarray(n, dtype=float) * bytes_per_token
                  / link.bandwidth, source)


def shipped(t: Target, op: str) -> tuple[Curve, str] | None:
    """A shipped network table for op ("all_reduce", "inter", "intra") as seconds by bytes."""
    s, tables = t.shape, t.device.tables
    if not tables:
        return None
    path = DATA_DIR / SHIPPED[tables][op]
    label = f"profile {tables} {path.stem}"
    if TABLE_DEVICE[tables] != t.device.name:
        label += f" (measured on {TABLE_DEVICE[tables]}, same links as {t.device.name})"
    if tables == "a100":
        col = "num_workers" if op == "all_reduce" else "num_tensor_parallel_workers"
        found = nembd_curve(path, col, s.tp, s.n_embd, slice_by_workers=op != "all_reduce")
        return (found[0], f"{label} {found[1]}") if found else None
    workers, per_node = (s.tp, s.tp) if op == "all_reduce" else (2, 1 if op == "inter" else 2)
    curve = size_curve(path, workers, per_node)
    return (curve, f"{label} num_workers={workers} by message size") if curve else None


def all_reduce(t: Target) -> tuple[Priced, bool] | None:
    """One all-reduce of [tokens, hidden] among a stage's tp ranks, and whether it was
    measured (None at tp = 1)."""
    s = t.shape
    if s.tp == 1:
        return None
    per_token = s.n_embd * s.dtype_bytes
    inside = s.tp <= t.gpus_per_node
    if t.profile and (f := t.profile.file("all_reduce.csv")):
        if found := nembd_curve(f, "num_workers", s.tp, s.n_embd, slice_by_workers=False):
            return by_bytes(found[0], per_token, f"profile {f} {found[1]}"), True
    if inside and (found := shipped(t, "all_reduce")):
        return by_bytes(found[0], per_token, found[1]), True
    link, name = (t.device.nvlink, "NVLink") if inside else (t.device.network, "InfiniBand")
    return over_link(link, 2 * (s.tp - 1) / s.tp, per_token,
                     f"roofline {t.device.name} ring all-reduce over {name}"), False


def send(t: Target, inter_node: bool) -> Priced:
    """One TP rank's 1/tp slice of [tokens, hidden] to the same rank of the next stage
    (all ranks send at once, each on its own link)."""
    s = t.shape
    per_token = s.n_embd / s.tp * s.dtype_bytes
    if t.profile and (f := t.profile.file("send_recv.csv")):
        found = nembd_curve(f, "num_tensor_parallel_workers", s.tp, s.n_embd, slice_by_workers=True)
        if found:
            return by_bytes(found[0], per_token, f"profile {f} {found[1]}")
    if found := shipped(t, "inter" if inter_node else "intra"):
        return by_bytes(found[0], per_token, found[1])
    link, name = (t.device.network, "InfiniBand") if inter_node else (t.device.nvlink, "NVLink")
    return over_link(link, 1.0, per_token, f"roofline {t.device.name} {name}")


def gather(t: Target, ar: tuple[Priced, bool] | None) -> Priced | None:
    """The receiving stage all-gathers the tp slices inside its node (None at tp = 1):
    half a measured all-reduce of the full tensor (a ring all-reduce is a reduce-scatter
    plus an all-gather of the same bytes), else the NVLink roofline."""
    s = t.shape
    if s.tp == 1 or ar is None:
        return None
    if ar[1]:
        return Priced(lambda n: 0.5 * ar[0](n), f"half of {ar[0].source}")
    return over_link(t.device.nvlink, (s.tp - 1) / s.tp, s.n_embd * s.dtype_bytes,
                     f"roofline {t.device.name} all-gather over NVLink")
