"""Reading a gateway's records straight from Redis, for tests that run gateway processes."""

from __future__ import annotations

import asyncio
import time

from gateway.config import StoreConfig
from gateway.keys import record_digest
from gateway.records import KeyRef, Record, State
from gateway.store.redis import RedisStore
from tests.support.servers import RedisServer


async def read_record(redis: RedisServer, prefix: str, route: str, key: str) -> Record | None:
    """The record of `key` on `route` (no scope), through a store of its own."""
    store = RedisStore(StoreConfig(url=redis.url, prefix=prefix))
    try:
        return await store.get(KeyRef(record_digest(route, "", key), route, key))
    finally:
        await store.close()


async def until_state(
    redis: RedisServer, prefix: str, route: str, key: str, state: State, timeout: float = 15
) -> Record:
    """Wait (bounded) until the record of `key` on `route` is in `state`."""
    deadline = time.monotonic() + timeout
    record = None
    while time.monotonic() < deadline:
        record = await read_record(redis, prefix, route, key)
        if record is not None and record.state is state:
            return record
        await asyncio.sleep(0.1)
    raise AssertionError(f"{route} {key} never became {state}: {record}")
