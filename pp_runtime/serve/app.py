"""The HTTP routes of `pp-runtime serve` (FastAPI): OpenAI's API over one `Engine`.

  POST /v1/completions, /v1/chat/completions   `stream: true` = server-sent events
  GET  /v1/models, /metrics (Prometheus text), /health (no API key needed)

A request's body is checked by `protocol.py` (400 naming the field), its prompt and
sampling values by the engine's one set of checks (`request.prompt_problems`: the 400
names `exc.field`), as it is added to the engine with a listener that hands its events to this request's asyncio queue; a full
waiting queue is 429 with Retry-After, a server that is starting or whose pipeline failed
is 503. Before the body is read: the API key (`Bearer`, any case), the content type
(`application/json`, else 415: a browser's cross-site form or text/plain POST never
runs) and its size (413 above `max_body_bytes`, from Content-Length before reading it, or
as it streams in). A client that goes away (mid-stream, or while waiting for a whole
response) aborts its request at once, which frees its KV blocks. Every accepted request
ends with a finish reason: length or stop, or an error body / error event (pipeline
failure, shutdown, refused by a full queue: 429).
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pp_runtime.engine.online import Engine, EngineClosed, Finished, QueueFull, Token
from pp_runtime.core.request import FinishReason, InvalidRequestError, SamplingParams, default_seed
from pp_runtime.serve import protocol as P
from pp_runtime.serve.metrics import ServeMetrics
from pp_runtime.serve.text import BadText, Codec

RETRY_AFTER_S = 1  # what a 429 / 503 asks the client to wait
MAX_BODY_MB = 4.0  # default request body limit (`--max-body-mb`): a 1024-token prompt is ~6 KB


@dataclass
class ServeState:
    """What the routes need; `engine` and `codec` appear once every stage is up."""

    model: str  # the one model name served
    max_len: int  # KV positions per request (prompt + max_tokens)
    vocab_size: int
    seed: int  # the runtime seed: unseeded request n draws `default_seed(seed, n)`
    metrics: ServeMetrics
    api_key: str | None = None
    max_body_bytes: int = int(MAX_BODY_MB * 2**20)
    engine: Engine | None = None
    codec: Codec | None = None
    error: str | None = None  # why the stages could not start
    failure: str | None = None  # a stage worker found dead by the liveness probe
    created: int = field(default_factory=lambda: int(time.time()))
    _serial: itertools.count = field(default_factory=itertools.count)

    def ready_engine(self) -> Engine:
        """The engine, or 503 while starting, after a failed start or a pipeline failure."""
        if self.engine is None or not self.engine.healthy or self.failure:
            reason = self.error or ("the stage workers are starting" if self.engine is None
                                    else f"the pipeline failed: {self.failure or self.engine.failure}")
            raise P.ApiError(503, f"not ready: {reason}", type="service_unavailable",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        return self.engine


def build_app(state: ServeState, lifespan=None) -> FastAPI:
    app = FastAPI(title="pp-runtime", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, exc: P.ApiError):
        if exc.status in (400, 413, 415, 429, 503):
            state.metrics.refused(exc.status)
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown route, method
        return JSONResponse(P.ApiError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), state.api_key.encode()):
            raise P.ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                             code="invalid_api_key")

    @app.get("/health")
    async def health():
        """200 once every stage worker is up; 503 while starting, while a failed stage's
        workers are replaced ("recovering": requests are still taken, and wait), and after
        a failure that was not recovered."""
        e = state.engine
        if state.error or e is None or not e.healthy or state.failure:
            status = "failed" if state.error else "starting" if e is None else "unhealthy"
            why = state.error or state.failure or (str(e.failure) if e and e.failure else None)
            return JSONResponse({"status": status, "error": why}, 503)
        if e.recovering:
            return JSONResponse({"status": "recovering", "recoveries": len(e.recoveries),
                                 "running": e.num_running(), "waiting": e.num_waiting()}, 503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok", "model": state.model, "running": e.num_running(),
                "waiting": e.num_waiting(), "recoveries": len(e.recoveries)}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": state.model, "object": "model",
                                            "created": state.created, "owned_by": "pp_runtime",
                                            "max_model_len": state.max_len}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        e = state.engine
        body = state.metrics.scrape(e.num_running() if e else 0, e.num_waiting() if e else 0)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(state, request, authorize, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(state, request, authorize, chat=True)

    return app


async def _generate(state: ServeState, request: Request, authorize, chat: bool):
    authorize(request)
    engine = state.ready_engine()
    raw = await _read_body(request, state.max_body_bytes)
    body = P.parse(P.ChatRequest if chat else P.CompletionRequest, raw)
    if body.model != state.model:
        raise P.ApiError(400, f"model {body.model!r} is not served here; this server serves "
                              f"{state.model!r} (GET /v1/models)", "model", code="model_not_found")
    prompt = _prompt_ids(state, body, chat)
    params = _sampling(state, body, len(prompt), chat)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def listener(event) -> None:  # on the engine thread
        if isinstance(event, Finished):
            o = event.output
            state.metrics.finished(str(o.finish_reason), len(o.prompt_token_ids), len(o.token_ids))
        loop.call_soon_threadsafe(queue.put_nowait, event)

    seed = default_seed(state.seed, next(state._serial))
    try:
        engine.add_request(prompt, params, rid, listener=listener, seed=seed)
    except QueueFull as exc:
        raise P.ApiError(429, f"too many requests waiting: {exc}; retry later",
                         type="rate_limit_exceeded", code="queue_full",
                         headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineClosed as exc:
        raise P.ApiError(503, str(exc), type="service_unavailable",
                         headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except InvalidRequestError as exc:  # the prompt checks, once, in the engine
        field_name = exc.field or "prompt"
        if chat and field_name == "prompt":  # the prompt is what the messages made
            field_name = "messages"
        message = str(exc) if str(exc).startswith(field_name) else f"{field_name}: {exc}"
        raise P.ApiError(400, message, field_name, code=exc.code) from None
    reply = _Reply(rid, state.model, chat, state.codec.decoder(), len(prompt),
                   include_usage=bool(body.stream_options and body.stream_options.include_usage))
    if body.stream:
        return StreamingResponse(_events(engine, rid, queue, reply), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(engine, rid, queue, reply, request)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, if it is JSON (415 otherwise) of at most `limit` bytes (413 otherwise,
    before reading it: from Content-Length, or as soon as a chunked body passes it)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise P.ApiError(415, f"Content-Type must be application/json, got {kind or 'none'}",
                         "Content-Type", code="unsupported_media_type")
    too_big = P.ApiError(413, f"the request body is over the limit of {limit} bytes "
                              "(--max-body-mb)", "body", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt_ids(state: ServeState, body, chat: bool) -> list[int]:
    field_name = "messages" if chat else "prompt"
    try:
        if chat:
            ids = state.codec.chat([(m.role, m.text()) for m in body.messages])
        elif isinstance(body.prompt, str):
            ids = state.codec.encode(body.prompt)
        else:
            ids = list(body.prompt)
    except BadText as exc:
        raise P.ApiError(400, f"{field_name}: {exc}", field_name) from None
    return ids  # empty, outside the vocabulary: the engine's checks say so


def _sampling(state: ServeState, body, prompt_len: int, chat: bool) -> SamplingParams:
    max_tokens = body.max_tokens
    if chat and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:  # no limit: up to the context; at least 1, so that a prompt
        max_tokens = max(1, state.max_len - prompt_len)  # that fills it is what's named
    temperature = P.OPENAI_TEMPERATURE if body.temperature is None else body.temperature
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                          ignore_eos=body.ignore_eos)


class _Reply:
    """One request's response bodies and stream chunks, built from its events."""

    def __init__(self, rid: str, model: str, chat: bool, decoder, prompt_len: int,
                 include_usage: bool):
        self.rid, self.model, self.chat, self.decoder = rid, model, chat, decoder
        self.prompt_len, self.include_usage = prompt_len, include_usage

    def chunk(self, text: str, token_ids: list[int], reason: str | None = None,
              first: bool = False, **extra) -> str:
        body = P.envelope(self.rid, self.model, self.chat, chunk=True)
        body["choices"] = [P.choice(self.chat, True, text, token_ids, reason, first)]
        body.update(extra)
        return _sse(body)

    def final_chunk(self, f: Finished) -> str:
        extra = {"pp_runtime": P.timing(f.timing),
                 "usage": P.usage(self.prompt_len, len(f.output.token_ids))}
        return self.chunk("", [], P.finish_reason(f.output.finish_reason), **extra)

    def whole(self, f: Finished) -> dict:
        ids = f.output.token_ids
        text = "".join(self.decoder.add(t) for t in ids)
        body = P.envelope(self.rid, self.model, self.chat, chunk=False)
        body["choices"] = [P.choice(self.chat, False, text, list(ids),
                                    P.finish_reason(f.output.finish_reason))]
        body.update(usage=P.usage(self.prompt_len, len(ids)), pp_runtime=P.timing(f.timing))
        return body


def _failure(f: Finished) -> P.ApiError | None:
    """The error a request that did not complete ends with (None when it did)."""
    reason = f.output.finish_reason
    if f.refused:
        return P.ApiError(429, "too many requests waiting for KV blocks (--max-waiting); retry "
                               "later", type="rate_limit_exceeded", code="queue_full",
                          headers={"Retry-After": str(RETRY_AFTER_S)})
    if reason == FinishReason.ERROR:
        return P.ApiError(500, f"the pipeline failed: {f.output.error}", type="server_error",
                          code="pipeline_failed")
    if reason == FinishReason.ABORTED:
        return P.ApiError(503, "the request was aborted (the server is shutting down)",
                          type="service_unavailable", code="aborted")
    return None


async def _events(engine: Engine, rid: str, queue: asyncio.Queue, reply: _Reply):
    """The SSE stream: a chunk per token, a final chunk (finish reason, usage, timing), then
    [DONE]; an error event instead if the request failed. A client that leaves cancels
    this generator: its request is aborted."""
    finished = False
    try:
        if reply.chat:
            yield reply.chunk("", [], first=True)
        while True:
            event = await queue.get()
            if isinstance(event, Token):
                yield reply.chunk(reply.decoder.add(event.token_id), [event.token_id])
                continue
            finished = True
            error = _failure(event)
            yield _sse(error.body()) if error else reply.final_chunk(event)
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:
            engine.abort(rid)


async def _whole(engine: Engine, rid: str, queue: asyncio.Queue, reply: _Reply,
                 request: Request):
    """Wait for the end; abort the moment the client goes away (ASGI's http.disconnect)."""
    finished = None
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while finished is None:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return Response(status_code=499)  # nobody reads it
            if isinstance(event := get.result(), Finished):
                finished = event
    finally:
        gone.cancel()
        if finished is None:
            engine.abort(rid)
    error = _failure(finished)
    if error:
        return JSONResponse(error.body(), error.status, headers=error.headers)
    return reply.whole(finished)


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
