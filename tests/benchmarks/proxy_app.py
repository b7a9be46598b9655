"""Minimal Starlette catch-all reverse proxy, one upstream HTTP client per process (for clients.py).

Run under uvicorn with the factory flag; configured by environment variables:

    BENCH_UPSTREAM=http://127.0.0.1:PORT BENCH_CLIENT=aiohttp-128 \\
      python -m uvicorn proxy_app:create_app --factory --app-dir tests/benchmarks \\
      --loop uvloop --http httptools --port 8001

BENCH_CLIENT is one of CLIENTS. BENCH_BLOCK_MODULES (comma separated, e.g. "sniffio") makes those
modules unimportable in this process, to measure libraries with and without optional imports when
they are installed (when they are not, leave it unset: a natural miss is the realistic case).

`create_upstream_app` is a trivial upstream answering 200 '{"ok":true}' (used when nginx is absent).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol


class _BlockModules(importlib.abc.MetaPathFinder):
    """Meta path finder that makes the named modules (and their submodules) unimportable.

    It first does the sys.path scan a real miss would do, so that a blocked import costs about
    what it costs when the module is simply not installed.
    """

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] in self.names:
            importlib.machinery.PathFinder.find_spec(fullname, path)
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


def _block_modules_from_env() -> None:
    names = frozenset(n.strip() for n in os.environ.get("BENCH_BLOCK_MODULES", "").split(",") if n)
    if not names:
        return
    for mod in [m for m in sys.modules if m.split(".", 1)[0] in names]:
        del sys.modules[mod]
    sys.meta_path.insert(0, _BlockModules(names))


_block_modules_from_env()  # before any HTTP client library gets imported

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.types import Receive, Scope, Send  # noqa: E402

Forwarded = tuple[int, list[tuple[str, str]], bytes]

CLIENTS = (
    "httpx-default",
    "httpx-128",
    "httpx2-128",
    "httpx-aiohttp-128",
    "aiohttp-128",
    "gateway-128",
)
POOL_SIZE = 128
TIMEOUT_S = 10.0
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# Request headers copied to the upstream (lower-case, as Starlette exposes them).
FORWARD_REQUEST_HEADERS = (
    "content-type",
    "accept",
    "authorization",
    "idempotency-key",
    "x-request-id",
)
# Response headers not copied back (hop-by-hop, or recomputed by uvicorn/Starlette).
DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",  # httpx returns decoded bodies
        "date",
        "server",
    }
)


class Forwarder(Protocol):
    async def forward(
        self, method: str, url: str, headers: dict[str, str], body: bytes
    ) -> Forwarded: ...

    async def aclose(self) -> None: ...


class HttpxForwarder:
    """Works for httpx.AsyncClient and httpx2.AsyncClient (same API)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def forward(
        self, method: str, url: str, headers: dict[str, str], body: bytes
    ) -> Forwarded:
        response = await self.client.request(method, url, headers=headers, content=body)
        items: list[tuple[str, str]] = response.headers.multi_items()
        return response.status_code, items, response.content

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpForwarder:
    def __init__(self, limit: int) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit),
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
            auto_decompress=False,
        )

    async def forward(
        self, method: str, url: str, headers: dict[str, str], body: bytes
    ) -> Forwarded:
        async with self.session.request(method, url, headers=headers, data=body) as response:
            content = await response.read()
            return response.status, list(response.headers.items()), content

    async def aclose(self) -> None:
        await self.session.close()


class GatewayForwarder:
    """The gateway's own upstream client (gateway/upstream/client.py), without the gateway."""

    def __init__(self, limit: int) -> None:
        # This directory holds gateway.py (the benchmark), which would shadow the package.
        sys.path.insert(0, os.environ.get("BENCH_GATEWAY_SRC", str(Path(__file__).parents[2])))
        sys.modules.pop("gateway", None)
        from gateway.config import ServerConfig
        from gateway.upstream import Upstream

        # As the gateway builds it (server.upstream_keep_alive; older sources had none)
        keepalive = getattr(ServerConfig(), "upstream_keep_alive", 2.0)
        self.upstream = Upstream(connections=limit, keepalive=keepalive)
        self.started = False

    async def forward(
        self, method: str, url: str, headers: dict[str, str], body: bytes
    ) -> Forwarded:
        if not self.started:
            await self.upstream.start()
            self.started = True
        response = await self.upstream.forward(
            method, url, list(headers.items()), body, TIMEOUT_S, 64 << 20
        )
        return response.status, list(response.headers), response.body

    async def aclose(self) -> None:
        await self.upstream.close()


def _importable(name: str) -> str:
    try:
        importlib.import_module(name)
    except ImportError:
        return "no"
    return "yes"


def make_forwarder(kind: str) -> Forwarder:
    """Create the forwarder; call inside the running event loop (aiohttp needs one)."""
    if kind == "aiohttp-128":
        return AiohttpForwarder(POOL_SIZE)
    if kind == "gateway-128":
        return GatewayForwarder(POOL_SIZE)
    if kind == "httpx2-128":
        import httpx2

        limits2 = httpx2.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE)
        return HttpxForwarder(httpx2.AsyncClient(limits=limits2, timeout=TIMEOUT_S))

    import httpx

    limits = httpx.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE)
    if kind == "httpx-default":
        return HttpxForwarder(httpx.AsyncClient(timeout=TIMEOUT_S))
    if kind == "httpx-128":
        return HttpxForwarder(httpx.AsyncClient(limits=limits, timeout=TIMEOUT_S))
    if kind == "httpx-aiohttp-128":
        from httpx_aiohttp import AiohttpTransport

        transport = AiohttpTransport(limits=limits)
        return HttpxForwarder(httpx.AsyncClient(transport=transport, timeout=TIMEOUT_S))
    raise ValueError(f"unknown BENCH_CLIENT {kind!r}; expected one of {CLIENTS}")


def create_app(upstream: str | None = None, client: str | None = None) -> Starlette:
    """The proxy: copies method, path, query, body and a few headers; returns the response."""
    base = (upstream or os.environ["BENCH_UPSTREAM"]).rstrip("/")
    kind = client or os.environ["BENCH_CLIENT"]
    if kind not in CLIENTS:
        raise ValueError(f"unknown client {kind!r}; expected one of {CLIENTS}")
    holder: dict[str, Forwarder] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        holder["forwarder"] = make_forwarder(kind)
        print(f"BENCH_PROXY client={kind} sniffio={_importable('sniffio')}", flush=True)
        try:
            yield
        finally:
            await holder.pop("forwarder").aclose()

    async def proxy(request: Request) -> Response:
        body = await request.body()
        headers = {
            name: value
            for name in FORWARD_REQUEST_HEADERS
            if (value := request.headers.get(name)) is not None
        }
        url = base + request.scope["path"]
        query: bytes = request.scope["query_string"]
        if query:
            url += "?" + query.decode("latin-1")
        status, upstream_headers, content = await holder["forwarder"].forward(
            request.method, url, headers, body
        )
        response = Response(content, status_code=status)
        response.raw_headers.extend(
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in upstream_headers
            if name.lower() not in DROP_RESPONSE_HEADERS
        )
        return response

    return Starlette(routes=[Route("/{path:path}", proxy, methods=METHODS)], lifespan=lifespan)


_UPSTREAM_BODY = b'{"ok":true}'
_UPSTREAM_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_UPSTREAM_BODY)).encode()),
]


async def _upstream(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:  # drain the request body
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _UPSTREAM_HEADERS})
    await send({"type": "http.response.body", "body": _UPSTREAM_BODY})


def create_upstream_app() -> Any:
    """Trivial upstream (run with `--lifespan off`): 200 '{"ok":true}' for every request."""
    return _upstream
