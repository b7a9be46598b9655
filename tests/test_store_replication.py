"""The store on a Redis whose replicas do not confirm a write (`wait_for_replicas`).

One Redis server without replicas stands in for replicas that fell behind: WAIT never
reaches the count asked for. The contract suite runs over every store; this is about
Redis alone, so it lives apart rather than being skipped for the others.
"""

from __future__ import annotations

import pytest

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import State
from gateway.store.redis import RedisStore
from tests.conftest import unique
from tests.support.servers import RedisServer
from tests.test_store_contract import REQUEST, TOKEN, ref

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


async def test_an_accept_the_replicas_did_not_confirm_is_an_error_and_stays_queued(
    redis_server: RedisServer,
) -> None:
    """wait_for_replicas on a server with none: the caller gets a store error (503,
    not 202), and the delivery stays queued for a repeat to find (nothing dropped)."""
    server = redis_server
    config = StoreConfig(
        url=server.url, prefix=unique("t") + ":", wait_for_replicas=1, socket_timeout=0.3
    )
    replicated = RedisStore(config)
    await replicated.start()
    try:
        r = ref()
        with pytest.raises(StoreError):
            await replicated.accept(r, "run-a", "fp", REQUEST, TOKEN)
        record = await replicated.get(r)
        assert record is not None and record.state is State.QUEUED
        assert await replicated.get_request(r) == REQUEST
    finally:
        await replicated.close()
