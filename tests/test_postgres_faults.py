"""The PostgreSQL store under faults, across real processes: the database
SIGKILLed under a duplicate storm and restarted on its data directory; the database
down (crashed, or hung) and back while gateways keep running; and what an acknowledged
write is worth when the database dies a moment later.

Everything is a real process: PostgreSQL of the test's own (initdb into a temp dir,
fsync and synchronous_commit on: tests/support/postgres.py), the counting test upstream
under uvicorn, and `python -m gateway run`. The storm's figures go to the reliability
ledger (area "postgres durability"), the row `docs/reliability.md` sets beside Redis
without persistence: there a restart forgets every key; here nothing acknowledged is
lost, because a commit is on disk before the gateway forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.keying import record_digest
from gateway.records import KeyRef, Record, State, StoredResponse
from gateway.store.postgres import PostgresStore
from tests.conftest import migrate_database, unique, upstream_count
from tests.support.ledger import Ledger
from tests.support.postgres import DATABASE, PostgresServer
from tests.support.servers import (
    Process,
    for_this_test,
    free_port,
    gateway_process,
    wait_for_port,
)
from tests.test_faults_process import Verdict, tally, until

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

AREA = "postgres durability"
OPEN = (State.IN_FLIGHT, State.UNRESOLVED)
#: Store timeouts of the gateways here: a commit waits for its fsync, which on a busy
#: 2-core machine can take a good part of 200 ms, and the copies of a key that arrive
#: before its first commit wait for one another (each locks the row). Lease =
#: upstream_timeout + 7 s.
STORE_TIMEOUT = "1s"


@contextlib.contextmanager
def own_database(**settings: str) -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own, with the gateway's schema: the test kills,
    stops and restarts it."""
    server = PostgresServer(None, **settings)
    server.start()
    try:
        migrate_database(server.url)
        yield server
    finally:
        resume(server)  # a failed test may leave it stopped
        server.stop()
        server.remove()


def stop_immediately(server: PostgresServer) -> None:
    """`pg_ctl stop -m immediate`: SIGQUIT to the postmaster, which ends every backend at
    once and exits without a checkpoint; the next start recovers from the WAL."""
    assert server.proc is not None
    children = server.children()
    server.proc.send_signal(signal.SIGQUIT)
    server.proc.wait(10)
    deadline = time.monotonic() + 10
    while children and time.monotonic() < deadline:  # they hold the shared memory
        children = [pid for pid in children if Path(f"/proc/{pid}").exists()]
        time.sleep(0.02)


def hang(server: PostgresServer) -> list[int]:
    """SIGSTOP to the postmaster and every backend: connections stay open and answer
    nothing, new ones are accepted by the kernel and never greeted. The pids stopped."""
    assert server.proc is not None
    pids = [server.proc.pid, *server.children()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def resume(server: PostgresServer, pids: list[int] | None = None) -> None:
    if server.proc is None or server.proc.poll() is not None:
        return
    for pid in pids or [server.proc.pid, *server.children()]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class Records:
    """The test's own reading of the records, through a store of its own (one pool for
    the whole test: after a restart its next call reconnects)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.store = PostgresStore(StoreConfig(url=url, prefix=prefix, socket_timeout=5.0))

    async def get(self, route: str, key: str) -> Record | None:
        return await self.store.get(KeyRef(record_digest(route, "", key), route, key))

    async def close(self) -> None:
        await self.store.close()


@contextlib.asynccontextmanager
async def records(url: str, prefix: str) -> AsyncIterator[Records]:
    reader = Records(url, prefix)
    try:
        yield reader
    finally:
        await reader.close()


@dataclass
class Site:
    """Routes on one PostgreSQL prefix, and the gateways serving them."""

    tmp_path: Path
    upstream: Process
    url: str
    prefix: str
    routes: list[dict[str, Any]]
    #: each gateway's admin port, by its proxy port
    admin: dict[int, int] = field(default_factory=dict)

    def gateway(self) -> Process:
        port, admin_port = free_port(), free_port()
        config = {
            "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
            "admin": {"listen": f"127.0.0.1:{admin_port}"},
            "store": {
                "url": self.url,
                "prefix": self.prefix,
                "socket_timeout": STORE_TIMEOUT,
                "connect_timeout": STORE_TIMEOUT,
            },
            "routes": self.routes,
        }
        path = self.tmp_path / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = gateway_process(path, port)
        self.admin[port] = admin_port
        for_this_test(gateway)
        gateway.start()
        wait_for_port(admin_port, gateway.proc)
        return gateway


def route(name: str, upstream: Process, **settings: Any) -> dict[str, Any]:
    return {
        "name": name,
        "match": {"methods": ["POST"], "path": f"/jobs/{name}"},
        "upstream": upstream.url,
        "key": {"body": "job_key"},
        # The query string is this suite's control channel to the test upstream.
        "fingerprint": ["method", "path", "body"],
        **settings,
    }


@dataclass
class Answer:
    key: str
    status: int
    headers: dict[str, str]
    body: bytes
    #: when the answer was complete (time.monotonic)
    ended: float = 0.0

    def doc(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed


async def post_raw(port: int, path: str, key: str, query: str = "") -> Answer:
    """One POST on a connection of its own (Connection: close) over asyncio streams: a
    storm of 1,000 through httpx would make the client what the test measures."""
    body = json.dumps({"job_key": key}).encode()
    target = path + (f"?{query}" if query else "")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        raw = await asyncio.wait_for(reader.read(-1), 60)
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines[1:])
    }
    return Answer(key, int(lines[0].split()[1]), headers, rest, time.monotonic())


async def upstream_call(upstream: Process, path: str, **doc: Any) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(f"{upstream.url}{path}", json=doc)


async def sent(upstream: Process, key: str) -> int:
    async with httpx.AsyncClient() as client:
        answer = await client.get(f"{upstream.url}/_count", params={"key": key, "of": "sent"})
        return int(answer.json()["count"])


# -- the database SIGKILLed under a duplicate storm ----------------------------------------


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.long
async def test_sigkill_under_a_storm_and_restart_loses_nothing(
    tmp_path: Path, upstream: Process, ledger: Ledger
) -> None:
    """50 copies of each of 20 keys over two gateway processes; PostgreSQL SIGKILLed
    (every process of it) while 6 keys are completed, 6 are answered by the upstream
    while it is dead (their completions cannot land; on a busy machine their deadline
    may come first, which ends the same way) and 8 are still held by the upstream; 2
    unresolved and 2 parked records from before. Restarted on its data dir
    (crash recovery from the WAL), with the same gateways still running:

    - completed keys replay: nothing acknowledged was lost (Redis without persistence
      runs each again);
    - the keys answered while it was dead stay in flight, their leases run out into
      unresolved, and the reconciler's check completes them: never resent;
    - the held keys complete when their answers come, on the reconnected pool;
    - the unresolved and parked records are still there, in their states;
    - while it was down, new keys got 503 problem+json with Retry-After, none reached
      the upstream. Every key ran exactly once."""
    with own_database() as database:
        prefix = unique("pgd") + ":"
        check = {"url": upstream.url + "/_status/{key}", "every": "300ms", "timeout": "1s"}
        site = Site(
            tmp_path,
            upstream,
            database.url,
            prefix,
            [
                # The held keys' answers come after the restart: a deadline past it.
                route(
                    "charge",
                    upstream,
                    upstream_timeout="25s",
                    wait_timeout="30s",
                    on_unknown_outcome="reconcile",
                    reconcile={**check, "park_after": "1h"},
                ),
                # The keys answered while it is dead: a short deadline, so that their
                # leases (6 s + 7 s) run out soon after the restart. Whether the answer
                # or the deadline comes first, the key ends completed by the check.
                route(
                    "answer",
                    upstream,
                    upstream_timeout="6s",
                    wait_timeout="30s",
                    on_unknown_outcome="reconcile",
                    reconcile={**check, "park_after": "1h"},
                ),
                # Unknown outcomes made before the crash: checked (inconclusive), parked.
                route(
                    "check",
                    upstream,
                    upstream_timeout="1s",
                    on_unknown_outcome="reconcile",
                    reconcile={**check, "park_after": "1h"},
                ),
                route("park", upstream, upstream_timeout="1s", on_unknown_outcome="park"),
            ],
        )
        gateways = [site.gateway(), site.gateway()]
        async with records(database.url, prefix) as store:
            # Records of unknown outcome from before the crash.
            unresolved = [unique("unresolved") for _ in range(2)]
            parked = [unique("parked") for _ in range(2)]
            for key in unresolved:
                await upstream_call(upstream, "/_set_status", key=key, status=503)
            early = await asyncio.gather(
                *[post_raw(gateways[0].port, "/jobs/check", k, "sleep=1.5") for k in unresolved],
                *[post_raw(gateways[1].port, "/jobs/park", k, "sleep=1.5") for k in parked],
            )
            assert [a.status for a in early] == [504] * 4, early
            for key in unresolved:
                await _until_state(store, "check", key, State.UNRESOLVED)
            for key in parked:
                await _until_state(store, "park", key, State.PARKED)
            before = {
                key: await store.get(name, key)
                for name, keys in (("check", unresolved), ("park", parked))
                for key in keys
            }

            # The storm: completed (no hold), answered while dead, held across.
            completed = [unique("completed") for _ in range(6)]
            answered = [unique("answered") for _ in range(6)]
            held = [unique("held") for _ in range(8)]
            copies = 50
            storm = [
                asyncio.create_task(
                    post_raw(
                        gateways[i % 2].port,
                        "/jobs/answer" if key in answered else "/jobs/charge",
                        key,
                        "" if key in completed else "hold=1",
                    )
                )
                for i in range(copies)
                for key in completed + answered + held
            ]

            async def at_their_points() -> bool:
                for key in completed:
                    record = await store.get("charge", key)
                    if record is None or record.state is not State.COMPLETED:
                        return False
                return all([await upstream_count(upstream, k) == 1 for k in answered + held])

            await until("completed keys completed, the others held", at_their_points, 30)
            for key in held:
                record = await store.get("charge", key)
                assert record is not None and record.state is State.IN_FLIGHT, record
            for key in answered:  # in flight, or past its deadline already: unresolved
                record = await store.get("answer", key)
                assert record is not None and record.state in OPEN, record

            database.kill()  # SIGKILL: the postmaster and every backend
            killed = time.monotonic()
            for key in answered:  # the upstream answers; no completion can land now
                await upstream_call(upstream, "/_release", key=key)

            async def all_sent() -> bool:
                return all([await sent(upstream, k) == 1 for k in answered])

            await until("the upstream has sent every answer of the dead time", all_sent)
            down = [unique("down") for _ in range(4)]
            while_down = [
                await post_raw(gateways[i % 2].port, "/jobs/charge", key)
                for i, key in enumerate(down)
            ]
            database.start()  # the same data dir: crash recovery from the WAL
            restarted = time.monotonic()
            for key in held:
                await upstream_call(upstream, "/_release", key=key)
            answers = await asyncio.gather(*storm)

            storm_keys = [
                *[("charge", k) for k in completed + held],
                *[("answer", k) for k in answered],
            ]
            everything = [
                *storm_keys,
                *[("check", k) for k in unresolved],
                *[("park", k) for k in parked],
            ]
            expected = {
                **{k: State.COMPLETED for _, k in storm_keys},
                **{k: State.UNRESOLVED for k in unresolved},
                **{k: State.PARKED for k in parked},
            }

            async def settled() -> bool:
                for name, key in everything:
                    record = await store.get(name, key)
                    if record is None or record.state is not expected[key]:
                        return False
                return True

            await until("every key is settled by the running gateways", settled, 40)
            found = [
                Verdict(name, key, await upstream_count(upstream, key), await store.get(name, key))
                for name, key in everything
            ]
            repeats = {
                key: await post_raw(gateways[i % 2].port, f"/jobs/{name}", key)
                for i, (name, key) in enumerate(everything)
            }
            runs = {key: await upstream_count(upstream, key) for _, key in everything}
            reached = [key for key in down if await upstream_count(upstream, key)]
            alive = [g.proc is not None and g.proc.poll() is None for g in gateways]
        for gateway in gateways:
            gateway.stop()

    by_key = {v.key: v for v in found}
    kept = [key for key, record in before.items() if _kept(record, by_key[key].record)]
    statuses: dict[int, int] = {}
    for answer in answers:
        statuses[answer.status] = statuses.get(answer.status, 0) + 1
    ledger.record(
        AREA,
        "postgres_sigkill_under_storm",
        requests=len(early) + len(answers) + len(while_down) + len(repeats),
        faults=1,
        upstream_duplicates=sum(max(0, n - 1) for n in runs.values()) + len(reached),
        records_lost=sum(v.lost for v in found) + len(before) - len(kept),
        detail=(
            f"{len(storm_keys)} keys x {copies} copies over 2 gateways; storm answers "
            f"{dict(sorted(statuses.items()))}; down {restarted - killed:.1f}s; "
            f"ends {tally(found)}"
        ),
    )
    assert [p for v in found for p in v.problems() if "left unresolved" not in p] == []
    assert all(alive), "a gateway exited: recovery must need no restart"
    assert runs == {key: 1 for _, key in everything}, runs
    assert sorted(kept) == sorted(before), "an unresolved or parked record was lost"
    # While it was down: fail closed, nothing forwarded.
    assert [a.status for a in while_down] == [503] * len(down)
    assert all(
        a.headers["content-type"] == "application/problem+json" and a.headers["retry-after"]
        for a in while_down
    )
    assert reached == []
    # The storm's callers: the first response, a replay of it, or a problem to retry.
    assert set(statuses) <= {200, 409, 503, 504}, statuses
    # Before the kill the database was up: no copy failed for want of it.
    assert {a.status for a in answers if a.ended < killed} <= {200}
    assert all(a.key in answered for a in answers if a.status == 504)  # past its deadline
    problems = [a for a in answers if a.status != 200]
    assert all(a.headers["content-type"] == "application/problem+json" for a in problems)
    assert all(a.doc()["run"] == 1 for a in answers if a.status == 200)
    for key in completed + held:  # the upstream's answer, stored and replayed
        record = by_key[key].record
        assert record is not None and record.response is not None
        assert record.response.origin == "upstream"
    for key in answered:  # lease ran out into unresolved, the check completed it
        record = by_key[key].record
        assert record is not None and record.response is not None
        assert record.response.origin == "reconciled"
        assert [e["event"] for e in record.history][:1] == ["unknown"]
    for _, key in storm_keys:
        assert repeats[key].status == 200 and repeats[key].headers["idempotent-replayed"]
    for key in unresolved + parked:
        assert repeats[key].status == 409


def _kept(before: Record | None, after: Record | None) -> bool:
    """The record is still there, in the state it had, with the history it had."""
    if before is None or after is None:
        return False
    return after.state is before.state and after.history[: len(before.history)] == before.history


async def _until_state(store: Records, route: str, key: str, state: State) -> Record:
    found: list[Record] = []

    async def there() -> bool:
        record = await store.get(route, key)
        found[:] = [record] if record is not None else []
        return record is not None and record.state is state

    await until(f"{route}/{key} is {state}", there)
    return found[0]


# -- what an acknowledged write is worth ---------------------------------------------------


@pytest.mark.slow
async def test_acknowledged_writes_survive_a_crash_at_once(ledger: Ledger) -> None:
    """Claims and completions the store acknowledged, then PostgreSQL SIGKILLed at
    once and restarted: every one is there. The server's WAL writer waits 10 s between
    rounds here, so a commit acknowledged before its WAL reached the kernel (a session
    with synchronous_commit off) would still be in shared memory when the server dies,
    and lost: the store must never ask for that."""
    response = StoredResponse(200, (("content-type", "application/json"),), b'{"ok":true}')
    with own_database(wal_writer_delay="10s") as database:
        prefix = unique("ack") + ":"
        keys = [unique("key") for _ in range(6)]
        refs = [KeyRef(record_digest("charge", "", key), "charge", key) for key in keys]
        store = PostgresStore(StoreConfig(url=database.url, prefix=prefix, socket_timeout=5.0))
        try:
            for i, ref in enumerate(refs):
                assert await store.claim(ref, f"run-{i}", "fp", 60) is None
            for i, ref in enumerate(refs[:3]):
                assert await store.complete(ref, f"run-{i}", response, 3600)
        finally:
            await store.close()
        database.kill()
        database.start()
        async with records(database.url, prefix) as reader:
            found = [await reader.get("charge", ref.key) for ref in refs]
    states = [None if r is None else r.state for r in found]
    ledger.record(
        AREA,
        "acknowledged_writes_survive_a_crash",
        faults=1,
        records_lost=sum(r is None for r in found),
        detail=f"6 claims and 3 completions acknowledged, then SIGKILL: {[str(s) for s in states]}",
    )
    assert states == [State.COMPLETED] * 3 + [State.IN_FLIGHT] * 3
    assert [r.response for r in found[:3] if r is not None] == [response] * 3


# -- the database down, then up, with the gateway running ----------------------------------

PASSWORD = "pg-S3cret-9f1c7e"  # a role of the test's own database
ROLE = "gateway_app"


def password_role(server: PostgresServer) -> str:
    """A login role that needs its password over TCP (scram-sha-256; the server's own
    user stays trusted for the test's reads), and the store URL with it in."""
    server.sql(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
    server.sql(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {ROLE}")
    hba = server.data / "pg_hba.conf"
    hba.write_text(f"host all {ROLE} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    server.sql("SELECT pg_reload_conf()")
    return f"postgresql://{ROLE}:{PASSWORD}@127.0.0.1:{server.port}/{DATABASE}"


async def _metric(admin_port: int, name: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{admin_port}/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("fault", ["crash", "hang"])
async def test_database_down_then_up_fails_closed_or_open_and_recovers(
    tmp_path: Path, upstream: Process, fault: str, ledger: Ledger
) -> None:
    """PostgreSQL stopped as `pg_ctl stop -m immediate` does (crash), or every process
    of it SIGSTOPped (hang: connections open, nothing answers), under a running
    gateway whose store URL holds a password. A fail_closed route answers 503
    problem+json with Retry-After, in bounded time, and forwards nothing; a fail_open
    route forwards without dedupe (counted store_bypassed). /readyz says 503. Then the
    database is back (started on its data dir, or SIGCONTed): the same gateway process
    claims, completes and replays again, and keys completed before still replay. The
    password is in no log line, no answer and no metric."""
    import psycopg

    with own_database() as database:
        url = password_role(database)
        with pytest.raises(psycopg.OperationalError):  # the password is really needed
            psycopg.connect(url.replace(f":{PASSWORD}", ""), connect_timeout=5).close()
        prefix = unique("pgdown") + ":"
        site = Site(
            tmp_path,
            upstream,
            url,
            prefix,
            [
                route("charge", upstream, upstream_timeout="5s"),
                route("open", upstream, upstream_timeout="5s", on_store_error="fail_open"),
            ],
        )
        gateway = site.gateway()
        admin_port = site.admin[gateway.port]
        admin = f"http://127.0.0.1:{admin_port}"
        port = gateway.port
        bodies: list[bytes] = []
        async with httpx.AsyncClient(timeout=20) as client:
            before = unique("before")
            assert (await post_raw(port, "/jobs/charge", before)).status == 200
            assert (await post_raw(port, "/jobs/charge", before)).headers["idempotent-replayed"]
            stopped: list[int] = []
            if fault == "crash":
                stop_immediately(database)
            else:
                stopped = hang(database)
            try:
                closed_keys = [unique("closed") for _ in range(3)]
                closed = [await post_raw(port, "/jobs/charge", k) for k in closed_keys]
                bypass = unique("bypass")
                opened = [await post_raw(port, "/jobs/open", bypass) for _ in range(2)]
                ready_down = await client.get(f"{admin}/readyz")
                bodies += [a.body for a in closed + opened] + [ready_down.content]
                bypassed = await _metric(
                    admin_port,
                    'idempotency_gateway_requests_total{outcome="store_bypassed"',
                )
                metrics_down = (await client.get(f"{admin}/metrics")).content
            finally:
                if fault == "crash":
                    database.start()
                else:
                    resume(database, stopped)
            recovered: list[Answer] = []

            async def claims_again() -> bool:
                answer = await post_raw(port, "/jobs/charge", unique("after"))
                recovered.append(answer)
                return answer.status == 200

            await until("the running gateway claims again", claims_again, 30)
            after = recovered[-1].key
            replay = await post_raw(port, "/jobs/charge", after)
            old = await post_raw(port, "/jobs/charge", before)

            async def ready() -> bool:
                return (await client.get(f"{admin}/readyz")).status_code == 200

            await until("/readyz answers 200 again", ready, 30)
            metrics_after = (await client.get(f"{admin}/metrics")).content
        runs = {k: await upstream_count(upstream, k) for k in [*closed_keys, bypass, after, before]}
        alive = gateway.proc is not None and gateway.proc.poll() is None
        gateway.stop()
    log = gateway.output()
    bodies += [a.body for a in recovered] + [metrics_down, metrics_after]
    leaked = [b for b in bodies if PASSWORD.encode() in b] + ([log] if PASSWORD in log else [])
    ledger.record(
        AREA,
        f"postgres_down_then_up[{fault}]",
        requests=4 + len(closed) + len(opened) + len(recovered) + 2,
        faults=1,
        upstream_duplicates=sum(runs[k] for k in closed_keys) + max(0, runs[before] - 1),
        detail=f"{len(recovered) - 1} 503s before it claimed again; runs {sorted(runs.values())}",
    )
    assert alive
    assert [a.status for a in closed] == [503] * len(closed)
    for answer in closed:
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.headers["retry-after"] == "1"
        assert answer.doc()["status"] == 503 and answer.doc()["title"]
    assert all(runs[k] == 0 for k in closed_keys)  # fail closed: nothing forwarded
    assert [a.status for a in opened] == [200, 200]  # fail open: forwarded, no dedupe
    assert runs[bypass] == 2 and bypassed >= 2
    assert ready_down.status_code == 503
    assert {a.status for a in recovered[:-1]} <= {503}
    assert replay.status == 200 and replay.headers["idempotent-replayed"] == "true"
    assert old.status == 200 and old.headers["idempotent-replayed"] == "true"
    assert runs[after] == 1 and runs[before] == 1
    assert "store failed on route charge" in log  # the failure is logged, as it was
    assert leaked == []


# -- the store's errors when the database dies under load -----------------------------------


@pytest.mark.slow
@pytest.mark.long
async def test_database_crashes_under_load_give_store_errors_only() -> None:
    """40 claims at a time through one store (a pool of 10), PostgreSQL SIGKILLed and
    restarted twice meanwhile: every failed call is a StoreError (a 503, or fail_open),
    never another exception (a 500), and claims succeed again after each restart.

    This found asyncpg handing back a pooled connection whose protocol was still
    mid-operation after a crash ("cannot switch to state 12; another operation (2) is
    in progress", an InternalClientError): the call on it escaped as a 500."""
    with own_database() as database:
        store = PostgresStore(
            StoreConfig(
                url=database.url,
                prefix=unique("crash") + ":",
                socket_timeout=0.5,
                connect_timeout=0.5,
                max_connections=10,
            )
        )
        outcomes: dict[str, int] = {}
        phase = ["before"]
        stop = asyncio.Event()

        async def claims() -> None:
            while not stop.is_set():
                key = unique("load")
                ref = KeyRef(record_digest("charge", "", key), "charge", key)
                try:
                    await store.claim(ref, "run", "fp", 10)
                    name = f"claimed {phase[0]}"
                except StoreError:
                    name = "StoreError"
                    await asyncio.sleep(0.01)
                except Exception as exc:  # what the test is here to catch
                    name = f"{type(exc).__name__}: {exc}"
                outcomes[name] = outcomes.get(name, 0) + 1

        workers = [asyncio.create_task(claims()) for _ in range(40)]
        try:
            for cycle in range(2):
                await asyncio.sleep(1.5)
                await asyncio.to_thread(database.kill)
                await asyncio.sleep(0.5)
                await asyncio.to_thread(database.start)
                phase[0] = f"after restart {cycle + 1}"
            await asyncio.sleep(1.5)
        finally:
            stop.set()
            await asyncio.gather(*workers)
            await store.close()
    unexpected = {k: n for k, n in outcomes.items() if k != "StoreError" and "claimed" not in k}
    assert unexpected == {}
    assert outcomes.get("claimed after restart 2", 0) > 0, outcomes
