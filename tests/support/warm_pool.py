"""A load balancer's warm pool, for tests: a TCP relay that opens connections to its
backend ahead of time and gives each client connection one of them as it is, without
looking at it first. A naive pool does exactly this; a browser's preconnect and an
HTTP client's spare connection come to the same thing: a connection the server saw
open long before the request that is finally written on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from tests.support.servers import free_port

Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class WarmPool:
    """`async with WarmPool(port, spares=8) as pool:` opens 8 connections to
    127.0.0.1:`port` at once; clients connect to `pool.url`. Past the spares, a client
    gets a connection opened for it."""

    def __init__(self, backend_port: int, spares: int) -> None:
        self.backend_port = backend_port
        self.count = spares
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.spares: deque[Pair] = deque()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> WarmPool:
        for _ in range(self.count):
            self.spares.append(await asyncio.open_connection("127.0.0.1", self.backend_port))
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for _, writer in self.spares:
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.spares:
            backend = self.spares.popleft()
        else:
            backend = await asyncio.open_connection("127.0.0.1", self.backend_port)
        tasks = [
            asyncio.create_task(_pipe(reader, backend[1])),
            asyncio.create_task(_pipe(backend[0], writer)),
        ]
        self._pipes.update(tasks)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._pipes.difference_update(tasks)
            for end in (writer, backend[1]):
                end.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy until the source ends, then end the sink's side too (a half-close)."""
    try:
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()
    except (ConnectionError, OSError):
        pass
    with contextlib.suppress(ConnectionError, OSError):
        if sink.can_write_eof():
            sink.write_eof()
