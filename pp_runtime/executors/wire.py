"""The control channel's wire format: JSON, typed by the dataclasses in `core/batch.py`.

Nothing here unpickles. pydantic writes and reads a message from the dataclasses' own type
hints (a `TypeAdapter` of the schema, so no second schema to keep in step), closed and
strict: every field present (a default is the sender's to fill in), no unknown field, ints as
JSON integers (not "3", 3.0 or true), floats either number, a `dict[int, int]` a JSON object
whose keys are integers, `X | None` either. Anything else (a pickle, a wrong type) raises
`WireError` naming the path of the bad value, on both sides: `encode` refuses a value that
does not fit the schema (numpy integers are taken as ints). No torch.
"""
from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError, SchemaSerializer, SchemaValidator

from pp_runtime.core.batch import MicroBatch, RankResult

PLAN = MicroBatch | None  # rank 0 -> every other rank; None: stop serving
RESULT = RankResult  # a rank -> rank 0 (torchrun), a TP peer -> its TP rank 0 (the relay)


class WireError(ValueError):
    """A control-channel message that is not what the receiver expects."""


def encode(value: Any, schema: Any) -> bytes:
    """`value` as JSON bytes; raises WireError if it does not fit `schema`."""
    validator, serializer = _codec(schema)
    try:  # the serializer checks each value's type as it writes it
        return serializer.to_json(value, warnings="error")
    except PydanticSerializationError:
        pass
    try:  # a list where a tuple is declared (or the reverse), or a bad value: which?
        data = serializer.to_json(value, warnings="none")
        validator.validate_json(data, strict=True)
        return data
    except ValidationError as exc:
        raise WireError(_problem(exc, "cannot send")) from None
    except PydanticSerializationError:
        raise WireError(f"message: cannot send {type(value).__name__} {value!r:.80} "
                        f"as {schema}") from None


def decode(data: bytes, schema: Any) -> Any:
    """The value of type `schema` that `data` encodes; WireError for anything else."""
    try:
        return _codec(schema)[0].validate_json(data, strict=True)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise WireError(f"not a JSON control message ({len(data)} bytes, starting "
                            f"{bytes(data[:8])!r}): {exc.errors()[0]['msg']}") from None
        raise WireError(_problem(exc, "expected")) from None


@cache
def _codec(schema: Any) -> tuple[SchemaValidator, SchemaSerializer]:
    core = _closed(TypeAdapter(schema).core_schema)
    return SchemaValidator(core), SchemaSerializer(core)


def _closed(schema: Any) -> Any:
    """pydantic's schema of the dataclasses with every field required and none unknown
    (a peer of another version fails loudly instead of being read with defaults), and
inf and nan written and read back as floats."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _closed(value) for key, value in schema.items()}
    if schema.get("type") == "dataclass-field" and schema["schema"]["type"] == "default":
        schema["schema"] = schema["schema"]["schema"]
    if schema.get("type") == "dataclass-args":
        schema["extra_behavior"] = "forbid"
    if schema.get("type") == "dataclass":  # inf and nan as JSON's usual Infinity and NaN
        schema["config"] = {**schema.get("config", {}), "ser_json_inf_nan": "constants"}
    return schema


def _path(loc: tuple) -> str:
    out = "message"
    for i, part in enumerate(loc):
        if part == "[key]":
            out += " key"
        elif isinstance(part, str) and part.isidentifier() and loc[i + 1:i + 2] != ("[key]",):
            out += f".{part}"
        else:
            out += f"[{part!r}]"
    return out


def _problem(exc: ValidationError, verb: str) -> str:
    """The first problem pydantic found, as "path: expected int, got str '3'"; a dataclass's
    missing and unknown fields together, and how many items a tuple lacks."""
    errors = exc.errors(include_url=False)
    loc, kind, ctx = errors[0]["loc"], errors[0]["type"], errors[0].get("ctx") or {}

    def last(of_kind: str) -> list:  # the fields or items of that kind beside the first
        return [e["loc"][-1] for e in errors if e["type"] == of_kind and e["loc"][:-1] == loc[:-1]]

    if kind in ("missing", "unexpected_keyword_argument") and isinstance(loc[-1], str):
        return (f"{_path(loc[:-1])}: fields do not match (unknown: "
                f"{last('unexpected_keyword_argument') or 'none'}, "
                f"missing: {last('missing') or 'none'})")
    if kind == "missing":  # a tuple too short: one error per missing item
        return f"{_path(loc[:-1])}: expected {loc[-1] + len(last('missing'))} items, got {loc[-1]}"
    if kind in ("too_long", "too_short"):
        return (f"{_path(loc)}: expected {ctx.get('max_length', '?')} items, "
                f"got {ctx.get('actual_length', '?')}")
    value = errors[0]["input"]
    if "class_name" in ctx:
        wanted = ctx["class_name"]
    elif kind.endswith(("_type", "_parsing")):
        wanted = kind.rsplit("_", 1)[0]
    else:
        wanted = errors[0]["msg"]
    if verb == "cannot send":
        return f"{_path(loc)}: cannot send {type(value).__name__} {value!r:.80} as {wanted}"
    return f"{_path(loc)}: expected {wanted}, got {type(value).__name__} {value!r:.80}"
