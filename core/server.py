"""`flashnext serve`: an OpenAI-compatible HTTP API over the engine (routes and names: docs/cli.md).

POST /v1/completions and /v1/chat/completions (JSON or SSE), GET /v1/models, GET /health, GET /metrics.
Errors are OpenAI's error object: {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, NotReady, Overloaded, RequestStream
from .engine.sequence import SamplingParams
from .errors import FlashnextError, UserError
from .metrics import ServerMetrics

PROFILE_HEADER = "X-Flashnext-Profile"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


# -- request bodies ------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share. None means the OpenAI default; unknown fields are ignored, as OpenAI does."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # extension (vLLM's name)
    n: int | None = Field(default=None, ge=1, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    stop_token_ids: list[int] | None = None  # extension


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


# OpenAI fields this server does not implement: accepted only at their "off" values, refused otherwise.
UNSUPPORTED = {
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
}


async def _parse(request: Request, model: type[BaseModel]):
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out", param=name,
                           code="unsupported_parameter")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        got = f" (got {err['input']!r})" if "input" in err and param else ""
        if param == "n":
            raise ApiError(400, f"n must be 1: this server returns one choice per request{got}", param="n") from None
        raise ApiError(400, f"{param or 'body'}: {err['msg']}{got}", param=param or None) from None


# -- the app -------------------------------------------------------------------------------------------------
class Server:
    """Request handling over one loaded LLM; `create_app` wires it into FastAPI."""

    def __init__(self, llm, api_key: str | None = None, max_queue: int = 256):
        self.llm, self.engine, self.tokenizer = llm, llm.engine, llm.tokenizer
        self.api_key = api_key
        self.model_name = llm.info.model
        self.created = int(time.time())
        self.metrics = ServerMetrics(llm.engine)
        self.async_engine = AsyncEngine(llm, self.metrics, max_queue)

    # -- checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model '{name}' is not served here; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def request_profile(self, request: Request) -> bool:
        """True when the request asks for the basic profile (no chunked prefill, no speculative decoding)."""
        value = request.headers.get(PROFILE_HEADER, "full").strip().lower()
        if value not in ("full", "basic"):
            raise ApiError(400, f"{PROFILE_HEADER} must be 'full' or 'basic' (got '{value}')", param=PROFILE_HEADER)
        return value == "basic"

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request (got {len(prompt)}); send several requests",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ApiError(400, "the prompt is empty: give some text", param="prompt")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise ApiError(400, "the prompt is empty: give some token ids", param="prompt")
        vocab = self.engine.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return list(prompt)

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        chat = [{"role": m.role, "content": m.text()} for m in messages]
        if not any(m["content"].strip() for m in chat):
            raise ApiError(400, "every message is empty: give some text", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(chat)
        except UserError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_length(self, ids: list[int], param: str) -> None:
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {limit}; shorten it",
                           param=param, code="context_length_exceeded")

    def sampling(self, req: _Sampling, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            max_tokens=max_tokens,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids or [],
        )

    def submit(self, request: Request, ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        basic = self.request_profile(request)
        try:
            return self.async_engine.submit(ids, params, request_id, chunked_prefill=False if basic else None,
                                            spec=not basic)
        except Overloaded as exc:
            raise ApiError(429, str(exc), code="queue_full", kind="server_overloaded") from None
        except NotReady as exc:
            raise ApiError(503, str(exc), code="not_ready", kind="server_unavailable") from None

    # -- endpoints
    async def completions(self, request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        self.check_model(req.model)
        ids = self.prompt_ids(req.prompt)
        self.check_length(ids, "prompt")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
        stops, rid = _stops(req.stop), f"cmpl-{uuid.uuid4().hex}"
        gen = Generation(self.submit(request, ids, self.sampling(req, max_tokens), rid), self.tokenizer, stops)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            chunks = self._completion_chunks(gen, head, _include_usage(req))
            return EventStream(gen, chunks)
        text = await _collect(request, gen)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
        return JSONResponse({**head, "choices": [choice], "usage": gen.usage()})

    async def _completion_chunks(self, gen: "Generation", head: dict, include_usage: bool):
        async for piece, reason in gen.pieces():
            yield {**head, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}]}
        if include_usage:
            yield {**head, "choices": [], "usage": gen.usage()}

    async def chat_completions(self, request: Request) -> Response:
        req = await _parse(request, ChatRequest)
        self.check_model(req.model)
        ids = self.chat_ids(req.messages)
        self.check_length(ids, "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens or self.engine.max_model_len - len(ids)
        stops, rid = _stops(req.stop), f"chatcmpl-{uuid.uuid4().hex}"
        gen = Generation(self.submit(request, ids, self.sampling(req, max_tokens), rid), self.tokenizer, stops)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            chunks = self._chat_chunks(gen, {**head, "object": "chat.completion.chunk"}, _include_usage(req))
            return EventStream(gen, chunks)
        text = await _collect(request, gen)
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish_reason}
        return JSONResponse({**head, "choices": [choice], "usage": gen.usage()})

    async def _chat_chunks(self, gen: "Generation", head: dict, include_usage: bool):
        def chunk(delta: dict, reason: str | None) -> dict:
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        yield chunk({"role": "assistant", "content": ""}, None)
        async for piece, reason in gen.pieces():
            if piece:
                yield chunk({"content": piece}, None)
            if reason:
                yield chunk({}, reason)
        if include_usage:
            yield {**head, "choices": [], "usage": gen.usage()}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "flashnext",
                "max_model_len": self.engine.max_model_len}

    def health(self) -> JSONResponse:
        profile, blocks, scheduler = self.engine.profile, self.engine.blocks, self.engine.scheduler
        status = self.async_engine.status
        body = {
            "status": status,
            "backend": self.llm.info.backend,
            "model": self.model_name,
            "precision": self.engine.precision.name,
            "profile": profile.name,
            "threads": self.llm.threads.threads,
            "optimizations": {
                "cuda_graphs": profile.cuda_graphs,
                "chunked_prefill": profile.chunked_prefill,
                "spec_decode": profile.spec != "none",
                "prefix_caching": profile.prefix_caching,
            },
            "kv_cache": {"blocks_total": blocks.num_blocks, "blocks_free": blocks.num_free,
                         "block_size": blocks.block_size},
            "requests": {"running": len(scheduler.running), "waiting": len(scheduler.waiting)},
            "device": self.engine.backend.device_telemetry(),
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)


class Generation:
    """Turns a request's tokens into text pieces: incremental detokenization, stop strings, usage counts."""

    def __init__(self, stream: RequestStream, tokenizer, stops: list[str]):
        self.stream, self.decoder, self.stops = stream, tokenizer.stream(), stops
        self.held = ""  # text that may be the start of a stop string
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish reason or None); the last item carries the reason."""
        async for new_ids, reason in self.stream:
            self.completion_tokens += len(new_ids)
            text = "".join(self.decoder.push(t) for t in new_ids) + (self.decoder.flush() if reason else "")
            text, stopped = self._cut_at_stop(self.held + text, final=reason is not None)
            if stopped:
                self.stream.cancel("stop")
                reason = "stop"
            if text or reason:
                yield text, reason
            if reason:
                self.finish_reason = reason
                return

    def _cut_at_stop(self, text: str, final: bool) -> tuple[str, bool]:
        """Text safe to send and whether a stop string ended it; keeps back a tail that could start a stop."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        keep = 0 if final else max((_overlap(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def usage(self) -> dict:
        prompt = len(self.stream.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper start of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return stops


def _include_usage(req: _Sampling) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _collect(request: Request, gen: Generation) -> str:
    """The whole text of a non-streamed request; a client that hangs up cancels it."""

    async def cancel_on_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gen.stream.cancel("abort")

    watcher = asyncio.create_task(cancel_on_disconnect())
    try:
        return "".join([piece async for piece, _ in gen.pieces()])
    except UserError as exc:
        raise ApiError(400, str(exc)) from None
    except FlashnextError as exc:
        raise ApiError(503, str(exc), kind="server_unavailable") from None
    finally:
        watcher.cancel()
        gen.stream.cancel("abort")  # a no-op once finished


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`; an error mid-way is one error event."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except FlashnextError as exc:
        kind = "invalid_request_error" if isinstance(exc, UserError) else "server_unavailable"
        error = {"message": str(exc), "type": kind, "param": None, "code": None}
        yield f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that cancels its request however it ends: a client that hangs up makes Starlette cancel
    the body, and the request's blocks are freed before the engine's next step."""

    def __init__(self, gen: Generation, chunks: AsyncIterator[dict]):
        super().__init__(_sse(chunks), media_type="text/event-stream", headers=SSE_HEADERS)
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.stream.cancel("abort")


def create_app(llm, api_key: str | None = None, max_queue: int = 256) -> FastAPI:
    """The ASGI app. The engine thread starts (and warms up) with the app's lifespan."""
    server = Server(llm, api_key, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        yield
        server.async_engine.stop()

    app = FastAPI(title="flashnext", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    @app.get("/health")
    async def health():
        return server.health()

    api = APIRouter(dependencies=[Depends(server.check_auth)])
    api.add_api_route("/v1/completions", server.completions, methods=["POST"])
    api.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    api.add_api_route("/v1/models", server.models, methods=["GET"])

    @api.get("/v1/models/{name:path}")
    async def model(name: str):
        server.check_model(name)
        return server.model_card()

    @api.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(api)
    return app
