"""One pipelined RESP connection, for the store's scripts: the requests' hot path.

Why not redis-py for these: its asyncio client spent about 120 us of CPU per script
call on this project's 2-core benchmark machine (a pool checkout under a lock, per-call
retry and timeout set-up, its reply handling), against about 12 us here, measured side
by side (docs/performance.md). A first request makes two script calls, so that was
most of what the gateway added to a bare proxy.

How: every caller writes its command at once and waits for a future; Redis answers a
connection's commands in order, so replies are matched to waiters first in, first out.
Redis runs scripts one at a time anyway, so one connection per process does not limit
throughput. A command sent while Redis has nothing else of ours leaves at once (Redis
starts on it while this process goes on); those sent while it still has some leave
together at the end of the loop iteration, in one write.

What it keeps from redis-py's behaviour: a reply slower than `timeout` fails the
waiting calls (the connection is dropped: its later replies could not be matched), a
lost connection is reopened by the next call, and the store retries a failed call
once (every script is safe to run twice). Pub/sub, listings and the cluster client
stay on redis-py, where the per-call cost does not matter or the routing is not ours.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis

#: hiredis's packer, typed (its stub takes one-element tuples and returns Any):
#: `*<n>\r\n` then `$<size>\r\n<bytes>\r\n` per argument, str as UTF-8, int in decimal.
pack_command: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command


class RespError(Exception):
    """Redis answered a command with an error reply (the message is Redis's)."""


class RespConnectionError(ConnectionError):
    """The connection failed, or Redis did not answer in time: the command may or may
    not have run."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where to connect and how to log in."""

    host: str = ""
    port: int = 6379
    path: str = ""  # a unix socket, instead of host and port
    ssl: ssl.SSLContext | None = None
    username: str = ""
    password: str = ""
    db: int = 0


class CommandTemplate:
    """A command's RESP bytes, for commands that differ only in one value (the hole)
    spliced into some of their leading arguments, and in their last `arity` arguments.

    The leading arguments are encoded once, with `marker` where the hole goes, and
    split there; packing joins the pieces with the hole's bytes and appends the last
    arguments as hiredis packs them. The bytes are hiredis.pack_command's for the whole
    command (test_resp.py checks them for every script the store sends), for a hole of
    `hole_size` bytes. `marker` must occur in the leading arguments only as the hole.
    """

    __slots__ = ("_cut", "_pieces", "arity", "hole_size")

    def __init__(
        self, leading: Sequence[str | bytes | int], marker: str, hole_size: int, arity: int
    ) -> None:
        self.hole_size, self.arity = hole_size, arity
        mark = marker.encode()
        pieces: list[bytes] = []
        current = b"*%d\r\n" % (len(leading) + arity)
        for argument in leading:
            # pack_command's bytes for one argument: `$<size>\r\n<bytes>\r\n`
            encoded = pack_command((argument,))[4:-2].partition(b"\r\n")[2]
            holes = encoded.split(mark)
            size = len(encoded) + (len(holes) - 1) * (hole_size - len(mark))
            current += b"$%d\r\n" % size + holes[0]
            for piece in holes[1:]:
                pieces.append(current)
                current = piece
            current += b"\r\n"
        pieces.append(current)
        self._pieces = pieces
        # what pack_command puts before the last arguments: `*<arity>\r\n`
        self._cut = len(b"*%d\r\n" % arity)

    def pack(self, hole: bytes, args: tuple[Any, ...]) -> bytes:
        """The command's bytes; `hole` must be `hole_size` bytes, `args` `arity` long."""
        return hole.join(self._pieces) + pack_command(args)[self._cut :]


class _Protocol(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.reader = hiredis.Reader()
        #: (waiter, loop time it was sent), oldest first.
        self.pending: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        #: Commands sent in this loop iteration while Redis still had others to answer,
        #: written together at its end: one write (and one wake-up of Redis) for a
        #: burst of requests instead of one each.
        self.outgoing: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports quack like asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pending = self.pending
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.abort(RespConnectionError(f"redis sent a reply that cannot be read: {exc}"))
                return
            if reply is False:
                return
            if not pending:  # a reply nobody asked for: the stream is out of step
                self.abort(RespConnectionError("redis sent a reply nobody was waiting for"))
                return
            waiter = pending.popleft()[0]
            if waiter.done():  # its caller gave up (cancelled): drop the reply
                continue
            if isinstance(reply, hiredis.ReplyError):
                waiter.set_exception(RespError(str(reply)))
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: BaseException | None) -> None:
        error = self.lost or RespConnectionError(f"connection to redis lost: {exc or 'closed'}")
        self.lost = error
        while self.pending:
            waiter = self.pending.popleft()[0]
            if not waiter.done():
                waiter.set_exception(error)

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """Send one command, already RESP-encoded, and return the future of its reply."""
        if self.lost is not None or self.transport is None:
            raise self.lost or RespConnectionError("not connected to redis")
        waiter = self.loop.create_future()
        idle = not self.pending
        self.pending.append((waiter, self.loop.time()))
        if idle:
            # Nothing in Redis's hands: send it now, so Redis works on it while this
            # process parses the next requests. Held to the iteration's end, it would
            # wait for them, and they for Redis after: the two would take turns
            # instead of overlapping (the accept benchmark lost a quarter of its
            # throughput so; docs/performance.md, "Redis round trips and work per request").
            self.transport.write(command)
        else:
            if not self.outgoing:
                self.loop.call_soon(self.flush)
            self.outgoing.append(command)
        return waiter

    def flush(self) -> None:
        outgoing, self.outgoing = self.outgoing, []
        if self.lost is None and self.transport is not None:
            self.transport.write(b"".join(outgoing))

    def abort(self, error: BaseException) -> None:
        if self.lost is None:
            self.lost = error
        if self.transport is not None:
            self.transport.abort()  # connection_lost fails the waiters


class RespConnection:
    """Calls on one connection, opened on first use and reopened after a failure."""

    def __init__(
        self,
        locate: Callable[[], Awaitable[Endpoint]],
        *,
        timeout: float,
        connect_timeout: float,
    ) -> None:
        # `locate` is asked before every connect, so a Sentinel can name a new master.
        self._locate = locate
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._closed = False

    async def call(self, *args: Any) -> Any:
        """Send one command and wait for its reply. Raises RespError for an error
        reply and RespConnectionError when the outcome is unknown."""
        return await self.call_packed(pack_command(args))

    async def call_packed(self, command: bytes) -> Any:
        """`call`, for a command already RESP-encoded (a CommandTemplate's)."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        return await protocol.send(command)

    def reset(self) -> None:
        """Drop the connection (its pending calls fail); the next call reconnects."""
        if self._protocol is not None:
            self._protocol.abort(RespConnectionError("connection reset by the gateway"))
            self._protocol = None

    async def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._connecting is not None:
            self._connecting.cancel()
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.lost = protocol.lost or RespConnectionError("connection closed")
            protocol.transport.close()

    async def _connect(self) -> _Protocol:
        if self._closed:
            raise RespConnectionError("connection closed")
        # Callers that find no connection share one attempt.
        if self._connecting is None:
            self._connecting = asyncio.create_task(self._open())
            self._connecting.add_done_callback(self._opened)
        return await asyncio.shield(self._connecting)

    def _opened(self, task: asyncio.Task[_Protocol]) -> None:
        self._connecting = None
        if not task.cancelled() and task.exception() is None:
            self._protocol = task.result()
            self._arm_watchdog()

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                endpoint = await self._locate()
                if endpoint.path:
                    _, protocol = await loop.create_unix_connection(
                        lambda: _Protocol(loop), endpoint.path
                    )
                else:
                    _, protocol = await loop.create_connection(
                        lambda: _Protocol(loop),
                        endpoint.host,
                        endpoint.port,
                        ssl=endpoint.ssl,
                        server_hostname=endpoint.host if endpoint.ssl else None,
                    )
                try:
                    if endpoint.password:
                        user = (endpoint.username,) if endpoint.username else ()
                        await protocol.send(pack_command(("AUTH", *user, endpoint.password)))
                    if endpoint.db:
                        await protocol.send(pack_command(("SELECT", endpoint.db)))
                except BaseException:
                    protocol.abort(RespConnectionError("login failed"))
                    raise
        except RespError as exc:
            raise RespConnectionError(f"redis refused the login: {exc}") from None
        except TimeoutError:
            raise RespConnectionError(
                f"no connection to redis within {self._connect_timeout:g}s"
            ) from None
        except OSError as exc:
            raise RespConnectionError(f"cannot connect to redis: {exc}") from None
        return protocol

    def _arm_watchdog(self) -> None:
        # One timer per connection, not one per call: a call costs a deque entry.
        if self._watchdog is not None:
            self._watchdog.cancel()
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self._timeout / 4, self._check_overdue)

    def _check_overdue(self) -> None:
        protocol = self._protocol
        if protocol is None or self._closed:
            self._watchdog = None
            return
        if protocol.pending and protocol.loop.time() - protocol.pending[0][1] > self._timeout:
            # The oldest reply is late; the ones behind it cannot come first.
            protocol.abort(RespConnectionError(f"redis did not answer within {self._timeout:g}s"))
            self._protocol = None
            self._watchdog = None
            return
        self._arm_watchdog()
