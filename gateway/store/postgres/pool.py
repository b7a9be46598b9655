"""The PostgreSQL store's connection pool: open connections, lent one call at a time.

asyncpg's own Pool costs a store call about as much of the gateway's CPU as the
statement does (measured: about 50 us a call of 110; its release runs in a Task of its
own under asyncio.shield, and re-arms an idle timer each time), and the store needs
little of what it does. The store leaves no session state on a connection (advisory
locks are transaction-scoped, LISTEN has a connection of its own, nothing is SET), so
nothing is reset on the way back (asyncpg's pool sends `SELECT
pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;`, a second round trip per
call, unless told not to: tests/test_store_round_trips.py counts them): lending a
connection is popping it from a list, taking it back is pushing it (or handing it to
the oldest waiter). What a call did to a
connection decides whether it is kept: one that ended in anything but a statement's
own error (a timeout, a cancellation, a lost or confused protocol) or inside a
transaction is closed, never lent again.

Connections are opened as calls need them, up to `max_size` (none at first: the
gateway starts while the database is down), and one idle for IDLE_LIFETIME is closed
when a call next comes back (the most recently used is lent first, so after a burst
the extra ones go idle and are closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import asyncpg

#: Seconds a connection may stay idle before it is closed.
IDLE_LIFETIME = 300.0


class Pool:
    def __init__(
        self,
        connect: dict[str, Any],
        max_size: int,
        setup: Callable[[asyncpg.Connection], Awaitable[None]],
    ) -> None:
        self._connect = connect
        self._max = max(1, max_size)
        self._setup = setup
        #: idle connections and when each came back, the most recent last
        self._idle: list[tuple[asyncpg.Connection, float]] = []
        #: connections open or being opened, lent or idle
        self.size = 0
        self._waiters: deque[asyncio.Future[asyncpg.Connection | None]] = deque()
        self._closing = False

    def free(self) -> bool:
        """Whether a call now gets a connection without waiting (one idle, or room)."""
        return bool(self._idle) or self.size < self._max

    async def acquire(self) -> asyncpg.Connection:
        while True:
            if self._closing:
                raise asyncpg.InterfaceError("the pool is closed")
            while self._idle:
                conn, _ = self._idle.pop()
                if not conn.is_closed():
                    return conn
                self.size -= 1
            if self.size < self._max:
                return await self._open()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                conn = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self.release(waiter.result())  # handed over as it was cancelled
                else:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                raise
            if conn is not None:
                return cast(asyncpg.Connection, conn)
            # None: a connection was closed, so there is room to open one

    async def _open(self) -> asyncpg.Connection:
        self.size += 1
        conn: asyncpg.Connection | None = None
        try:
            conn = cast(asyncpg.Connection, await asyncpg.connect(**self._connect))
            await self._setup(conn)
            return conn
        except BaseException:
            if conn is not None:
                conn.terminate()
            self._gone()
            raise

    def release(self, conn: asyncpg.Connection, *, keep: bool = True) -> None:
        """Take `conn` back; `keep` False (or a connection closed, or left in a
        transaction) closes it instead."""
        if not keep or self._closing or conn.is_closed() or conn.is_in_transaction():
            conn.terminate()
            self._gone()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        now = time.monotonic()
        self._idle.append((conn, now))
        if self._idle[0][1] < now - IDLE_LIFETIME:
            old, _ = self._idle.pop(0)
            old.terminate()
            self._gone()

    def _gone(self) -> None:
        self.size -= 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # room to open one: it tries
                return

    async def close(self, timeout: float = 2.0) -> None:
        """Close the idle connections (politely, within `timeout`); lent ones are
        closed as they come back."""
        self._closing = True
        idle, self._idle = self._idle, []
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        for conn, _ in idle:
            try:
                await asyncio.wait_for(conn.close(), timeout)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                conn.terminate()
            self.size -= 1
