"""delivery: async across real processes: gateways SIGKILLed mid-attempt and
before pickup, Redis restarted with AOF between acceptance and delivery, SIGTERM while
a delivery is under way, and a duplicate storm over two gateway processes. The kill
before pickup and the storm run on PostgreSQL too, whose pick is `FOR
UPDATE SKIP LOCKED`: two processes never deliver one item.

Everything is a real process: redis-server (or PostgreSQL), the test upstream under
uvicorn (it counts runs per key) and `python -m gateway run`. The figures go to the
reliability ledger (area "async delivery"): a duplicate is a run of a key the promise
does not allow, a lost record an accepted key that is gone, released, or left with
nobody to deliver it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.keying import record_digest
from gateway.records import KeyRef, Record, State
from gateway.store import open_store
from tests.conftest import unique, upstream_count
from tests.support.ledger import Ledger
from tests.support.records import StoreServer
from tests.support.servers import Process, RedisServer, for_this_test, free_port, gateway_process
from tests.support.topologies import ClusterSetup

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis]

AREA = "async delivery"
ROUTE = "send-invoices"
PATH = "/jobs/send-invoices"
#: Short store timeouts keep the lease margin small: lease = upstream_timeout + 2.2 s.
#: PostgreSQL's commits wait for an fsync, and the copies of a key that arrive before
#: its first commit wait for one another (each locks the row): 1 s there (lease =
#: upstream_timeout + 7 s; no test here waits for a PostgreSQL lease).
STORE = {"socket_timeout": "200ms", "connect_timeout": "200ms"}
PG_STORE = {"socket_timeout": "1s", "connect_timeout": "1s"}
AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")


class Site:
    """One async route on one Redis prefix; gateways of it, each with its own config."""

    def __init__(
        self,
        tmp_path: Path,
        upstream: Process,
        redis: StoreServer | None,
        cluster: ClusterSetup | None = None,
        **route: Any,
    ) -> None:
        self.tmp_path, self.upstream = tmp_path, upstream
        self.prefix = unique("dp") + ":"
        if cluster is not None:
            nodes = [f"127.0.0.1:{node.port}" for node in cluster.nodes]
            # Commands now wait for a connection on a Cluster too (_QueueingCluster), but
            # pipelines (the queue watch's reads) do not: with all 64 busy, a pipeline
            # and a command can still race for a node's last one (a rare 503). Reported.
            self.store: dict[str, Any] = {"cluster": {"nodes": nodes}, "max_connections": 1024}
            self.store_config = StoreConfig(
                cluster_nodes=tuple(("127.0.0.1", n.port) for n in cluster.nodes),
                prefix=self.prefix,
            )
        else:
            assert redis is not None
            timeouts = PG_STORE if redis.url.startswith("postgres") else STORE
            self.store = {"url": redis.url, **timeouts}
            self.store_config = StoreConfig(url=redis.url, prefix=self.prefix)
        self.route = {
            "name": ROUTE,
            "match": {"methods": ["POST"], "path": PATH},
            "upstream": upstream.url,
            "key": {"header": "Idempotency-Key"},
            "fingerprint": ["method", "path", "body"],
            "delivery": "async",
            "retry": {"attempts": 5, "backoff": "100ms", "max_backoff": "500ms"},
            "upstream_timeout": "3s",
            "on_unknown_outcome": "reconcile",
            "reconcile": {
                "url": upstream.url + "/_status/{key}",
                "every": "300ms",
                "timeout": "1s",
                "park_after": "1s",
            },
            **route,
        }

    def gateway(self, start: bool = True, workers: int = 0, **server: Any) -> Process:
        port, admin_port = free_port(), free_port()
        config = {
            "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s", **server},
            "admin": {"listen": f"127.0.0.1:{admin_port}"},
            "store": {**STORE, **self.store, "prefix": self.prefix},
            "routes": [self.route],
        }
        path = self.tmp_path / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = gateway_process(path, port)
        if workers:
            gateway.args += ["--workers", str(workers)]
        gateway.admin_port = admin_port  # type: ignore[attr-defined]
        for_this_test(gateway)
        return gateway.start() if start else gateway

    async def record(self, key: str) -> Record | None:
        store = open_store(self.store_config)
        if self.store_config.kind == "sqlite":  # the file is opened by start()
            await store.start()
        try:
            return await store.get(KeyRef(record_digest(ROUTE, "", key), ROUTE, key))
        finally:
            await store.close()

    async def until(self, key: str, state: State, timeout: float = 20) -> Record:
        """Wait (bounded) until the record of `key` is in `state`."""
        deadline = time.monotonic() + timeout
        record = None
        while time.monotonic() < deadline:
            record = await self.record(key)
            if record is not None and record.state is state:
                return record
            await asyncio.sleep(0.1)
        raise AssertionError(f"{key} never became {state}: {record}")

    async def set_status(self, key: str, status: int) -> None:
        async with httpx.AsyncClient() as client:
            await client.post(
                f"{self.upstream.url}/_set_status", json={"key": key, "status": status}
            )

    async def runs(self, prefix: str) -> dict[str, int]:
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{self.upstream.url}/_counts", params={"prefix": prefix})
        return {k: int(n) for k, n in answer.json()["runs"].items()}


async def send(gateway: Process, key: str, query: str = "") -> httpx.Response:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
        return await client.post(
            PATH + (f"?{query}" if query else ""), content=b"{}", headers={"Idempotency-Key": key}
        )


async def until_runs(upstream: Process, key: str, runs: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while await upstream_count(upstream, key) < runs:
        assert time.monotonic() < deadline, f"{key} never reached the upstream {runs}x"
        await asyncio.sleep(0.05)


@dataclass(frozen=True)
class SqliteFile:
    """A SQLite store's file, shared by every gateway process of a test on this host."""

    url: str


def _store_server(kind: str, request: pytest.FixtureRequest) -> StoreServer:
    """The session's redis-server, its PostgreSQL with the gateway's schema, or a SQLite
    file of the test's own."""
    if kind == "sqlite":
        folder: Path = request.getfixturevalue("tmp_path")
        return SqliteFile(f"sqlite://{folder / 'gateway.db'}")
    server: StoreServer = request.getfixturevalue(
        "postgres_database" if kind == "postgres" else "redis_server"
    )
    return server


def lost(record: Record | None) -> bool:
    """An accepted key that is gone, or free to run again as if never accepted."""
    return record is None or record.state is State.RELEASED


# -- the scheduler's case, across processes ----------------------------------------------


@pytest.mark.slow
async def test_article_case_a_caller_with_a_1s_timeout_and_a_3_5s_handler(
    tmp_path: Path, upstream: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """The case of "Make scheduled job handlers idempotent: safe to run twice", scaled
    down, with a real gateway process: a caller that gives up after 1 s, a handler that
    takes 3.5 s. The caller has its 202 while the handler has not finished (the
    upstream's own counters say so, not a clock); the handler runs once; the caller's
    retries get the same 202 and never reach it; the status URL shows `completed` with
    the handler's response."""
    site = Site(tmp_path, upstream, redis_server, upstream_timeout="10s")
    gateway = site.gateway()
    key = unique("article")
    query = "sleep=3.5"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=1.0) as caller:

        async def call() -> httpx.Response:
            return await caller.post(
                f"{PATH}?{query}", content=b"{}", headers={"Idempotency-Key": key}
            )

        first = await call()  # httpx raises if the gateway takes the caller's 1 s
        assert first.status_code == 202, first.text
        finished = await _finished(upstream, key)
        assert finished == 0  # not done yet: the 202 did not wait for the handler
        retries = [await call() for _ in range(3)]
        assert all(r.status_code == 202 for r in retries)
        assert all(r.headers["idempotent-replayed"] == "true" for r in retries)
        assert {r.headers["location"] for r in retries} == {first.headers["location"]}
    record = await site.until(key, State.COMPLETED, timeout=20)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=5) as reader:
        status = await reader.get(first.headers["location"])
    gateway.stop()
    runs = await upstream_count(upstream, key)
    ledger.record(
        AREA,
        "article_case",
        requests=4,
        faults=0,
        upstream_duplicates=max(0, runs - 1),
        records_lost=int(lost(record)),
        detail=f"202 with the handler unfinished; {runs} run",
    )
    assert runs == 1
    doc = status.json()
    assert (status.status_code, doc["state"]) == (200, "completed")
    assert doc["response"]["status"] == 200
    assert json.loads(doc["response"]["body"])["key"] == key


async def _finished(upstream: Process, key: str) -> int:
    async with httpx.AsyncClient() as client:
        answer = await client.get(f"{upstream.url}/_counts", params={"prefix": key})
    return sum(answer.json()["answers"].get(key, {}).values())


# -- SIGKILL of the delivering gateway mid-attempt ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("store_kind", ["redis", "sqlite"])
@pytest.mark.parametrize("check", ["done", "not_done", "inconclusive"])
async def test_sigkill_mid_attempt(
    tmp_path: Path,
    upstream: Process,
    store_kind: str,
    check: str,
    ledger: Ledger,
    request: pytest.FixtureRequest,
) -> None:
    """The delivering gateway dies while the upstream runs the job (1.5 s, first run
    only); a new gateway's sweep finds the dead lease, and the unknown outcome follows
    the route's reconcile policy: `done` completes it without a second attempt,
    `not_done` delivers it once more, an inconclusive check parks it after park_after.
    On SQLite the new gateway opens the file the killed one wrote, as a restart does."""
    site = Site(tmp_path, upstream, _store_server(store_kind, request))
    key = unique(f"kill-{check}")
    if check == "not_done":
        await site.set_status(key, 404)
    elif check == "inconclusive":
        await site.set_status(key, 503)
    first = site.gateway()
    accepted = await send(first, key, "sleep=1.5&sleep_runs=1")
    assert accepted.status_code == 202
    await until_runs(upstream, key, 1)
    first.kill()
    killed = await site.record(key)
    assert killed is not None and killed.state is State.IN_FLIGHT  # nobody settled it
    second = site.gateway()
    expected = State.PARKED if check == "inconclusive" else State.COMPLETED
    record = await site.until(key, expected)
    await asyncio.sleep(0.5)  # a second attempt, if one were wrongly made, would show
    runs = await upstream_count(upstream, key)
    repeat = await send(second, key, "sleep=1.5&sleep_runs=1")
    runs_after = await upstream_count(upstream, key)
    allowed = 2 if check == "not_done" else 1  # the check said it never ran
    ledger.record(
        AREA,
        f"sigkill_mid_attempt[{store_kind}-{check}]",
        requests=2,
        faults=1,
        upstream_duplicates=max(0, runs_after - allowed),
        records_lost=int(lost(record)),
        detail=f"ends {record.state}, {record.attempts} attempt(s), {runs_after} run(s)",
    )
    unknown = [e for e in record.to_json()["history"] if e["event"] == "unknown"]
    assert unknown and unknown[0]["reason"] == "lease_expired"
    assert (repeat.status_code, repeat.json()["state"]) == (202, str(expected))
    assert repeat.headers["idempotent-replayed"] == "true"
    assert runs == runs_after == allowed
    if check == "done":
        assert record.attempts == 1
        assert record.response is not None and record.response.origin == "reconciled"
    elif check == "not_done":
        assert record.attempts == 2
        assert record.response is not None and record.response.origin == "upstream"
    else:
        assert record.attempts == 1 and record.reason


# -- SIGKILL before pickup ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "store_kind", ["redis", pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"]
)
async def test_sigkill_before_pickup_other_replica_delivers(
    tmp_path: Path,
    upstream: Process,
    store_kind: str,
    ledger: Ledger,
    request: pytest.FixtureRequest,
) -> None:
    """A gateway that only accepts (`server.max_deliveries: 0`) is killed after its
    202s. A replica started afterwards finds the queued work by its rescan; a replica
    already running when another accepting gateway is killed finds it by the notice
    (Redis pub/sub, or PostgreSQL's NOTIFY)."""
    site = Site(tmp_path, upstream, _store_server(store_kind, request))
    before = [unique("before") for _ in range(3)]
    accepting = site.gateway(max_deliveries=0)
    for key in before:
        assert (await send(accepting, key)).status_code == 202
    accepting.kill()
    for key in before:
        record = await site.record(key)
        assert record is not None and record.state is State.QUEUED
        assert await upstream_count(upstream, key) == 0
    delivering = site.gateway()
    found = [await site.until(key, State.COMPLETED, timeout=10) for key in before]

    during = unique("during")
    accepting = site.gateway(max_deliveries=0)
    assert (await send(accepting, during)).status_code == 202
    accepting.kill()  # right after the 202: the running replica has the notice
    found.append(await site.until(during, State.COMPLETED, timeout=10))
    await asyncio.sleep(0.3)
    runs = [await upstream_count(upstream, key) for key in [*before, during]]
    delivering.stop()
    ledger.record(
        AREA,
        f"sigkill_before_pickup[{store_kind}]",
        requests=len(runs),
        faults=2,
        upstream_duplicates=sum(max(0, n - 1) for n in runs),
        records_lost=sum(lost(r) for r in found),
        detail=f"{len(before)} found by the rescan, 1 by the notice; runs {runs}",
    )
    assert runs == [1] * len(runs)
    assert all(r.attempts == 1 and r.response is not None for r in found)


# -- Redis restarted with AOF between acceptance and delivery ----------------------------


@pytest.mark.slow
async def test_redis_aof_restart_between_accept_and_delivery(
    tmp_path: Path, upstream: Process, ledger: Ledger
) -> None:
    """Accepted (202) while no gateway delivers, then redis-server (appendonly yes,
    appendfsync always) SIGKILLed and restarted on its data directory: the queue is
    intact, a delivering gateway started afterwards delivers each key once, and the
    accepting gateway's repeats get their 202 with the completed state."""
    redis = RedisServer(*AOF_ALWAYS)
    redis.start()
    try:
        site = Site(tmp_path, upstream, redis)
        keys = [unique("aof") for _ in range(5)]
        accepting = site.gateway(max_deliveries=0)
        for key in keys:
            assert (await send(accepting, key)).status_code == 202
        redis.kill()
        redis.start()
        queued = [await site.record(key) for key in keys]
        assert all(r is not None and r.state is State.QUEUED for r in queued), queued
        site.gateway()
        found = [await site.until(key, State.COMPLETED, timeout=15) for key in keys]
        repeats = [await send(accepting, key) for key in keys]
        runs = [await upstream_count(upstream, key) for key in keys]
    finally:
        redis.stop()
    ledger.record(
        AREA,
        "redis_aof_restart_between_accept_and_delivery",
        requests=2 * len(keys),
        faults=1,
        upstream_duplicates=sum(max(0, n - 1) for n in runs),
        records_lost=sum(lost(r) for r in queued),
        detail=f"{len(keys)} keys queued across the restart; runs {runs}",
    )
    assert runs == [1] * len(keys)
    assert all(r.attempts == 1 for r in found)
    assert [(r.status_code, r.json()["state"]) for r in repeats] == [(202, "completed")] * len(keys)


# -- SIGTERM while a delivery is under way -----------------------------------------------


@pytest.mark.slow
async def test_sigterm_stops_picking_then_marks_unresolved(
    tmp_path: Path, upstream: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """One delivery at a time (`concurrency: 1`): a 5 s job under way, a second key
    queued behind it. SIGTERM: no new pick, the grace (500 ms), then the attempt under
    way is marked unresolved and the process exits 0. The queued key stays queued and
    another gateway delivers it; the unresolved one is never sent again blind."""
    site = Site(
        tmp_path,
        upstream,
        redis_server,
        delivery={"mode": "async", "concurrency": 1},
        upstream_timeout="10s",
        reconcile={"url": upstream.url + "/_status/{key}", "every": "1h"},
    )
    running, waiting = unique("running"), unique("waiting")
    gateway = site.gateway(shutdown_grace="500ms")
    assert (await send(gateway, running, "sleep=5")).status_code == 202
    await until_runs(upstream, running, 1)
    assert (await send(gateway, waiting)).status_code == 202
    started = time.monotonic()
    gateway.signal(signal.SIGTERM)
    assert gateway.proc is not None and gateway.proc.wait(10) == 0
    stopped_in = time.monotonic() - started
    cut = await site.record(running)
    left = await site.record(waiting)
    waiting_runs = await upstream_count(upstream, waiting)
    site.gateway()
    delivered = await site.until(waiting, State.COMPLETED, timeout=10)
    await asyncio.sleep(0.5)
    runs = {k: await upstream_count(upstream, k) for k in (running, waiting)}
    ledger.record(
        AREA,
        "sigterm_mid_delivery",
        requests=2,
        faults=1,
        upstream_duplicates=sum(max(0, n - 1) for n in runs.values()),
        records_lost=int(lost(cut) or lost(left)),
        detail=f"stopped in {stopped_in:.2f}s; ends {cut and cut.state}, {left and left.state}",
    )
    assert stopped_in < 3  # it did not wait for the 5 s job
    assert cut is not None and cut.state is State.UNRESOLVED
    assert cut.reason == "the gateway shut down before the upstream answered"
    assert left is not None and left.state is State.QUEUED and waiting_runs == 0
    assert "marked unresolved" in gateway.output()
    assert delivered.attempts == 1
    assert runs == {running: 1, waiting: 1}


# -- a backlog picked by two replicas at once ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "store_kind", ["redis", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_backlog_picked_by_two_replicas_at_once_runs_each_once(
    tmp_path: Path,
    upstream: Process,
    store_kind: str,
    ledger: Ledger,
    request: pytest.FixtureRequest,
) -> None:
    """24 deliveries queued while nobody delivers, then two delivering replicas started
    at the same moment: both rescan the same queue and pick its earliest items at once.
    Each item is taken by one of them (Redis: one script; PostgreSQL: FOR UPDATE SKIP
    LOCKED, Technique 3 of "Make scheduled job handlers idempotent: safe to run
    twice") and runs once."""
    site = Site(tmp_path, upstream, _store_server(store_kind, request))
    prefix = unique("backlog")
    keys = [f"{prefix}-{i}" for i in range(24)]
    accepting = site.gateway(max_deliveries=0)
    for key in keys:
        assert (await send(accepting, key, "sleep=0.3")).status_code == 202
    accepting.stop()
    replicas = [site.gateway(start=False) for _ in range(2)]
    for replica in replicas:
        replica.start(wait=False)
    found = [await site.until(key, State.COMPLETED, timeout=30) for key in keys]
    await asyncio.sleep(0.5)  # a second delivery, if one were wrongly made, would show
    runs = await site.runs(prefix)
    replicas_seen = {
        e["replica"] for r in found for e in r.to_json()["history"] if e["event"] == "attempt"
    }
    ledger.record(
        AREA,
        f"backlog_two_replicas_at_once[{store_kind}]",
        requests=len(keys),
        upstream_duplicates=sum(max(0, n - 1) for n in runs.values()),
        records_lost=sum(lost(r) for r in found),
        detail=f"{len(keys)} queued; delivered by {len(replicas_seen)} replicas",
    )
    assert runs == {key: 1 for key in keys}
    assert [r.attempts for r in found] == [1] * len(keys)


# -- a duplicate storm over two gateway processes ----------------------------------------


@dataclass
class Answer:
    key: str
    side: int
    status: int
    headers: dict[str, str]
    doc: dict[str, Any]


async def post_raw(port: int, key: str, side: int) -> Answer:
    """One POST on a connection of its own (Connection: close), over asyncio streams: a
    storm of 1,000 through httpx costs the client ~30 ms of CPU per request on this
    machine, which would make the client, not the gateways, what the test measures."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {PATH}?sleep=0.2 HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: {key}\r\n"
            "Content-Length: 2\r\nConnection: close\r\n\r\n{}".encode()
        )
        raw = await asyncio.wait_for(reader.read(-1), 30)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(
        (n.strip().lower(), v.strip()) for n, _, v in (x.partition(":") for x in lines[1:])
    )
    return Answer(key, side, int(lines[0].split()[1]), headers, json.loads(body))


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology",
    [
        "redis",
        pytest.param("cluster", marks=pytest.mark.cluster),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
@pytest.mark.long
async def test_storm_two_replicas_twenty_deliveries(
    tmp_path: Path,
    upstream: Process,
    topology: str,
    ledger: Ledger,
    request: pytest.FixtureRequest,
) -> None:
    """50 parallel copies of each of 20 keys, spread over two gateway processes: every
    caller gets a 202 for its key with that key's one status URL, each key is delivered
    exactly once, and each status URL answers from the replica that did not give it.
    On one Redis, on a Cluster (the queues follow the records' 64 hash tags) and on
    PostgreSQL (both processes pick with FOR UPDATE SKIP LOCKED)."""
    if topology == "cluster":
        site = Site(tmp_path, upstream, None, request.getfixturevalue("redis_cluster"))
    else:
        site = Site(tmp_path, upstream, _store_server(topology, request))
    gateways = [site.gateway(), site.gateway()]
    prefix = unique("storm")
    keys = [f"{prefix}-{i}" for i in range(20)]
    copies = 50
    answers = await asyncio.gather(
        *[post_raw(gateways[i % 2].port, key, i % 2) for key in keys for i in range(copies)]
    )
    records = [await site.until(key, State.COMPLETED, timeout=30) for key in keys]
    await asyncio.sleep(0.5)
    runs = await site.runs(prefix)
    async with httpx.AsyncClient(timeout=30) as client:
        statuses = [
            await client.get(gateways[1 - answer.side].url + answer.headers["location"])
            for answer in answers[::copies] + answers[1::copies]
        ]
    ledger.record(
        AREA,
        f"storm_two_replicas[{topology}]",
        requests=len(answers) + len(statuses),
        upstream_duplicates=sum(max(0, n - 1) for n in runs.values()),
        records_lost=sum(lost(r) for r in records),
        detail=f"{len(keys)} keys x {copies} copies over 2 gateways; "
        f"{sum(r.attempts for r in records)} attempts",
    )
    assert [a.status for a in answers] == [202] * len(answers)
    assert all(a.doc["key"] == a.key for a in answers)
    locations = {key: {a.headers["location"] for a in answers if a.key == key} for key in keys}
    assert all(len(found) == 1 for found in locations.values()), locations
    assert runs == {key: 1 for key in keys}
    assert [(s.status_code, s.json()["state"]) for s in statuses] == [(200, "completed")] * len(
        statuses
    )
    assert all(s.json()["response"]["status"] == 200 for s in statuses)


class _MemoryServer:
    """The memory store, for Site: one process, its records its own."""

    url = "memory://"


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology",
    [
        "memory",
        "redis",
        pytest.param("cluster", marks=pytest.mark.cluster),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_a_burst_over_every_replica_and_worker_queues_exactly_max_queued(
    tmp_path: Path,
    upstream: Process,
    topology: str,
    ledger: Ledger,
    request: pytest.FixtureRequest,
) -> None:
    """200 new keys at once over two gateway replicas of `--workers 2` (four processes;
    one process on the memory store), on a route with `delivery.max_queued: 10` whose
    deliveries wait (`max_deliveries: 0`: nothing is picked meanwhile): exactly ten are
    accepted (202) and the other 190 refused with 503 queue-full; ten deliveries wait
    in the store, each an accepted one; a repeat of an accepted key is still its 202."""
    delivery = {"mode": "async", "max_queued": 10}
    if topology == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        site = Site(tmp_path, upstream, None, cluster, delivery=delivery)
    elif topology == "memory":
        site = Site(tmp_path, upstream, _MemoryServer(), delivery=delivery)
    else:
        site = Site(tmp_path, upstream, _store_server(topology, request), delivery=delivery)
    if topology == "memory":
        gateways = [site.gateway(max_deliveries=0)]
    else:
        gateways = [site.gateway(workers=2, max_deliveries=0) for _ in range(2)]
    for gateway in gateways:  # every worker up: each answers readiness
        async with httpx.AsyncClient(timeout=10) as client:
            admin = f"http://127.0.0.1:{gateway.admin_port}"  # type: ignore[attr-defined]
            for _ in range(8):
                assert (await client.get(admin + "/readyz")).status_code == 200
    prefix = unique("burst")
    answers = await asyncio.gather(
        *[post_raw(gateways[i % len(gateways)].port, f"{prefix}-{i}", i % 2) for i in range(200)]
    )
    accepted = [a.key for a in answers if a.status == 202]
    if topology != "memory":
        records = [await site.record(key) for key in accepted]
    else:
        records = []
    async with httpx.AsyncClient(timeout=10) as client:
        admin = f"http://127.0.0.1:{gateways[0].admin_port}"  # type: ignore[attr-defined]
        metrics = (await client.get(admin + "/metrics")).text
    ledger.record(
        AREA,
        f"burst_max_queued[{topology}]",
        requests=len(answers),
        records_lost=sum(lost(r) for r in records),
        detail=f"200 new keys over {len(gateways)} gateway(s): {len(accepted)} accepted "
        "of max_queued 10",
    )
    assert sorted(a.status for a in answers) == [202] * 10 + [503] * 190, [
        a.status for a in answers
    ]
    refused = [a for a in answers if a.status == 503]
    assert all(a.doc["type"].endswith("/queue-full") for a in refused)
    assert all(r is not None and r.state is State.QUEUED for r in records), records
    assert f'idempotency_gateway_queue_depth{{route="{ROUTE}",state="queued"}} 10.0' in metrics
    again = await post_raw(gateways[-1].port, accepted[0], 0)
    assert again.status == 202 and again.headers["idempotent-replayed"] == "true"
