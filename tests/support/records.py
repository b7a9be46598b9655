"""Reading a gateway's records straight from its store (Redis or PostgreSQL), for tests
that run gateway processes."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from gateway.config import StoreConfig
from gateway.keying import record_digest
from gateway.records import KeyRef, Record, State
from gateway.store import open_store


class StoreServer(Protocol):
    """A server the tests started (RedisServer, PostgresServer): where its store is."""

    @property
    def url(self) -> str: ...


async def read_record(server: StoreServer, prefix: str, route: str, key: str) -> Record | None:
    """The record of `key` on `route` (no scope), through a store of its own."""
    store = open_store(StoreConfig(url=server.url, prefix=prefix))
    try:
        return await store.get(KeyRef(record_digest(route, "", key), route, key))
    finally:
        await store.close()


async def until_state(
    server: StoreServer, prefix: str, route: str, key: str, state: State, timeout: float = 15
) -> Record:
    """Wait (bounded) until the record of `key` on `route` is in `state`."""
    deadline = time.monotonic() + timeout
    record = None
    while time.monotonic() < deadline:
        record = await read_record(server, prefix, route, key)
        if record is not None and record.state is state:
            return record
        await asyncio.sleep(0.1)
    raise AssertionError(f"{route} {key} never became {state}: {record}")
