"""Measured tables: reading the CSVs, picking the rows for a shape, interpolating them.

Every table is CSV in Vidur's format (times in milliseconds, `time_stats.OP.median`); this
module turns the rows that match a shape into `Curve`s of seconds by tokens (or by bytes
for network tables). The shipped tables live in `data/` (see its README); a local profile
directory written by `pp-runtime profile` has the same format (docs/costmodel.md).
"""
from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pp_runtime.costmodel.devices import DeviceSpec
from pp_runtime.costmodel.roofline import TABLE_OPS, LayerShape

DATA_DIR = Path(__file__).resolve().parent / "data"
MS = 1e-3  # seconds per millisecond
NEAR = 2.0  # a measured shape is scaled to a model whose n_embd is within this factor


@dataclass(frozen=True, eq=False)
class Curve:
    """Seconds by a size (tokens or bytes): piecewise linear between measured points, the
    first point below them, and proportional to size beyond the last. The medians are made
    monotone by their lower envelope (each point is the minimum over it and every larger
    size): a bigger batch never costs less, and an upward outlier (interference during
    the measurement) does not spread to the sizes after it."""

    xs: np.ndarray  # increasing sizes
    ys: np.ndarray  # seconds at xs, non-decreasing

    @classmethod
    def of(cls, xs, ys_ms) -> "Curve":
        order = np.argsort(xs, kind="stable")
        xs = np.asarray(xs, dtype=float)[order]
        ys = np.asarray(ys_ms, dtype=float)[order] * MS
        ys = np.minimum.accumulate(ys[::-1])[::-1]
        return cls(xs, ys)

    def __call__(self, x):
        x = np.asarray(x, dtype=float)
        inside = np.interp(x, self.xs, self.ys)
        last = max(self.xs[-1], 1.0)
        return np.where(x > self.xs[-1], self.ys[-1] * x / last, inside)


def read_table(path: Path) -> dict[str, np.ndarray]:
    """A CSV as float columns ('' -> nan, True/False -> 1/0), cached by path and mtime."""
    return _read_table(str(path), path.stat().st_mtime)


@functools.lru_cache(maxsize=32)
def _read_table(path: str, mtime: float) -> dict[str, np.ndarray]:
    conv = {"": math.nan, "True": 1.0, "False": 0.0, "true": 1.0, "false": 0.0}
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = [[conv[v] if v in conv else float(v) for v in row] for row in reader if row]
    data = np.array(rows, dtype=float).reshape(len(rows), len(header))
    return {name: data[:, i] for i, name in enumerate(header) if name}


def median(op: str) -> str:
    return f"time_stats.{op}.median"


# ---- linear and small ops (mlp.csv) -----------------------------------------------------
@dataclass(frozen=True, eq=False)
class LinearTable:
    """The per-layer ops measured for one shape on one device."""

    shape: LayerShape  # the measured shape (dtype of the measurement)
    curves: dict[str, Curve]  # op -> seconds by tokens; ops not measured are absent
    device: DeviceSpec  # where it was measured
    label: str  # e.g. "a100 profile", "profile /path/mlp.csv"


def load_linear_tables(path: Path, device: DeviceSpec, label: str,
                       dtype_bytes: int = 2) -> list[LinearTable]:
    """The table of every shape the CSV measured; read once per file version (its mtime)
    and arguments in a process: a plan builds a cost model for every layout it prices."""
    return list(_linear_tables(str(path), path.stat().st_mtime, device, label, dtype_bytes))


@functools.lru_cache(maxsize=32)
def _linear_tables(path: str, mtime: float, device: DeviceSpec, label: str,
                   dtype_bytes: int) -> tuple[LinearTable, ...]:
    t = _read_table(path, mtime)
    keys = ("n_embd", "n_head", "n_kv_head", "n_expanded_embd", "use_gated_mlp",
            "num_tensor_parallel_workers", "vocab_size")
    cols = np.stack([t[k] for k in keys], axis=1)
    tables = []
    for key in sorted({tuple(row) for row in cols.tolist()}):
        rows = np.all(cols == key, axis=1)
        e, h, kv, f, gated, tp, vocab = (int(v) for v in key)
        shape = LayerShape(e, h, kv, f, bool(gated), tp, vocab, dtype_bytes, bool(gated))
        curves = {}
        for op in TABLE_OPS:
            if median(op) in t:
                y = t[median(op)][rows]
                ok = ~np.isnan(y)
                if ok.any():
                    curves[op] = Curve.of(t["num_tokens"][rows][ok], y[ok])
        tables.append(LinearTable(shape, curves, device, label))
    return tuple(tables)


def match_linear(shape: LayerShape, tables: list[LinearTable]) -> tuple[LinearTable, bool] | None:
    """The table measured for this shape (exact: True), or the nearest one to scale from
    (False): same tp first, then the closest n_embd (larger on a tie, within a factor NEAR),
    then the same attention kind (MHA vs GQA), then the closest FFN width ratio."""
    exact = [t for t in tables if t.shape.key == shape.key]
    if exact:
        return min(exact, key=lambda t: abs(math.log(t.shape.vocab / shape.vocab))), True
    near = [t for t in tables if 1 / NEAR <= t.shape.n_embd / shape.n_embd <= NEAR]
    if not near:
        return None
    mha = shape.n_kv_head == shape.n_head
    ratio = shape.up_width * shape.tp / shape.n_embd

    def distance(t: LinearTable):
        s = t.shape
        return (s.tp != shape.tp, abs(math.log(s.n_embd / shape.n_embd)), -s.n_embd,
                (s.n_kv_head == s.n_head) != mha, abs(s.up_width * s.tp / s.n_embd - ratio))

    return min(near, key=distance), False


# ---- network ------------------------------------------------------------------------
def nembd_curve(path: Path, workers_col: str, workers: int, n_embd: int,
                slice_by_workers: bool) -> tuple[Curve, str] | None:
    """A collective measured on [num_tokens, n_embd] fp16 activations among `workers` ranks,
    as seconds by bytes (per rank: a 1/workers slice when `slice_by_workers`), from the rows
    of the closest n_embd. None when no row has this worker count."""
    t = read_table(path)
    at_w = t[workers_col] == workers if workers_col in t else np.zeros(0, bool)
    if not at_w.any():
        return None
    e = min(set(t["n_embd"][at_w].tolist()), key=lambda v: (abs(math.log(v / n_embd)), -v))
    rows = at_w & (t["n_embd"] == e)
    width = e / workers if slice_by_workers else e
    note = f"n_embd={int(e)} {workers_col}={workers}"
    if int(e) != n_embd:
        note += f", by message size for n_embd={n_embd}"
    return Curve.of(t["num_tokens"][rows] * width * 2, t[median_col(t)][rows]), note


def size_curve(path: Path, workers: int, devices_per_node: int) -> Curve | None:
    """A collective measured by message size in bytes (vidur main's network tables)."""
    t = read_table(path)
    rows = (t["num_workers"] == workers) & (t["devices_per_node"] == devices_per_node)
    if not rows.any():
        return None
    return Curve.of(t["size"][rows], t[median_col(t)][rows])


def median_col(t: dict[str, np.ndarray]) -> str:
    return next(c for c in t if c.startswith("time_stats.") and c.endswith(".median"))
