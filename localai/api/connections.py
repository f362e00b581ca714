"""Connections that never finish their request: deadlines on its headers and its body, and a cap on how many may
wait for their headers.

uvicorn's h11 protocol waits for a request's headers as long as the client likes (its keep-alive timeout starts
only after a response), so 1,000 clients sending a header line a minute held 1,000 file descriptors indefinitely.
Here a connection gets ``HEADER_SECONDS`` from its start (or from its last response) to complete its next request's
headers, and at most ``MAX_WAITING`` connections wait at once: one more closes the longest waiting, so a flood of
slow clients cannot keep a fast one out for long. Then its body has ``body_seconds`` (``LOCALAI_BODY_TIMEOUT``) from
the end of the headers: 24 clients sending a byte every 2 s held their connections (and the requests' handlers,
waiting for their bodies) for as long as they liked.

A WebSocket upgrade hands the transport to uvicorn's WebSocket protocol while h11 still sees the request's body as
pending: both deadlines end there (they once closed every ``/v1/responses`` socket 60 s after its handshake, which
ended Codex turns mid-reply). A socket's own limits are the WebSocket protocol's pings and
``LOCALAI_WS_IDLE_TIMEOUT`` (``api/responses_socket.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("localai.server")
HEADER_SECONDS = 10.0
BODY_SECONDS = 60.0
MAX_WAITING = 256


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with the headers' and the body's deadlines and the cap on waiting connections."""

    waiting: ClassVar[dict[DeadlineProtocol, float]] = {}  # connection -> when it started waiting
    header_seconds: ClassVar[float] = HEADER_SECONDS
    body_seconds: ClassVar[float] = BODY_SECONDS
    max_waiting: ClassVar[int] = MAX_WAITING

    @classmethod
    def with_body_deadline(cls, seconds: float) -> type[DeadlineProtocol]:
        """This protocol with ``seconds`` for a request's body (the daemon's ``LOCALAI_BODY_TIMEOUT``)."""
        return type("DeadlineProtocol", (cls,), {"body_seconds": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self._body_received()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.get_protocol() is not self:  # upgraded to a WebSocket: no HTTP deadlines any more
            self._stop_waiting()
            self._body_received()
            return
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in (or the connection is done)
            self._stop_waiting()
        if self.conn.their_state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.body_seconds, self._body_too_slow)
        else:
            self._body_received()

    def _body_received(self) -> None:
        if getattr(self, "_body_timer", None) is not None:
            self._body_timer.cancel()  # type: ignore[union-attr]
            self._body_timer = None

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            log.warning("closing a connection whose request body took over %g s (LOCALAI_BODY_TIMEOUT)",
                        self.body_seconds)
            self.transport.close()  # the request's handler sees the client go (http.disconnect)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._wait_for_headers()  # before the next request is looked at: a pipelined one ends the wait at once
        super().on_response_complete()

    def _wait_for_headers(self) -> None:
        waiting = type(self).waiting
        if self not in waiting and len(waiting) >= self.max_waiting:
            longest = min(waiting, key=waiting.__getitem__)
            log.warning("%d connections are waiting for their headers; closing the one waiting longest",
                        len(waiting))
            longest._give_up()
        self._stop_waiting()
        waiting[self] = time.monotonic()
        self._header_timer = self.loop.call_later(self.header_seconds, self._give_up)

    def _stop_waiting(self) -> None:
        type(self).waiting.pop(self, None)
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()  # type: ignore[union-attr]
            self._header_timer = None

    def _give_up(self) -> None:
        self._stop_waiting()
        if not self.transport.is_closing():
            self.transport.close()
