"""The store on a Redis whose replicas do not confirm a write (`wait_for_replicas`).

One Redis server without replicas stands in for replicas that fell behind: WAIT never
reaches the count asked for. The contract suite runs over every store; this is about
Redis alone, so it lives apart rather than being skipped for the others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

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


@pytest.fixture
async def views(redis_server: RedisServer) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """One prefix seen by two stores: a plain one, standing in for a first try whose
    write landed but whose reply was lost, and one with wait_for_replicas: 1 on a
    server without replicas, for the retry."""
    prefix = unique("t") + ":"
    plain = RedisStore(StoreConfig(url=redis_server.url, prefix=prefix))
    replicated = RedisStore(
        StoreConfig(url=redis_server.url, prefix=prefix, wait_for_replicas=1, socket_timeout=0.3)
    )
    await plain.start()
    await replicated.start()
    yield plain, replicated
    await replicated.close()
    await plain.close()


async def test_a_retried_claim_that_finds_its_own_claim_still_needs_the_replicas(
    views: tuple[RedisStore, RedisStore],
) -> None:
    """redis-py retries a command once after a timeout, and WAIT's own wait can be that
    timeout: the first try's claim landed on the master, unconfirmed. The retry finds
    the record in flight under its own run id; it must not take that as a confirmed
    claim (the request would go out on a claim a failover can lose, and run twice). It
    is a store error (503, never forwarded), and the claim is released for the retry."""
    plain, replicated = views
    r = ref()
    assert await plain.claim(r, "run-a", "fp", 30) is None  # the first try's write
    with pytest.raises(StoreError, match="replicas confirmed the claim"):
        await replicated.claim(r, "run-a", "fp", 30)
    assert await plain.claim(r, "run-b", "fp", 30) is None  # free for the retry


async def test_a_retried_accept_that_finds_its_own_delivery_still_needs_the_replicas(
    views: tuple[RedisStore, RedisStore],
) -> None:
    """The same for a delivery: a retried accept that finds its own queued record is
    not a confirmed 202. It is a store error, and the delivery stays queued."""
    plain, replicated = views
    r = ref()
    assert (await plain.accept(r, "run-a", "fp", REQUEST, TOKEN)).outcome == "queued"
    with pytest.raises(StoreError, match="replicas confirmed the accepted delivery"):
        await replicated.accept(r, "run-a", "fp", REQUEST, TOKEN)
    record = await replicated.get(r)
    assert record is not None and record.state is State.QUEUED
