"""The upstream HTTP client: forwarding, header hygiene, one deadline, outcome classes.

A small HTTP/1.1 client of the gateway's own: a keep-alive pool per origin on asyncio
protocols, with httptools (llhttp, the parser uvicorn uses) reading the answers. It
replaced aiohttp by measurement (README, design; docs/performance.md): forwarding is
what the gateway does on every first request, and aiohttp's general-purpose client
(cookies, redirects, auth, proxies, retries, tracing) cost more CPU per request than
the whole idempotency layer. The gateway needs one thing: send these bytes, read one
whole answer, and know exactly how far it got when something breaks.

How a failure is classified is decided here and only here:
- NotSent: connection refused, DNS failure, connect timeout, no pooled connection in
  time, a header that cannot be written. Not one byte of the request left, so the key
  may be released and the work run again.
- OutcomeLost: the deadline passed, or the connection broke or spoke nonsense, after
  the request may have been sent. The upstream may have done the work: never resend.
  That includes an answer cut off after its status line (a streaming endpoint sends
  "200" before its work is done), and a body that never ends or outgrows
  `max_response_body`: the status received is kept on the error, for the record.

The client never resends anything: a request goes out on one connection, once. (A
general-purpose client retries an idempotent method once when a kept-alive connection
breaks before the answer's headers; for the gateway that would be a blind resend.)
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

from gateway.errors import NotSent, OutcomeLost

#: RFC 9110 7.6.1, plus headers that describe the framing of one hop's message.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "expect",  # the gateway holds the whole body and answers 100-continue itself
    }
)


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    status: int
    #: hop-by-hop headers removed; the body is the raw bytes, still content-encoded
    headers: tuple[tuple[str, str], ...]
    body: bytes


def forwarded_headers(
    headers: list[tuple[str, str]], client: str | None, scheme: str
) -> list[tuple[str, str]]:
    """The caller's headers as the upstream should see them: hop-by-hop ones (and any
    the Connection header names) removed, X-Forwarded-For/-Proto/-Host added."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name == "connection"
        for token in value.split(",")
    }
    out: list[tuple[str, str]] = []
    host = ""
    prior_for = ""
    for name, value in headers:
        if name == "host":
            host = value
        elif name == "x-forwarded-for":
            prior_for = value
        elif name in ("x-forwarded-proto", "x-forwarded-host"):
            continue
        elif name not in HOP_BY_HOP and name not in named:
            out.append((name, value))
    if client:
        out.append(("x-forwarded-for", f"{prior_for}, {client}" if prior_for else client))
    out.append(("x-forwarded-proto", scheme))
    if host:
        out.append(("x-forwarded-host", host))
    return out


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for name, value in raw:
        lowered = name.decode("latin-1").lower()
        if lowered not in HOP_BY_HOP:
            out.append((lowered, value.decode("latin-1")))
    return tuple(out)


class _Broken(Exception):
    """How an exchange ended without a whole answer; becomes OutcomeLost."""

    def __init__(self, reason: str, status: int | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class _Stop(Exception):
    """Raised in a parser callback to stop the parser (httptools wraps it)."""


class _Exchange:
    """One request's answer as httptools parses it; its callbacks are the parser's."""

    __slots__ = (
        "chunks",
        "complete",
        "error",
        "future",
        "head",
        "headers",
        "in_body",
        "keep_alive",
        "limit",
        "parser",
        "size",
        "status",
        "until_close",
    )

    def __init__(self, future: asyncio.Future[UpstreamResponse], head: bool, limit: int) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.future = future
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.head = head
        self.until_close = False  # no Content-Length, not chunked: the body ends at EOF
        self.in_body = False  # the head is read; what is cut off now is the body
        self.complete = False
        self.keep_alive = False
        self.error: _Broken | None = None

    # -- httptools callbacks ------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        # The status line is in, the headers may never be: it already says the
        # request arrived, and it goes on the record.
        status = self.parser.get_status_code()
        if status >= 200:
            self.status = status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            self.headers = []  # 100 Continue, 103 Early Hints: the answer follows
            return
        self.status = status
        self.in_body = True
        length: int | None = None
        chunked = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length":
                length = int(value)  # llhttp has checked it is a number
            elif lowered == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if self.head:
            self._finish(keep_alive=False)  # no body follows; the connection is not reused
            raise _Stop
        if length is not None and length > self.limit:
            self._fail_too_large()
        self.until_close = length is None and not chunked and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.limit:
            self._fail_too_large()
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.status is None:
            return  # the end of a 1xx answer
        self._finish(keep_alive=self.parser.should_keep_alive())

    # -- outcomes -----------------------------------------------------------------------

    def _fail_too_large(self) -> None:
        self.error = _Broken(
            f"the upstream answered {self.status} with a body larger than "
            f"max_response_body ({self.limit} bytes); reading stopped",
            self.status,
        )
        raise _Stop

    def _finish(self, *, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive
        if not self.future.done():
            assert self.status is not None
            self.future.set_result(
                UpstreamResponse(self.status, response_headers(self.headers), b"".join(self.chunks))
            )

    def fail(self, error: _Broken) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.complete:
            return
        if self.until_close and self.error is None and exc is None:
            self._finish(keep_alive=False)
            return
        after = _after(self.status)
        if self.error is not None:
            self.fail(self.error)
        elif self.in_body:
            detail = "" if exc is None else f": {type(exc).__name__}: {exc}"
            self.fail(_Broken(f"the body was cut off{after}{detail}", self.status))
        elif exc is not None:
            self.fail(_Broken(f"connection broke{after}: {type(exc).__name__}: {exc}", self.status))
        else:
            self.fail(_Broken(f"the upstream closed the connection{after}", self.status))


class _Connection(asyncio.Protocol):
    """One kept-alive connection to an origin; carries one exchange at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted
            return
        try:
            exchange.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # _Stop from a callback: the exchange says why
        except httptools.HttpParserUpgrade:
            exchange.error = _Broken("the upstream switched protocols", exchange.status)
        except httptools.HttpParserError as exc:
            reason = f"the upstream's answer is not valid HTTP{_after(exchange.status)}: {exc}"
            exchange.error = _Broken(reason, exchange.status)
        if exchange.complete:
            self.detach()
            # Bytes after the answer that are not HTTP: the connection is out of step.
            self.pool.release(self, reusable=exchange.keep_alive and exchange.error is None)
        elif exchange.error is not None:
            exchange.fail(exchange.error)
            self.close()

    def eof_received(self) -> bool:
        # The upstream closed its side; connection_lost follows, one callback later.
        # Out of the pool now: a request written here in between would be lost.
        self.closed = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange = self.detach()
        if exchange is not None:
            exchange.connection_lost(exc)
        self.pool.lost(self)

    def detach(self) -> _Exchange | None:
        """The connection is done with its exchange (answered, failed or abandoned):
        let go of it, once. The exchange's parser holds the exchange's bound methods
        and the exchange holds the parser, a reference cycle that only the garbage
        collector would free, the response and its future with it; breaking it here
        frees each request's objects as it ends (the collector's passes over them
        cost about 8% of the gateway's CPU)."""
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            del exchange.parser
        return exchange

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class _Pool:
    """Kept-alive connections to one origin, at most `limit` open at once."""

    def __init__(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        limit: int,
        keepalive: float,
    ) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl_context
        self.limit = limit
        self.keepalive = keepalive
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self.waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self.connecting = 0

    async def acquire(self, timeout: float) -> _Connection:
        """A connection ready for a request, or NotSent."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive:
                return connection
            connection.close()
        if len(self.open) + self.connecting >= self.limit:
            waiter: asyncio.Future[_Connection | None] = loop.create_future()
            self.waiters.append(waiter)
            try:
                handed = await asyncio.wait_for(waiter, timeout)
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._hand_back(waiter.result())  # it came as we gave up: pass it on
                else:
                    with contextlib.suppress(ValueError):
                        self.waiters.remove(waiter)
                if isinstance(exc, TimeoutError):
                    raise NotSent(
                        f"no upstream connection came free within {timeout:g}s "
                        f"({self.limit} are open)"
                    ) from None
                raise
            if handed is not None:
                return handed
            timeout = max(0.0, timeout - (loop.time() - now))
        return await self._connect(timeout)

    async def _connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(self)
        self.connecting += 1
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(
                    lambda: connection,
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                )
        except BaseException as exc:
            self.connecting -= 1
            connection.close()
            self._wake()  # the slot it would have taken is free again
            if isinstance(exc, TimeoutError):
                raise NotSent(
                    f"connect to {self.host}:{self.port} timed out after {timeout:g}s"
                ) from None
            if isinstance(exc, OSError):
                raise NotSent(f"could not connect to {self.host}:{self.port}: {exc}") from exc
            raise
        self.connecting -= 1
        if connection.closed:  # the upstream hung up at once
            self._wake()
            raise NotSent(f"{self.host}:{self.port} closed the connection as it opened")
        self.open.add(connection)
        return connection

    def release(self, connection: _Connection, *, reusable: bool) -> None:
        if not reusable or connection.closed:
            connection.close()
            return  # connection_lost takes it out and wakes a waiter
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        connection.idle_since = asyncio.get_running_loop().time()
        self.idle.append(connection)

    def _hand_back(self, connection: _Connection | None) -> None:
        if connection is None:
            self._wake()
        else:
            self.release(connection, reusable=True)

    def lost(self, connection: _Connection) -> None:
        if connection in self.open:
            self.open.discard(connection)
            with contextlib.suppress(ValueError):
                self.idle.remove(connection)
            self._wake()

    def _wake(self) -> None:
        """A connection slot came free: let one waiter open a connection of its own."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for connection in list(self.open):
            connection.close()
        self.idle.clear()


@dataclass(frozen=True, slots=True)
class _Origin:
    pool: _Pool
    host_header: str
    authorization: str | None  # from user:password@ in the upstream URL


class Upstream:
    """The process's client: one pool per origin; started and closed by the app's
    lifespan."""

    def __init__(self, *, connections: int = 256, keepalive: float = 2.0) -> None:
        # Idle connections are dropped well before common servers' keep-alive
        # timeouts (uvicorn: 5 s): a POST on a connection the server just closed
        # would fail after it may have been sent, and park the key for nothing.
        self._connections = connections
        self._keepalive = keepalive
        self._origins: dict[str, _Origin] = {}
        self._ssl: ssl.SSLContext | None = None
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._started = False
        for origin in self._origins.values():
            origin.pool.close()
        self._origins.clear()

    def _origin(self, authority: str, tls: bool) -> _Origin:
        key = ("https://" if tls else "http://") + authority
        origin = self._origins.get(key)
        if origin is None:
            parts = urlsplit(key)
            host = parts.hostname or ""
            port = parts.port or (443 if tls else 80)
            if tls and self._ssl is None:
                self._ssl = ssl.create_default_context()
            hostport = authority.rpartition("@")[2]
            authorization = None
            if parts.username is not None:
                secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
                authorization = "Basic " + base64.b64encode(secret.encode()).decode("ascii")
            pool = _Pool(host, port, self._ssl if tls else None, self._connections, self._keepalive)
            origin = self._origins[key] = _Origin(pool, hostport, authorization)
        return origin

    async def forward(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        deadline: float,
        max_body: int,
    ) -> UpstreamResponse:
        """Send one request and read the whole response, at most `max_body` bytes of
        body, within `deadline` seconds.

        Raises NotSent or OutcomeLost (see the module docstring); never anything else
        for a network or protocol failure.
        """
        if not self._started:
            raise RuntimeError("Upstream.forward before start()")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline
        tls = url.startswith("https://")
        rest = url[8:] if tls else url[7:]
        slash = rest.find("/")
        authority, target = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
        origin = self._origin(authority, tls)
        request = _request_bytes(method, target, origin, headers, body)
        # Connecting (pool wait included) gets part of the deadline and its own error,
        # so a slow connect is known to be "never sent" rather than "unknown".
        connection = await origin.pool.acquire(deadline * 0.9)
        future: asyncio.Future[UpstreamResponse] = loop.create_future()
        exchange = _Exchange(future, method == "HEAD", max_body)
        connection.exchange = exchange
        assert connection.transport is not None
        connection.transport.write(request)
        timer = loop.call_at(give_up, _expire, future)
        try:
            return await future
        except TimeoutError:
            raise OutcomeLost(
                f"no complete answer within {deadline:g}s{_after(exchange.status)}",
                exchange.status,
            ) from None
        except _Broken as exc:
            raise OutcomeLost(exc.reason, exc.status) from None
        finally:
            timer.cancel()
            if not exchange.complete:
                connection.detach()
                connection.close()  # an exchange cut short leaves the connection unusable


def _expire(future: asyncio.Future[UpstreamResponse]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _request_bytes(
    method: str, target: str, origin: _Origin, headers: list[tuple[str, str]], body: bytes
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {origin.host_header}\r\n"]
    authorization = origin.authorization
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
        if name == "authorization":
            authorization = None  # the caller's own credentials win
    if authorization is not None:
        lines.append(f"authorization: {authorization}\r\n")
    if body or method in _BODY_METHODS:
        lines.append(f"content-length: {len(body)}\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    # One line per header: a CR or LF inside a value or the target would start a
    # header (or a request) of its own on the upstream.
    breaks = len(lines) + 1  # the first holds the request line and host
    if text.count("\n") != breaks or text.count("\r") != breaks:
        raise NotSent("a header or the path holds a line break; the request was not sent")
    try:
        head = text.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise NotSent(f"a header holds a character HTTP cannot carry: {exc}") from None
    return head + body


#: Methods whose requests carry Content-Length even when the body is empty (RFC 9110 8.6).
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _after(status: int | None) -> str:
    return f" after it answered {status}" if status is not None else ""
