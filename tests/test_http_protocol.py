"""The header deadline of `flashnext serve`'s HTTP protocol: raw sockets that stall or trickle a header block."""

import socket
import threading
import time

import pytest
import uvicorn

from flashnext.core.http_protocol import HeaderTimeoutProtocol
from flashnext.core.server import UVICORN_LIMITS

DEADLINE_S = 0.6


class ShortDeadline(HeaderTimeoutProtocol):
    header_timeout_s = DEADLINE_S


async def hello(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port():
    limits = UVICORN_LIMITS | {"http": ShortDeadline}
    server = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=0, log_level="warning", **limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(10)


def closed_after(sock: socket.socket, trickle: bytes = b"", limit_s: float = 5.0) -> float:
    """Seconds until the server closes `sock`, sending one byte of `trickle` every 0.1 s meanwhile."""
    start = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - start < limit_s:
        if trickle:
            try:
                sock.sendall(trickle[:1])
            except OSError:
                return time.monotonic() - start
            trickle = trickle[1:] or b"x"
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return float("inf")


def test_uvicorn_runs_the_header_deadline_protocol():
    assert issubclass(UVICORN_LIMITS["http"], HeaderTimeoutProtocol)
    assert UVICORN_LIMITS["http"].header_timeout_s >= 1


def test_half_a_header_is_cut_off_at_the_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
        assert DEADLINE_S * 0.8 < closed_after(sock) < DEADLINE_S + 2


def test_a_silent_connection_is_cut_off(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert closed_after(sock) < DEADLINE_S + 2


def test_a_trickled_header_is_cut_off_though_bytes_keep_coming(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert closed_after(sock, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200) < DEADLINE_S + 2


def test_keep_alive_requests_each_get_a_fresh_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        for _ in range(3):
            time.sleep(DEADLINE_S * 0.6)  # well inside the deadline each time, past it in total
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            reply = b""
            while not reply.endswith(b"\r\n\r\nok"):
                chunk = sock.recv(1024)
                assert chunk, f"closed mid-reply: {reply!r}"
                reply += chunk
        sock.sendall(b"GET / HTTP/1.1\r\n")  # then a stalled one on the same connection
        assert closed_after(sock) < DEADLINE_S + 2
