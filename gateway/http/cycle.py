"""One request and its answer on a caller's connection: the ASGI receive and send the
proxy listener (gateway/http/protocol.py) gives the app, in place of uvicorn's
RequestResponseCycle, whose wire format it keeps.

What it does that uvicorn's does not:

- the status line and headers are held until the first body write, so a response sent
  whole leaves in one write (one syscall where uvicorn makes two; most of the
  gateway's answers are whole). A large first body write goes after the head instead
  of being copied onto it. A 100 Continue goes out at once, and a HEAD answer, which
  has no body write to wait for, is not held;
- an answer that starts before its request's body has all arrived (a 404 or a 413 by
  Content-Length, before the app read the body; an Expect: 100-continue request
  refused before its 100) says Connection: close and ends the connection: the client
  may send the rest of the body or not, so what follows cannot be framed, and reading
  and discarding a body that never ends would hold the connection forever. The close
  is the listener's lingering one, so the answer is not lost to a reset while the
  client is still sending;
- the header checks run once over all the names and once over all the values, and
  the app's wake-ups are a flag and, only when the app waits, a future: it is on every
  request's path (docs/performance.md, "Where a first request's CPU goes");
- an app that fails before its answer started gets problem+json `internal-error`
  written for it (`internal_error`: the cause logged with its traceback, never
  answered), not a text/plain 500.

The app finds the caller's transport in the scope under CALLER_TRANSPORT: it cuts off
a streamed response with it, and server.write_timeout gives up on a caller through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import struct
import time
from email.utils import formatdate
from typing import Any, Protocol

from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string
from uvicorn.server import ServerState

from gateway.errors import InternalError
from gateway.records import is_status

#: The scope key under which the app finds the response's transport.
CALLER_TRANSPORT = "gateway.transport"

#: A body write at least this large goes out as it is, after the held head, rather
#: than copied onto it.
COALESCE_BELOW = 64 * 1024

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_date_second = -1
_date_value = b""


def http_date() -> bytes:
    """Now as an HTTP Date value, formatted once per second."""
    global _date_second, _date_value
    now = int(time.time())
    if now != _date_second:
        _date_second, _date_value = now, formatdate(now, usegmt=True).encode()
    return _date_value


#: uvicorn's status lines, one for every code from 100 to 599 (the reason phrase empty
#: where HTTP names none), of the codes that are an HTTP status (records.is_status):
#: filtered once here rather than checked on every answer.
_STATUS_LINES = {code: line for code, line in STATUS_LINE.items() if is_status(code)}


def status_line(status: int) -> bytes:
    """The status line of an answer the gateway writes. Any code but 100 to 599 is no
    HTTP status (records.is_status) and is never written: ValueError."""
    line = _STATUS_LINES.get(status)
    if line is None:
        raise ValueError(f"{status} is no HTTP status (100 to 599); it is never sent")
    return line


def internal_error(exc: BaseException | None, scope: Any, route: str | None) -> InternalError:
    """The answer to a request whose handling failed unexpectedly, and the log line
    that names the cause (with its traceback, when there is an exception). The answer
    says what a caller can do; it never carries the exception's text, which may hold
    internals or data that is not the caller's."""
    logging.getLogger("gateway").error(
        "unexpected error answering %s %s (route %s): %s",
        scope.get("method", ""),
        get_path_with_query_string(scope) if "path" in scope else "",
        route or "none",
        "" if exc is None else repr(exc),
        exc_info=exc,
    )
    return InternalError(
        "An unexpected error stopped the gateway while it handled this request; its "
        "log names the cause. If the request has an idempotency key, send it again with "
        "the same key: the key's record decides whether it runs, so it never runs twice "
        "because of this.",
        route=route,
    )


def reset(transport: Any) -> None:
    """Close a caller's connection at once with a reset, its unsent bytes dropped: for a
    caller that stopped reading, a plain close would leave them (and the socket's
    buffers, megabytes) waiting in the kernel for a reader that never comes."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class Caller(Protocol):
    """What a cycle uses of its caller's connection: uvicorn's protocol's parts and the
    lingering close (gateway/http/protocol.py's `GatewayHttpProtocol` is one)."""

    config: Config
    loop: asyncio.AbstractEventLoop
    logger: logging.Logger
    access_logger: logging.Logger
    access_log: bool
    server_state: ServerState
    tasks: set[asyncio.Task[None]]
    transport: asyncio.Transport
    flow: FlowControl

    def on_response_complete(self) -> None: ...

    def linger(self) -> None: ...


class Cycle:
    """A request's body on its way to the app, and the app's answer on its way out."""

    __slots__ = (
        "_head",
        "_holds",
        "_protocol",
        "_ready",
        "_waiter",
        "body",
        "chunked_encoding",
        "disconnected",
        "expected_content_length",
        "flow",
        "keep_alive",
        "more_body",
        "response_complete",
        "response_started",
        "scope",
        "transport",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        protocol: Caller,
        scope: Any,
        keep_alive: bool,
        expect_100_continue: bool,
        hold: bool,
    ) -> None:
        self._protocol = protocol
        self.scope = scope
        self.transport: asyncio.Transport = protocol.transport
        self.flow = protocol.flow
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = bytearray()
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None
        self.expected_content_length = 0
        self._holds = hold  # the head waits for the body; the close lingers
        self._head: bytes | None = None if hold else b""  # None: nothing held yet; b"": out
        self._ready = False  # something for receive(): body, its end, or the end of all
        self._waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        """Tell receive() there is news (uvicorn's message_event.set())."""
        self._ready = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- the app -------------------------------------------------------------------

    def start(self, app: Any) -> None:
        protocol = self._protocol
        if protocol.config.reset_contextvars:
            # uvicorn's opt-in workaround for context vars leaking between tasks.
            task = protocol.loop.create_task(self.run_asgi(app), context=contextvars.Context())
        else:
            task = protocol.loop.create_task(self.run_asgi(app))
        task.add_done_callback(protocol.tasks.discard)
        protocol.tasks.add(task)

    async def run_asgi(self, app: Any) -> None:
        logger = self._protocol.logger
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            if not self.response_started:
                await self.send_500_response(exc)
            else:
                logger.error("Exception in ASGI application\n", exc_info=exc)
                self._close()
        else:
            if result is not None:
                logger.error("ASGI callable should return None, but returned '%s'.", result)
                self._close()
            elif not self.response_started and not self.disconnected:
                logger.error("ASGI callable returned without starting response.")
                await self.send_500_response(None)
            elif not self.response_complete and not self.disconnected:
                logger.error("ASGI callable returned without completing response.")
                self._close()

    async def send_500_response(self, exc: BaseException | None) -> None:
        """problem+json `internal-error` in place of uvicorn's text/plain 500 (the
        cause logged by `internal_error`), and the connection's end."""
        _, headers, payload = internal_error(exc, self.scope, None).render()
        headers.append((b"connection", b"close"))
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": payload, "more_body": False})

    # --- ASGI ----------------------------------------------------------------------

    async def receive(self) -> Any:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            if self.flow.read_paused:
                self.flow.resume_reading()
            if not self._ready:
                self._waiter = self._protocol.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            self._ready = False
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    async def send(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
                )
            self._send_head(message["status"], message.get("headers", []))
        elif not self.response_complete:
            if message["type"] != "http.response.body":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
                )
            more_body = message.get("more_body", False)
            self._send_body(message.get("body", b""), more_body)
            if not more_body:
                if self.expected_content_length != 0:
                    raise RuntimeError("Response content shorter than Content-Length")
                self.response_complete = True
                self.wake()
                if not self.keep_alive:
                    self._close()
                self._protocol.on_response_complete()
        else:
            raise RuntimeError(
                f"Unexpected ASGI message '{message['type']}' sent, after response already "
                "completed."
            )

    # --- the wire ------------------------------------------------------------------

    def _send_head(self, status: int, app_headers: Any) -> None:
        # Before the answer counts as started: a code no status line is written for
        # fails the app, and the caller gets run_asgi's 500 instead of nothing.
        line = status_line(status)
        self.response_started = True
        self.waiting_for_100_continue = False
        protocol = self._protocol
        default = protocol.server_state.default_headers
        headers = default + list(app_headers) if default else app_headers
        if protocol.access_log:
            protocol.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(self.scope),
                self.scope["method"],
                get_path_with_query_string(self.scope),
                self.scope["http_version"],
                status,
            )
        names = b"".join([name for name, _ in headers])
        values = [value for _, value in headers]
        # One search over all names, one over all values (the patterns match single
        # bytes, so this finds what uvicorn's per-field searches find).
        if HEADER_RE.search(names):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(b"".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        content = [line]
        close = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection":
                if b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    close = True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not close:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status not in (204, 304)
        ):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        if self._head is None:
            if self.more_body and self.keep_alive:
                self.keep_alive = False  # the answer came before the body: the end
                content.append(b"connection: close\r\n")
            content.append(b"\r\n")
            self._head = b"".join(content)  # written with the first body write
        else:
            content.append(b"\r\n")
            self.transport.write(b"".join(content))

    def _send_body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
            return
        if self.chunked_encoding:
            content = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more_body:
                content.append(b"0\r\n\r\n")
            data = b"".join(content)
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            data = body
        head = self._head
        if head:
            self._head = b""
            if len(data) >= COALESCE_BELOW:
                self.transport.write(head)  # one write more, not a copy of the body
            else:
                data = head + data
        self.transport.write(data)

    def _close(self) -> None:
        if self._head:  # the app never sent its body: the head goes, as uvicorn's would
            self.transport.write(self._head)
            self._head = b""
        if self._holds:
            self._protocol.linger()
        else:
            self.transport.close()
