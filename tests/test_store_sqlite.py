"""The SQLite store beyond the contract suite: group commit (many callers, one commit),
notices that wake a waiter in another store on the same file, a full file and a
read-only one (a StoreError: 503, or forwarded on fail_open; never a 500, nothing
already stored lost), and the schema applied once by stores starting together.

Real files in the test's temp dir; the read-only file is behind a read-only bind mount
(skipped where this process may not mount).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import KeyRef, Record, State, StoredResponse
from gateway.store.base import Store
from gateway.store.sqlite import SqliteStore
from gateway.store.sqlite.database import WriteTurns
from gateway.store.sqlite.rows import Effects
from gateway.store.sqlite.schema import APPLICATION_ID, latest, migrations
from tests.conftest import GatewayClient, unique, upstream_count
from tests.support.servers import ROOT, Process

pytestmark = pytest.mark.anyio

Build = Callable[..., Any]
RESPONSE = StoredResponse(200, (("content-type", "application/json"),), b'{"ok":true}')
REMINDER = {
    "name": "send-reminder",
    "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
    "key": {"body": "job_key"},
}


@pytest.fixture
def store_kind() -> str:
    """make_store and gateway_for make SQLite stores here (one file per test)."""
    return "sqlite"


def ref() -> KeyRef:
    return KeyRef(unique("d").replace("-", "").ljust(32, "0")[:32], "send-reminder", unique())


def sqlite_of(client: GatewayClient) -> SqliteStore:
    store = client.gateway.store
    assert isinstance(store, SqliteStore)
    return store


async def test_claims_of_many_callers_share_commits(make_store: Callable[[], Store]) -> None:
    """200 first claims at once: far fewer commits (fsyncs) than claims, and each
    caller its own answer."""
    store = make_store()
    assert isinstance(store, SqliteStore)
    await store.start()
    try:
        before = store.db.commits
        refs = [ref() for _ in range(200)]
        got = await asyncio.gather(*(store.claim(r, "run-1", "fp", 30) for r in refs))
        assert got == [None] * 200
        commits = store.db.commits - before
        assert commits <= 50, commits
        again = await asyncio.gather(*(store.claim(r, "run-2", "fp", 30) for r in refs))
        assert all(g is not None and g.run_id == "run-1" for g in again)
    finally:
        await store.close()


async def test_completions_answered_together_are_one_notice(
    make_store: Callable[[], Store],
) -> None:
    """100 completions at once, in a process with another on the file: far fewer
    datagrams than completions (one per turn of the loop that answered a batch), and
    the other process hears every key."""
    store, other = make_store(), make_store()
    assert isinstance(store, SqliteStore) and isinstance(other, SqliteStore)
    await store.start()
    await other.start()
    try:
        refs = [ref() for _ in range(100)]
        await asyncio.gather(*(store.claim(r, "run-1", "fp", 30) for r in refs))
        heard: list[str] = []
        other.notifier.notify = lambda digest, completed=None: heard.append(digest)  # type: ignore[method-assign]
        before = store.notices.sent
        done = await asyncio.gather(*(store.complete(r, "run-1", RESPONSE, 60) for r in refs))
        assert done == [True] * 100
        sent = store.notices.sent - before
        assert 1 <= sent <= 25, sent
        async with asyncio.timeout(5):
            while len(heard) < 100:
                await asyncio.sleep(0.01)
        assert sorted(heard) == sorted(r.digest for r in refs)
    finally:
        await other.close()
        await store.close()


async def test_a_first_request_costs_two_operations_a_replay_one(
    gateway_for: Build, upstream: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a request costs the file: a first request two operations (the claim, the
    completion: at most two commits, fewer when other callers share them), a replay
    one, which writes nothing. (The gateway's own gauges read the store now and then
    too: those are not the request's.)"""
    gw = await gateway_for([REMINDER])
    store = sqlite_of(gw)
    ran: list[str] = []
    run = store.db.run

    async def counted(operation: Callable[[sqlite3.Connection], Any], what: str) -> Any:
        ran.append(what)
        return await run(operation, what)

    monkeypatch.setattr(store.db, "run", counted)
    gauges = {"queue stats", "stats", "last successes", "reap", "lease expiry"}
    key = unique()
    first = await gw.post("/jobs/send-reminder", json={"job_key": key})
    assert first.status_code == 200
    assert [what for what in ran if what not in gauges] == ["claim", "complete"]
    ran.clear()
    replay = await gw.post("/jobs/send-reminder", json={"job_key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert [what for what in ran if what not in gauges] == ["claim"]


async def test_one_failing_operation_fails_alone(make_store: Callable[[], Store]) -> None:
    """An operation that fails in a batch is rolled back to its savepoint: the others
    of its transaction commit."""
    store = make_store()
    assert isinstance(store, SqliteStore)
    await store.start()
    try:
        r = ref()

        def broken(conn: sqlite3.Connection, now: int, fx: Effects) -> None:
            conn.execute("INSERT INTO gateway_roster (entry, mark, since_ms) VALUES ('x', 'y', 1)")
            conn.execute("INSERT INTO no_such_table VALUES (1)")

        results = await asyncio.gather(
            store.claim(r, "run-1", "fp", 30),
            store.run(broken, "broken"),
            store.complete(r, "run-1", RESPONSE, 60),
            return_exceptions=True,
        )
        assert results[0] is None and results[2] is True
        assert isinstance(results[1], StoreError)
        assert "no_such_table" not in str(results[1])  # SQLite's text stays out
        assert await store.roster() == {}  # its first statement went with it
        record = await store.get(r)
        assert record is not None and record.state is State.COMPLETED
    finally:
        await store.close()


async def test_an_operation_failing_half_way_in_a_batch_is_undone_alone(
    make_store: Callable[[], Store],
) -> None:
    """A claim, an operation that writes and then fails, and a completion, in one
    batch: the batch runs again in savepoints, so the failed operation's write is gone,
    the claim and the completion commit in one transaction, and each caller has its
    own answer."""
    store = make_store()
    assert isinstance(store, SqliteStore)
    await store.start()
    try:
        r = ref()
        held, release = threading.Event(), threading.Event()

        def hold(conn: sqlite3.Connection, now: int, fx: Effects) -> None:
            held.set()
            release.wait(10)

        def broken(conn: sqlite3.Connection, now: int, fx: Effects) -> None:
            fx.changed.append(("broken", None))
            conn.execute("INSERT INTO gateway_roster (entry, mark, since_ms) VALUES ('x', 'y', 1)")
            raise ValueError("a fault after a write")

        holding = asyncio.ensure_future(store.run(hold, "hold"))
        while not held.is_set():
            await asyncio.sleep(0.001)
        before = store.db.commits
        calls = [
            asyncio.ensure_future(store.claim(r, "run-1", "fp", 30)),
            asyncio.ensure_future(store.run(broken, "broken")),
            asyncio.ensure_future(store.complete(r, "run-1", RESPONSE, 60)),
        ]
        await asyncio.sleep(0.05)  # all three wait for the thread
        release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        await holding
        assert results[0] is None and results[2] is True
        assert isinstance(results[1], ValueError)
        assert store.db.commits - before == 2  # the held batch's, then the three's
        assert await store.roster() == {}  # the failed operation's write went with it
        record = await store.get(r)
        assert record is not None and record.state is State.COMPLETED
    finally:
        release.set()
        await store.close()


async def test_a_deferred_write_runs_once_per_commit_and_goes_with_a_failure(
    make_store: Callable[[], Store],
) -> None:
    """Writes deferred to the commit (a route's last success): the last one given for
    a key is written, once; one deferred by an operation that then fails is taken
    back with the rest of that operation, and the one before it stands."""
    store = make_store()
    assert isinstance(store, SqliteStore)
    await store.start()
    try:
        held, release = threading.Event(), threading.Event()
        insert = "INSERT INTO gateway_roster (entry, mark, since_ms) VALUES (?, 'm', 1)"

        def hold(conn: sqlite3.Connection, now: int, fx: Effects) -> None:
            held.set()
            release.wait(10)

        def deferring(key: str, entry: str, fails: bool) -> Callable[..., None]:
            def op(conn: sqlite3.Connection, now: int, fx: Effects) -> None:
                store.db.defer(key, insert, (entry,))
                if fails:
                    raise ValueError("a fault after a deferred write")

            return op

        holding = asyncio.ensure_future(store.run(hold, "hold"))
        while not held.is_set():
            await asyncio.sleep(0.001)
        before = store.db.commits
        calls = [
            asyncio.ensure_future(store.run(deferring(key, entry, fails), entry))
            for key, entry, fails in (
                ("x", "first", False),
                ("y", "replaced", False),
                ("x", "failed", True),
                ("y", "last", False),
            )
        ]
        await asyncio.sleep(0.05)  # all four wait for the thread
        release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        await holding
        assert [type(r).__name__ for r in results] == ["NoneType"] * 2 + [
            "ValueError",
            "NoneType",
        ]
        assert store.db.commits - before == 2
        assert sorted(await store.roster()) == ["first", "last"]
        r = ref()
        assert await store.claim(r, "run-1", "fp", 30) is None
        assert await store.complete(r, "run-1", RESPONSE, 60) is True
        assert r.route in await store.last_successes()
    finally:
        release.set()
        await store.close()


async def test_callers_that_are_gone_leave_the_thread_serving(
    make_store: Callable[[], Store],
) -> None:
    """Callers cancelled while their operations wait for the thread or run (a client
    gone): their operations are dropped or answered to nobody, and every other caller
    gets its answer."""
    store = make_store()
    assert isinstance(store, SqliteStore)
    await store.start()
    try:
        async with asyncio.timeout(10):  # an answer lost leaves its callers waiting
            # Cancelled before the thread takes them, and while their batch commits.
            for delay in (0, 0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.012):
                calls = [
                    asyncio.ensure_future(store.claim(ref(), "run-1", "fp", 30)) for _ in range(100)
                ]
                await asyncio.sleep(delay)
                for call in calls[::2]:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
            assert await store.claim(ref(), "run-1", "fp", 30) is None
    finally:
        await store.close()


async def test_a_waiter_in_another_store_is_woken_by_the_notice(
    gateway_for: Build, upstream: Process
) -> None:
    """Two gateways on one file (as two workers are): a duplicate waiting in the second
    is answered as soon as the first completes, by its notice, not at the next
    fallback re-read (0.5 s to 1 s later)."""
    a = await gateway_for([REMINDER])
    b = await gateway_for([REMINDER])
    b.gateway.store.fallback_wait = (5.0, 5.0)  # a re-read would come too late
    key = unique()
    body = {"job_key": key}
    first = asyncio.create_task(a.post("/jobs/send-reminder", json=body, params={"sleep": "0.5"}))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    second = await b.post("/jobs/send-reminder", json=body, params={"sleep": "0.5"})
    waited = time.monotonic() - started
    assert second.status_code == 200 and second.headers["idempotent-replayed"] == "true"
    assert second.content == (await first).content
    assert waited < 2.0, waited
    assert await upstream_count(upstream, key) == 1


async def test_a_full_file_is_a_store_error_never_a_500(
    gateway_for: Build, upstream: Process
) -> None:
    """The file at its size limit (PRAGMA max_page_count, as a full disk refuses a
    write): a new key is answered 503 problem+json on a fail_closed route and forwarded
    unguarded on a fail_open one; the keys stored before still replay."""
    gw = await gateway_for([REMINDER, {**REMINDER, "name": "open", "match": {
        "methods": ["POST"], "path": "/jobs/open"}, "on_store_error": "fail_open"}])  # fmt: skip
    store = sqlite_of(gw)
    kept = unique()
    first = await gw.post("/jobs/send-reminder", json={"job_key": kept})
    assert first.status_code == 200

    def fill(conn: sqlite3.Connection, now: int, fx: Effects) -> int:
        pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        conn.execute(f"PRAGMA max_page_count = {pages}")
        return pages

    await store.run(fill, "test: the size limit")
    statuses = []
    for _ in range(30):  # a page or two of room may be left: fill it
        answer = await gw.post("/jobs/send-reminder", json={"job_key": unique(), "pad": "x" * 2000})
        statuses.append(answer.status_code)
        if answer.status_code == 503:
            assert answer.headers["content-type"] == "application/problem+json"
            assert "SQLite" not in answer.text and "full" not in answer.text
            break
    assert statuses[-1] == 503 and set(statuses) <= {200, 503}, statuses
    with pytest.raises(StoreError, match="the disk is full"):
        for _ in range(200):  # room left in a page takes a small claim: the next page is refused
            await store.claim(ref(), "run-1", "fp", 30)
    forwarded = await gw.post("/jobs/open", json={"job_key": unique(), "pad": "x" * 2000})
    assert forwarded.status_code == 200
    again = await gw.post("/jobs/send-reminder", json={"job_key": kept})
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content


@contextlib.contextmanager
def read_only_view(folder: Path) -> Iterator[Path]:
    """`folder` seen through a read-only bind mount (skips where mounting is refused)."""
    view = folder.parent / f"{folder.name}-ro"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(folder), str(view)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode(errors='replace')}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


READ_ONLY_RUN = """
import asyncio, json, os, sys
from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import KeyRef
from gateway.store.sqlite import SqliteStore

async def main(path):
    url = "sqlite://" + path
    store = SqliteStore(StoreConfig(url=url))
    await store.start()
    await store.close()
    os.chmod(path, 0o444)
    store = SqliteStore(StoreConfig(url=url))
    await store.start()
    try:
        await store.claim(KeyRef("d" * 32, "r", "k"), "run-1", "fp", 30)
        print(json.dumps({"claimed": True}))
    except StoreError as exc:
        print(json.dumps({"error": str(exc)}))
    finally:
        await store.close()

asyncio.run(main(sys.argv[1]))
"""


def test_a_read_only_file_is_a_store_error_never_a_500(tmp_path: Path) -> None:
    """The gateway's file made read-only (its mode; the folder still writable), in a
    process that cannot override it (root without CAP_DAC_OVERRIDE, through setpriv):
    the store starts, says so, and every write is a StoreError naming the cause, which
    the engine answers 503 (or forwards, fail_open)."""
    drop: list[str] = []
    if os.geteuid() == 0:  # root reads a file's mode as advice: drop the capability
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs util-linux's setpriv to run without CAP_DAC_OVERRIDE")
        drop = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]
    done = subprocess.run(
        [
            *drop,
            sys.executable,
            "-c",
            READ_ONLY_RUN,
            str(tmp_path / "gateway.db"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert "read-only" in said.get("error", ""), (said, done.stderr)
    assert "is read-only: requests on keyed routes fail" in done.stderr


def test_a_read_only_file_system_stops_the_start(tmp_path: Path) -> None:
    """On a read-only mount SQLite cannot open a write-ahead-logged file at all: the
    start is refused naming the file and what to check."""
    folder = tmp_path / "data"
    folder.mkdir()

    async def make() -> None:
        writer = SqliteStore(StoreConfig(url=f"sqlite://{folder / 'gateway.db'}"))
        await writer.start()
        await writer.close()

    asyncio.run(make())
    with read_only_view(folder) as view:
        store = SqliteStore(StoreConfig(url=f"sqlite://{view / 'gateway.db'}"))
        with pytest.raises(StoreError, match="permissions") as caught:
            asyncio.run(store.start())
        assert str(view / "gateway.db") in str(caught.value)


async def test_stores_starting_together_apply_the_schema_once(tmp_path: Path) -> None:
    """Eight stores opening one new file at once (workers starting): each finds the
    schema whole, applied by one of them under the write lock."""
    url = f"sqlite://{tmp_path / 'gateway.db'}"
    stores = [SqliteStore(StoreConfig(url=url)) for _ in range(8)]
    await asyncio.gather(*(store.start() for store in stores))
    try:
        r = ref()
        got = await asyncio.gather(
            *(s.claim(r, f"run-{i}", "fp", 30) for i, s in enumerate(stores))
        )
        assert sum(g is None for g in got) == 1
    finally:
        await asyncio.gather(*(store.close() for store in stores))
    with sqlite3.connect(tmp_path / "gateway.db") as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == latest()
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_stores_claiming_the_same_keys_at_once_each_wait_their_turn(
    tmp_path: Path,
) -> None:
    """Four stores on one file (four workers) read and claim the same 60 keys at once,
    each in batches of its own that begin with a read: a batch reads only once it holds
    the file's write lock, so none decides on a read another's commit made stale (that
    write would fail, SQLITE_BUSY_SNAPSHOT, instead of waiting its turn). Every claim is
    answered, and each key has one winner."""
    url = f"sqlite://{tmp_path / 'gateway.db'}"
    stores = [SqliteStore(StoreConfig(url=url)) for _ in range(4)]
    for store in stores:
        await store.start()

    async def look_then_claim(store: Store, key: KeyRef, run: str) -> Record | None:
        # Both queued in one tick: one batch, its first operation a read.
        _, claimed = await asyncio.gather(store.get(key), store.claim(key, run, "fp", 30))
        return claimed

    try:
        refs = [ref() for _ in range(60)]
        got = await asyncio.gather(
            *(look_then_claim(s, r, f"run-{i}") for r in refs for i, s in enumerate(stores)),
            return_exceptions=True,
        )
    finally:
        await asyncio.gather(*(store.close() for store in stores))
    failures = [g for g in got if isinstance(g, BaseException)]
    assert not failures, failures[:3]
    winners = [sum(g is None for g in got[k * 4 : k * 4 + 4]) for k in range(len(refs))]
    assert winners == [1] * len(refs)


async def test_a_file_of_the_first_schema_keeps_its_records(tmp_path: Path) -> None:
    """A file written with the first schema (records keyed by their digest) is brought
    to the latest on start, and its records come through whole: a completed key still
    replays, a key in flight still holds, and the rows are in arrival order."""
    path = tmp_path / "gateway.db"
    store = SqliteStore(StoreConfig(url=f"sqlite://{path}"))
    done, held = ref(), ref()
    first = dict(migrations())[1]
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.executescript(first)
        conn.execute("PRAGMA user_version = 1")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        insert = (
            "INSERT INTO gateway_records (digest, route, key, state, run_id, fingerprint,"
            " created_ms, since_ms, lease_until_ms, place, expires_ms, response)"
            " VALUES (?, ?, ?, ?, 'run-1', 'fp', ?, ?, ?, ?, ?, ?)"
        )
        now = int(time.time() * 1000)
        sealed = store.codec.encode(done.digest, RESPONSE)
        conn.execute(
            insert, (done.digest, done.route, done.key, "completed", now, now, 0, None,
                     now + 3_600_000, sealed)
        )  # fmt: skip
        conn.execute(
            insert, (held.digest, held.route, held.key, "in_flight", now + 1, now + 1,
                     now + 3_600_000, now + 3_600_000, None, None)
        )  # fmt: skip
    await store.start()
    try:
        record = await store.get(done)
        assert record is not None and record.state is State.COMPLETED
        assert record.response == RESPONSE
        again = await store.claim(held, "run-2", "fp", 30)
        assert again is not None and again.run_id == "run-1"
        assert await store.claim(ref(), "run-3", "fp", 30) is None
    finally:
        await store.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == latest()
        digests = [d for (d,) in conn.execute("SELECT digest FROM gateway_records ORDER BY rowid")]
        assert digests[:2] == [done.digest, held.digest]


async def test_notices_from_anything_but_a_worker_are_dropped(tmp_path: Path) -> None:
    """What arrives on a store's notice socket is read as untrusted: text that is not
    a notice (not JSON, nested past what Python parses, wrong types) wakes nobody and
    stops nothing; a notice after it is heard."""
    store = SqliteStore(StoreConfig(url=f"sqlite://{tmp_path / 'gateway.db'}"))
    await store.start()
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert store.subscribed.is_set() and store.notices._path is not None
        target = str(store.notices._path)
        due: list[Any] = []
        stop = store.due.listen(due.append, lambda _: None, lambda: None)
        r = ref()
        with store.notifier.watch(r.digest) as watch:
            for junk in (
                b"\xff\xfe not json",
                b"[1, 2]",
                b"[" * 100_000,
                json.dumps({"c": [1, None, {"x": 1}], "d": [[1, 2, 3], "x"], "t": "x"}).encode(),
                json.dumps({"d": [[r.digest, "route", "key", "soon", 0, ""]]}).encode(),
            ):
                sender.sendto(junk, target)
            await asyncio.sleep(0.2)
            assert not watch.is_set() and due == []
            sender.sendto(json.dumps({"c": [r.digest]}).encode(), target)
            async with asyncio.timeout(5):
                await watch.wait()
        stop()
    finally:
        sender.close()
        await store.close()


async def test_a_notice_folder_open_to_others_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A notice folder another user could read or write (made before the gateway, mode
    0777): the store does without notices (waiters re-read) and says how to fix it."""
    folder = tmp_path / "gateway.db-notices"
    folder.mkdir()
    folder.chmod(0o777)
    store = SqliteStore(StoreConfig(url=f"sqlite://{tmp_path / 'gateway.db'}"))
    await store.start()
    try:
        assert not store.subscribed.is_set()
        assert list(folder.iterdir()) == []
        assert "open to other users (mode 777)" in caplog.text
        r = ref()
        assert await store.claim(r, "run-1", "fp", 30) is None  # the store itself works
    finally:
        await store.close()


async def test_a_long_path_still_gets_its_notices(tmp_path: Path) -> None:
    """A database whose notice socket's path is past a Unix socket's 107 bytes: the
    socket is reached through the folder's descriptor, and a waiter is still woken."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    url = f"sqlite://{deep / 'gateway.db'}"
    a, b = SqliteStore(StoreConfig(url=url)), SqliteStore(StoreConfig(url=url))
    await a.start()
    await b.start()
    try:
        assert a.subscribed.is_set() and b.subscribed.is_set()
        r = ref()
        assert await a.claim(r, "run-1", "fp", 30) is None
        with b.notifier.watch(r.digest) as watch:
            assert await a.complete(r, "run-1", RESPONSE, 60)
            async with asyncio.timeout(5):
                await watch.wait()
    finally:
        await a.close()
        await b.close()


def _delete(db: Path) -> None:
    for name in (db.name, db.name + "-wal", db.name + "-shm"):
        (db.parent / name).unlink(missing_ok=True)


def _replace(db: Path) -> None:
    other = db.with_name("restored.db")
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
    os.replace(other, db)


def _truncate(db: Path) -> None:
    os.truncate(db, 0)


def _drop_log(db: Path) -> None:
    for name in (db.name + "-wal", db.name + "-shm"):
        (db.parent / name).unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_delete, "was deleted"),
        (_replace, "was replaced"),
        (_truncate, "was truncated"),
        (_drop_log, "lost its write-ahead log"),
    ],
)
async def test_a_file_deleted_or_replaced_under_the_store_refuses_every_write(
    tmp_path: Path, damage: Callable[[Path], None], said: str
) -> None:
    """The file deleted, replaced, truncated or its -wal removed while the store runs:
    SQLite would go on committing to what it holds open, and a restart would find none
    of it (each key run again). Every operation after it, reads and the readiness ping
    too, is a StoreError naming the file, what happened and the fix; nothing is kept in
    the lost file as if it were safe."""
    db = tmp_path / "gateway.db"
    store = SqliteStore(StoreConfig(url=f"sqlite://{db}"))
    await store.start()
    try:
        kept = ref()
        assert await store.claim(kept, "run-1", "fp", 30) is None
        damage(db)
        for attempt in (
            store.claim(ref(), "run-2", "fp", 30),
            store.get(kept),
            store.ping(),
        ):
            with pytest.raises(StoreError, match=said) as raised:
                await attempt
            assert str(db) in str(raised.value) and "restart" in str(raised.value)
    finally:
        await store.close()


async def test_what_else_is_in_the_notice_folder_fails_no_write(tmp_path: Path) -> None:
    """Entries in the notice folder named like sockets but that are not a worker's (a
    folder, a file, a socket nobody reads from, nor binds any more): a completion is
    still answered, the other store still hears of it, and nothing but a dead socket
    is removed."""
    url = f"sqlite://{tmp_path / 'gateway.db'}"
    a, b = SqliteStore(StoreConfig(url=url)), SqliteStore(StoreConfig(url=url))
    await a.start()
    await b.start()
    folder = tmp_path / "gateway.db-notices"
    for name in ("0-folder.sock", "~-folder.sock"):  # listed before and after the workers'
        (folder / name).mkdir()
    (folder / "0-file.sock").write_text("not a socket")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gone.bind(str(folder / "0-gone.sock"))
    gone.close()  # a worker killed before it removed its socket
    a.notices._peers_at = -10.0  # list the folder again now
    try:
        for _ in range(3):
            r = ref()
            assert await a.claim(r, "run-1", "fp", 30) is None
            with b.notifier.watch(r.digest) as watch:
                assert await a.complete(r, "run-1", RESPONSE, 60)
                async with asyncio.timeout(5):
                    await watch.wait()
        left = sorted(p.name for p in folder.iterdir())
        assert {"0-folder.sock", "~-folder.sock", "0-file.sock"} <= set(left)
        assert "0-gone.sock" not in left
    finally:
        await a.close()
        await b.close()


def test_a_worker_waits_its_turn_at_the_write_lock_in_the_kernels_queue(tmp_path: Path) -> None:
    """Two processes' turns (two descriptors, as two workers have): while one holds the
    turn the other waits for it, gets it as soon as it is given, and a wait that runs
    past its deadline is given up, its turn let go when it comes (so the next take
    gets one)."""
    first, second = (WriteTurns(tmp_path / "gateway.db") for _ in range(2))
    for turns in (first, second):
        turns.open()
        turns.shared = True
    try:
        assert first.take(5.0) and first.held
        taken = threading.Event()
        waiter = threading.Thread(target=lambda: second.take(10.0) and taken.set())
        waiter.start()
        assert not taken.wait(0.3), "the second worker took the turn the first holds"
        first.give()
        assert taken.wait(5.0), "the turn given was not taken"
        waiter.join()
        assert second.held
        assert not first.take(0.2), "a turn held by another was had past its deadline"
        second.give()
        assert first.take(5.0) and first.held
        first.give()
    finally:
        first.close()
        second.close()


async def test_a_worker_holding_the_write_lock_too_long_gets_a_store_error_answered(
    tmp_path: Path,
) -> None:
    """A worker that holds its turn and stops (SIGSTOP, a debugger) leaves the others'
    callers answered: a StoreError (503) at the store's deadline, and service again
    once the turn is given."""
    url = f"sqlite://{tmp_path / 'gateway.db'}"
    stopped, serving = (SqliteStore(StoreConfig(url=url, socket_timeout=0.5)) for _ in range(2))
    await stopped.start()
    await serving.start()
    try:
        await serving.get(ref())  # both see each other's notice sockets
        stopped.db.turns.shared = True
        assert stopped.db.turns.take(1.0)
        with pytest.raises(StoreError, match="write lock"):
            await serving.claim(ref(), "run-1", "fp", 30)
        stopped.db.turns.give()
        assert await serving.claim(ref(), "run-2", "fp", 30) is None
    finally:
        await stopped.close()
        await serving.close()


def test_a_link_in_place_of_the_lock_file_is_not_followed(tmp_path: Path) -> None:
    """`gateway.db-lock` a link to somewhere else: nothing is made where it points, and
    the workers fall back to SQLite's own wait."""
    target = tmp_path / "elsewhere" / "made-by-the-gateway"
    target.parent.mkdir()
    (tmp_path / "gateway.db-lock").symlink_to(target)
    turns = WriteTurns(tmp_path / "gateway.db")
    turns.open()
    turns.shared = True
    try:
        assert turns.take(1.0) and not turns.held
    finally:
        turns.close()
    assert not target.exists()
