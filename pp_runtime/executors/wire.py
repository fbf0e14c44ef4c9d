"""The control channel's wire format: plain JSON, typed by the dataclasses in `core/batch.py`.

Nothing here unpickles. A message is JSON text; `decode(data, schema)` rebuilds the one
type the receiver expects, walking the type hints of the dataclasses themselves (no second
schema to keep in step): a dataclass is an object with exactly its field names, a
`tuple[X, ...]` or `list[X]` a list, a `dict[int, int]` a list of [key, value] pairs (JSON object keys
are strings), `X | None` either. Ints must be JSON integers (not booleans), floats may be
either number. Anything else (a pickle, unknown or missing fields, a wrong type) raises
`WireError` naming the path of the bad value. No torch.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import operator
import types
import typing
from functools import cache
from typing import Any

from pp_runtime.core.batch import MicroBatch, StageTiming

PLAN = MicroBatch | None  # rank 0 -> every other rank; None: stop serving
RESULT = tuple[dict[int, int] | None, StageTiming]  # a rank -> rank 0: (token ids, timing)


class WireError(ValueError):
    """A control-channel message that is not what the receiver expects."""


def encode(value: Any, schema: Any) -> bytes:
    """`value` as JSON bytes; raises WireError if it does not fit `schema`."""
    return json.dumps(_to_json(value, schema, "message"), separators=(",", ":"),
                      allow_nan=False).encode()


def decode(data: bytes, schema: Any) -> Any:
    """The value of type `schema` that `data` encodes; WireError for anything else."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"not a JSON control message ({len(data)} bytes, starting "
                        f"{bytes(data[:8])!r}): {exc}") from None
    return _from_json(raw, schema, "message")


@cache
def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _union_args(schema: Any) -> tuple | None:
    if typing.get_origin(schema) in (typing.Union, types.UnionType):
        return typing.get_args(schema)
    return None


def _to_json(value: Any, schema: Any, path: str) -> Any:
    if (options := _union_args(schema)) is not None:
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _to_json(value, inner, path)
    if schema is bool and isinstance(value, bool):
        return value
    if schema is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return operator.index(value)
    if schema is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if dataclasses.is_dataclass(schema) and isinstance(value, schema):
        return {name: _to_json(getattr(value, name), hint, f"{path}.{name}")
                for name, hint in _hints(schema)}
    origin, args = typing.get_origin(schema), typing.get_args(schema)
    if origin is list and isinstance(value, (tuple, list)):
        return [_to_json(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple and isinstance(value, (tuple, list)):
        items = _tuple_items(args, len(value), path)
        return [_to_json(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, items))]
    if origin is dict and isinstance(value, dict):
        kt, vt = args
        return [[_to_json(k, kt, f"{path} key"), _to_json(v, vt, f"{path}[{k!r}]")]
                for k, v in value.items()]
    raise WireError(f"{path}: cannot send {type(value).__name__} {value!r:.80} as {_name(schema)}")


def _from_json(raw: Any, schema: Any, path: str) -> Any:
    if (options := _union_args(schema)) is not None:
        if raw is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _from_json(raw, inner, path)
    if schema is bool and isinstance(raw, bool):
        return raw
    if schema is int and type(raw) is int:
        return raw
    if schema is float and type(raw) in (int, float):
        return float(raw)
    if dataclasses.is_dataclass(schema) and isinstance(raw, dict):
        hints = _hints(schema)
        names = {name for name, _ in hints}
        if set(raw) != names:
            extra, missing = sorted(set(raw) - names), sorted(names - set(raw))
            raise WireError(f"{path}: {schema.__name__} fields do not match "
                            f"(unknown: {extra or 'none'}, missing: {missing or 'none'})")
        return schema(**{name: _from_json(raw[name], hint, f"{path}.{name}")
                         for name, hint in hints})
    origin, args = typing.get_origin(schema), typing.get_args(schema)
    if origin is list and isinstance(raw, list):
        return [_from_json(v, args[0], f"{path}[{i}]") for i, v in enumerate(raw)]
    if origin is tuple and isinstance(raw, list):
        items = _tuple_items(args, len(raw), path)
        return tuple(_from_json(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(raw, items)))
    if origin is dict and isinstance(raw, list):
        kt, vt = args
        out = {}
        for i, pair in enumerate(raw):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise WireError(f"{path}[{i}]: expected a [key, value] pair, got {pair!r:.80}")
            key = _from_json(pair[0], kt, f"{path}[{i}] key")
            out[key] = _from_json(pair[1], vt, f"{path}[{key!r}]")
        return out
    raise WireError(f"{path}: expected {_name(schema)}, got {type(raw).__name__} {raw!r:.80}")


def _tuple_items(args: tuple, n: int, path: str) -> list:
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
        return [args[0]] * n
    if len(args) != n:
        raise WireError(f"{path}: expected {len(args)} items, got {n}")
    return list(args)


def _name(schema: Any) -> str:
    return getattr(schema, "__name__", None) if isinstance(schema, type) else str(schema)
