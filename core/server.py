"""`flashnext serve`: an OpenAI-compatible HTTP API over the engine (routes and names: docs/cli.md).

POST /v1/completions and /v1/chat/completions (JSON or SSE), GET /v1/models, GET /health, GET /metrics.
Errors are OpenAI's error object: {"error": {"message", "type", "param", "code"}}, for every failure: a bad body,
a body too large (413), a request the engine failed (500), an unexpected exception (500).
"""

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, NotReady, Overloaded, RequestFailed, RequestStream
from .engine.sequence import SamplingParams
from .errors import EMPTY_PROMPT, FlashnextError, UserError
from .http_protocol import HeaderTimeoutProtocol
from .metrics import ServerMetrics, spec_path

log = logging.getLogger("flashnext.serve")

PROFILE_HEADER = "X-Flashnext-Profile"
# What the server changed about a request (a max_tokens above the backend's cap, lowered): this header, and the
# same text in a top-level "warning" field of the response body (the first chunk of a stream).
WARNING_HEADER = "X-Flashnext-Warning"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIB = 1 << 20
INT64 = 1 << 63
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
MAX_STOP_TOKEN_IDS = 256
# Request body bytes may arrive this far apart at most: a client that stops sending mid-body is cut off.
BODY_READ_TIMEOUT_S = 30.0
# uvicorn settings for `flashnext serve`: idle keep-alive connections close, header blocks are bounded in size and
# in time (http_protocol.py), and connections beyond the limit get 503 at once rather than piling up.
UVICORN_LIMITS = {
    "timeout_keep_alive": 5,
    "h11_max_incomplete_event_size": 64 * 1024,
    "limit_concurrency": 2048,
    "http": HeaderTimeoutProtocol,
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
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
    max_tokens: int | None = Field(default=None, ge=1, lt=INT64)  # and at most the context: Server.check_limits
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, lt=INT64)  # extension (vLLM's name); at most the vocabulary
    n: int | None = Field(default=None, ge=1, le=1)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # extension


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
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=INT64)


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


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes whether or not Content-Length says so; 408 when it stalls."""
    too_large = ApiError(
        413,
        f"the request body is larger than {limit} bytes (the server's --max-body-mib); send a smaller request",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size, stream = [], 0, request.stream()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), BODY_READ_TIMEOUT_S)
        except StopAsyncIteration:
            return b"".join(chunks)
        except TimeoutError:
            raise ApiError(
                408, f"the request body stopped arriving for {BODY_READ_TIMEOUT_S:.0f} s", code="request_timeout"
            ) from None
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _decode(raw: bytes, model: type[BaseModel]):
    """Body bytes → validated request; every failure is an ApiError(400) naming the field."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise ApiError(400, f"the request body is not valid JSON: {_short(exc)}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise ApiError(
                400, f"'{name}' is not supported by this server; leave it out", param=name, code="unsupported_parameter"
            )
    if bad := _lone_surrogate(body):
        raise ApiError(
            400,
            f"{bad}: text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode",
            param=bad,
        )
    try:
        return model.model_validate(body)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _union_tag(p))
        got = f" (got {_short(err['input'])})" if "input" in err and param else ""
        if param == "n":
            raise ApiError(400, f"n must be 1: this server returns one choice per request{got}", param="n") from None
        raise ApiError(400, f"{param or 'body'}: {err['msg']}{got}", param=param or None) from None


def _union_tag(loc_item) -> bool:
    """pydantic names the member of a union it tried ("str", "list[int]") in an error's location: not a field."""
    return isinstance(loc_item, str) and (loc_item in ("str", "int", "float", "bool") or "[" in loc_item)


def _short(value, limit: int = 120) -> str:
    """A value for an error message, cut short: a message never echoes a megabyte of prompt back."""
    text = str(value) if isinstance(value, Exception) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _lone_surrogate(body: dict) -> str | None:
    """The path of the first string holding a surrogate code point (only a bad escape makes one), else None."""
    todo: list[tuple[str, object]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            todo += ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
            todo += ((path, k) for k in value)
        elif isinstance(value, list) and value and not isinstance(value[0], int):
            todo += ((f"{path}.{i}", v) for i, v in enumerate(value))
    return None


async def _parse(request: Request, model: type[BaseModel], max_body_bytes: int):
    raw = await _read_body(request, max_body_bytes)
    return await asyncio.to_thread(_decode, raw, model)  # a large body parses off the event loop


# -- the app -------------------------------------------------------------------------------------------------
class Server:
    """Request handling over one loaded LLM; `create_app` wires it into FastAPI."""

    def __init__(self, llm, api_key: str | None = None, max_queue: int = 256, max_body_mib: float = 8.0):
        self.llm, self.engine, self.tokenizer = llm, llm.engine, llm.tokenizer
        self.api_key = api_key
        self.max_body_bytes = int(max_body_mib * MIB)
        self.vocab_size = llm.engine.config.vocab_size
        self.model_name = llm.info.model
        self.created = int(time.time())
        self.metrics = ServerMetrics(llm.engine)
        self.async_engine = AsyncEngine(llm, self.metrics, max_queue)

    # -- checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"model {_short(name)} is not served here; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def request_profile(self, request: Request) -> bool:
        """True when the request asks for the basic profile (no chunked prefill, no speculative decoding)."""
        value = request.headers.get(PROFILE_HEADER, "full").strip().lower()
        if value not in ("full", "basic"):
            raise ApiError(400, f"{PROFILE_HEADER} must be 'full' or 'basic' (got '{value}')", param=PROFILE_HEADER)
        return value == "basic"

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(
                    400, f"one prompt per request (got {len(prompt)}); send several requests", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ApiError(400, EMPTY_PROMPT, param="prompt")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise ApiError(400, "the prompt is empty: give some token ids", param="prompt")
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

    def check_prompt(self, ids: list[int], param: str) -> None:
        """Room to generate, and every id in the model's vocabulary (a tokenizer may know more ids than the model)."""
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens but the context holds {limit}; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400, f"prompt token id {bad} is outside the model's vocabulary [0, {self.vocab_size})", param=param
            )

    def check_limits(self, req: "_Sampling", max_tokens: int | None, max_tokens_field: str) -> None:
        """Bounds that depend on the model: the engine never sees a value it cannot hold."""
        limit = self.engine.max_model_len
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(
                400,
                f"{max_tokens_field} is {max_tokens} but the context holds {limit} tokens; ask for fewer",
                param=max_tokens_field,
            )
        if req.top_k is not None and req.top_k > self.vocab_size:
            raise ApiError(
                400,
                f"top_k is {req.top_k} but the vocabulary has {self.vocab_size} tokens; give at most"
                f" {self.vocab_size} (0 turns top-k off)",
                param="top_k",
            )
        bad = next((t for t in req.stop_token_ids or [] if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400, f"stop_token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})", param="stop_token_ids"
            )

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
            return self.async_engine.submit(
                ids, params, request_id, chunked_prefill=False if basic else None, spec=not basic
            )
        except Overloaded as exc:
            raise ApiError(429, str(exc), code="queue_full", kind="server_overloaded") from None
        except NotReady as exc:
            raise ApiError(503, str(exc), code="not_ready", kind="server_unavailable") from None

    # -- endpoints
    async def completions(self, request: Request) -> Response:
        req = await _parse(request, CompletionRequest, self.max_body_bytes)
        self.check_model(req.model)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
        self.check_limits(req, max_tokens, "max_tokens")
        stops, rid = _stops(req.stop), f"cmpl-{uuid.uuid4().hex}"
        ids = await asyncio.to_thread(self.prompt_ids, req.prompt)  # tokenizing a long prompt takes a while
        self.check_prompt(ids, "prompt")
        gen = Generation(self.submit(request, ids, self.sampling(req, max_tokens), rid), self.tokenizer, stops)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        warning = self.engine.max_tokens_notice(max_tokens)
        if req.stream:
            chunks = self._completion_chunks(gen, head, _include_usage(req))
            return EventStream(gen, _warned(chunks, warning), _warning_header(warning))
        text = await _collect(request, gen)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
        body = {**head, "choices": [choice], "usage": gen.usage()}
        return JSONResponse(_with_warning(body, warning), headers=_warning_header(warning))

    async def _completion_chunks(self, gen: "Generation", head: dict, include_usage: bool):
        async for piece, reason in gen.pieces():
            yield {**head, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}]}
        if include_usage:
            yield {**head, "choices": [], "usage": gen.usage()}

    async def chat_completions(self, request: Request) -> Response:
        req = await _parse(request, ChatRequest, self.max_body_bytes)
        self.check_model(req.model)
        asked = req.max_completion_tokens or req.max_tokens
        self.check_limits(req, asked, "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        stops, rid = _stops(req.stop), f"chatcmpl-{uuid.uuid4().hex}"
        ids = await asyncio.to_thread(self.chat_ids, req.messages)  # template and tokenizer off the event loop
        self.check_prompt(ids, "messages")
        max_tokens = asked or self.engine.max_model_len - len(ids)
        gen = Generation(self.submit(request, ids, self.sampling(req, max_tokens), rid), self.tokenizer, stops)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        warning = self.engine.max_tokens_notice(max_tokens)
        if req.stream:
            chunks = self._chat_chunks(gen, {**head, "object": "chat.completion.chunk"}, _include_usage(req))
            return EventStream(gen, _warned(chunks, warning), _warning_header(warning))
        text = await _collect(request, gen)
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish_reason}
        body = {**head, "choices": [choice], "usage": gen.usage()}
        return JSONResponse(_with_warning(body, warning), headers=_warning_header(warning))

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
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "flashnext",
            "max_model_len": self.engine.max_model_len,
        }

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
            "kv_cache": {
                "blocks_total": blocks.num_blocks,
                "blocks_free": blocks.num_free,
                "block_size": blocks.block_size,
            },
            "requests": {"running": len(scheduler.running), "waiting": len(scheduler.waiting)},
            "spec": self._spec_health(),
            "device": self.engine.backend.device_telemetry(),
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    def _spec_health(self) -> dict:
        """Speculative decoding's method, where it runs (metrics.spec_path) and its drafts so far."""
        engine, stats = self.engine, self.engine.spec_stats()
        drafted = stats["drafted"]
        return {
            "method": engine.profile.spec,
            "path": spec_path(engine.runner.stats()) if engine.profile.spec != "none" else None,
            "drafts": stats["drafts"],
            "drafted": drafted,
            "accepted": stats["accepted"],
            "acceptance_rate": round(stats["accepted"] / drafted, 4) if drafted else None,
        }


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
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }


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
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each", param="stop"
        )
    return stops


def _with_warning(body: dict, warning: str | None) -> dict:
    return {**body, "warning": warning} if warning else body


def _warning_header(warning: str | None) -> dict[str, str]:
    return {WARNING_HEADER: warning} if warning else {}


async def _warned(chunks: AsyncIterator[dict], warning: str | None) -> AsyncIterator[dict]:
    """The stream with the warning in its first chunk."""
    first = True
    async for chunk in chunks:
        yield _with_warning(chunk, warning) if first else chunk
        first = False


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
    except FlashnextError as exc:
        raise _engine_error(exc) from None
    finally:
        watcher.cancel()
        gen.stream.cancel("abort")  # a no-op once finished


def _engine_error(exc: Exception) -> ApiError:
    """What an error from the engine side means to the client: its request was bad (400), the engine failed on it
    (500: other requests go on), the server is not serving (503), or a bug (500)."""
    if isinstance(exc, UserError):
        return ApiError(400, str(exc))
    if isinstance(exc, RequestFailed):
        return ApiError(500, str(exc), code="engine_error", kind="server_error")
    if isinstance(exc, FlashnextError):
        return ApiError(503, str(exc), kind="server_unavailable")
    return ApiError(
        500, f"internal error ({type(exc).__name__}); see the server log", code="internal_error", kind="server_error"
    )


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`; an error mid-way is one error event."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except Exception as exc:
        if not isinstance(exc, FlashnextError):
            log.exception("a streamed request failed")
        error = _engine_error(exc)
        body = {"message": error.message, "type": error.kind, "param": None, "code": error.code}
        yield f"data: {json.dumps({'error': body}, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that cancels its request however it ends: a client that hangs up makes Starlette cancel
    the body, and the request's blocks are freed before the engine's next step."""

    def __init__(self, gen: Generation, chunks: AsyncIterator[dict], headers: dict[str, str] | None = None):
        super().__init__(_sse(chunks), media_type="text/event-stream", headers=SSE_HEADERS | (headers or {}))
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.stream.cancel("abort")


def create_app(llm, api_key: str | None = None, max_queue: int = 256, max_body_mib: float = 8.0) -> FastAPI:
    """The ASGI app. The engine thread starts (and warms up) with the app's lifespan."""
    server = Server(llm, api_key, max_queue, max_body_mib)

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

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # Starlette logs the traceback
        return _engine_error(exc).response()

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
