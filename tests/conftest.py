from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from gateway.assembly import Gateway
from gateway.config import Config, StoreConfig, parse_config
from gateway.proxy.app import ProxyApp
from gateway.store.base import Store
from gateway.store.memory import MemoryStore
from gateway.store.postgres import PostgresStore
from gateway.store.postgres.schema import migrate
from gateway.store.redis import RedisStore
from gateway.store.sqlite import SqliteStore
from tests.support.ledger import LEDGER, Ledger
from tests.support.postgres import PostgresServer
from tests.support.servers import (
    ROOT,
    Process,
    RedisServer,
    job_service_server,
    kill_what_this_test_started,
    upstream_server,
)
from tests.support.topologies import ClusterSetup, ReplicatedSetup, SentinelSetup

#: The browser fixtures (`browser`, `tabs`) for the console's tests.
pytest_plugins = ["tests.support.browser"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _nothing_left_running() -> Iterator[None]:
    """Kills the processes the test registered with `for_this_test`."""
    yield
    kill_what_this_test_started()


@pytest.fixture(scope="session")
def ledger() -> Ledger:
    """What the reliability tests tried and what held; see tests/support/ledger.py."""
    return LEDGER


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not LEDGER.entries:
        return
    LEDGER.write(ROOT / "build" / "reliability.json")
    terminalreporter.section("reliability ledger (build/reliability.json)")
    for line in LEDGER.table():
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's own PostgreSQL (initdb into a temp dir, a free port; never the
    machine's service), durable as production runs it. Each store gets a prefix of its
    own in its one database; tests that crash or restart it start their own."""
    server = PostgresServer()
    server.start()
    yield server
    server.stop()
    server.remove()


@pytest.fixture(scope="session")
def postgres_database(postgres_server: PostgresServer) -> PostgresServer:
    """The session's PostgreSQL with the gateway's schema (`store migrate`, once)."""
    migrate_database(postgres_server.url)
    return postgres_server


def migrate_database(url: str) -> None:
    """What `idempotency-gateway store migrate` does, for a test's own database."""

    async def run() -> None:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
        finally:
            await conn.close()

    # In a thread of its own: fixtures asking for it may run inside an event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


@pytest.fixture(scope="session")
def upstream() -> Iterator[Process]:
    server = upstream_server()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def job_service() -> Iterator[Process]:
    """tests/support/job_service.py, one per session: tests use keys of their own."""
    server = job_service_server()
    server.start()
    yield server
    server.stop()


def unique(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ClusterSetup]:
    cluster = ClusterSetup().start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster_replicated() -> Iterator[ClusterSetup]:
    """Three masters with a replica each, for store.wait_for_replicas on a cluster."""
    cluster = ClusterSetup(replicas=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_replicated() -> Iterator[ReplicatedSetup]:
    """A master with one replica, for store.wait_for_replicas on one server's URL."""
    setup = ReplicatedSetup().start()
    yield setup
    setup.stop()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[SentinelSetup]:
    """A Sentinel setup nobody fails over (tests that kill its master start their own)."""
    setup = SentinelSetup().start()
    yield setup
    setup.stop()


#: Every store the contract holds for; tests parametrise `store_kind` with it where
#: the cluster must be covered too (the contract suite, the duplicate storm).
ALL_STORES = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("cluster", marks=[pytest.mark.redis, pytest.mark.cluster]),
    pytest.param("postgres", marks=pytest.mark.postgres),
    "sqlite",
]
#: The Redis topologies among them, for tests that count Redis's own commands.
REDIS_STORES = ALL_STORES[1:3]
#: Every topology, and each that has replicas with `store.wait_for_replicas: 1`
#: (`+wait`): the contract suite runs over all of them, so each setting check-config
#: accepts is held to the contract wherever it is accepted. The `+wait` runs are the
#: long tier (`scripts/test-all`; about 20 s each): the default run keeps every
#: topology without them, and tests/test_store_replication.py drives the waits.
EVERY_TOPOLOGY = [
    *ALL_STORES,
    pytest.param("redis+wait", marks=[pytest.mark.redis, pytest.mark.long]),
    pytest.param("sentinel", marks=[pytest.mark.redis, pytest.mark.sentinel]),
    pytest.param(
        "sentinel+wait", marks=[pytest.mark.redis, pytest.mark.sentinel, pytest.mark.long]
    ),
    pytest.param("cluster+wait", marks=[pytest.mark.redis, pytest.mark.cluster, pytest.mark.long]),
]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(store_kind: str, request: pytest.FixtureRequest) -> Callable[[], Store]:
    """Stores of the parametrised kind; Redis ones get a prefix of their own, SQLite
    ones a file of their own (every store made here shares it, as workers do)."""
    return store_maker(store_kind, request, "gateway.db")


@pytest.fixture
def make_other_store(store_kind: str, request: pytest.FixtureRequest) -> Callable[[], Store]:
    """Stores of the parametrised kind apart from `make_store`'s (another prefix, another
    SQLite file): where a test copies records from one store to another."""
    return store_maker(store_kind, request, "other.db")


def store_maker(
    store_kind: str, request: pytest.FixtureRequest, sqlite_file: str
) -> Callable[[], Store]:
    prefix = unique("t") + ":"

    topology, _, wait = store_kind.partition("+")
    redis_common: dict[str, Any] = {
        "prefix": prefix,
        "socket_timeout": 1.0,
        "connect_timeout": 1.0,
        "wait_for_replicas": 1 if wait else 0,
    }

    def make() -> Store:
        if topology == "memory":
            return MemoryStore()
        if topology == "cluster":
            name = "redis_cluster_replicated" if wait else "redis_cluster"
            cluster: ClusterSetup = request.getfixturevalue(name)
            nodes = tuple(("127.0.0.1", node.port) for node in cluster.nodes)
            return RedisStore(StoreConfig(cluster_nodes=nodes, **redis_common))
        if topology == "sentinel":
            sentinel: SentinelSetup = request.getfixturevalue("redis_sentinel")
            return RedisStore(
                StoreConfig(
                    sentinel_master=sentinel.master_name,
                    sentinel_nodes=tuple(("127.0.0.1", s.port) for s in sentinel.sentinels),
                    **redis_common,
                )
            )
        if topology == "sqlite":
            folder: Path = request.getfixturevalue("tmp_path")
            return SqliteStore(StoreConfig(url=f"sqlite://{folder / sqlite_file}"))
        if topology == "postgres":
            database: PostgresServer = request.getfixturevalue("postgres_database")
            return PostgresStore(
                StoreConfig(
                    # A shared CI machine has stalled a statement past 2 s.
                    url=database.url,
                    prefix=prefix,
                    socket_timeout=5.0,
                    connect_timeout=5.0,
                )
            )
        if wait:
            replicated: ReplicatedSetup = request.getfixturevalue("redis_replicated")
            return RedisStore(StoreConfig(url=replicated.master.url, **redis_common))
        server: RedisServer = request.getfixturevalue("redis_server")
        return RedisStore(StoreConfig(url=server.url, **redis_common))

    return make


def config_for(upstream_url: str, routes: list[dict[str, Any]], **top: Any) -> Config:
    """A Config from YAML-shaped dicts, every route pointing at `upstream_url`; the
    store is the test's own (`make_store`), so the config names memory:// unless told."""
    data: dict[str, Any] = {
        "routes": [{"upstream": upstream_url, **route} for route in routes],
        "store": {"url": "memory://"},
        **top,
    }
    return parse_config(data, "test-config")


class GatewayClient:
    """An in-process gateway (real store, real upstream) and an httpx client on it."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=ProxyApp(gateway, lifespan=False)),
            base_url="http://gateway.test",
            timeout=60,
        )

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.http.post(path, **kwargs)

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return await self.http.request(method, path, **kwargs)


@pytest.fixture
async def gateway_for(
    make_store: Callable[[], Store], upstream: Process
) -> AsyncIterator[Callable[..., Any]]:
    """`await gateway_for(routes, **top)` gives a started GatewayClient (no sweep:
    tests that want one run it themselves)."""
    opened: list[GatewayClient] = []

    async def build(routes: list[dict[str, Any]], sweep: bool = False, **top: Any) -> GatewayClient:
        config = config_for(upstream.url, routes, **top)
        gateway = Gateway(config, store=make_store(), sweep=sweep)
        await gateway.start()
        client = GatewayClient(gateway)
        opened.append(client)
        return client

    yield build
    for client in opened:
        await client.http.aclose()
        await client.gateway.close()


async def upstream_count(upstream: Process, key: str) -> int:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{upstream.url}/_count", params={"key": key})
        return int(response.json()["count"])
