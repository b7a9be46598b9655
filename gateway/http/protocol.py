"""The proxy listener: uvicorn's httptools protocol, with the gateway's answers for
requests it cannot parse, deadlines for callers that are slow on purpose, and a close
that does not lose bytes in flight.

Stock uvicorn answers an unparseable request (Content-Length with Transfer-Encoding,
two Content-Lengths, a bad chunk size, a bare LF, ...) with a text/plain 400, buffers
a request head of any size, waits forever for a head or a body that never ends, and
closes a kept-alive connection after 5 s whatever is arriving on it.
`GatewayHttpProtocol`, one class, changes that; gateway/http/cycle.py holds each
request's ASGI receive and send.

- the parsing: the head is bounded while it streams in: the request target over
  `server.max_header_bytes` gets 414, header names and values over it 431, and a head
  that is still incomplete after that many bytes (plus `READ_SLACK`) gets 431 too. A
  chunked body's trailer fields are never headers: they are dropped, and their bytes
  count against the same limit. A request target with a fragment, and any upgrade
  request, are refused;
- the connection (below): refusals in order, the head and body deadlines, the
  connection cap, the keep-alive, the write timeout, the lingering close;
- gateway/http/cycle.py, each request's ASGI receive and send: a response's head held
  until its body, so a whole answer leaves in one write, and an answer before the
  body that ends the connection.

`date_header` is off in uvicorn: a forwarded or replayed response keeps the Date it
has, and the gateway adds one (`http_date`) only to answers that have none.

The parser callbacks do uvicorn's work themselves rather than through super(): they run
for every request (on_header for every field), and each frame less is a measurable part
of a request's CPU (docs/performance.md, "Where a first request's CPU goes"). The app
checks the header total again (gateway/proxy/app.py), so in-process use without this
protocol answers the same.

The connection, apart from parsing:

- every refusal is problem+json (400, 408, 414, 431 or 503) and ends the connection,
  so nothing after a request the parser gave up on is read as another request. It is
  written only once the responses to the requests before it on the connection are
  (pipelining keeps the answers in order); a refusal of a request whose own answer has
  started is not written at all, the connection just closes after that answer;
- deadlines: `server.header_timeout` for a whole head (from the connection's start for
  its first request, from a later request's first byte), `server.body_timeout` for
  the silence between reads of a body. Either gets a 408 and a close, once a byte of
  the request has come: a connection on which no request began (opened ahead of its
  first one, or sending only the empty lines a server ignores) is closed quietly, as
  an idle kept-alive one is, since an unasked-for 408 would be read as the answer to
  the request the client writes next;
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
  the scope under CALLER_TRANSPORT (gateway/http/cycle.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar
from urllib.parse import unquote

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.config import ServerConfig
from gateway.config.units import format_duration
from gateway.errors import (
    HeadersTooLarge,
    MalformedRequest,
    ProblemError,
    RequestTimeout,
    TooManyConnections,
    UpgradeRefused,
    UriTooLong,
)
from gateway.http.cycle import CALLER_TRANSPORT, Cycle, http_date, reset, status_line

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


#: Bytes the parser is fed at a time: a read brings up to about 256 KiB (asyncio's and
#: uvloop's read size), fed in pieces of this size, so an unfinished head or trailer
#: section is cut at most this far past the limit (and counting a piece that ends one
#: message and starts the next as head bytes cannot refuse a head under the limit).
READ_SLACK = 8 * 1024


class GatewayHttpProtocol(HttpToolsProtocol):
    """A caller's connection to a listener: its requests parsed (the parser callbacks
    below), its deadlines, refusals, keep-alive, place under the connection cap, and
    end."""

    #: The listener's settings; read per connection and per request, so a config
    #: reload applies.
    settings: Callable[[], ServerConfig] = staticmethod(ServerConfig)
    #: This listener's idle kept-alive connections, oldest first: the ones a connection
    #: over server.max_connections closes to make room (protocol_for gives each
    #: listener its own).
    idle: ClassVar[dict[GatewayHttpProtocol, None]] = {}
    #: Connections refused over the cap since the last log line about them, and when.
    capped: ClassVar[list[float]] = [0, 0.0]
    #: What a refused request did not get, in this listener's words (its refusals'
    #: details end with it): the proxy's are forwarded, the admin listener's acted on.
    unserved: ClassVar[str] = "it was not forwarded"
    #: The request being read or answered, and those pipelined behind it: the
    #: gateway's cycle (gateway/http/cycle.py), not uvicorn's.
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
        self._began = False  # a byte of the next request came (its request line began)
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
        self.linger()

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
        if not self._began:
            # No request began: nothing was refused, so nothing is answered. A client
            # that writes its request here later reads the close (and may retry on a
            # new connection), never a 408 it did not cause.
            self.linger()
            return
        self._refuse(
            RequestTimeout(
                f"The request head was not complete within {format_duration(timeout)} "
                f"(server.header_timeout); {self.unserved}."
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
                f"(server.body_timeout); {self.unserved}."
            )
        )

    # --- refusals and the end of a connection ----------------------------------------

    def send_400_response(self, msg: str) -> None:
        refusal = self._refusal or self.malformed(
            "The request is not valid HTTP/1.1 (for example: Content-Length together with "
            "Transfer-Encoding, two Content-Lengths, a bad chunk, a malformed line, a raw "
            "line break or a byte over 0x7F in the target), so the gateway cannot tell "
            f"where it ends; {self.unserved}."
        )
        self._refuse(refusal)

    def malformed(self, detail: str) -> ProblemError:
        """The refusal of a request that is not valid HTTP/1.1, in this listener's type."""
        return MalformedRequest(detail)

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
                "(server.max_connections); nothing was read from this one.",
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
            lines = [status_line(status)]
            default = self.server_state.default_headers
            if not any(name == b"date" for name, _ in default):  # the proxy's: no Date
                default = [*default, (b"date", http_date())]
            headers = [*default, *headers]
            lines += [name + b": " + value + b"\r\n" for name, value in headers]
            lines.append(b"connection: close\r\n\r\n")
            self.transport.write(b"".join(lines) + payload)
        self.linger()

    def linger(self) -> None:
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

    # --- parsing ----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        now = self._last_read = self.loop.time()
        if self._stopped:
            return  # refused or lingering: what comes now is read and dropped
        if self.timeout_keep_alive_task is not None:
            self._unset_keepalive_if_required()
        if self._in_head and self._head_since is None:
            self._head_since = now  # a later request's first byte: its deadline starts
        if len(data) <= READ_SLACK:
            self._feed(data)
        else:
            view = memoryview(data)
            for start in range(0, len(data), READ_SLACK):
                self._feed(view[start : start + READ_SLACK])  # type: ignore[arg-type]
                if self._stopped or self.parser is None or self.parser.should_upgrade():
                    break
        if self._stopped or self._timer is not None:
            return
        # Armed only for what did not finish within this read: a request that arrives
        # whole costs no timer.
        if not self._in_head:
            self._timer = self.loop.call_later(self._server.body_timeout, self._body_idle)
        elif self._head_since is not None:
            self._timer = self.loop.call_at(
                self._head_since + self._server.header_timeout, self._head_deadline
            )

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            # on_headers_complete refuses every upgrade, so llhttp never gets here with
            # one; stock uvicorn would only log it too.
            self.logger.warning("Unsupported upgrade request.")
        if (self._in_head or self._trailing) and not self._stopped:
            self._head_bytes += len(data)
            if self._head_bytes > self._limit + READ_SLACK:
                what = "head" if self._in_head else "trailer section"
                self._refuse(
                    HeadersTooLarge(
                        f"The request {what} is over {self._head_bytes} bytes and not "
                        f"finished; the limit is {self._limit}."
                    )
                )

    # --- parser callbacks ----------------------------------------------------------
    # What they leave out of uvicorn's: the websocket upgrade (the gateway refuses
    # upgrades, in on_headers_complete, so no body or message of one is ever parsed).

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        server = self._server = self.settings()
        self._limit = server.max_header_bytes
        self.timeout_keep_alive = server.keep_alive  # type: ignore[assignment]
        self._in_head = self._began = True
        if self._head_since is None:
            self._head_since = self._last_read
        self._url_bytes = self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self._limit:
            # Raising stops the parser; uvicorn then calls send_400_response.
            self._refusal = UriTooLong(
                f"The request target is over {self._limit} bytes, the gateway's limit."
            )
            raise self._refusal
        if b"#" in url:
            # RFC 9112 3.2: a request target has no fragment. Dropping it (what the URL
            # parser would do) forwards a request the caller did not write.
            self._refusal = self.malformed(
                "The request target has a fragment (#...), which HTTP requests do not "
                f"carry; {self.unserved}."
            )
            raise self._refusal
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self._limit:
            self._refusal = HeadersTooLarge(
                f"The request headers are over {self._header_bytes} bytes; "
                f"the limit is {self._limit}."
            )
            raise self._refusal
        # After the head, a field is a trailer: uvicorn would append it to the
        # request's headers (the scope's list) whenever it arrives in the same read as
        # the head. The gateway forwards no trailers, so it drops them.
        if self._in_head:
            name = name.lower()
            if name == b"expect" and value.lower() == b"100-continue":
                self.expect_100_continue = True
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        if parser.should_upgrade():
            # llhttp reads nothing after an upgrade request as HTTP any more (its body
            # and any pipelined request would be lost or misread), and the gateway
            # speaks HTTP/1.1 only: refused. Raising stops the parser (see on_url).
            self._refusal = UpgradeRefused(
                "The request asks to switch protocols (Connection: upgrade); the gateway "
                "speaks HTTP/1.1 only."
            )
            raise self._refusal
        # The target is read while the head still counts as unfinished, so a refusal of
        # it is answered like any head's (after the requests pipelined before it).
        try:
            parsed_url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            parsed_url = None
        if parsed_url is None or parsed_url.path is None:
            # `http://host` or `http://host?q` (absolute-form without a path): llhttp
            # passes it, and no path means nothing a route could match.
            self._refusal = self.malformed(
                "The request target has no path (for example `http://host` without `/`); "
                f"{self.unserved}."
            )
            raise self._refusal
        self._in_head = False
        self._head_since = None
        self._head_bytes = 0
        if self._timer is not None:
            self._cancel_timer()
        scope = self.scope
        http_version = parser.get_http_version()
        method = scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        raw_path = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed_url.query or b""
        app = self.app
        if self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency
            or len(self.tasks) >= self.limit_concurrency
        ):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        existing = self.cycle
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        # A HEAD answer has no body write for its head to wait for (gateway/http/cycle.py).
        hold = method != "HEAD"
        cycle = self.cycle = Cycle(self, scope, keep_alive, self.expect_100_continue, hold)
        scope[CALLER_TRANSPORT] = self.transport  # type: ignore[literal-required]
        if existing is None or existing.response_complete:
            cycle.start(app)
        else:
            # Pipelined: it waits for the responses before it (on_response_complete).
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))

    def on_chunk_header(self) -> None:
        # The last chunk's header is followed by the trailer section, any other by
        # data: until data comes, what arrives counts as trailer bytes.
        self._trailing = True
        self._head_bytes = self._header_bytes

    def on_chunk_complete(self) -> None:
        self._trailing = False

    def on_body(self, body: bytes) -> None:
        self._trailing = False
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if not cycle.response_complete:
            cycle.more_body = False
            cycle.wake()
        self._url_bytes = 0
        self._in_head = True
        self._began = False
        self._trailing = False
        self._head_bytes = 0
        if self._timer is not None:
            self._cancel_timer()


def protocol_for(
    settings: Callable[[], ServerConfig], base: type[GatewayHttpProtocol] = GatewayHttpProtocol
) -> type[GatewayHttpProtocol]:
    """The protocol class uvicorn instantiates per connection of one listener (`base`:
    the proxy's, or the admin listener's wording of the same), reading `settings`; its
    idle connections and cap log are the listener's own."""
    return type(
        base.__name__,
        (base,),
        {"settings": staticmethod(settings), "idle": {}, "capped": [0, 0.0]},
    )
