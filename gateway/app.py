"""The app factory: a Gateway owns the store, the upstream client and the metrics;
the proxy and admin ASGI apps are views on it.

`create_app(config, store=..., upstream=...)` is the seam tests use: pass a store to
share it, or let the config's URL choose one. The proxy app's lifespan starts and
closes the gateway; `cli run` drives both listeners from one gateway instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from dataclasses import replace
from typing import Any
from urllib.parse import quote, unquote, unquote_to_bytes

from starlette.types import Message, Receive, Scope, Send

from gateway.config import Config
from gateway.cycle import CALLER_TRANSPORT, http_date, reset
from gateway.engine import Engine, Origin, Reply
from gateway.errors import (
    AmbiguousPath,
    BadHost,
    GatewayError,
    HeadersTooLarge,
    MalformedRequest,
    NoRoute,
    OutcomeLost,
    PayloadTooLarge,
    ProblemError,
    StoreError,
)
from gateway.keys import RequestParts
from gateway.logs import Trace, current_trace, log_access
from gateway.metrics import Metrics
from gateway.reconcile import Reconciler, stop_if_cancelled
from gateway.routes import Router, remove_dot_segments
from gateway.store import open_store
from gateway.store.base import Store
from gateway.upstream import BodyStream, ResponseBudget, TrustedProxies, Upstream, valid_host

log = logging.getLogger("gateway")

#: C0 controls but HTAB, and DEL: not allowed in a field value (RFC 9110 5.5).
_FORBIDDEN_IN_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")

#: Seconds between looks at the store's markers (see Store.check_reset).
STORE_WATCH_INTERVAL = 1.0

#: A whole body larger than this is written in parts of this size (_send_parts).
WRITE_PART = 256 * 1024


class Gateway:
    def __init__(
        self,
        config: Config,
        *,
        store: Store | None = None,
        upstream: Upstream | None = None,
        metrics: Metrics | None = None,
        sweep: bool = True,
    ) -> None:
        self.config = config
        self.store = store if store is not None else open_store(config.store)
        self.upstream = (
            upstream
            if upstream is not None
            else Upstream(keepalive=config.server.upstream_keep_alive)
        )
        self.metrics = metrics if metrics is not None else Metrics()
        self.router = Router(config.routes)
        self.proxies = TrustedProxies(config.server.trusted_proxies)
        self.engine = Engine(config, self.store, self.upstream, self.metrics)
        budget = self.engine.budget
        self.metrics.watch_buffered(lambda: budget.held)
        self.reconciler = Reconciler(config, self.store, self.upstream, self.metrics)
        self.engine.reconciler = self.reconciler
        self.sweep = sweep
        self._sweeper: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.started = False

    async def start(self) -> None:
        await self.store.start()
        await self.upstream.start()
        if self.sweep:
            self._sweeper = asyncio.create_task(self.reconciler.run(), name="sweep")
        self._watcher = asyncio.create_task(self._watch_store(), name="store-reset-watch")
        self.started = True

    async def _watch_store(self) -> None:
        """Notice a store that lost its records under a running gateway, and say so
        loudly: every key completed before will run again if repeated, and keys of
        unknown outcome are gone with nobody left to check them."""
        while True:
            try:
                lost = await self.store.check_reset()
            except StoreError:
                lost = 0  # down: nothing to compare until it answers again
            except Exception:
                log.exception("store reset check failed")
                lost = 0
            stop_if_cancelled()
            self.metrics.refresh_buffered()
            if lost:
                self.metrics.store_resets.inc()
                log.error(
                    "STORE RESET: %d of the store's buckets lost every record (a restart "
                    "without persistence, a flush or an eviction). Repeats of keys that "
                    "completed before will run again, and keys whose outcome was unknown "
                    "are forgotten: check the upstreams for work done twice. Run Redis "
                    "with appendonly yes and appendfsync always (docs/reliability.md).",
                    lost,
                )
            await asyncio.sleep(STORE_WATCH_INTERVAL)

    async def close(self) -> None:
        self.started = False
        # Forwards still out are settled (marked unresolved) while the store is open.
        await self.engine.drain(0)
        for task in (self._sweeper, self._watcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.upstream.close()
        await self.store.close()

    def reload(self, config: Config) -> list[str]:
        """Swap in a new config's routes, upstreams and policies. Requests in flight
        keep the route they started with. Listeners and the store need a restart:
        changes there are kept out and reported."""
        kept: list[str] = []
        for name, old, new in (
            ("store", self.config.store, config.store),
            ("server.listen", self.config.server.listen, config.server.listen),
            ("admin.listen", self.config.admin.listen, config.admin.listen),
        ):
            if old != new:
                kept.append(f"{name} changed: restart the gateway to apply it")
        config = replace(
            config,
            store=self.config.store,
            server=replace(config.server, listen=self.config.server.listen),
            admin=replace(config.admin, listen=self.config.admin.listen),
        )
        self.config = config
        self.router = Router(config.routes)
        self.proxies = TrustedProxies(config.server.trusted_proxies)
        self.engine.config = config
        self.engine.budget.limit = config.server.max_buffered_responses
        self.reconciler.configure(config)
        return kept

    async def refresh_key_metrics(self) -> None:
        """Read key counts and ages from the store, so every replica reports the
        cluster-wide truth at scrape time."""
        try:
            stats = await self.store.stats()
        except StoreError:
            self.metrics.store_up.set(0)
            return
        self.metrics.store_up.set(1)
        self.metrics.set_key_stats(stats, [r.name for r in self.config.routes])

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class ProxyApp:
    """The listener schedulers call. Plain ASGI: it sits on every request's path."""

    def __init__(self, gateway: Gateway, *, lifespan: bool = True) -> None:
        self.gateway = gateway
        self._lifespan = lifespan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan_events(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway = self.gateway
        route_name: str | None = None
        trace = Trace(scope["method"], scope["path"])
        current_trace.set(trace)
        try:
            raw_path, path = _paths(scope)
            match = gateway.router.match(scope["method"], path)
            if match is not None:
                route_name = trace.route = match.route.name
            # Before NoRoute: a request that is not valid HTTP is a 400 wherever it goes.
            headers = _headers(scope, gateway.config.server.max_header_bytes)
            if match is None:
                raise NoRoute(f"No route for {scope['method']} {path}.")
            route = match.route
            if route.key is not None and _splits_differently(raw_path):
                raise AmbiguousPath(
                    "The path has %2F, %5C or a backslash. Servers disagree on whether "
                    "they separate segments, so the path keyed here might not be the one "
                    "the upstream serves; this keyed route refuses them."
                )
            body = await _read_body(receive, headers, route.max_request_body)
            parts = RequestParts(
                method=scope["method"],
                path=raw_path,
                query=scope["query_string"].decode("latin-1"),
                headers=headers,
                body=body,
                params=match.params,
            )
            client = scope.get("client")
            origin = Origin(
                client[0] if client else None, scope.get("scheme", "http"), gateway.proxies
            )
            reply = await gateway.engine.handle(match, parts, origin)
        except ProblemError as exc:
            if exc.route is None:
                exc.route = route_name
            if not trace.outcome and route_name is not None:
                # Refused before the engine saw it: too large, unreadable, unkeyable.
                gateway.metrics.count(route_name, "bad_request")
                trace.outcome = "bad_request"
            status, raw, payload = exc.render()
            await _send(send, status, raw, payload)
            log_access(trace, status)
            return
        except GatewayError:
            log.exception("gateway error")
            status, raw, payload = ProblemError(route=route_name).render()
            await _send(send, status, raw, payload)
            log_access(trace, status)
            return
        await _send_reply(send, reply, gateway.engine.budget, scope, receive)
        if reply.settling is not None:
            await asyncio.wait([reply.settling])  # so the access log has the key's outcome
        log_access(trace, reply.status)

    async def _lifespan_events(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    if self._lifespan:
                        await self.gateway.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._lifespan:
                    await self.gateway.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app(
    config: Config,
    *,
    store: Store | None = None,
    upstream: Upstream | None = None,
    metrics: Metrics | None = None,
) -> ProxyApp:
    return ProxyApp(Gateway(config, store=store, upstream=upstream, metrics=metrics))


def _headers(scope: Scope, limit: int) -> list[tuple[str, str]]:
    raw: list[tuple[bytes, bytes]] = scope["headers"]
    size = 0
    out: list[tuple[str, str]] = []
    bad = ""
    hosts = 0
    host = ""
    for name, value in raw:
        size += len(name) + len(value)
        header, text = name.decode("latin-1").lower(), value.decode("latin-1")
        # httptools refuses these already; another ASGI server might not, and the
        # upstream client would fail on them after the key was claimed.
        if not bad and _FORBIDDEN_IN_HEADER.search(text):
            bad = header
        if header == "host":
            hosts += 1
            host = text
        out.append((header, text))
    if size > limit:
        raise HeadersTooLarge(f"The request headers are {size} bytes; the limit is {limit}.")
    if bad:
        raise MalformedRequest(f"The {bad} header contains control characters.")
    if hosts != 1 or not valid_host(host):
        _check_host(hosts, host, scope.get("http_version", "1.1"))
    return out


def _check_host(hosts: int, host: str, version: str) -> None:
    """RFC 9112 3.2: 400 for an HTTP/1.1 request without Host, and for any with more
    than one Host line or an invalid one. Which Host the gateway reports upstream
    (X-Forwarded-Host, Forwarded) must never be a choice between two. An HTTP/1.0
    request may lack it (its clients predate the header): it is forwarded without."""
    if hosts > 1:
        raise BadHost(f"The request has {hosts} Host header lines; HTTP allows exactly one.")
    if hosts == 0:
        if version == "1.0":
            return
        raise BadHost("The request has no Host header; HTTP/1.1 requires one.")
    shown = host if len(host) <= 64 else host[:64] + "..."
    raise BadHost(f"The Host header {shown!r} is not a host name or address with an optional port.")


def _paths(scope: Scope) -> tuple[str, str]:
    """The request's path twice: as forwarded, and as matched (the same, decoded).

    The forwarded one is the path as the caller sent it, still percent-encoded, with
    its dot-segments removed (routes.remove_dot_segments): what is matched is what
    keys, fingerprints and the upstream see. Decoding it would turn %3F into a query,
    %0D%0A into a line break in the upstream request, and %2F into a path separator.

    A path whose percent-escapes are not UTF-8 is refused: decoded with U+FFFD for
    each bad byte, /jobs/%FF and /jobs/%FE would match as one path and give a
    `{path.<param>}` key the same value."""
    raw_bytes: bytes | None = scope.get("raw_path")
    path: str = scope["path"]
    if raw_bytes is None:
        raw = quote(path, safe="/%:@!$&'()*+,;=~")
    else:
        raw = raw_bytes.decode("latin-1")
    normal = remove_dot_segments(raw)
    if normal is not raw:
        raw, path = normal, unquote(normal)
    if "\ufffd" in path:
        try:
            unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedRequest("The path is not valid UTF-8 once percent-decoded.") from None
    return raw, path


def _splits_differently(raw: str) -> bool:
    """%2F and %5C (and a backslash) are one segment to some servers, a separator to
    others (and to their path normalisation): refused on keyed routes."""
    if "\\" in raw:
        return True
    if "%" not in raw:
        return False
    lowered = raw.lower()
    return "%2f" in lowered or "%5c" in lowered


async def _read_body(receive: Receive, headers: list[tuple[str, str]], limit: int) -> bytes:
    codings = [
        token.strip().lower()
        for name, value in headers
        if name == "transfer-encoding"
        for token in value.split(",")
    ]
    if codings and codings != ["chunked"]:
        # The body would reach the upstream still coded, its coding header dropped.
        raise MalformedRequest(
            "The gateway accepts Transfer-Encoding: chunked only, once; "
            f"this request has {', '.join(codings)}."
        )
    declared = [v for n, v in headers if n == "content-length"]
    if declared:
        if len(set(declared)) > 1 or not declared[0].strip().isdigit():
            raise MalformedRequest("The Content-Length header is not a single whole number.")
        if codings:
            raise MalformedRequest(
                "Content-Length and Transfer-Encoding must not be sent together."
            )
        if int(declared[0]) > limit:
            raise PayloadTooLarge(f"The body is {declared[0]} bytes; this route accepts {limit}.")
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            # A body cut short is not the request the caller meant: never forward it.
            raise MalformedRequest(
                "The client disconnected before the body was complete; nothing was forwarded."
            )
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The body is over {limit} bytes, the limit of this route.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    _date(headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _date(headers: list[tuple[bytes, bytes]]) -> None:
    """One Date: a forwarded or replayed response keeps the upstream's (a replay says
    when the response was made, as a cache's would); any other answer gets the
    gateway's. The listener adds none of its own."""
    for name, _ in headers:
        if name == b"date":
            return
    headers.append((b"date", http_date()))


async def _send_reply(
    send: Send, reply: Reply, budget: ResponseBudget, scope: Scope, receive: Receive
) -> None:
    headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in reply.headers]
    body = reply.body
    try:
        if reply.rest is not None:
            await _send_stream(send, reply.status, headers, reply.rest, scope, receive)
            return
        headers.append((b"content-length", str(len(body)).encode()))
        if len(body) <= WRITE_PART:
            await _send(send, reply.status, headers, body)  # one write, the usual case
        else:
            await _send_parts(send, reply.status, headers, body, scope)
    finally:
        if reply.held:
            budget.release(reply.held)


async def _send_parts(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes, scope: Scope
) -> None:
    """A large body in parts, each written when the caller has taken enough of the one
    before (uvicorn's flow control), so a caller that stops reading holds one part in
    the server's buffers, not the body; server.write_timeout ends its connection."""
    _date(headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    transport = scope.get(CALLER_TRANSPORT)
    view = memoryview(body)
    size = len(body)
    for start in range(0, size, WRITE_PART):
        end = start + WRITE_PART
        part = {"type": "http.response.body", "body": view[start:end], "more_body": end < size}
        await send(part)
        if transport is not None and transport.is_closing():
            return  # the caller is gone


async def _send_stream(
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    rest: BodyStream,
    scope: Scope,
    receive: Receive,
) -> None:
    """A body as it arrives. Each part is written once the caller has taken the one
    before, and the upstream is read no faster. If the body is cut off (or this caller
    is given up on), the connection closes with the response short of its
    Content-Length or last chunk: visibly incomplete, never a completed response."""
    if rest.length is not None:
        headers.append((b"content-length", str(rest.length).encode()))
    _date(headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    transport = scope.get(CALLER_TRANSPORT)
    if transport is not None:
        rest.when_dropped(functools.partial(_cut_off, transport, hard=True))
    try:
        while chunk := await rest.read():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if transport is not None and transport.is_closing():
                break  # the caller is gone (or stopped reading for server.write_timeout)
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
    except OutcomeLost as exc:
        if transport is None:
            raise  # another server: an error is how the connection gets closed
        _cut_off(transport, exc.reason)
    finally:
        rest.abandon()  # what is left is not for this caller (a key's body is still read)
    # Let the server see the connection gone before this returns, so it does not take
    # the unfinished response for an app that forgot to finish it.
    while (await receive())["type"] != "http.disconnect":
        pass


def _cut_off(transport: Any, reason: str, *, hard: bool = False) -> None:
    """End a response short. `hard` for a caller given up on: a reset, since it is not
    reading what the kernel holds for it; otherwise what was sent still arrives, then
    the close."""
    if not transport.is_closing():
        log.warning("response to the caller cut off: %s", reason)
        if hard:
            reset(transport)
        else:
            transport.abort()
