"""What only the PostgreSQL store has: its schema and `store migrate`, the reaper, its
indexes, NOTIFY between processes, and recovering from a database that went away.
The contract every store keeps is in test_store_contract.py and test_store_states.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml

from gateway.assembly import Gateway
from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import KeyRef, Record, State, StoredRequest, StoredResponse
from gateway.store.base import CheckResult, NewDelivery
from gateway.store.pages import Cursor, Match
from gateway.store.postgres import REAP_LOCK, PostgresStore
from gateway.store.postgres.schema import VERSION, migrations
from tests.conftest import GatewayClient, config_for, migrate_database, unique, upstream_count
from tests.support.postgres import PostgresServer, lock_record, sessions_waiting_on_a_lock
from tests.support.servers import ROOT, Process, free_port, gateway_process

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

RESPONSE = StoredResponse(200, (("content-type", "text/plain"),), b"done")
REQUEST = StoredRequest("POST", "/jobs", (), b"{}")


def ref(route: str = "r") -> KeyRef:
    digest = unique("d").replace("-", "").ljust(32, "0")[:32]
    return KeyRef(digest, route, unique("key"))


def fresh_database(server: PostgresServer) -> str:
    """A database of its own on the session's server, without the gateway's schema."""
    name = unique("db").replace("-", "_")
    server.sql(f"CREATE DATABASE {name}")
    return server.dsn(name)


def write_config(tmp_path: Path, url: str, **store: Any) -> Path:
    port, admin = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{admin}"},
        "store": {"url": url, "prefix": unique("p") + ":", **store},
        "routes": [
            {
                "name": "send-reminder",
                "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
                "upstream": "http://127.0.0.1:9",
                "key": {"body": "job_key"},
            }
        ],
    }
    path = tmp_path / f"config-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def gateway_command(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
async def store(postgres_database: PostgresServer) -> AsyncIterator[PostgresStore]:
    s = PostgresStore(StoreConfig(url=postgres_database.url, prefix=unique("t") + ":"))
    await s.start()
    yield s
    await s.close()


# -- the schema ---------------------------------------------------------------------


def test_migrate_is_versioned_idempotent_and_safe_from_two_replicas_at_once(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = fresh_database(postgres_server)
    path = write_config(tmp_path, url)
    both = [gateway_command("store", "migrate", "--config", str(path)) for _ in range(2)]
    outputs = [p.communicate(timeout=60) for p in both]
    assert [p.returncode for p in both] == [0, 0], outputs
    said = sorted(out for out, _ in outputs)
    assert "applied 001_initial" in said[0] and "nothing to do" in said[1], said
    again = gateway_command("store", "migrate", "--config", str(path))
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0 and "nothing to do" in out, (out, err)
    [(database,)] = postgres_server.sql("SELECT current_database()")  # the session's
    rows = _sql(url, "SELECT version, name FROM gateway_schema ORDER BY version")
    assert rows == [(m.version, m.name) for m in migrations()] and rows[-1][0] == VERSION
    assert database == "gateway"


async def test_migrate_brings_a_version_1_database_to_the_last_success_table(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """A database a gateway of schema version 1 made: `run` refuses it naming the
    command, `store migrate` applies the migrations after 1 (002 and on), and
    completions then record the last success."""
    url = fresh_database(postgres_server)
    _sql(url, "CREATE TABLE gateway_schema (version integer PRIMARY KEY, name text NOT NULL,"
              " applied_at timestamptz NOT NULL DEFAULT now())")  # fmt: skip
    _sql(url, migrations()[0].sql)
    _sql(url, "INSERT INTO gateway_schema (version, name) VALUES (1, 'initial')")
    path = write_config(tmp_path, url)
    run = gateway_command("run", "--config", str(path))
    out, err = run.communicate(timeout=60)
    assert run.returncode == 1 and f"version 1, and this gateway needs {VERSION}" in err, (
        out,
        err,
    )
    migrate = gateway_command("store", "migrate", "--config", str(path))
    out, err = migrate.communicate(timeout=60)
    after = ", ".join(f"{m.version:03d}_{m.name}" for m in migrations()[1:])
    assert after.startswith("002_last_success")
    assert migrate.returncode == 0 and f"applied {after};" in out, (out, err)
    store = PostgresStore(StoreConfig(url=url, prefix=unique("t") + ":"))
    await store.start()
    try:
        r = ref("send-reminder")
        assert await store.claim(r, "run", "fp", 30) is None
        assert await store.complete(r, "run", RESPONSE, 60)
        assert list(await store.last_successes()) == ["send-reminder"]
    finally:
        await store.close()


def _sql(url: str, query: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(query)
        return cursor.fetchall() if cursor.description is not None else []


def test_run_refuses_a_database_without_the_schema_naming_the_command(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = fresh_database(postgres_server)
    path = write_config(tmp_path, url)
    run = gateway_command("run", "--config", str(path))
    out, err = run.communicate(timeout=60)
    assert run.returncode == 1, (out, err)
    assert "has no gateway schema" in err
    assert f"idempotency-gateway store migrate --config {path}" in err
    # Newer than this gateway (a newer one migrated it): refused too, and not "fixed".
    migrate_database(url)
    _sql(url, "INSERT INTO gateway_schema (version, name) VALUES (999, 'future')")
    run = gateway_command("run", "--config", str(path))
    out, err = run.communicate(timeout=60)
    assert run.returncode == 1 and "newer than this gateway knows" in err, (out, err)
    migrate = gateway_command("store", "migrate", "--config", str(path))
    out, err = migrate.communicate(timeout=60)
    assert migrate.returncode == 1 and "nothing was changed" in err, (out, err)


async def test_a_store_on_a_database_without_the_schema_is_refused(
    postgres_server: PostgresServer,
) -> None:
    url = fresh_database(postgres_server)
    store = PostgresStore(StoreConfig(url=url, prefix="x:"))
    with pytest.raises(StoreError, match="store migrate"):
        await store.start()


def test_migrate_on_a_store_without_a_schema_says_so(tmp_path: Path) -> None:
    path = write_config(tmp_path, "memory://")
    done = gateway_command("store", "migrate", "--config", str(path))
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0 and "no schema; nothing to do" in out, (out, err)


# -- the claim's races (gateway_take, READ COMMITTED) ---------------------------------


async def _claim_beaten_by_an_uncommitted_claim(
    store: PostgresStore, server: PostgresServer, r: KeyRef
) -> Record | None:
    """store.claim of `r` while another session's claim of it (run-1) is not yet
    committed: the store's claim waits on that session's lock, then it commits."""
    winner = await asyncpg.connect(server.url)
    try:
        async with winner.transaction():
            claim = store.db.statements["claim"]
            won = await winner.fetchrow(
                claim, r.digest, r.route, r.key, "run-1", "fp", 30000, "", False
            )
            assert won is not None and won["outcome"] == 1
            loser = asyncio.create_task(store.claim(r, "run-2", "fp", 30))
            await sessions_waiting_on_a_lock(server)  # its INSERT or UPDATE waits for the winner
        return await loser
    finally:
        await winner.close()


@pytest.mark.parametrize("fresh", [True, False], ids=["insert-first", "read-first"])
async def test_a_claim_that_loses_the_race_for_a_new_key_answers_with_the_winner(
    store: PostgresStore, postgres_database: PostgresServer, fresh: bool
) -> None:
    """The READ COMMITTED pitfall: the claim's read sees no row (or, inserting first, it
    does not read), another session's claim of the key commits, and the claim's INSERT
    then conflicts. It must not take the key nor come back empty: it reads again and
    answers with the winner's record. In either order gateway_take may try."""
    r = ref()
    store.rows.fresh[r.route] = fresh
    found = await _claim_beaten_by_an_uncommitted_claim(store, postgres_database, r)
    assert found is not None and found.state is State.IN_FLIGHT and found.run_id == "run-1"


@pytest.mark.parametrize("fresh", [True, False], ids=["insert-first", "read-first"])
async def test_a_claim_that_loses_the_race_for_a_free_row_answers_with_the_winner(
    store: PostgresStore, postgres_database: PostgresServer, fresh: bool
) -> None:
    """The same pitfall on a row that is free (here a completed record past its expiry):
    the claim's read sees it free, another session's claim takes it and commits, and
    the claim's UPDATE then finds the row in flight. It must not take it (the UPDATE's
    WHERE asks gateway_free again of the locked row): it answers with the winner's."""
    r = ref()
    assert await store.claim(r, "run-0", "fp", 30) is None
    assert await store.complete(r, "run-0", RESPONSE, 0.001)
    await asyncio.sleep(0.01)  # past its expiry: free
    store.rows.fresh[r.route] = fresh
    found = await _claim_beaten_by_an_uncommitted_claim(store, postgres_database, r)
    assert found is not None and found.state is State.IN_FLIGHT and found.run_id == "run-1"


async def test_a_claim_inserts_first_on_a_route_whose_last_claim_took_a_new_key(
    store: PostgresStore,
) -> None:
    """gateway_take's order is the route's last outcome: a new key taken, the next claim
    inserts first; a record found, the next reads first. (Both decide alike; the
    contract suite and the races above hold each order.)"""
    fresh, repeated = ref("fresh"), ref("repeated")
    assert await store.claim(fresh, "run-1", "fp", 30) is None
    assert await store.claim(repeated, "run-1", "fp", 30) is None
    assert await store.claim(repeated, "run-2", "fp", 30) is not None
    assert store.rows.fresh == {"fresh": True, "repeated": False}
    # Inserting first, an accept that may not admit still reads: a taken key exists.
    full = await store.accept(
        NewDelivery(fresh, "run-2", "fp", REQUEST, "token-0123456789", limit=0)
    )
    assert full.outcome == "exists" and full.record is not None
    assert full.record.run_id == "run-1"


async def test_a_duplicate_whose_key_completes_under_it_replays_the_response(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    """A duplicate reads the key in flight and goes to mark it `waiting`; the run
    completes first. The mark finds nothing to mark: the duplicate reads again and
    replays the completed record, never half a record."""
    r = ref()
    assert await store.claim(r, "run-1", "fp", 30) is None
    other = await asyncpg.connect(postgres_database.url)
    try:
        async with other.transaction():
            await lock_record(other, store.prefix, r.digest)
            duplicate = asyncio.create_task(store.claim(r, "run-2", "fp", 30))
            await sessions_waiting_on_a_lock(postgres_database)  # read: in flight; mark: waits
            sealed = store.codec.encode(r.digest, RESPONSE)
            done = await other.fetchrow(
                store.db.statements["complete"], r.digest, "run-1", sealed, 60000, "", None, True
            )
            assert done is not None and done["ok"]
        found = await duplicate
    finally:
        await other.close()
    assert found is not None and found.state is State.COMPLETED
    assert found.response == RESPONSE


# -- the pool (postgres_pool.py) -----------------------------------------------------


async def test_the_pool_opens_at_most_max_connections_and_serves_every_waiter(
    postgres_database: PostgresServer,
) -> None:
    prefix = unique("pool") + ":"
    store = PostgresStore(StoreConfig(url=postgres_database.url, prefix=prefix, max_connections=2))
    try:

        async def backend() -> int:
            await asyncio.sleep(0)
            pid = await store.db.call(
                lambda conn: conn.fetchval("SELECT pg_backend_pid() FROM pg_sleep(0.02)"), "pid"
            )
            return int(pid)

        pids = await asyncio.gather(*(backend() for _ in range(20)))
        assert len(set(pids)) == 2 and store.db.pool().size == 2, pids
    finally:
        await store.close()


async def test_a_connection_left_in_a_transaction_is_never_lent_again(
    postgres_database: PostgresServer,
) -> None:
    """Whatever left a transaction open on a connection (a call cut short between its
    statements), the next call must not run inside it: its claim would never commit."""
    prefix = unique("pool") + ":"
    store = PostgresStore(StoreConfig(url=postgres_database.url, prefix=prefix, max_connections=1))
    try:
        await store.db.call(lambda conn: conn.execute("BEGIN"), "begin")
        r = ref()
        assert await store.claim(r, "run-1", "fp", 30) is None
        rows = postgres_database.sql(
            "SELECT run_id FROM gateway_records"
            f" WHERE prefix = '{prefix}' AND digest = '{r.digest}'"
        )
        assert rows == [("run-1",)]  # committed: another session sees it
    finally:
        await store.close()


async def test_a_connection_whose_call_timed_out_is_never_lent_again(
    postgres_database: PostgresServer,
) -> None:
    """A call cut short by the store's timeout leaves its statement running on the
    server, and asyncpg's connection mid-operation: lent again, the next call would
    fail ("another operation is in progress") or read the cut call's answer. It is
    closed; the next call gets a connection of its own."""
    prefix = unique("pool") + ":"
    config = StoreConfig(
        url=postgres_database.url, prefix=prefix, max_connections=1, socket_timeout=0.2
    )
    store = PostgresStore(config)
    try:

        async def pid_then_sleep(conn: Any) -> int:
            pid = int(await conn.fetchval("SELECT pg_backend_pid()"))
            pids.append(pid)
            # The server's own statement_timeout (the store's socket_timeout) would end
            # the statement first, a server error on a sound connection: turn it off.
            await conn.execute("SET statement_timeout = 0")
            await conn.execute("SELECT pg_sleep(5)")
            return pid

        pids: list[int] = []
        with pytest.raises(StoreError, match="timed out"):
            await store.db.call(pid_then_sleep, "sleep")
        after = await store.db.call(lambda conn: conn.fetchval("SELECT pg_backend_pid()"), "pid")
        assert pids and int(after) != pids[0], (pids, after)
        assert store.db.pool().size == 1
    finally:
        await store.close()


# -- expiry: reads, the reaper --------------------------------------------------------


async def test_the_reaper_deletes_expired_settled_records_and_nothing_open(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    completed, released, live = ref(), ref(), ref()
    for r in (completed, released, live):
        await store.claim(r, "run", "fp", 30)
    await store.complete(completed, "run", RESPONSE, 0.05)
    await store.mark_unresolved(released, "run", "timeout")  # a story: a tombstone follows
    await store.begin_check(released, "run", 30, 0)
    await store.end_check(CheckResult(released, "run", "not_done", {}, None, 0.05, 3600))
    await store.complete(live, "run", RESPONSE, 3600)
    opened = await _every_open_state(store)
    await asyncio.sleep(0.15)
    assert await store.get(completed) is None  # past its expiry: absent before reaping
    while (await store.reap(limit=1)) != 0:  # bounded batches, until none is left
        pass
    rows = postgres_database.sql(
        "SELECT digest, state FROM gateway_records WHERE prefix = %s", (store.prefix,)
    )
    left = dict(rows)
    assert completed.digest not in left and released.digest not in left
    assert left[live.digest] == "completed"
    for r, state in opened.items():
        assert left[r.digest] == state, (state, left.get(r.digest))


async def _every_open_state(store: PostgresStore) -> dict[KeyRef, str]:
    """A record in each state that never expires, each with a lease that ran out."""
    found: dict[KeyRef, str] = {}
    for state in ("unresolved", "parked", "claimed", "in_flight"):
        r = ref()
        await store.claim(r, "run", "fp", 0.05)
        if state != "in_flight":
            await store.mark_unresolved(r, "run", "timeout", park=state != "unresolved")
        if state == "claimed":
            assert (await store.operator_claim(r, "alice", force=False)).ok
        found[r] = state
    queued, retrying = ref("d"), ref("d")
    for r in (queued, retrying):
        await store.accept(NewDelivery(r, "run", "fp", REQUEST, "token-0123456789"))
    await store.pick("d", retrying, "run-2", 30, 8, "replica")
    await store.retry_later(retrying, "run-2", 3600, {"result": "status"})
    found[queued], found[retrying] = "queued", "retrying"
    return found


async def test_one_reaper_at_a_time(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    import psycopg

    with psycopg.connect(postgres_database.url, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (REAP_LOCK,))  # another replica reaps
        assert await store.reap() is None
        other.execute("SELECT pg_advisory_unlock(%s)", (REAP_LOCK,))
    assert await store.reap() is not None


@pytest.mark.parametrize(
    ("statement", "index"),
    [
        ("stats", "gateway_records_listed"),
        ("leases", "gateway_records_leases"),
        ("due", "gateway_records_due|gateway_records_waiting"),
        ("queue_stats", "gateway_records_due|gateway_records_waiting"),
        ("reap", "gateway_records_expiry"),
    ],
)
async def test_listings_gauges_sweep_and_reaper_read_their_index(
    store: PostgresStore, statement: str, index: str
) -> None:
    """O(open records), never O(completed ones): the statements can be answered from
    their partial index (the planner is told not to scan the table, and must not have
    to; on a table this small it would otherwise choose a scan anyway). Either index
    of the pending deliveries will do for the queue's (on a table this small the
    planner has no reason to prefer one)."""
    args = {"leases": (10,), "due": ("r", 10), "reap": (10, 1)}.get(statement, ())

    async def explain(conn: Any) -> str:
        async with conn.transaction():
            await conn.execute("SET LOCAL enable_seqscan = off")
            rows = await conn.fetch("EXPLAIN " + store.db.statements[statement], *args)
        return "\n".join(row[0] for row in rows)

    plan = await store.db.call(explain, "explain")
    assert any(name in plan for name in index.split("|")), plan
    assert "Seq Scan on gateway_records" not in plan, plan


async def _explained(store: PostgresStore, sql: str, *args: Any) -> int:
    """Rows the statement's scans of gateway_records returned, by EXPLAIN ANALYZE."""

    async def run(conn: Any) -> Any:
        return await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args)

    plan = await store.db.call(run, "explain")
    doc = plan if isinstance(plan, list) else json.loads(plan)

    def rows(node: dict[str, Any]) -> int:
        own = 0
        if node.get("Relation Name") == "gateway_records":
            own = int(node["Actual Rows"]) * int(node.get("Actual Loops", 1))
        return own + sum(rows(child) for child in node.get("Plans", []))

    return rows(doc[0]["Plan"])


async def test_a_page_and_the_counts_read_a_page_of_50000_parked_rows(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    """50,000 parked rows (inserted in one statement, their count written as the
    triggers keep it: the triggers themselves, firing 50,000 times in one transaction
    on one count's row, would take 20 s): a page of 100, from the start and from a
    cursor in the middle, reads about a page of rows from the listing index, and the
    gauges' counts read one row per route and state, not the 50,000 (EXPLAIN ANALYZE's
    actual rows of every scan of gateway_records)."""
    insert = (
        "INSERT INTO gateway_records (prefix, digest, route, key, state, run_id,"
        " fingerprint, created_ms, since_ms)"
        " SELECT $1, md5($2 || i), $2, 'k' || i, 'parked', 'r', 'f', i, i"
        " FROM generate_series(1, $3) AS i"
    )
    counted = "INSERT INTO gateway_counts VALUES ($1, $2, 'parked', 0, $3)"
    conn = await asyncpg.connect(postgres_database.url)  # no statement_timeout
    try:
        await conn.execute("SET session_replication_role = replica")  # no triggers
        for route, n in (("charge", 50_000), ("refund", 3)):
            await conn.execute(insert, store.prefix, route, n)
            await conn.execute(counted, store.prefix, route, n)
        await conn.execute("ANALYZE gateway_records")
    finally:
        await conn.close()
    [charge] = [s for s in await store.stats() if s.route == "charge"]
    assert charge.count == 50_000
    parked = frozenset({State.PARKED})
    first = await store.list_records(parked)
    middle = await store.list_records(parked, cursor=first.next, limit=100)
    assert len(first.records) == len(middle.records) == 100
    pairs = [(State.PARKED, "charge"), (State.PARKED, "refund")]
    for start in (None, Cursor.decode(first.next)):
        sql, args = store.listing._page_query(pairs, False, None, 0.0, Match(), start, 101)
        assert await _explained(store, sql, *args) <= 2 * 101, sql
    assert await _explained(store, store.db.statements["stats"]) <= 10
    assert await _explained(store, store.db.statements["queue_stats"]) <= 10


# -- notices between processes ----------------------------------------------------------


async def test_a_waiter_in_another_process_is_woken_with_the_response(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    """Two stores are two processes' connections: the waiter's claim marks the row,
    the completion's NOTIFY wakes it, carrying the response when it fits, so the
    waiter replays without reading the record again."""
    other = PostgresStore(StoreConfig(url=postgres_database.url, prefix=store.prefix))
    await other.start()
    try:
        await asyncio.wait_for(other.subscribed.wait(), 10)
        for body in (b"small", b"x" * 6000):
            r = ref()
            await store.claim(r, "run-1", "fp", 30)
            with other.notifier.watch(r.digest) as changed:
                seen = await other.claim(r, "run-2", "fp", 30)
                assert seen is not None and seen.state is State.IN_FLIGHT
                response = StoredResponse(200, (), body)
                assert await store.complete(r, "run-1", response, 60)
                await asyncio.wait_for(changed.wait(), 5)
            if len(body) < 5000:
                assert changed.completed == ("fp", response)
            else:  # too large for a notice: the waiter reads the record
                assert changed.completed is None
    finally:
        await other.close()


# -- a database that goes away ------------------------------------------------------------


@pytest.mark.slow
async def test_database_down_fails_closed_or_open_then_recovers_without_a_restart(
    upstream: Process,
) -> None:
    server = PostgresServer()
    server.start()
    migrate_database(server.url)
    routes = [
        {"name": "closed", "match": {"path": "/closed"}, "key": {"header": "Idempotency-Key"}},
        {
            "name": "open",
            "match": {"path": "/open"},
            "key": {"header": "Idempotency-Key"},
            "on_store_error": "fail_open",
        },
    ]
    store = {"url": server.url, "socket_timeout": "500ms", "connect_timeout": "500ms"}
    gateway = Gateway(config_for(upstream.url, routes, store=store))
    await gateway.start()
    client = GatewayClient(gateway)
    try:
        assert (
            await client.post("/closed", headers={"Idempotency-Key": unique()})
        ).status_code == 200
        server.stop()
        down = await client.post("/closed", headers={"Idempotency-Key": unique()})
        assert down.status_code == 503 and "retry-after" in down.headers
        key = unique()
        passed = await client.post("/open", headers={"Idempotency-Key": key})
        assert passed.status_code == 200 and await upstream_count(upstream, key) == 1
        server.start()
        key = unique()
        for _ in range(50):  # the pool reconnects on the next call; no restart
            back = await client.post("/closed", headers={"Idempotency-Key": key})
            if back.status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert back.status_code == 200
        again = await client.post("/closed", headers={"Idempotency-Key": key})
        assert again.headers.get("idempotent-replayed") == "true"
        assert await upstream_count(upstream, key) == 1
    finally:
        await client.http.aclose()
        await gateway.close()
        server.stop()
        server.remove()


# -- two gateway processes on one database ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
async def test_two_gateway_processes_on_one_database_run_each_key_once(
    tmp_path: Path, upstream: Process, postgres_database: PostgresServer
) -> None:
    prefix = unique("rep") + ":"
    gateways = []
    try:
        for _ in range(2):
            port, admin = free_port(), free_port()
            config = {
                "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "3s"},
                "admin": {"listen": f"127.0.0.1:{admin}"},
                "store": {"url": postgres_database.url, "prefix": prefix},
                "routes": [
                    {
                        "name": "send-reminder",
                        "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
                        "upstream": upstream.url,
                        "key": {"body": "job_key"},
                    }
                ],
            }
            path = tmp_path / f"config-{port}.yaml"
            path.write_text(yaml.safe_dump(config))
            gateways.append(gateway_process(path, port).start())
        keys = [unique("storm") for _ in range(20)]
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:

            async def one(i: int, key: str) -> tuple[str, httpx.Response]:
                url = f"http://127.0.0.1:{gateways[i % 2].port}/jobs/send-reminder"
                return key, await client.post(url, json={"job_key": key}, params={"sleep": "0.2"})

            results = await asyncio.gather(*[one(i, k) for k in keys for i in range(10)])
        by_key: dict[str, set[bytes]] = {}
        for key, response in results:
            assert response.status_code == 200, response.text
            by_key.setdefault(key, set()).add(response.content)
        for key in keys:
            assert len(by_key[key]) == 1, "every caller of a key gets the same body"
            assert await upstream_count(upstream, key) == 1, key
    finally:
        for gateway in gateways:
            gateway.stop()


async def test_an_unreachable_database_fails_calls_and_never_shows_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()  # nothing listens there
    config = StoreConfig(
        url=f"postgresql://gateway:s3cret-pw@127.0.0.1:{port}/gateway",
        password="other-secret",
        connect_timeout=0.5,
        socket_timeout=0.5,
    )
    store = PostgresStore(config)
    await store.start()  # starts anyway: routes fail closed (or open) until it answers
    try:
        with pytest.raises(StoreError) as failed:
            await store.claim(ref(), "run", "fp", 30)
        assert "postgresql claim failed" in str(failed.value)
        with pytest.raises(StoreError):
            await store.ping()
    finally:
        await store.close()
    shown = str(failed.value) + caplog.text
    assert "s3cret-pw" not in shown and "other-secret" not in shown
    assert "requests on keyed routes fail until it answers" in caplog.text


@pytest.mark.slow
async def test_a_hung_database_fails_calls_in_bounded_time_then_recovers() -> None:
    """SIGSTOP: the server holds its connections and answers nothing. Calls fail as
    StoreError (a hang here would be the test's timeout), and work again after
    SIGCONT, with no restart of the store."""
    import os
    import signal

    server = PostgresServer()
    server.start()
    migrate_database(server.url)
    assert server.proc is not None
    store = PostgresStore(StoreConfig(url=server.url, socket_timeout=0.5, connect_timeout=0.5))
    await store.start()
    frozen = [server.proc.pid, *server.children()]
    try:
        assert await store.claim(ref(), "run", "fp", 30) is None
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        for _ in range(3):
            with pytest.raises(StoreError):
                await store.claim(ref(), "run", "fp", 30)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        frozen = []
        for _ in range(50):
            try:
                assert await store.claim(ref(), "run", "fp", 30) is None
                break
            except StoreError:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the store never recovered")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        await store.close()
        server.stop()
        server.remove()


async def test_a_call_that_runs_out_of_time_is_not_retried(
    postgres_database: PostgresServer,
) -> None:
    """A timed-out call is a StoreError at once, not a second try: TimeoutError is an
    OSError, which the retry on a lost connection catches: retried, every timeout would
    run twice and a hung database cost a request 4 x socket_timeout instead of 2."""
    store = PostgresStore(
        StoreConfig(url=postgres_database.url, prefix=unique("to") + ":", socket_timeout=0.1)
    )
    runs = 0

    async def work(conn: asyncpg.Connection) -> None:
        nonlocal runs
        runs += 1
        await asyncio.sleep(30)  # the client's deadline ends it

    try:
        with pytest.raises(StoreError, match="timed out"):
            await store.db.call(work, "slow")
    finally:
        await store.close()
    assert runs == 1


def test_the_pool_defaults_to_ten_connections_on_postgresql_and_64_on_redis() -> None:
    """Unset, store.max_connections is the store's own default: a PostgreSQL connection is
    a backend process, and a few busy ones commit more per second than many that take
    turns on the database's cores (docs/performance.md, "The PostgreSQL store"); set, it
    is as set."""
    assert StoreConfig(url="postgresql://gateway@127.0.0.1/gateway").pool_size == 10
    assert StoreConfig(url="redis://127.0.0.1:6379/0").pool_size == 64
    assert StoreConfig(url="postgres://g@h/d", max_connections=3).pool_size == 3
    store = PostgresStore(StoreConfig(url="postgresql://gateway@127.0.0.1/gateway"))
    assert store.db.pool()._max == 10
