"""Which source prices each operation, in this order (the first that covers it wins):

1. a local profile (`hardware.profile`, written by `pp-runtime profile`): exact shape only;
2. the shipped tables of the device (`data/`): the exact shape, else the nearest measured
   shape (or device) scaled by the ratio of the two roofline times at the same token count;
3. the roofline of the device (the local profile's device when one is given).

The result, `Pricing`, holds one vectorised function per operation; `model.py` turns them
into per-token-count tables for the hot path.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pp_runtime.core.dtypes import DTYPES
from pp_runtime.costmodel.attention import AttentionFit, fit_attention
from pp_runtime.costmodel.devices import DEVICES, DeviceSpec, spec_for_profile
from pp_runtime.costmodel.profiles import (DATA_DIR, Curve, LinearTable, load_linear_tables,
                                           match_linear)
from pp_runtime.costmodel.roofline import (LayerShape, decode_attention_time, op_time,
                                           prefill_attention_time)
from pp_runtime.core.errors import ConfigError

# cost-model operation -> vidur table ops it is made of (per layer)
LAYER_OPS = {
    "qkv_proj": ("attn_pre_proj",),
    "out_proj": ("attn_post_proj",),
    "ffn_up": ("mlp_up_proj",),  # gated: gate + up fused, 2 x ffn wide
    "ffn_act": ("mlp_act",),
    "ffn_down": ("mlp_down_proj",),
    "other": ("input_layernorm", "post_attention_layernorm", "add", "add", "attn_rope"),
}
PROFILE_FILES = ("mlp.csv", "attention.csv", "send_recv.csv", "all_reduce.csv")
TABLE_DEVICE = {"a100": "a100-80gb", "h100": "h100"}  # shipped table set -> measured on


@dataclass(frozen=True, eq=False)
class Priced:
    fn: Callable[[Any], Any]  # size (tokens or rows; int or numpy array) -> seconds
    source: str  # which source priced it, human readable

    def __call__(self, x):
        return self.fn(x)


@dataclass(frozen=True, eq=False)
class AttentionPricing:
    prefill: Callable[[int, int], float]  # (start, n) -> seconds per layer
    decode: Callable[[int, int], float]  # (count, sum of KV lengths) -> seconds per layer
    source: str


@dataclass(frozen=True, eq=False)
class Pricing:
    layer: dict[str, Priced]  # LAYER_OPS + "tp_all_reduce": seconds per layer by tokens
    embedding: Priced  # first stage, by tokens
    lm_head: Priced  # last stage: final norm + LM head, by sampling rows
    attention: AttentionPricing
    send_inter: Priced  # one micro-batch's activations across nodes, by tokens
    send_intra: Priced  # inside a node, by tokens
    gather: Priced | None  # the receiver's all-gather of the tp slices (None at tp = 1)


@dataclass(frozen=True)
class Profile:
    path: Path  # directory written by `pp-runtime profile`
    device: DeviceSpec  # what it was measured on (from device.json)
    dtype_bytes: int  # dtype of the measurement

    def file(self, name: str) -> Path | None:
        p = self.path / name
        return p if p.is_file() else None


@dataclass(frozen=True)
class Target:
    shape: LayerShape  # the model, one TP rank
    device: DeviceSpec  # roofline device: the profile's when one is given
    profile: Profile | None  # hardware.profile
    gpus_per_node: int  # hardware.gpus_per_node


def load_profile(directory: str, fallback: DeviceSpec) -> Profile:
    path = Path(directory).expanduser()
    fix = ("run `pp-runtime profile` to write one, or unset hardware.profile for the "
           "shipped profiles")
    if not path.is_dir():
        raise ConfigError(f"hardware.profile: {directory!r} is not a directory; {fix}")
    if not any((path / f).is_file() for f in PROFILE_FILES):
        raise ConfigError(f"hardware.profile: {path} has none of {', '.join(PROFILE_FILES)}; {fix}")
    info: dict = {}
    if (path / "device.json").is_file():
        try:
            info = json.loads((path / "device.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"hardware.profile: {path}/device.json is not JSON: {exc}") from exc
    dev = spec_for_profile(str(info.get("device", "cuda")), str(info.get("name", "")), fallback)
    dtype = DTYPES.get(str(info.get("dtype", "float16")).replace("torch.", ""), 2)
    return Profile(path, dev, dtype)


def no_rows(f: Path, what: str) -> ConfigError:
    return ConfigError(f"hardware.profile: {f} has no rows for this model's shape ({what}); "
                       "measure them with `pp-runtime profile` for this config, or unset "
                       "hardware.profile")


# ---- layer ops ------------------------------------------------------------------------
def linear_sources(t: Target) -> list[LinearTable]:
    """Tables that may price the layer ops, best first (a profile's must match exactly)."""
    out = []
    if t.profile and (f := t.profile.file("mlp.csv")):
        tables = load_linear_tables(f, t.profile.device, f"profile {f}", t.profile.dtype_bytes)
        found = match_linear(t.shape, tables)
        if found is None or not found[1]:
            raise no_rows(f, t.shape.describe())
        out.append(found[0])
    if t.device.tables:
        dev = DEVICES[TABLE_DEVICE[t.device.tables]]
        tables = load_linear_tables(DATA_DIR / f"{t.device.tables}_mlp.csv", dev,
                                    f"profile {t.device.tables}")
        found = match_linear(t.shape, tables)
        if found:
            out.append(found[0])
    return out


def table_op(op: str, src: LinearTable, t: Target) -> Priced | None:
    """One op from a table; scaled by the roofline ratio when shape or device differ."""
    curve = src.curves.get(op)
    if curve is None:
        return None
    source = f"{src.label} {src.shape.describe()}"
    same_shape = src.shape.key == t.shape.key and src.shape.dtype_bytes == t.shape.dtype_bytes
    if same_shape and src.device == t.device:
        return Priced(curve, source)
    if not same_shape:
        source += f", scaled to {t.shape.describe()} by roofline ratio"
    if src.device != t.device:
        source += f", scaled {src.device.name} -> {t.device.name} by roofline ratio"

    def scaled(n, curve: Curve = curve):
        m = np.maximum(n, 1)  # the ratio at 0 tokens is 0 / 0
        ratio = op_time(op, t.shape, m, t.device) / op_time(op, src.shape, m, src.device)
        return curve(n) * ratio

    return Priced(scaled, source)


def price_op(op: str, t: Target, sources: list[LinearTable]) -> Priced:
    for src in sources:
        if (p := table_op(op, src, t)) is not None:
            return p
    return Priced(lambda n: op_time(op, t.shape, n, t.device), f"roofline {t.device.name}")


def combined(parts: list[Priced]) -> Priced:
    names = list(dict.fromkeys(p.source for p in parts))
    return Priced(lambda n: sum(p(n) for p in parts), " + ".join(names))


def layer_ops(t: Target, sources: list[LinearTable]) -> dict[str, Priced]:
    out = {}
    for name, ops in LAYER_OPS.items():
        ops = tuple(op for op in ops if op != "attn_rope" or t.shape.rope)
        out[name] = combined([price_op(op, t, sources) for op in ops])
    return out


# ---- attention ----------------------------------------------------------------------
def attention(t: Target) -> AttentionPricing:
    s, dev = t.shape, t.device
    if t.profile and (f := t.profile.file("attention.csv")):
        fit = fit_attention(f, s, f"profile {f}", exact=True)
        if fit is None:
            raise no_rows(f, f"n_embd={s.n_embd} heads={s.n_head}/{s.n_kv_head} tp={s.tp}")
        src_dtype = t.profile.dtype_bytes
        fit = fit.scaled(dev.flops(src_dtype) / dev.flops(s.dtype_bytes), s.dtype_bytes / src_dtype)
        return AttentionPricing(fit.prefill_time, fit.decode_time, fit.label)
    fit = fit_attention(DATA_DIR / "a100_attention.csv", s, "profile a100 attention",
                        exact=False) if dev.tables else None
    if fit is not None:
        return carried(fit, t)
    return AttentionPricing(
        lambda start, n: prefill_attention_time(s, start, n, dev),
        lambda count, sum_kv: decode_attention_time(s, count, sum_kv, dev) if count else 0.0,
        f"roofline {dev.name}")


def carried(fit: AttentionFit, t: Target) -> AttentionPricing:
    """The shipped A100 fit carried to this model (width ratios) and device (peak ratios)."""
    s, dev, a100 = t.shape, t.device, DEVICES["a100-80gb"]
    pre = s.q_width / fit.q_width * a100.flops(2) / dev.flops(s.dtype_bytes)
    dec = s.kv_width / fit.kv_width * s.dtype_bytes / 2 * a100.mem_bandwidth / dev.mem_bandwidth
    fit = fit.scaled(pre, dec)
    source = (f"{fit.label}, scaled to {s.n_head // s.tp} query / {s.n_kv_head // s.tp} KV "
              f"heads per rank by width ratio")
    if dev != a100:
        source += f", a100-80gb -> {dev.name} by peak FLOP/s (prefill) and bandwidth (decode)"
    return AttentionPricing(fit.prefill_time, fit.decode_time, source)
