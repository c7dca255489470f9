"""uvicorn's h11 protocol with limits on the request head and body, and OpenAI-shaped protocol errors.

uvicorn answers what the app never sees (malformed HTTP) with text/plain, takes a complete head of any size,
and waits forever for a slow head or a stalled body. This subclass bounds all three and answers in JSON.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from pagoda.server.api.errors import APIError
from pagoda.server.config import HTTPLimits
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.server import ServerState

logger = logging.getLogger(__name__)

# After an error response, how long the request's remaining bytes are read and dropped before the close: closing
# with unread bytes makes the kernel send a reset, which can destroy the response before the client reads it.
_LINGER_SECONDS = 2.0
# Longest protocol-error message echoed to the client (h11's messages may quote the offending bytes).
_MAX_MESSAGE_CHARS = 200


def write_eof_quietly(transport: asyncio.WriteTransport) -> bool:
    """Send FIN; False (the transport closed, one debug line) when the client has gone already.

    asyncio's write_eof shuts the socket down directly, and a peer that reset the connection a moment before
    makes that an OSError (ENOTCONN, "Transport endpoint is not connected"), which would reach the event loop's
    handler as a traceback: a closed transport is an ordinary event (issue 43, finding 15).
    """
    try:
        transport.write_eof()
    except OSError as exc:
        logger.debug("the client closed the connection before the error response ended: %s", exc)
        transport.close()
        return False
    return True


class HTTPConfig(uvicorn.Config):
    """uvicorn's Config serving through LimitedH11Protocol with these limits."""

    def __init__(self, app: Any, limits: HTTPLimits, **kwargs: Any) -> None:
        super().__init__(
            app,
            http=LimitedH11Protocol,
            h11_max_incomplete_event_size=limits.max_head_bytes,
            limit_concurrency=limits.limit_concurrency,
            **kwargs,
        )
        self.limits = limits


def _head_sizes(event: h11.Request) -> tuple[int, int]:
    """(request line, whole head) sizes in bytes, as sent but for whitespace h11 strips."""
    line = len(event.method) + len(event.target) + len(b"HTTP/1.1") + 4  # two spaces and CRLF
    headers = sum(len(name) + len(value) + 4 for name, value in event.headers)  # ": " and CRLF
    return line, line + headers + 2


class _LimitedConnection(h11.Connection):
    """h11's server connection that also refuses a complete head over the limit, and keeps the last error."""

    def __init__(self, max_head_bytes: int) -> None:
        # h11 itself refuses a head that is still incomplete past this size (431).
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.error: APIError | None = None

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """h11's next event; a RemoteProtocolError also leaves the APIError it answers with in `error`."""
        reading_head = self.their_state is h11.IDLE
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error = self._api_error(exc, reading_head)
            raise
        if isinstance(event, h11.Request):
            line, head = _head_sizes(event)
            if line > self.max_head_bytes:
                self.error = APIError(414, f"The request line is longer than {self.max_head_bytes} bytes.")
            elif head > self.max_head_bytes:
                self.error = APIError(431, f"The request head is larger than {self.max_head_bytes} bytes.")
            if self.error is not None:
                raise h11.RemoteProtocolError(self.error.message, self.error.status)
        return event

    def _api_error(self, exc: h11.RemoteProtocolError, reading_head: bool) -> APIError:
        if exc.error_status_hint == 431:  # the buffer outgrew max_head_bytes before a complete event
            if not reading_head:
                return APIError(400, "A chunk-size line of the body is too long.")
            if b"\n" not in self.trailing_data[0]:
                return APIError(414, f"The request line is longer than {self.max_head_bytes} bytes.")
            return APIError(431, f"The request head is larger than {self.max_head_bytes} bytes.")
        return APIError(exc.error_status_hint, f"Invalid HTTP request: {exc}"[:_MAX_MESSAGE_CHARS])


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with HTTPLimits, answering protocol errors and timeouts with OpenAI-shaped JSON.

    Timers: the head timer runs while a connection waits for a request head (h11's IDLE), from the connection
    opening or, on a kept-alive connection, from the first byte of its next head; the body timer while it reads a
    body (SEND_BODY), for both the idle gap and the whole body's deadline. An idle kept-alive connection is left to
    uvicorn's keep-alive timer. Both are checked after each read, so the normal path pays two attribute reads and
    a clock read per received chunk.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = config.limits if isinstance(config, HTTPConfig) else HTTPLimits()
        self.conn: _LimitedConnection = _LimitedConnection(self.limits.max_head_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._last_body_read = 0.0
        self._body_started = 0.0  # when the current body began (its deadline counts from here)
        self._lingering = False
        self._kept_alive = False  # a response has completed on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the head timer: a connection that never sends a head must not stay open forever."""
        super().connection_made(transport)
        self._update_timers()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop both timers."""
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed h11, then note body progress and start or stop the timers for the state it reached."""
        if self._lingering:
            return  # the rest of a refused request: dropped
        super().data_received(data)
        self._last_body_read = self.loop.time()
        self._update_timers()

    def on_response_complete(self) -> None:
        """After a response the next head's timer waits for that head's first byte.

        Idle, the connection is uvicorn's keep-alive timer's to close: a head timer shorter than it would close a
        connection the client may be reusing at that very moment, and the client's request would meet a reset.
        """
        super().on_response_complete()
        self._kept_alive = True
        self._update_timers()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a RemoteProtocolError: the APIError the connection recorded, in JSON."""
        self._send_error(self.conn.error or APIError(400, msg))

    def _update_timers(self) -> None:
        if self.transport.is_closing() or self._lingering:
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            waiting_idle = self._kept_alive and not self.conn.trailing_data[0]
            if self._head_timer is None and not waiting_idle:
                self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)
        else:
            self._cancel_head_timer()
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_started = self.loop.time()
                first = min(self.limits.body_timeout, self.limits.body_deadline)
                self._body_timer = self.loop.call_later(first, self._body_timed_out)
        else:
            self._cancel_body_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:
            # Nothing of a request arrived: an idle connection, closed without a response as keep-alive does
            # (a 408 here could be read as the answer to a request the client sends at the same moment).
            self.transport.close()
            return
        seconds = self.limits.head_timeout
        self._send_error(APIError(408, f"The request head did not arrive within {seconds:g} s."))

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # uvicorn stopped reading because the app has not taken what arrived: not the client's delay.
            self._last_body_read = now
        idle = now - self._last_body_read
        # The deadline bounds a body that trickles one byte per idle gap, which the gap alone never cuts off.
        left = self.limits.body_deadline - (now - self._body_started)
        if idle < self.limits.body_timeout and left > 0:
            wait = min(self.limits.body_timeout - idle, left)
            self._body_timer = self.loop.call_later(wait, self._body_timed_out)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.transport.close()  # the app answered already; the client stalled sending the rest
            return
        if left <= 0:
            seconds = self.limits.body_deadline
            self._send_error(APIError(408, f"The request body did not arrive within {seconds:g} s."))
            return
        seconds = self.limits.body_timeout
        self._send_error(APIError(408, f"No byte of the request body arrived for {seconds:g} s."))

    def _send_error(self, error: APIError) -> None:
        """Answer `error` as JSON, then close; the app, if it runs, sees a disconnect and its answer is dropped."""
        if self._lingering:
            return
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        body = error.to_model().model_dump_json().encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            reason = STATUS_PHRASES[error.status]
            self.transport.write(
                self.conn.send(h11.Response(status_code=error.status, headers=headers, reason=reason)) or b""
            )
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            pass  # a response had begun after all: closing is all that is left
        self._cancel_head_timer()
        self._cancel_body_timer()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # Lingering close: send FIN, drop what still arrives, close when the client does or the linger ends.
        self._lingering = True
        if not write_eof_quietly(self.transport):
            return
        self.flow.resume_reading()
        self.loop.call_later(_LINGER_SECONDS, self.transport.close)
