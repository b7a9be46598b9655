"""A small store pool never starves: waiting duplicates, the notification listener
and a burst past the pool all answer.

In-process gateways on a real redis-server (one server, Sentinel, Cluster) and a real
PostgreSQL, in front of tests/support/upstream_app.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.assembly import Gateway
from gateway.config.store import StoreConfig
from gateway.errors import StoreError
from gateway.records import State
from gateway.store.postgres import PostgresStore
from gateway.store.redis import RedisStore
from tests.conftest import GatewayClient, config_for, unique
from tests.support.postgres import PostgresServer
from tests.support.servers import Process, RedisServer
from tests.support.topologies import ClusterSetup, ReplicatedSetup, SentinelSetup

pytestmark = pytest.mark.anyio

ROUTE = {
    "name": "send-reminder",
    "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
    "key": {"body": "job_key"},
}


@pytest.fixture
async def gateway_on(upstream: Process) -> AsyncIterator[Callable[..., Any]]:
    opened: list[GatewayClient] = []

    async def build(**store: Any) -> GatewayClient:
        config = StoreConfig(prefix=unique("t") + ":", socket_timeout=1.0, **store)
        gateway = Gateway(config_for(upstream.url, [ROUTE]), store=RedisStore(config), sweep=False)
        await gateway.start()
        opened.append(GatewayClient(gateway))
        return opened[-1]

    yield build
    for client in opened:
        await client.http.aclose()
        await client.gateway.close()


async def duplicates_all_answer(gw: GatewayClient) -> None:
    """Three keys, four requests each at once: the first runs (0.4 s), the others wait
    for it and replay its answer."""
    store = gw.gateway.store
    if isinstance(store, RedisStore):
        await asyncio.wait_for(store.subscribed.wait(), timeout=10)
    keys = [unique() for _ in range(3)]
    sent = [
        gw.post("/jobs/send-reminder", json={"job_key": key}, params={"sleep": "0.4"})
        for key in keys
        for _ in range(4)
    ]
    answers = await asyncio.wait_for(asyncio.gather(*sent), timeout=20)
    assert [a.status_code for a in answers] == [200] * len(sent), [a.text for a in answers]
    replayed = sum(a.headers.get("idempotent-replayed") == "true" for a in answers)
    assert replayed == len(sent) - len(keys)


@pytest.mark.redis
@pytest.mark.parametrize("connections", [1, 2])
async def test_waiting_duplicates_answer_on_a_pool_of_one_or_two(
    gateway_on: Callable[..., Any], redis_server: RedisServer, connections: int
) -> None:
    gw = await gateway_on(url=redis_server.url, max_connections=connections)
    await duplicates_all_answer(gw)


@pytest.mark.redis
@pytest.mark.parametrize("connections", [1, 2])
async def test_waiting_duplicates_answer_on_a_small_pool_waiting_for_replicas(
    gateway_on: Callable[..., Any], redis_replicated: ReplicatedSetup, connections: int
) -> None:
    gw = await gateway_on(
        url=redis_replicated.master.url, max_connections=connections, wait_for_replicas=1
    )
    await duplicates_all_answer(gw)


@pytest.mark.postgres
@pytest.mark.parametrize("connections", [1, 2])
async def test_waiting_duplicates_answer_on_a_small_postgres_pool(
    upstream: Process, postgres_database: PostgresServer, connections: int
) -> None:
    config = StoreConfig(
        url=postgres_database.url,
        prefix=unique("t") + ":",
        socket_timeout=2.0,
        max_connections=connections,
    )
    gateway = Gateway(config_for(upstream.url, [ROUTE]), store=PostgresStore(config), sweep=False)
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        await duplicates_all_answer(gw)
    finally:
        await gw.http.aclose()
        await gateway.close()


@pytest.mark.redis
@pytest.mark.sentinel
@pytest.mark.parametrize("connections", [1, 2])
async def test_waiting_duplicates_answer_on_a_small_sentinel_pool(
    gateway_on: Callable[..., Any], redis_sentinel: SentinelSetup, connections: int
) -> None:
    gw = await gateway_on(
        sentinel_master=redis_sentinel.master_name,
        sentinel_nodes=tuple(("127.0.0.1", s.port) for s in redis_sentinel.sentinels),
        max_connections=connections,
    )
    await duplicates_all_answer(gw)


@pytest.mark.redis
@pytest.mark.cluster
@pytest.mark.parametrize("connections", [1, 2])
async def test_waiting_duplicates_answer_on_a_small_cluster_pool(
    gateway_on: Callable[..., Any], redis_cluster: ClusterSetup, connections: int
) -> None:
    gw = await gateway_on(
        cluster_nodes=tuple(("127.0.0.1", node.port) for node in redis_cluster.nodes),
        max_connections=connections,
    )
    await duplicates_all_answer(gw)


@pytest.mark.redis
@pytest.mark.cluster
@pytest.mark.parametrize("connections", [1, 2])
async def test_a_burst_past_a_cluster_pool_waits_for_connections(
    redis_cluster: ClusterSetup, connections: int
) -> None:
    """Pipelines (every bucket read at once) and single commands, forty at a time on a
    pool of one or two: each waits for a connection and all answer."""
    store = RedisStore(
        StoreConfig(
            cluster_nodes=tuple(("127.0.0.1", node.port) for node in redis_cluster.nodes),
            prefix=unique("t") + ":",
            socket_timeout=1.0,
            max_connections=connections,
        )
    )
    await store.start()
    try:
        calls = [
            call()
            for _ in range(10)
            for call in (
                store.last_successes,
                store.check_reset,
                store.stats,
                # Completed deliveries are listed by route; every other state at once.
                lambda: store.list_records(frozenset(State) - {State.COMPLETED}),
            )
        ]
        await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
    finally:
        await store.close()


@pytest.mark.redis
@pytest.mark.cluster
async def test_a_cluster_call_that_finds_no_connection_in_time_says_so(
    redis_cluster: ClusterSetup, caplog: pytest.LogCaptureFixture
) -> None:
    """The one connection held past the wait (twice the socket timeout): the call fails
    as a store error whose log line says what failed and why; the caller's answer
    stays the generic 503."""
    store = RedisStore(
        StoreConfig(
            cluster_nodes=tuple(("127.0.0.1", node.port) for node in redis_cluster.nodes),
            prefix=unique("t") + ":",
            socket_timeout=0.2,
            max_connections=1,
        )
    )
    await store.start()
    held, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with store.client.turn():
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    try:
        await asyncio.wait_for(held.wait(), timeout=5)
        with pytest.raises(StoreError) as failed:
            await asyncio.wait_for(store.last_successes(), timeout=5)
        assert str(failed.value) == (
            "redis read failed: no cluster connection free within 0.4s (store.max_connections: 1)"
        )
        gw = GatewayClient(Gateway(config_for("http://127.0.0.1:9", [ROUTE]), store=store))
        answer = await gw.post("/jobs/send-reminder", json={"job_key": unique()})
        assert answer.status_code == 503
        assert "connection" not in answer.text and "max_connections" not in answer.text
        assert "no cluster connection free within 0.4s" in caplog.text
        await gw.http.aclose()
    finally:
        release.set()
        await holder
        await store.close()


def test_a_store_error_names_a_cause_that_has_no_words() -> None:
    for cause, kind in (
        (MaxConnectionsError(), "MaxConnectionsError"),
        (RedisTimeoutError(), "TimeoutError"),
        (TimeoutError(), "TimeoutError"),
        (OSError(), "OSError"),
    ):
        assert str(StoreError.because("redis read failed", cause)) == f"redis read failed: {kind}"
    multi = RedisConnectionError("Error 111 connecting\nto 127.0.0.1:1")
    assert str(StoreError.because("redis claim failed", multi)) == (
        "redis claim failed: Error 111 connecting"
    )
