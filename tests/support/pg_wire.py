"""A TCP relay in front of PostgreSQL that counts the client's round trips.

A client waits for the server once per Sync (extended protocol: Parse/Bind/Execute
then Sync) and once per simple Query message (which may hold several statements):
those are the round trips, whatever the driver does inside them. The relay reads the
client's side of the wire (the untyped start-up messages first: SSLRequest, then the
StartupMessage) and counts them per connection; the server's side passes untouched,
its bytes counted.
Loopback only, in the test's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import Counter
from dataclasses import dataclass, field

#: StartupMessage's protocol version 3.0; SSLRequest, GSSENCRequest and CancelRequest
#: carry other codes and are answered before (or instead of) a start-up.
PROTOCOL_3 = 196608


@dataclass
class WireCount:
    """What the relay saw from clients: round trips, and which message carried them."""

    messages: Counter[str] = field(default_factory=Counter)
    #: the text of each simple Query message (asyncpg's reset query, for example)
    queries: list[str] = field(default_factory=list)
    #: how many bytes the server sent back (what the clients' statements read)
    server_bytes: int = 0

    @property
    def round_trips(self) -> int:
        return self.messages["S"] + self.messages["Q"]


class PgRelay:
    """`async with PgRelay(port) as relay:` listens on relay.port and forwards to the
    PostgreSQL on `port`; relay.count grows as clients talk."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.count = WireCount()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> PgRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):  # each connection's reads end, and its task
            writer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 5)

    def reset(self) -> WireCount:
        """The count so far, and a fresh one from here on."""
        seen, self.count = self.count, WireCount()
        return seen

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        back = asyncio.create_task(self._back(up_reader, writer))
        self._tasks |= {task, back}
        self._writers |= {writer, up_writer}
        try:
            await self._client(reader, up_writer)
        except (OSError, asyncio.IncompleteReadError):
            pass  # either side closed
        finally:
            up_writer.close()
            writer.close()
            await asyncio.gather(back, return_exceptions=True)
            self._writers -= {writer, up_writer}
            self._tasks -= {task, back}

    async def _client(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter) -> None:
        started = False
        while True:
            if not started:  # untyped: int32 length, int32 code, the rest
                head = await reader.readexactly(8)
                length, code = struct.unpack("!ii", head)
                rest = await reader.readexactly(length - 8)
                started = code == PROTOCOL_3
                up.write(head + rest)
            else:  # typed: a byte, int32 length (itself included), the rest
                head = await reader.readexactly(5)
                kind = chr(head[0])
                (length,) = struct.unpack("!i", head[1:])
                rest = await reader.readexactly(length - 4)
                self.count.messages[kind] += 1
                if kind == "Q":
                    self.count.queries.append(rest.rstrip(b"\0").decode(errors="replace"))
                up.write(head + rest)
            await up.drain()

    async def _back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                self.count.server_bytes += len(data)
                writer.write(data)
                await writer.drain()
