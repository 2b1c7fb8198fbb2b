"""uvicorn's h11 protocol with a deadline on each request's header block.

uvicorn times out a keep-alive connection only while it is idle and forgets the timer at the first byte, and it
never times a fresh connection: a client that sends half a header and stalls, or trickles a byte every few seconds
(slowloris), holds its connection forever, and enough of them use up `limit_concurrency` for everyone. Here the
whole header block of every request, from the connection's start or the previous response's end, must arrive
within HEADER_TIMEOUT_S, else the connection is closed. Bodies have their own bound (server.BODY_READ_TIMEOUT_S).
"""

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0

log = logging.getLogger("flashnext.serve")


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # this request's headers are in (or the connection is done)
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        # Armed first: the call below may read a pipelined request's headers at once and disarm it again.
        self._arm_header_timer()
        super().on_response_complete()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %g s", self.header_timeout_s)
            self.transport.close()
