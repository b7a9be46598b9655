"""Many records at once, through a store's own operations: for the tests of operator
surfaces at scale (tests/test_scale.py) and the benchmark that serves them."""

from __future__ import annotations

import asyncio

from gateway.keying import record_digest
from gateway.records import KeyRef
from gateway.store.base import Store


async def park_many(
    store: Store, route: str, count: int, *, prefix: str = "bulk", chunk: int = 500
) -> list[KeyRef]:
    """`count` parked records of `route` (keys `{prefix}-0` ...), as a gateway makes
    them: a claim, then an unknown outcome under `on_unknown_outcome: park`. Each
    chunk's calls go at once (on Redis, pipelined on the store's one connection)."""
    refs = [
        KeyRef(record_digest(route, "", f"{prefix}-{i}"), route, f"{prefix}-{i}")
        for i in range(count)
    ]
    for start in range(0, count, chunk):
        part = refs[start : start + chunk]
        claims = await asyncio.gather(*(store.claim(r, "bulk-run", "fp", 3600) for r in part))
        assert all(c is None for c in claims), "park_many wants keys no record has"
        parked = await asyncio.gather(
            *(store.mark_unresolved(r, "bulk-run", "timed out", park=True) for r in part)
        )
        assert all(parked)
    return refs
