"""The proxy's ASGI app: `ProxyApp`, plain ASGI on every request's path, a view on a
`Gateway` (gateway/assembly.py): the status URL, routing, the request read, the
engine's answer written (whole, in parts, or as it arrives).

`create_app(config, store=..., upstream=...)` is the seam tests use: pass a store to
share it, or let the config's URL choose one. The proxy app's lifespan starts and
closes the gateway; `cli run` drives both listeners from one gateway instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.assembly import Gateway
from gateway.config import Config
from gateway.engine.outbound import Origin
from gateway.engine.settlement import Reply
from gateway.errors import AmbiguousPath, NoRoute, OutcomeLost, ProblemError
from gateway.http.cycle import CALLER_TRANSPORT, http_date, internal_error, reset
from gateway.http.request import read_body, read_headers, request_paths, splits_differently
from gateway.keying import RequestParts
from gateway.logs import Trace, access_path, current_trace, log_access
from gateway.metrics import Metrics
from gateway.proxy.status import status_reply
from gateway.store.base import Store
from gateway.upstream import BodyStream, ResponseBudget, Upstream

log = logging.getLogger("gateway")

#: A whole body larger than this is written in parts of this size (_send_parts).
WRITE_PART = 256 * 1024

#: Answers that never carry content, and so no Content-Length from the gateway (RFC
#: 9110 8.6: never on a 204; on a 304 only the length a 200 would have had, which the
#: gateway does not know).
NO_CONTENT = frozenset({204, 304})


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
        prefix = gateway.config.server.status_prefix
        trace = Trace(scope["method"], access_path(scope["path"], prefix))
        current_trace.set(trace)
        try:
            raw_path, path = request_paths(scope)
            # The gateway's own, whatever the routes say; the prefix never ends in "/".
            if path.startswith(prefix) and path[len(prefix) : len(prefix) + 1] == "/":
                status, raw, payload = await status_reply(gateway, scope, raw_path, trace)
                await _send(send, status, raw, payload)
                log_access(trace, status)
                return
            match = gateway.router.match(scope["method"], path)
            if match is not None:
                route_name = trace.route = match.route.name
            # Before NoRoute: a request that is not valid HTTP is a 400 wherever it goes.
            headers = read_headers(scope, gateway.config.server.max_header_bytes)
            if match is None:
                raise NoRoute(f"No route for {scope['method']} {path}.")
            route = match.route
            if route.key is not None and splits_differently(raw_path):
                raise AmbiguousPath(
                    "The path has %2F, %5C, a backslash, or a segment that is empty or a "
                    "dot-segment before ;parameters (;x, ..;x). Servers disagree on whether "
                    "they separate, drop or climb segments, "
                    "so the path keyed here might not be the one the upstream serves; this "
                    "keyed route refuses them."
                )
            body = await read_body(receive, headers, route.max_request_body)
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
        except Exception as exc:
            # Nothing a caller sends and nothing a store or upstream answers is meant to
            # get here: a fault of the gateway's own, or a driver's error it does not
            # wrap. The caller still gets a problem it can read; the log the cause.
            problem = internal_error(exc, scope, route_name)
            if route_name is not None:
                gateway.metrics.count(route_name, "internal_error")
            status, raw, payload = problem.render()
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
        if reply.status not in NO_CONTENT:
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
