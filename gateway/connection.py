"""A caller's connection to the proxy listener, apart from parsing its requests
(gateway/listener.py does that): the deadlines, the connection cap, the keep-alive,
refusals written in order, the write timeout and the lingering close.

- every refusal is problem+json (400, 408, 414, 431 or 503) and ends the connection,
  so nothing after a request the parser gave up on is read as another request. It is
  written only once the responses to the requests before it on the connection are
  (pipelining keeps the answers in order); a refusal of a request whose own answer has
  started is not written at all, the connection just closes after that answer;
- deadlines: `server.header_timeout` for a whole head (from the connection's start for
  its first request, from a later request's first byte), `server.body_timeout` for
  the silence between reads of a body. Either gets a 408 and a close;
- `server.max_connections` per process: a connection over it first closes the oldest
  idle kept-alive one, and if there is none gets a 503 with Retry-After;
- an idle kept-alive connection is kept for `server.keep_alive`, and is not closed
  while request bytes wait on it unread; the gateway's last word on a connection is a
  half-close that reads and drops what still arrives for a while (`LINGER`), so a
  request that crossed the FIN, or the rest of a refused upload, does not make the
  kernel reset the connection and destroy the answer before the client reads it;
- `server.write_timeout`: a caller whose connection stays over the transport's
  high-water mark that long without taking a byte is given up on (the connection is
  reset, its buffered bytes freed); the app learns it from the transport it finds in
  the scope under CALLER_TRANSPORT (gateway/cycle.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.config import ServerConfig
from gateway.config.units import format_duration
from gateway.cycle import Cycle, http_date, reset
from gateway.errors import MalformedRequest, ProblemError, RequestTimeout, TooManyConnections

#: After its last answer the gateway half-closes and drops what still arrives until
#: the client closes, or nothing came for LINGER seconds, or LINGER_MAX passed.
LINGER = 2.0
LINGER_MAX = 10.0

#: Seconds between log lines about connections refused over server.max_connections.
CAP_LOG_INTERVAL = 10.0


def _unread_bytes(transport: asyncio.Transport) -> bool:
    """Whether bytes wait in the socket's receive queue, not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return False
    return bool(struct.unpack("i", queued)[0])


class Connection(HttpToolsProtocol):
    """A caller's connection, apart from the parsing: its deadlines, refusals, keep-alive,
    place under the connection cap and end. GatewayHttpProtocol (gateway/listener.py)
    adds the parser callbacks."""

    #: The listener's settings; read per connection and per request, so a config
    #: reload applies.
    settings: Callable[[], ServerConfig] = staticmethod(ServerConfig)
    #: This listener's idle kept-alive connections, oldest first: the ones a connection
    #: over server.max_connections closes to make room (protocol_for gives each
    #: listener its own).
    idle: ClassVar[dict[Connection, None]] = {}
    #: Connections refused over the cap since the last log line about them, and when.
    capped: ClassVar[list[float]] = [0, 0.0]
    #: The request being read or answered, and those pipelined behind it: the
    #: gateway's cycle (gateway/cycle.py), not uvicorn's.
    cycle: Cycle  # type: ignore[assignment]
    pipeline: deque[tuple[Cycle, Any]]  # type: ignore[assignment]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._server = self.settings()
        self._limit = self._server.max_header_bytes
        self.timeout_keep_alive = self._server.keep_alive  # type: ignore[assignment]
        self._in_head = True  # the next bytes belong to a head (or nothing came yet)
        self._head_since: float | None = None  # when the head deadline started
        self._trailing = False  # a chunk header and no body since: maybe the trailers
        self._head_bytes = 0  # bytes read while a head (or trailer section) was open
        self._url_bytes = 0
        self._header_bytes = 0
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None  # the head, body or linger timer
        self._refusal: ProblemError | None = None
        self._answer = False  # whether the refusal is written, once it may be
        self._stopped = False  # no more requests are read: refused or lingering
        self._lingering = False
        self._linger_until = 0.0
        self._stall: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes buffered for the caller when the stall timer was set

    # --- the connection ------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._last_read = self._head_since = self.loop.time()
        if len(self.connections) > self._server.max_connections and not self._make_room():
            self._refuse_over_cap()
            return
        self._timer = self.loop.call_later(self._server.header_timeout, self._head_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self.idle.pop(self, None)
        self.connections.discard(self)
        cycle = self.cycle
        if cycle is not None:
            if not cycle.response_complete:
                cycle.disconnected = True
            cycle.wake()
        if self.flow is not None:
            self.flow.resume_writing()
        if exc is None:
            self.transport.close()
            self._unset_keepalive_if_required()
        self.parser = None  # type: ignore[assignment]

    def shutdown(self) -> None:
        """The server's graceful shutdown: close when idle, else after this answer."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.close()
        else:
            cycle.keep_alive = False

    # --- responses and the keep-alive ------------------------------------------------

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self._lingering:  # the answer closed the connection (Connection: close)
            return
        last = not self.pipeline  # no response before the refused request is left
        if not self.transport.is_closing():
            if self.timeout_keep_alive_task is not None:
                self._unset_keepalive_if_required()
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                cycle.start(app)
            else:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
        if self._stopped:
            if last and not self._lingering:
                self._finish()
        elif self.timeout_keep_alive_task is not None:
            self.idle[self] = None

    def _unset_keepalive_if_required(self) -> None:
        if self.timeout_keep_alive_task is not None:
            self.idle.pop(self, None)
            super()._unset_keepalive_if_required()

    def timeout_keep_alive_handler(self) -> None:
        self._unset_keepalive_if_required()  # called from _make_room too, not only the timer
        if self._stopped or self.transport.is_closing():
            return
        if not self._in_head or self._head_since is not None:
            return  # a request is arriving: its own deadline applies
        if _unread_bytes(self.transport):
            return  # a request came as the timer fired: it is read next, and answered
        self._linger()

    def _make_room(self) -> bool:
        """Close idle kept-alive connections, oldest first, until this one fits."""
        while self.idle:
            other = next(iter(self.idle))
            del self.idle[other]
            other.timeout_keep_alive_handler()  # leaves the count, unless a request came
            if len(self.connections) <= self._server.max_connections:
                return True
        return False

    # --- deadlines -----------------------------------------------------------------

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_deadline(self) -> None:
        self._timer = None
        if self._stopped or not self._in_head:
            return
        timeout = self._server.header_timeout
        if self.flow.read_paused:
            # The gateway stopped reading (a pipelined request waits its turn): the
            # delay is not the client's.
            self._timer = self.loop.call_later(timeout, self._head_deadline)
            return
        self._refuse(
            RequestTimeout(
                f"The request head was not complete within {format_duration(timeout)} "
                "(server.header_timeout); it was not forwarded."
            )
        )

    def _body_idle(self) -> None:
        self._timer = None
        if self._stopped or self._in_head:
            return
        timeout = self._server.body_timeout
        now = self.loop.time()
        if self.flow.read_paused:
            self._last_read = now  # not reading is the gateway's doing
        idle = now - self._last_read
        if idle < timeout:
            self._timer = self.loop.call_later(timeout - idle, self._body_idle)
            return
        self._refuse(
            RequestTimeout(
                f"No byte of the request body arrived for {format_duration(timeout)} "
                "(server.body_timeout); it was not forwarded."
            )
        )

    # --- refusals and the end of a connection ----------------------------------------

    def send_400_response(self, msg: str) -> None:
        refusal = self._refusal or MalformedRequest(
            "The request is not valid HTTP/1.1 (for example: Content-Length together with "
            "Transfer-Encoding, two Content-Lengths, a bad chunk, or a malformed line), so "
            "the gateway cannot tell where it ends. It was not forwarded."
        )
        self._refuse(refusal)

    def _refuse(self, refusal: ProblemError, *, log: bool = True) -> None:
        """Read no more requests here; answer `refusal` once every response before it on
        the connection has been written, then close."""
        if self._stopped:
            return
        self._stopped = True
        self._refusal = refusal
        self._cancel_timer()
        if log:
            self.logger.warning("refused a request: %s", refusal.detail)
        cycle = self.cycle
        self._answer = True
        if self._in_head or cycle is None:
            # A head that never completed (or whose cycle was never made): every
            # request parsed before it comes first.
            ready = not self.pipeline and (cycle is None or cycle.response_complete)
        elif any(queued is cycle for queued, _ in self.pipeline):
            # Refused while it waits behind earlier requests: its app never runs.
            self.pipeline = type(self.pipeline)(p for p in self.pipeline if p[0] is not cycle)
            ready = False
        elif cycle.response_started:
            # Its own answer is out (a 404 before the body, say): that answer stands,
            # and the connection ends after it.
            self._answer = False
            ready = cycle.response_complete
        else:
            # Its app waits for the body: it sees a disconnect, and nothing it would
            # send is written.
            cycle.disconnected = True
            cycle.wake()
            ready = True
        if ready:
            self._finish()

    def _refuse_over_cap(self) -> None:
        count, since = self.capped
        now = self.loop.time()
        if now - since >= CAP_LOG_INTERVAL:
            self.logger.warning(
                "refused %d connection(s) over server.max_connections (%d) with 503",
                count + 1,
                self._server.max_connections,
            )
            self.capped[:] = [0, now]
        else:
            self.capped[0] = count + 1
        self._refuse(
            TooManyConnections(
                f"The gateway has {self._server.max_connections} connections open "
                "(server.max_connections); nothing was read or forwarded.",
                headers={"Retry-After": "1"},
            ),
            log=False,
        )

    def _refused_head(self) -> bool:
        """Whether the refused request is a HEAD, whose answer has no body (RFC 9110
        9.3.2): the one being parsed, or the cycle's when its head was complete."""
        if not self._in_head:
            return bool(self.scope.get("method") == "HEAD")
        if not self._url_bytes:
            return False  # llhttp still holds the method of the request before
        try:
            return bool(self.parser.get_method() == b"HEAD")
        except Exception:  # no method parsed yet
            return False

    def _finish(self) -> None:
        refusal = self._refusal
        if self._answer and refusal is not None and not self.transport.is_closing():
            status, headers, payload = refusal.render()
            if self._refused_head():
                payload = b""  # the headers (Content-Length included) as a GET's would be
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
            headers = [*self.server_state.default_headers, (b"date", http_date()), *headers]
            lines += [name + b": " + value + b"\r\n" for name, value in headers]
            lines.append(b"connection: close\r\n\r\n")
            self.transport.write(b"".join(lines) + payload)
        self._linger()

    def _linger(self) -> None:
        """Half-close, then drop what still arrives before closing. A close with bytes
        unread makes the kernel send a RST, and a RST can destroy what the client has
        not read yet: the answer just written, or the connection it was about to send
        a request on (it gets a clean end of stream instead, and knows the request
        was never read)."""
        self._stopped = self._lingering = True
        self._unset_keepalive_if_required()
        self._cancel_timer()
        self.connections.discard(self)  # no longer counts against max_connections
        transport = self.transport
        if transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()
        now = self._last_read = self.loop.time()
        self._linger_until = now + LINGER_MAX
        self._timer = self.loop.call_later(LINGER, self._linger_check)

    def _linger_check(self) -> None:
        self._timer = None
        now = self.loop.time()
        left = min(self._last_read + LINGER, self._linger_until) - now
        if left <= 0:
            self.transport.close()
        else:
            self._timer = self.loop.call_later(left, self._linger_check)

    # -- server.write_timeout: the transport calls these at its high/low-water marks ----

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._unsent = self.transport.get_write_buffer_size()
            self._stall = self.loop.call_later(self._server.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _write_stalled(self) -> None:
        self._stall = None
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # it reads, if slowly: it gets another period
            self._unsent = unsent
            self._stall = self.loop.call_later(self._server.write_timeout, self._write_stalled)
            return
        self.logger.warning(
            "a caller took nothing of its response for %gs (server.write_timeout): "
            "connection closed, %d unsent bytes dropped",
            self._server.write_timeout,
            unsent,
        )
        reset(self.transport)
