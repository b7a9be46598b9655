"""Kept-alive connections to one origin, and when one may carry a request.

A `Pool` holds at most `limit` connections to its origin; each `Connection` (an
asyncio protocol) carries one exchange at a time and feeds the upstream's bytes to it.
A kept-alive connection is looked at just before a request is written to it
(`Pool._fit`, `Connection.ready`): one idle past the keep-alive, one the upstream has
closed, or one that holds bytes nobody asked for, is retired and another taken, so a
request is never written where it cannot arrive. What fails here, before the request's
bytes are handed to the transport, is NotSent (see gateway/upstream/client.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import select
import ssl
from typing import cast

import httptools

from gateway.errors import NotSent
from gateway.upstream.parser import Exchange
from gateway.upstream.response import Broken, after_status


def _closed_cleanly(transport: asyncio.BaseTransport) -> bool:
    """Whether the upstream's end of the stream is one a body may end on: a FIN on
    plain TCP; on TLS only a close_notify, since an attacker (or a crash) can end the
    TCP connection under the TLS session and a body that ends at the connection's end
    would look whole. asyncio's SSL transport reports a FIN without close_notify as
    eof_received, as it does a clean close (uvloop's reports it as connection_lost(None)
    without eof_received), so the TLS session is asked: after the peer's close_notify a
    read returns b"" (SSL_ERROR_ZERO_RETURN); without one it raises. Everything sent
    was read before eof_received, so the read takes nothing from the answer."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return True
    try:
        return cast(bytes, ssl_object.read(1)) == b""
    except (ssl.SSLError, OSError, ValueError):
        return False


def _poller(fd: int | None) -> select.poll:
    """A poll(2) set of one socket, made once per connection: asking it (`_readable`)
    costs one system call, about 0.3 us. Without a socket (fd None) it is empty, and
    never readable."""
    poller = select.poll()
    if fd is not None:
        poller.register(fd, select.POLLIN)
    return poller


def _readable(poller: select.poll) -> bool:
    """Whether the socket holds something the event loop has not read yet: bytes, a
    FIN, or an error (poll reports those whatever was asked)."""
    return bool(poller.poll(0))


class Connection(asyncio.Protocol):
    """One kept-alive connection to an origin; carries one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self.poller = _poller(None)
        #: given to a waiter that has not looked at it yet: its slot is that waiter's
        self.handed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")  # the TCP socket, under TLS too
        if sock is not None:
            self.poller = _poller(sock.fileno())

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted
            return
        size, events = exchange.size, exchange.chunk_events
        try:
            exchange.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # _Stop from a callback: the exchange says why
        except httptools.HttpParserUpgrade:
            exchange.error = Broken("the upstream switched protocols", exchange.status)
        except httptools.HttpParserError as exc:
            reason = (
                f"the upstream's answer is not valid HTTP{after_status(exchange.status)}: {exc}"
            )
            exchange.error = Broken(reason, exchange.status)
        exchange.measure(len(data), size, events)
        if exchange.complete:
            self.detach()
            # Bytes after the answer, HTTP or not: the connection is out of step.
            self.pool.release(self, reusable=exchange.reusable())
        elif exchange.error is not None:
            exchange.fail(exchange.error)
            self.close()

    def eof_received(self) -> bool:
        # The upstream closed its side; connection_lost follows, one callback later.
        # Out of the pool now: a request written here in between would be lost.
        self.closed = True
        exchange = self.exchange
        if exchange is not None and exchange.until_close and self.transport is not None:
            if _closed_cleanly(self.transport):
                exchange.end_of_stream()
                if exchange.complete:
                    self.detach()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange = self.detach()
        if exchange is not None:
            exchange.connection_lost(exc)
        self.pool.lost(self)

    def ready(self) -> bool:
        """Whether a request written now would go out on an open connection as the
        first thing since its last answer: not closed (by us, or by the upstream as
        far as the loop has seen), and nothing waiting in the socket that the loop
        has not read yet: a FIN (the upstream closed it: the request would never be
        read) or bytes nobody asked for (they would be read as its answer)."""
        transport = self.transport
        return (
            not self.closed
            and transport is not None
            and not transport.is_closing()
            and not _readable(self.poller)
        )

    def detach(self) -> Exchange | None:
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


class Pool:
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
        self.idle: list[Connection] = []
        self.open: set[Connection] = set()
        self.waiters: collections.deque[asyncio.Future[Connection | None]] = collections.deque()
        self.connecting = 0

    async def acquire(self, timeout: float) -> Connection:
        """A connection ready for a request, or NotSent. A kept-alive one is taken
        only if it is fit to be written to now (_fit); one that is not is retired and
        its slot serves a new connection, within the same timeout."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.idle:
            connection = self.idle.pop()
            if self._fit(connection, now):
                return connection
            self._retire(connection)
        if len(self.open) + self.connecting >= self.limit:
            handed = await self._wait(timeout)
            if handed is not None:
                handed.handed = False
                if self._fit(handed, loop.time()):
                    return handed
                self._retire(handed)  # its slot is this request's now
            timeout = max(0.0, timeout - (loop.time() - now))
        return await self._connect(timeout)

    def _fit(self, connection: Connection, now: float) -> bool:
        """Whether a kept-alive connection may be written to now: idle for less than
        the keep-alive (the upstream closes idle connections after its own, and a
        request written as it does is lost: the gateway lets go first), and ready."""
        return now - connection.idle_since < self.keepalive and connection.ready()

    def _retire(self, connection: Connection) -> None:
        """Close a connection (out of the idle list) that will not carry a request;
        its slot is free at once, for the caller: no waiter is woken for it."""
        connection.close()
        self.open.discard(connection)

    async def _wait(self, timeout: float) -> Connection | None:
        """Wait for a released connection (or None: a free slot to connect in)."""
        waiter: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._hand_back(waiter.result())  # it came as we gave up: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise NotSent(
                    f"no upstream connection came free within {timeout:g}s ({self.limit} are open)"
                ) from None
            raise

    async def _connect(self, timeout: float) -> Connection:
        loop = asyncio.get_running_loop()
        connection = Connection(self)
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

    def release(self, connection: Connection, *, reusable: bool) -> None:
        """An answer is complete: keep its connection for the next request (a waiter
        first), or close it."""
        if not reusable or connection.closed:
            connection.close()
            return  # connection_lost takes it out and wakes a waiter
        connection.idle_since = asyncio.get_running_loop().time()
        self._offer(connection)

    def _offer(self, connection: Connection) -> None:
        # A waiter looks at it (_fit) when it wakes: the loop may read the
        # upstream's FIN before then.
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                connection.handed = True
                waiter.set_result(connection)
                return
        connection.handed = False
        self.idle.append(connection)

    def _hand_back(self, connection: Connection | None) -> None:
        if connection is None:
            self._wake()
        else:
            self._offer(connection)

    def lost(self, connection: Connection) -> None:
        if connection in self.open:
            self.open.discard(connection)
            with contextlib.suppress(ValueError):
                self.idle.remove(connection)
            if not connection.handed:  # else the waiter it went to connects in its slot
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
