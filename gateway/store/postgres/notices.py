"""The PostgreSQL store's listener: one connection per process, LISTENing on the
store's channel, for waiting duplicates and delivery workers.

What the statements NOTIFY there (sent when their transaction commits): a changed
record's digest, for a completion followed by its fingerprint and sealed response
(base64) when they fit in a notice; or a delivery notice, `!d <digest>/<route> <due_ms>
<now_ms> <origin>` (due) or `!t <digest>/<route>` (taken), the Redis store's words.
Notices are hints, at-most-once: after a (re)connect every waiter is woken and the
workers rescan (`due.lost()`), and waiters re-read on the store's jittered fallback
anyway. A part PostgresStore (store.py) holds and starts.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from gateway.records import KeyRef
from gateway.store.base import Opener
from gateway.store.notices import Due, DueFeed, Notifier
from gateway.store.postgres.database import FAILED

log = logging.getLogger("gateway.store")

#: Seconds between the listener's checks that its connection still answers.
KEEPALIVE = 5.0


class PostgresNotices:
    def __init__(
        self,
        connect_args: Callable[[], dict[str, Any]],
        channel: str,
        timeout: float,
        opener: Opener,
        notifier: Notifier,
        due: DueFeed,
    ) -> None:
        self._connect_args = connect_args
        self.channel = channel
        self._timeout = timeout
        self.opener = opener
        self.notifier = notifier
        self.due = due
        self._closing = False
        #: Set while the LISTEN connection is up (tests wait on it).
        self.subscribed = asyncio.Event()

    def close(self) -> None:
        """Stop reconnecting: the listening task is cancelled by its owner."""
        self._closing = True

    async def listen(self) -> None:
        delay = 0.1
        while not self._closing:
            conn: asyncpg.Connection | None = None
            lost = asyncio.Event()
            try:
                conn = await asyncpg.connect(**self._connect_args())
                conn.add_termination_listener(lambda _, lost=lost: lost.set())
                await conn.add_listener(self.channel, self._on_notify)
                self.subscribed.set()
                self.notifier.notify_all()  # changes made while not listening: re-read
                self.due.lost()  # deliveries announced meanwhile: rescan
                delay = 0.1
                while not self._closing:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(KEEPALIVE):
                            await lost.wait()
                    if lost.is_set():
                        raise ConnectionError("the listening connection closed")
                    # A peer that vanished without a FIN is found here, not in hours.
                    await conn.fetchval("SELECT 1", timeout=self._timeout)
            except (*FAILED, ConnectionError) as exc:
                if not self._closing:
                    log.warning("store notifications lost (%s); reconnecting", exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
            finally:
                self.subscribed.clear()
                if conn is not None:
                    try:
                        await asyncio.wait_for(conn.close(), 1)
                    except (TimeoutError, *FAILED):
                        conn.terminate()

    def _on_notify(self, conn: object, pid: int, channel: str, payload: object) -> None:
        text = str(payload)
        if text[:1] == "!":
            self._delivery_notice(text)
            return
        digest, _, notice = text.partition("\n")
        if not self.notifier.watching(digest):
            return  # every process hears every change; most are for others
        completed = None
        if notice:
            fingerprint, _, blob = notice.partition("\n")
            try:
                data = base64.b64decode(blob)
            except (binascii.Error, ValueError):
                data = b""
            response, _ = self.opener.read_response(digest, data) if data else (None, "")
            if response is not None:  # unreadable: the waiter reads the record instead
                completed = (fingerprint, response)
        self.notifier.notify(digest, completed)

    def _delivery_notice(self, text: str) -> None:
        kind, _, rest = text.partition(" ")
        try:
            if kind == "!t":
                self.due.taken(rest.split("/", 1)[0])
            elif kind == "!d":
                member, due, now, origin = rest.split(" ", 3)
                digest, _, route = member.partition("/")
                self.due.announce(Due(KeyRef(digest, route, ""), int(due), int(now), origin))
        except ValueError:
            return  # not one of ours: the writers are trusted, their notices hints
