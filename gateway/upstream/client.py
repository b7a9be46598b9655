"""The upstream HTTP client: a request sent once, one deadline, outcome classes.

A small HTTP/1.1 client of the gateway's own: a keep-alive pool per origin on asyncio
protocols, with httptools (llhttp, the parser uvicorn uses) reading the answers. It
replaced aiohttp by measurement (README, design; docs/performance.md): forwarding is
what the gateway does on every first request, and aiohttp's general-purpose client
(cookies, redirects, auth, proxies, retries, tracing) cost more CPU per request than
the whole idempotency layer. The gateway needs one thing: send these bytes, read one
whole answer, and know exactly how far it got when something breaks.

How a failure is classified is decided by one rule, stated here and only here:
- NotSent: connection refused, DNS failure, connect timeout, no pooled connection in
  time, a header that cannot be written. Not one byte of the request left, so the key
  may be released and the work run again. A kept-alive connection is looked at just
  before the request is written to it (see Pool._fit in gateway/upstream/pool.py): one the
  upstream has closed, or that holds bytes nobody asked for, is retired and another
  taken, so a request is never written where it cannot arrive.
- OutcomeLost: the deadline passed, or the connection broke or spoke nonsense, after
  the request may have been sent. The upstream may have done the work: never resend.
  That includes an answer cut off after its status line (a streaming endpoint sends
  "200" before its work is done), a body that never ends or outgrows
  `max_response_body`, a response head over MAX_RESPONSE_HEAD bytes or
  MAX_RESPONSE_FIELDS fields, and a body delimited by the connection's end whose TLS
  connection ended without close_notify: the status received is kept on the error,
  for the record. Once the request's bytes were handed to the transport, an end of
  the connection without an answer is OutcomeLost, whatever it looks like: the
  upstream may have read the request before it closed.

The line between them is where `forward` hands the request's bytes to the transport.
Before it, only the pool (gateway/upstream/pool.py: no connection) and `_request_bytes` (here:
an unsendable head) fail, as NotSent. After it, every failure is a `Broken`
(gateway/upstream/response.py), whatever found it (the parser in gateway/upstream/parser.py, the
connection, a deadline), and it becomes OutcomeLost: in `forward`, or for a body
handed on in parts in `BodyStream.read` and `.finished` (where a reader given up on is
OutcomeLost too). No other module raises either. An exception nobody foresaw (a fault
of the gateway's own) is classified by the same line, and logged with its traceback:
NotSent before it, OutcomeLost after, so a caller of `forward` never has to guess.

The client never resends anything: a request goes out on one connection, once. (A
general-purpose client retries an idempotent method once when a kept-alive connection
breaks before the answer's headers; for the gateway that would be a blind resend.)
"""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from gateway.errors import NotSent, OutcomeLost
from gateway.upstream.parser import Exchange
from gateway.upstream.pool import Pool
from gateway.upstream.response import Broken, ResponseBudget, UpstreamResponse, after_status

log = logging.getLogger("gateway.upstream")


@dataclass(frozen=True, slots=True)
class _Origin:
    pool: Pool
    host_header: str
    authorization: str | None  # from user:password@ in the upstream URL


class Upstream:
    """The process's client: one pool per origin; started and closed by the app's
    lifespan."""

    def __init__(self, *, connections: int = 256, keepalive: float = 1.0) -> None:
        # `keepalive` is server.upstream_keep_alive (the default is the same):
        # idle connections are retired before common servers' keep-alive timeouts
        # (gunicorn: 2 s; uvicorn, node: 5 s), since a request written as the server
        # closes its end is lost after it may have been read, and parks the key.
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
            pool = Pool(host, port, self._ssl if tls else None, self._connections, self._keepalive)
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
        budget: ResponseBudget | None = None,
        whole_up_to: int = 0,
        read_to_end: bool = False,
    ) -> UpstreamResponse:
        """Send one request and read the whole response, at most `max_body` bytes of
        body, within `deadline` seconds.

        With `budget`: a body longer than `whole_up_to` bytes (or one the budget has
        no room for) comes back as soon as that is known, as `rest` (a BodyStream);
        `read_to_end` for a key's answer, whose end decides the key (see BodyStream).
        A body read whole is counted in the budget as `held` until its writer
        releases it.

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
        try:
            origin = self._origin(authority, tls)
            request = _request_bytes(method, target, origin, headers, body)
            # Connecting (pool wait included) gets part of the deadline and its own
            # error, so a slow connect is known to be "never sent" rather than "unknown".
            connection = await origin.pool.acquire(deadline * 0.9)
        except NotSent:
            raise
        except Exception as exc:  # a fault of the gateway's own: nothing has left
            log.exception("a request to %s failed before it was sent", authority)
            raise NotSent(f"the gateway failed before sending ({type(exc).__name__})") from exc
        future: asyncio.Future[UpstreamResponse] = loop.create_future()
        exchange = Exchange(future, method == "HEAD", max_body)
        exchange.connection = connection
        if budget is not None:
            exchange.budget = budget
            exchange.hold = whole_up_to
            exchange.read_to_end = read_to_end
        connection.exchange = exchange
        assert connection.transport is not None
        connection.transport.write(request)
        timer = loop.call_at(give_up, _expire, future)
        handed = False
        try:
            response = await future
            if response.rest is not None:
                response.rest.begin(give_up, deadline)
            handed = True
            return response
        except TimeoutError:
            raise OutcomeLost(
                f"no complete answer within {deadline:g}s{after_status(exchange.status)}",
                exchange.status,
            ) from None
        except Broken as exc:
            raise OutcomeLost(exc.reason, exc.status) from None
        except Exception as exc:  # a fault of the gateway's own, after the bytes left
            log.exception("reading the answer from %s failed", authority)
            why = f"the gateway failed after sending ({type(exc).__name__})"
            raise OutcomeLost(why, exchange.status) from exc
        finally:
            timer.cancel()
            if not handed:
                exchange.let_go()


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
