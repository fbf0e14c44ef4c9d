"""The OpenAI wire format: request bodies checked field by field, response and chunk bodies.

Requests are pydantic models in strict mode (a `"5"` is not a number, a `1.5` not an int):
what OpenAI's API would refuse we refuse too, with a 400 whose body names the field
(`{"error": {"message", "type", "param", "code"}}`). Every field is honoured or refused:
fields we cannot honour (`n` > 1, `logprobs`, `echo`, `stop`, `logit_bias`, `tools`,
`response_format`, `suffix`, `top_logprobs`, ...) are refused unless they hold their
default, and an unknown field is refused too; only `IGNORED` fields, which change no
token, pass unread. Extensions: `ignore_eos` (as vLLM),
and in every choice and chunk the generated `token_ids`; every response carries the
request's timing as `pp_runtime`.
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pp_runtime.engine.online import RequestTiming
from pp_runtime.core.request import FinishReason

OPENAI_TEMPERATURE = 1.0  # OpenAI's default when a request gives none (0 = greedy)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
UNSUPPORTED = ("n", "logprobs", "stop", "echo", "best_of", "presence_penalty", "frequency_penalty")
IGNORED = ("user", "metadata", "store", "service_tier")  # bookkeeping: no effect on tokens
# fields we do not implement, each with the values that mean "not used" (accepted)
DEFAULT_ONLY = {"logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
                "functions": (None, []), "function_call": (None, "none"),
                "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
                "suffix": (None, ""), "top_logprobs": (None, 0), "modalities": (None, ["text"]),
                "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
                "min_tokens": (None, 0), "repetition_penalty": (None, 1, 1.0),
                "top_k": (None, -1, 0), "min_p": (None, 0, 0.0)}


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share; other fields are kept (`model_extra`) and checked
    against IGNORED and DEFAULT_ONLY by `parse`."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice per request
    ignore_eos: bool = False  # extension (vLLM): generate max_tokens even past EOS
    logprobs: None = None  # not supported: refused when given
    stop: None = None
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None


class ContentPart(_Strict):
    type: Literal["text"]  # images, audio, files: refused
    text: str


class Message(_Strict):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """Its text (content parts, concatenated)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None


def parse(model: type[_Strict], body: bytes) -> _Strict:
    """The request body as `model`, or ApiError(400) naming the first bad field."""
    try:
        parsed = model.model_validate_json(body or b"")
    except ValidationError as exc:
        # the most specific error: of a union, the member that got furthest
        err = max(exc.errors(), key=lambda e: (len(e["loc"]), e["type"] != "extra_forbidden"))
        if err["type"] == "json_invalid":
            raise ApiError(400, f"malformed JSON body: {err['msg']}", "body",
                           code="invalid_json") from None
        param = _param(err["loc"], err["type"] == "extra_forbidden")
        what = f"{param}: " if param else "body: "
        if param in UNSUPPORTED:
            what += "only the default is supported here: "
        msg = "not a field this server knows" if err["type"] == "extra_forbidden" else err["msg"]
        raise ApiError(400, what + msg, param or "body") from None
    for name, value in (parsed.model_extra or {}).items():
        if name in IGNORED or value in DEFAULT_ONLY.get(name, ()):
            continue
        why = ("not supported by this server (only its default is accepted)"
               if name in DEFAULT_ONLY else "not a field this server knows")
        raise ApiError(400, f"{name}: {why}", name)
    return parsed


def _param(loc: tuple, extra: bool = False) -> str | None:
    """`messages[0].content` from pydantic's loc; union member names dropped (the last
    part kept for an unknown field: `messages[0].name`)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out or part in _fields() or (extra and i == len(loc) - 1):
            out += ("." if out else "") + part
        elif "[" not in part and not part.startswith(("str", "list", "int")):
            out += "." + part
        else:
            continue  # a union member's name ("str", "list[ContentPart]"): not a field
    return out or None


def _fields() -> set[str]:
    return {f for m in (CompletionRequest, ChatRequest, Message, StreamOptions, ContentPart)
            for f in m.model_fields}


# ---- responses ---------------------------------------------------------------------------

def finish_reason(reason: FinishReason) -> str:
    """OpenAI's name: eos is `stop`."""
    return "stop" if reason == FinishReason.EOS else str(reason)


def timing(t: RequestTiming) -> dict:
    return {"queue_s": t.queue_s, "ttft_s": t.ttft_s, "generation_s": t.generation_s,
            "bubble_s": t.bubble_s}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(rid: str, model: str, chat: bool, chunk: bool) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def choice(chat: bool, chunk: bool, text: str, token_ids: list[int],
           reason: str | None, first: bool = False) -> dict:
    """One choice of a response (`chunk`: of a stream chunk)."""
    out: dict = {"index": 0}
    if not chat:
        out.update(text=text, logprobs=None)
    elif chunk:
        out["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
    else:
        out["message"] = {"role": "assistant", "content": text}
    out.update(finish_reason=reason, token_ids=token_ids)
    return out
