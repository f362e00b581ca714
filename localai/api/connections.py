"""Connections that never finish their request's headers: a deadline, and a cap on how many may wait.

uvicorn's h11 protocol waits for a request's headers as long as the client likes (its keep-alive timeout starts
only after a response), so 1,000 clients sending a header line a minute held 1,000 file descriptors indefinitely.
Here a connection gets ``HEADER_SECONDS`` from its start (or from its last response) to complete its next request's
headers, and at most ``MAX_WAITING`` connections wait at once: one more closes the longest waiting, so a flood of
slow clients cannot keep a fast one out for long.
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
MAX_WAITING = 256


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with the headers' deadline and the cap on waiting connections."""

    waiting: ClassVar[dict[HeaderDeadlineProtocol, float]] = {}  # connection -> when it started waiting
    header_seconds: ClassVar[float] = HEADER_SECONDS
    max_waiting: ClassVar[int] = MAX_WAITING

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in (or the connection is done)
            self._stop_waiting()

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
