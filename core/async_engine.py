"""The engine on a thread of its own, its tokens handed to asyncio consumers.

The engine is single-threaded: only the engine thread calls add_request / step / abort. The event loop sends it
commands through a queue ("add", "abort", "stop"); the thread sends each request's new tokens back to that
request's asyncio queue with `call_soon_threadsafe`. Between steps the thread drains the command queue, so an
abort frees the request's KV blocks before the next step runs.
"""

import asyncio
import contextlib
import logging
import queue
import threading
import time

from .engine.sequence import SamplingParams
from .errors import FlashnextError
from .metrics import ServerMetrics

log = logging.getLogger("flashnext.serve")


class NotReady(FlashnextError):
    """The server is starting, shutting down or its engine failed: try again later (HTTP 503)."""


class Overloaded(FlashnextError):
    """Every running slot and the waiting queue are taken (HTTP 429)."""


class RequestFailed(FlashnextError):
    """The engine raised while running this request; the request ends, the server goes on (HTTP 500)."""


class RequestStream:
    """One request's tokens as they come: `async for new_ids, finish_reason in stream`.

    The finish reason is None until the last item. `cancel()` stops the request and frees its blocks.
    """

    def __init__(
        self,
        owner: "AsyncEngine",
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        chunked_prefill: bool | None,
        spec: bool,
    ):
        self.owner, self.prompt_ids, self.params, self.request_id = owner, prompt_ids, params, request_id
        self.chunked_prefill, self.spec = chunked_prefill, spec
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finish_reason: str | None = None
        self.arrived = time.perf_counter()
        self.last_token_at: float | None = None  # engine thread only
        self.seq = None  # engine thread only

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[list[int], str | None]:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self._close("error")
            raise item
        new_ids, reason = item
        if reason:
            self._close(reason)
        return new_ids, reason

    def cancel(self, reason: str = "abort") -> None:
        """Stop generating (client gone, or a stop string matched); `reason` is what requests_total records."""
        if self.finish_reason is None:
            self._close(reason)
            self.owner.commands.put(("abort", self))
            self.queue.put_nowait(([], reason))  # wakes a consumer waiting on the next token

    def _close(self, reason: str) -> None:
        """The outcome is decided here, on the event loop, before the client hears of it: counted once."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.owner.active -= 1
            self.owner.metrics.requests.labels(reason).inc()

    def put(self, item) -> None:
        """From the engine thread: hand an item to the event loop (dropped if that loop is gone)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Owns the engine thread. `submit` (event loop) → RequestStream; capacity: max_num_seqs + max_queue."""

    def __init__(self, llm, metrics: ServerMetrics, max_queue: int):
        self.llm, self.engine, self.metrics = llm, llm.engine, metrics
        self.capacity = self.engine.profile.max_num_seqs + max_queue
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.status = "starting"  # starting → ok → shutting_down (or error if the engine loop fails)
        self.active = 0  # requests submitted and not yet finished (event loop only)
        self.live: dict[int, RequestStream] = {}  # id(seq) → stream (engine thread only)
        self.thread = threading.Thread(target=self._run, name="flashnext-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.status = "shutting_down"
        self.commands.put(("stop",))
        self.thread.join(timeout)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        chunked_prefill: bool | None = None,
        spec: bool = True,
    ) -> RequestStream:
        if self.status != "ok":
            self.metrics.requests.labels("rejected").inc()
            raise NotReady(f"the server is {self.status.replace('_', ' ')}; retry shortly")
        if self.active >= self.capacity:
            self.metrics.requests.labels("rejected").inc()
            raise Overloaded(
                f"the server is at capacity ({self.active} requests: {self.engine.profile.max_num_seqs} running"
                f" slots + {self.capacity - self.engine.profile.max_num_seqs} queued); retry later"
            )
        stream = RequestStream(self, prompt_ids, params, request_id, chunked_prefill, spec)
        self.active += 1
        self.commands.put(("add", stream))
        return stream

    # -- engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._warm_up()
        except Exception as exc:  # an engine that cannot run one request serves none
            self._give_up(exc)
            return
        if self.status == "starting":
            self.status = "ok"
        while True:
            try:
                if not self._serve_commands(block=not self.engine.has_work()):
                    break
                if self.engine.has_work():
                    self._deliver(self.engine.step(isolate_failures=True))
            except Exception as exc:  # outside any one request: fail those running, serve the next ones
                log.exception("an engine step failed")
                try:
                    self._abort_all(
                        f"the engine failed ({type(exc).__name__}: {exc}); see the server log", RequestFailed
                    )
                except Exception as abort_exc:
                    self._give_up(abort_exc)
                    return
        self._abort_all("the server is shutting down")

    def _give_up(self, exc: Exception) -> None:
        """The engine's own state is broken: fail what is running and refuse new requests (503) until restart."""
        log.exception("the engine loop failed", exc_info=exc)
        self.status = "error"
        for stream in self.live.values():
            stream.put(NotReady(f"the engine failed ({exc!r}); see the server log"))
        self.live.clear()

    def _warm_up(self) -> None:
        """One short generation before /health says ok: first-call allocations, kernel choices, graph capture."""
        ids = self.llm.tokenizer.encode("Hello") or [0]
        seq = self.engine.add_request(ids, SamplingParams(max_tokens=2, ignore_eos=True), request_id="warm-up")
        while seq.finish_reason is None:
            self.engine.step()

    def _serve_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle). False once told to stop."""
        try:
            command = self.commands.get(block=block)
            while True:
                if command[0] == "stop":
                    return False
                self._apply(command)
                command = self.commands.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, command: tuple) -> None:
        kind, stream = command
        if kind == "add":
            try:
                seq = self.engine.add_request(
                    stream.prompt_ids,
                    stream.params,
                    stream.request_id,
                    chunked_prefill=stream.chunked_prefill,
                    spec_enabled=stream.spec,
                )
            except FlashnextError as exc:
                stream.put(exc)
                return
            except Exception as exc:
                log.exception("the engine refused a request")
                stream.put(RequestFailed(f"the engine could not take this request ({type(exc).__name__}: {exc})"))
                return
            stream.seq = seq
            self.live[id(seq)] = stream
            self.metrics.prompt_tokens.inc(len(stream.prompt_ids))
        elif kind == "abort" and stream.seq is not None and self.live.pop(id(stream.seq), None):
            self.engine.abort(stream.seq)

    def _deliver(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            stream = self.live.get(id(out.seq))
            if stream is None:  # the warm-up request
                continue
            if out.new_token_ids:
                self._observe_latency(stream, len(out.new_token_ids), now)
                self.metrics.generation_tokens.inc(len(out.new_token_ids))
            reason = out.seq.finish_reason if out.finished else None
            if out.finished:
                del self.live[id(out.seq)]
            if out.error:
                log.error("request %s failed in an engine step: %s", stream.request_id, out.error)
                stream.put(RequestFailed(f"the engine failed on this request ({out.error}); the server goes on"))
            elif out.new_token_ids or reason:
                stream.put((out.new_token_ids, reason))

    def _observe_latency(self, stream: RequestStream, num_tokens: int, now: float) -> None:
        if stream.last_token_at is None:
            self.metrics.ttft.observe(now - stream.arrived)
        else:
            gap = (now - stream.last_token_at) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        stream.last_token_at = now

    def _abort_all(self, message: str, error: type[FlashnextError] = NotReady) -> None:
        for stream in list(self.live.values()):
            self.engine.abort(stream.seq)
            stream.put(error(message))
        self.live.clear()
