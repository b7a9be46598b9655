"""One store read for many readers: what a scrape storm costs.

`/metrics` (unauthenticated), `/admin/overview` and the console's overview read the
kept counts per route and state from the store: on Redis Cluster a round trip per
bucket, with many routes a large answer, on the proxy's event loop. `SharedRead`
runs one such read at a time, the readers that arrive meanwhile await it, and its
answer serves every reader for `ttl` seconds after it ended; so any number of
concurrent or repeated scrapes costs one store read per `ttl`, and the counts they
report are at most that old. A read that fails is kept by no one: each waiter gets
its error, the next reader reads again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedRead(Generic[T]):
    def __init__(self, read: Callable[[], Awaitable[T]], ttl: float) -> None:
        self._read = read
        self.ttl = ttl
        self._kept: tuple[float, T] | None = None
        self._reading: asyncio.Future[T] | None = None

    async def get(self) -> T:
        kept = self._kept
        if kept is not None and time.monotonic() < kept[0]:
            return kept[1]
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._refresh())
        # A reader that gives up (its client went away) leaves the read to the others.
        return await asyncio.shield(self._reading)

    async def _refresh(self) -> T:
        try:
            value = await self._read()
            self._kept = (time.monotonic() + self.ttl, value)
            return value
        finally:
            self._reading = None
