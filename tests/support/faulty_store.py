"""Memory stores that fail one operation: in a way nobody foresaw, for the tests of
what the engine does when recording an outcome fails with an error that is not a
StoreError (a fault of the gateway's own); or after it took effect, as a store whose
reply was lost does."""

from __future__ import annotations

from typing import Any

from gateway.errors import StoreError
from gateway.records import Record
from gateway.store.base import PickResult, QueueStat
from gateway.store.memory import MemoryStore
from gateway.store.notices import Due


class UnforeseenFault(MemoryStore):
    """`fail` ("complete", "retry_later", "queue_stats" or "due_candidates") raises
    RuntimeError, counted in `raised`; every other operation is the memory store's."""

    def __init__(self, fail: str) -> None:
        super().__init__()
        self.fail = fail
        self.raised = 0

    async def retry_later(self, *args: Any, **kwargs: Any) -> bool:
        if self.fail == "retry_later":
            self.raised += 1
            raise RuntimeError("an unforeseen fault while scheduling the next attempt")
        return await super().retry_later(*args, **kwargs)

    async def complete(self, *args: Any, **kwargs: Any) -> bool:
        if self.fail == "complete":
            self.raised += 1
            raise RuntimeError("an unforeseen fault while completing")
        return await super().complete(*args, **kwargs)

    async def queue_stats(self) -> list[QueueStat]:
        if self.fail == "queue_stats":
            self.raised += 1
            raise RuntimeError("an unforeseen fault while counting the queues")
        return await super().queue_stats()

    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]:
        if self.fail == "due_candidates":
            self.raised += 1
            raise RuntimeError("an unforeseen fault while rescanning the queue")
        return await super().due_candidates(route, limit)


class LostPickReply(MemoryStore):
    """A memory store whose first `pick` that takes a delivery does so, then raises
    StoreError, as a pick whose reply was lost (a connection that broke after Redis
    ran the script) does; `lost` counts it."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    async def pick(self, *args: Any, **kwargs: Any) -> PickResult:
        picked = await super().pick(*args, **kwargs)
        if picked.record is not None and not self.lost:
            self.lost += 1
            raise StoreError("redis pick failed: Connection closed by server.")
        return picked


class LateClaim(MemoryStore):
    """A memory store whose first claim raises StoreError without taking effect, as a
    claim that timed out with its command still in Redis's socket buffer does; that
    claim lands after the next release of its key has run (the release found nothing),
    as Redis may run two connections' buffered commands in either order. `landed`
    counts it."""

    def __init__(self) -> None:
        super().__init__()
        self.held: tuple[Any, ...] | None = None
        self.landed = 0

    async def claim(self, *args: Any, **kwargs: Any) -> Record | None:
        if self.held is None and not self.landed:
            self.held = (args, kwargs)
            raise StoreError("redis claim failed: Timeout reading from socket")
        return await super().claim(*args, **kwargs)

    async def release(self, *args: Any, **kwargs: Any) -> bool:
        released = await super().release(*args, **kwargs)
        if self.held is not None:
            (claim_args, claim_kwargs), self.held = self.held, None
            await super().claim(*claim_args, **claim_kwargs)
            self.landed += 1
        return released
