"""An eviction policy that can drop records is noticed: at start (a log line naming
the fix), in /readyz (503 with the reason, unless store.allow_eviction), and in the
`idempotency_gateway_store_info{maxmemory_policy, aof}` gauge the alerts read.

Every Redis here is a redis-server the test started (tests/support/servers.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.admin.api import create_admin_app
from gateway.assembly import Gateway
from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.keying import record_digest
from gateway.records import KeyRef, StoreInfo
from gateway.store.redis import RedisStore
from tests.conftest import config_for, unique
from tests.support.servers import Process, RedisServer
from tests.support.topologies import ClusterSetup, SentinelSetup, redis_cli

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

FIX = "Set maxmemory-policy noeviction, or store.allow_eviction: true if"


@pytest.fixture(scope="module")
def evicting() -> Iterator[RedisServer]:
    server = RedisServer("--maxmemory-policy", "allkeys-lru").start()
    yield server
    server.stop()


@asynccontextmanager
async def admin_of(upstream: Process, store: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    route = {"name": "r", "match": {"path": "/r"}, "key": {"header": "Idempotency-Key"}}
    gateway = Gateway(config_for(upstream.url, [route], store=store), sweep=False)
    await gateway.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_admin_app(gateway)), base_url="http://admin"
    )
    try:
        yield client
    finally:
        await client.aclose()
        await gateway.close()


def store_info_samples(scrape: str) -> list[str]:
    return [
        line for line in scrape.splitlines() if line.startswith("idempotency_gateway_store_info{")
    ]


async def test_an_evicting_policy_fails_readiness_and_says_how_to_fix_it(
    evicting: RedisServer, upstream: Process, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    store = {"url": evicting.url, "prefix": unique("evict") + ":"}
    async with admin_of(upstream, store) as admin:
        logged = [r for r in caplog.records if "maxmemory-policy allkeys-lru" in r.getMessage()]
        ready = await admin.get("/readyz")
        again = await admin.get("/readyz")
        scrape = (await admin.get("/metrics")).text
    assert len(logged) == 1, "logged once, at start, not at every look"
    assert logged[0].levelno == logging.ERROR and FIX in logged[0].getMessage()
    assert f"127.0.0.1:{evicting.port}" in logged[0].getMessage()
    assert ready.status_code == 503 and again.status_code == 503
    doc = ready.json()
    assert doc["ready"] is False and doc["checks"]["store"] == "ok"
    assert "maxmemory-policy allkeys-lru" in doc["checks"]["store_eviction"]
    assert FIX in doc["checks"]["store_eviction"]
    assert doc["store"] == {"maxmemory_policy": "allkeys-lru", "aof": "no"}
    assert store_info_samples(scrape) == [
        'idempotency_gateway_store_info{aof="no",maxmemory_policy="allkeys-lru"} 1.0'
    ]


async def test_allow_eviction_is_ready_and_still_reports_it(
    evicting: RedisServer, upstream: Process, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    store = {"url": evicting.url, "prefix": unique("allow") + ":", "allow_eviction": True}
    async with admin_of(upstream, store) as admin:
        ready = await admin.get("/readyz")
        scrape = (await admin.get("/metrics")).text
    assert ready.status_code == 200, ready.text
    doc = ready.json()
    assert doc["ready"] is True
    assert doc["checks"]["store_eviction"] == "allowed by store.allow_eviction"
    assert doc["store"]["maxmemory_policy"] == "allkeys-lru"
    assert 'maxmemory_policy="allkeys-lru"} 1.0' in scrape
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "allowed by store.allow_eviction" in caplog.text


async def test_a_policy_changed_at_run_time_is_seen(
    upstream: Process, caplog: pytest.LogCaptureFixture
) -> None:
    """CONFIG SET on a running Redis: the next /readyz sees it, the gauge moves to the
    new label set (the old one is dropped), and the change is logged once."""
    caplog.set_level(logging.INFO)
    server = RedisServer().start()
    try:
        async with admin_of(upstream, {"url": server.url}) as admin:
            assert (await admin.get("/readyz")).status_code == 200
            redis_cli(server.port, "config", "set", "maxmemory-policy", "volatile-lru")
            redis_cli(server.port, "config", "set", "appendonly", "yes")
            evicting = await admin.get("/readyz")
            await admin.get("/readyz")
            scrape = (await admin.get("/metrics")).text
            redis_cli(server.port, "config", "set", "maxmemory-policy", "noeviction")
            back = await admin.get("/readyz")
    finally:
        server.stop()
    assert evicting.status_code == 503
    assert "volatile-lru" in evicting.json()["checks"]["store_eviction"]
    assert evicting.json()["store"] == {"maxmemory_policy": "volatile-lru", "aof": "yes"}
    assert store_info_samples(scrape) == [
        'idempotency_gateway_store_info{aof="yes",maxmemory_policy="volatile-lru"} 1.0'
    ]
    assert back.status_code == 200 and back.json()["checks"]["store_eviction"] == "ok"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "volatile-lru" in errors[0] and FIX in errors[0]


async def test_the_memory_store_never_evicts(upstream: Process) -> None:
    async with admin_of(upstream, {"url": "memory://"}) as admin:
        ready = await admin.get("/readyz")
        scrape = (await admin.get("/metrics")).text
    assert ready.status_code == 200
    assert ready.json()["store"] == {"maxmemory_policy": "noeviction", "aof": "n/a"}
    assert store_info_samples(scrape) == [
        'idempotency_gateway_store_info{aof="n/a",maxmemory_policy="noeviction"} 1.0'
    ]


async def test_info_refused_by_an_acl_is_not_taken_for_noeviction(
    redis_server: RedisServer,
) -> None:
    user = unique("noinfo")
    redis_cli(redis_server.port, "acl", "setuser", user, "on", ">pw", "~*", "&*", "+@all", "-info")
    try:
        store = RedisStore(StoreConfig(url=redis_server.url, username=user, password="pw"))
        try:
            await store.ping()
            info = await store.info()
        finally:
            await store.close()
    finally:
        redis_cli(redis_server.port, "acl", "deluser", user)
    assert info.maxmemory_policy == "unknown" and info.evicts
    assert "NOPERM" in info.error or "permission" in info.error
    refusal = info.refusal(allow_eviction=False)
    assert "+info" in refusal and "store.allow_eviction: true" in refusal
    assert info.refusal(allow_eviction=True) == ""


async def test_readiness_says_an_acl_refusal_in_the_gateways_words(
    redis_server: RedisServer, upstream: Process, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis user the ACL does not let run INFO: /readyz (no token needed) says what
    the gateway could not learn and the fix, in its own words; Redis's refusal goes
    to the log."""
    caplog.set_level(logging.INFO)
    user = unique("noinfo")
    redis_cli(redis_server.port, "acl", "setuser", user, "on", ">pw", "~*", "&*", "+@all", "-info")
    store = {"url": redis_server.url, "username": user, "password": "pw", "prefix": user + ":"}
    try:
        async with admin_of(upstream, store) as admin:
            ready = await admin.get("/readyz")
    finally:
        redis_cli(redis_server.port, "acl", "deluser", user)
    assert ready.status_code == 503, ready.text
    said = ready.json()["checks"]["store_eviction"]
    assert "INFO" in said and "+info" in said and "store.allow_eviction: true" in said, said
    for driver in ("NOPERM", "permission", "'info'", user):
        assert driver not in ready.text, (driver, ready.text)
    logged = [r for r in caplog.records if "no permissions to run the 'info'" in r.getMessage()]
    assert logged and logged[0].levelno == logging.ERROR, caplog.text


def test_the_worst_server_wins() -> None:
    ok = StoreInfo("noeviction", "yes", "a")
    volatile = StoreInfo("volatile-ttl", "yes", "b")
    allkeys = StoreInfo("allkeys-random", "no", "c")
    unknown = StoreInfo("unknown", "unknown", "d", error="NOPERM")
    assert ok.worse(volatile) == volatile and volatile.worse(ok) == volatile
    assert volatile.worse(allkeys) == allkeys and allkeys.worse(volatile) == allkeys
    assert allkeys.worse(unknown).maxmemory_policy == "unknown"
    assert allkeys.worse(unknown).aof == "no"  # "no" is worse than not knowing
    assert ok.worse(StoreInfo("noeviction", "no", "e")) == StoreInfo("noeviction", "no", "a")


@pytest.mark.cluster
async def test_a_cluster_reports_its_worst_master(redis_cluster: ClusterSetup) -> None:
    nodes = tuple(("127.0.0.1", node.port) for node in redis_cluster.nodes)
    store = RedisStore(StoreConfig(cluster_nodes=nodes, socket_timeout=2.0))
    found: list[StoreInfo] = []
    try:
        assert (await store.info()).maxmemory_policy == "noeviction"
        for odd in redis_cluster.nodes:  # whichever master it is, it is seen
            redis_cli(odd.port, "config", "set", "maxmemory-policy", "volatile-lfu")
            try:
                found.append(await store.info())
            finally:
                redis_cli(odd.port, "config", "set", "maxmemory-policy", "noeviction")
    finally:
        await store.close()
    assert [info.maxmemory_policy for info in found] == ["volatile-lfu"] * len(nodes)
    assert [info.source for info in found] == [f"127.0.0.1:{port}" for _, port in nodes]
    assert {info.aof for info in found} == {"no"}


@pytest.mark.sentinel
@pytest.mark.slow
async def test_sentinel_reports_the_master() -> None:
    setup = SentinelSetup().start()
    try:
        redis_cli(setup.master.port, "config", "set", "maxmemory-policy", "allkeys-lfu")
        redis_cli(setup.replica.port, "config", "set", "maxmemory-policy", "noeviction")
        store = RedisStore(
            StoreConfig(
                sentinel_master=setup.master_name,
                sentinel_nodes=tuple(("127.0.0.1", s.port) for s in setup.sentinels),
            )
        )
        try:
            info = await store.info()
        finally:
            await store.close()
    finally:
        setup.stop()
    assert info.maxmemory_policy == "allkeys-lfu"
    assert "sentinel master mymaster" in info.refusal(allow_eviction=False)


@pytest.mark.cluster
async def test_a_cluster_queues_calls_beyond_max_connections(redis_cluster: ClusterSetup) -> None:
    """As on one Redis (a blocking pool), a burst larger than store.max_connections
    waits for a connection; redis-py's cluster client would raise MaxConnectionsError,
    a 503 for every request past the pool (found by test_delivery_process's storm)."""
    nodes = tuple(("127.0.0.1", node.port) for node in redis_cluster.nodes)
    config = StoreConfig(
        cluster_nodes=nodes, prefix=unique("mc") + ":", max_connections=4, socket_timeout=2.0
    )
    store = RedisStore(config)
    await store.start()
    try:
        refs = [KeyRef(record_digest("r", "", f"k{i}"), "r", f"k{i}") for i in range(200)]
        results = await asyncio.gather(
            *[store.claim(ref, f"run-{i}", "fp", 30) for i, ref in enumerate(refs)],
            return_exceptions=True,
        )
        assert [r for r in results if isinstance(r, BaseException)] == []
    finally:
        await store.close()


def _script_loads(port: int) -> int:
    stats = redis_cli(port, "INFO", "commandstats")
    for line in stats.splitlines():
        if line.startswith("cmdstat_script|load:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


@pytest.mark.cluster
async def test_a_cluster_loads_a_flushed_script_once_not_once_per_caller(
    redis_cluster: ClusterSetup,
) -> None:
    """After a SCRIPT FLUSH (a restarted node, a first start) a burst of calls all meet
    NOSCRIPT. redis-py's own fallback loads the script in each of them, on every
    primary: the 1,000 accepts of test_delivery_process's cluster storm made thousands
    of loads at once, which timed out, and the driver then failed commands it had
    closed under them with AttributeError: a 500 to the caller (seen in CI). One load
    per script is shared by every caller that met NOSCRIPT."""
    nodes = tuple(("127.0.0.1", node.port) for node in redis_cluster.nodes)
    config = StoreConfig(cluster_nodes=nodes, prefix=unique("fl") + ":", socket_timeout=2.0)
    store = RedisStore(config)
    await store.start()
    try:
        for node in redis_cluster.nodes:
            redis_cli(node.port, "SCRIPT", "FLUSH")
        before = {node.port: _script_loads(node.port) for node in redis_cluster.nodes}
        refs = [KeyRef(record_digest("r", "", f"k{i}"), "r", f"k{i}") for i in range(200)]
        results = await asyncio.gather(
            *[store.claim(ref, f"run-{i}", "fp", 30) for i, ref in enumerate(refs)],
            return_exceptions=True,
        )
        assert [r for r in results if r is not None] == []  # each one claimed
        loads = {port: _script_loads(port) - count for port, count in before.items()}
        # One load of `claim` per primary (a replica node answers none); a flush that
        # lands between a load and its callers' retries could make it two.
        assert max(loads.values()) <= 2, loads
        again = await asyncio.gather(*[store.claim(ref, "other", "fp", 30) for ref in refs])
        assert all(
            record is not None and record.run_id == f"run-{i}" for i, record in enumerate(again)
        )
    finally:
        await store.close()


@pytest.mark.cluster
@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"), "asyncio"],
)
async def test_a_cluster_connection_closed_under_commands_is_a_store_error(
    redis_cluster: ClusterSetup,
) -> None:
    """redis-py's cluster client closes connections under commands still using them
    (it does so itself after a timeout or a ClusterDownError; aclose() here does the
    same at once). Those commands fail inside the driver with AttributeError (on
    asyncio's loop) or RuntimeError (on uvloop's, the gateway's: "the handler is
    closed"), which are no store errors: a 500 with a traceback instead of a 503 (or
    fail-open), and a delivery worker's queue watch ended on one after a failover.
    Each call ends as a record or a StoreError, on both loops."""
    nodes = tuple(("127.0.0.1", node.port) for node in redis_cluster.nodes)
    store = RedisStore(
        StoreConfig(cluster_nodes=nodes, prefix=unique("cl") + ":", socket_timeout=2.0)
    )
    await store.start()
    try:
        refs = [KeyRef(record_digest("r", "", f"k{i}"), "r", f"k{i}") for i in range(300)]
        outcomes: Counter[str] = Counter()
        for _ in range(5):
            calls = [asyncio.ensure_future(store.get(ref)) for ref in refs]
            await asyncio.sleep(0.002)  # some answered, some on the wire
            await store.client.aclose()
            results = await asyncio.gather(*calls, return_exceptions=True)
            outcomes.update(type(result).__name__ for result in results)
        assert set(outcomes) <= {"NoneType", "StoreError"}, outcomes
        assert await store.get(refs[0]) is None  # and the client works again after
    finally:
        await store.close()


@pytest.mark.cluster
async def test_a_cluster_no_node_answers_is_a_store_error_and_its_listener_lives() -> None:
    """Every node of a cluster is down: redis-py's cluster client, refreshing its
    topology, raises RedisClusterException ("cannot be connected"), which is no
    RedisError. Each call of the store ends as a StoreError (the delivery worker's
    queue watch, which expects nothing else, ended on it and delivered nothing more),
    and the notifications listener keeps trying: when the nodes are back, the store
    answers and its subscription is up again."""
    cluster = ClusterSetup().start()
    nodes = tuple(("127.0.0.1", node.port) for node in cluster.nodes)
    store = RedisStore(
        StoreConfig(
            cluster_nodes=nodes,
            prefix=unique("down") + ":",
            socket_timeout=1.0,
            connect_timeout=1.0,
        )
    )
    await store.start()
    try:
        await asyncio.wait_for(store.subscribed.wait(), 10)
        ref = KeyRef(record_digest("r", "", "k"), "r", "k")
        for node in cluster.nodes:
            node.kill()
        calls = {
            "get": lambda: store.get(ref),
            "claim": lambda: store.claim(ref, "run", "fp", 30),
            "queue_stats": store.queue_stats,
            "stats": store.stats,
            "due_candidates": lambda: store.due_candidates("r", 10),
        }
        outcomes = {}
        for _ in range(2):  # the first meets a lost connection, the next a refresh
            for name, call in calls.items():
                try:
                    await call()
                    outcomes[name] = "answered"
                except Exception as exc:
                    outcomes[name] = type(exc).__name__
        assert outcomes == dict.fromkeys(calls, "StoreError"), outcomes
        await asyncio.sleep(3)  # the listener meets the outage and tries again, in vain
        for node in cluster.nodes:
            node.start()
        deadline = time.monotonic() + 30
        while "cluster_state:ok" not in redis_cli(cluster.nodes[0].port, "cluster", "info"):
            assert time.monotonic() < deadline, "the cluster never came back"
            await asyncio.sleep(0.2)
        while True:
            try:
                assert await store.get(ref) is None
                break
            except StoreError:
                assert time.monotonic() < deadline, "the store never answered again"
                await asyncio.sleep(0.2)
        await asyncio.wait_for(store.subscribed.wait(), 15)
    finally:
        await store.close()
        cluster.stop()
