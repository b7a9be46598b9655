"""The SQLite store across real processes: `run --workers 4` on one file (one claim per
key, waiters woken across workers, each caller answered; each delivery of an async
route picked once; every worker SIGKILLed and restarted with nothing lost or run
twice), and the start-up errors of a file the gateway cannot use
(another program's, a newer gateway's, damaged, or locked by another process past the
deadline), each naming the file and the fix.

Everything is a real process: the test upstream under uvicorn (it counts runs per key)
and `python -m gateway run`; the lock is held by a sqlite3 connection in a process of
its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.keying import record_digest
from gateway.records import KeyRef, State
from gateway.store.sqlite import SqliteStore
from tests.conftest import unique, upstream_count
from tests.support.ledger import Ledger
from tests.support.servers import ROOT, Process, for_this_test, free_port, gateway_process

pytestmark = [pytest.mark.anyio, pytest.mark.process]

PATH = "/jobs/send-reminder"


def write_config(
    tmp_path: Path,
    upstream: Process,
    database: Path,
    route: dict[str, Any] | None = None,
    **store: Any,
) -> tuple[Path, int]:
    port = free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {"url": f"sqlite://{database}", **store},
        "routes": [
            {
                "name": "send-reminder",
                "match": {"methods": ["POST"], "path": PATH},
                "upstream": upstream.url,
                "key": {"header": "Idempotency-Key"},
                "wait_timeout": "20s",
                **(route or {}),
            }
        ],
    }
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


@pytest.mark.slow
async def test_four_workers_on_one_file_run_each_key_once(
    tmp_path: Path, upstream: Process, ledger: Ledger
) -> None:
    """50 parallel copies of each of 20 keys over 4 workers sharing one file: every key
    reaches the upstream once, and every caller gets its key's one answer (the copies
    in other workers than the one that claimed it are woken by its notice)."""
    config, port = write_config(tmp_path, upstream, tmp_path / "gateway.db")
    gateway = gateway_process(config, port)
    gateway.args += ["--workers", "4"]
    for_this_test(gateway)
    gateway.start()
    keys = [unique("sqw") for _ in range(20)]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as client:
        answers = await asyncio.gather(
            *(
                client.post(
                    PATH, params={"sleep": "0.3"}, content=b"{}", headers={"Idempotency-Key": key}
                )
                for key in keys
                for _ in range(50)
            )
        )
    bodies: dict[str, set[bytes]] = {}
    for i, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        bodies.setdefault(keys[i // 50], set()).add(answer.content)
    runs = {key: await upstream_count(upstream, key) for key in keys}
    ledger.record(
        "sqlite",
        "test_four_workers_on_one_file_run_each_key_once",
        requests=len(answers),
        upstream_duplicates=sum(n - 1 for n in runs.values() if n > 1),
        detail="4 workers, one file, 50 copies x 20 keys",
    )
    assert runs == dict.fromkeys(keys, 1), runs
    assert all(len(found) == 1 for found in bodies.values()), "one answer per key"


@pytest.mark.slow
async def test_four_workers_on_one_file_deliver_each_key_once(
    tmp_path: Path, upstream: Process, ledger: Ledger
) -> None:
    """An async route: 10 parallel copies of each of 20 keys over 4 workers on one
    file. Every caller gets 202, and every key is delivered once: a pick holds the
    file's write lock, so two workers never take one delivery."""
    async_route = {"delivery": "async", "retry": {"attempts": 3, "backoff": "100ms"}}
    config, port = write_config(tmp_path, upstream, tmp_path / "gateway.db", async_route)
    gateway = gateway_process(config, port)
    gateway.args += ["--workers", "4"]
    for_this_test(gateway)
    gateway.start()
    keys = [unique("sqd") for _ in range(20)]
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as client:
        answers = await asyncio.gather(
            *(
                client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
                for key in keys
                for _ in range(10)
            )
        )
    assert {answer.status_code for answer in answers} == {202}, {a.text for a in answers}
    deadline = time.monotonic() + 30
    runs = {key: await upstream_count(upstream, key) for key in keys}
    while min(runs.values()) < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        runs = {key: await upstream_count(upstream, key) for key in keys}
    await asyncio.sleep(1.0)  # a second pick of one would have run by now
    runs = {key: await upstream_count(upstream, key) for key in keys}
    ledger.record(
        "sqlite",
        "test_four_workers_on_one_file_deliver_each_key_once",
        requests=len(answers),
        upstream_duplicates=sum(n - 1 for n in runs.values() if n > 1),
        records_lost=sum(n == 0 for n in runs.values()),
        detail="4 workers, one file, async route, 10 copies x 20 keys",
    )
    assert runs == dict.fromkeys(keys, 1), runs


@pytest.mark.slow
async def test_sigkill_of_every_worker_loses_nothing_and_runs_nothing_twice(
    tmp_path: Path, upstream: Process, ledger: Ledger
) -> None:
    """4 workers on one file SIGKILLed together (the supervisor and every worker, no
    chance to clean up) while 10 keys are completed and 5 are held by the upstream.
    Restarted on the same file: every completed key replays its answer (a commit with
    synchronous=FULL survived), and every held key, whose outcome nobody knows, is
    parked when its lease runs out (the route's policy): none reaches the upstream
    twice."""
    database = tmp_path / "gateway.db"
    policy = {"upstream_timeout": "1s", "on_unknown_outcome": "park", "wait_timeout": "1s"}
    config, port = write_config(tmp_path, upstream, database, policy)
    gateway = gateway_process(config, port)
    gateway.args += ["--workers", "4"]
    gateway.popen["start_new_session"] = True  # its own process group: killed whole
    for_this_test(gateway)
    gateway.start()
    completed = [unique("sqk-done") for _ in range(10)]
    held = [unique("sqk-held") for _ in range(5)]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        answers = await asyncio.gather(
            *(
                client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
                for key in completed
                for _ in range(5)
            )
        )
        assert {answer.status_code for answer in answers} == {200}
        bodies = {key: answers[i * 5].content for i, key in enumerate(completed)}
        holding = [
            asyncio.create_task(
                client.post(
                    PATH, params={"hold": "1"}, content=b"{}", headers={"Idempotency-Key": key}
                )
            )
            for key in held
        ]
        deadline = time.monotonic() + 15
        while not all([await upstream_count(upstream, key) for key in held]):
            assert time.monotonic() < deadline, "the held keys never reached the upstream"
            await asyncio.sleep(0.1)
        assert gateway.proc is not None
        os.killpg(gateway.proc.pid, signal.SIGKILL)
        gateway.proc.wait(10)
        await asyncio.gather(*holding, return_exceptions=True)
    async with httpx.AsyncClient() as client:  # the upstream lets the held ones go
        for key in held:
            await client.post(f"{upstream.url}/_release", json={"key": key})

    restarted = gateway_process(config, port)
    restarted.args += ["--workers", "4"]
    for_this_test(restarted)
    restarted.start()
    async with httpx.AsyncClient(base_url=restarted.url, timeout=30) as client:
        for key in completed:
            again = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
            assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
            assert again.content == bodies[key]
        store = SqliteStore(StoreConfig(url=f"sqlite://{database}"))
        await store.start()
        try:
            deadline = time.monotonic() + 30
            for key in held:
                ref = KeyRef(record_digest("send-reminder", "", key), "send-reminder", key)
                record = await store.get(ref)
                while record is None or record.state is not State.PARKED:
                    assert time.monotonic() < deadline, f"{key} never parked: {record}"
                    await asyncio.sleep(0.2)
                    record = await store.get(ref)
                repeat = await client.post(
                    PATH, params={"hold": "1"}, content=b"{}", headers={"Idempotency-Key": key}
                )
                # A parked key is a person's now: refused, never run again.
                assert repeat.status_code == 409, repeat.text
                assert repeat.headers["content-type"] == "application/problem+json"
        finally:
            await store.close()
    runs = {key: await upstream_count(upstream, key) for key in completed + held}
    ledger.record(
        "sqlite",
        "test_sigkill_of_every_worker_loses_nothing_and_runs_nothing_twice",
        requests=len(answers) + len(held),
        faults=1,
        upstream_duplicates=sum(n - 1 for n in runs.values() if n > 1),
        records_lost=0,
        detail="4 workers SIGKILLed together, 10 completed and 5 held keys, restarted",
    )
    assert runs == dict.fromkeys(completed + held, 1), runs


async def test_no_store_url_is_a_sqlite_file_beside_the_config_that_survives_sigkill(
    tmp_path: Path, upstream: Process
) -> None:
    """A config with no store section, in a fresh directory, started from another
    working directory: `run` creates idempotency-gateway.db beside the config and says
    so with the path; a key completed before a SIGKILL replays after the restart,
    and the upstream ran it once."""
    fresh = tmp_path / "fresh dir"
    fresh.mkdir()
    config, port = write_config(fresh, upstream, tmp_path / "unused.db")
    written = yaml.safe_load(config.read_text())
    del written["store"]
    config.write_text(yaml.safe_dump(written))
    database = fresh / "idempotency-gateway.db"
    gateway = gateway_process(config, port)
    for_this_test(gateway)
    gateway.start()
    gateway.wait_for_output(f"store sqlite at {database} (the default: no store.url)")
    assert database.is_file() and not (ROOT / "idempotency-gateway.db").exists()
    key = unique("sq-default")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        first = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
    assert first.status_code == 200, first.text
    gateway.kill()
    restarted = gateway_process(config, port)
    for_this_test(restarted)
    restarted.start()
    async with httpx.AsyncClient(base_url=restarted.url, timeout=30) as client:
        again = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert await upstream_count(upstream, key) == 1


async def test_memory_says_at_start_that_it_keeps_nothing(
    tmp_path: Path, upstream: Process
) -> None:
    """memory:// says so at start, and means it: a completed key runs again after a
    restart."""
    config, port = write_config(tmp_path, upstream, tmp_path / "unused.db")
    written = yaml.safe_load(config.read_text())
    written["store"] = {"url": "memory://"}
    config.write_text(yaml.safe_dump(written))
    key = unique("mem-forgets")
    for _ in range(2):
        gateway = gateway_process(config, port)
        for_this_test(gateway)
        gateway.start()
        gateway.wait_for_output("store memory (it keeps nothing: a restart forgets every key")
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            answer = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
        assert answer.status_code == 200 and "idempotent-replayed" not in answer.headers
        gateway.kill()
    assert await upstream_count(upstream, key) == 2
    assert not list(tmp_path.glob("*.db"))


def refused_start(config: Path) -> str:
    """What `run` says when it refuses to start (it must exit, not serve)."""
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def test_a_file_the_gateway_cannot_use_stops_the_start(tmp_path: Path, upstream: Process) -> None:
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(b"this is not a database" * 300)
    said = refused_start(write_config(tmp_path, upstream, damaged)[0])
    assert str(damaged) in said and "restore it from a backup" in said

    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    said = refused_start(write_config(tmp_path, upstream, foreign)[0])
    assert str(foreign) in said and "not an Idempotency Gateway database" in said

    newer = tmp_path / "newer.db"
    config = write_config(tmp_path, upstream, newer)[0]
    migrated = subprocess.run(
        [sys.executable, "-m", "gateway", "store", "migrate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert migrated.returncode == 0, migrated.stderr
    with sqlite3.connect(newer) as conn:
        conn.execute("PRAGMA user_version = 999")
    said = refused_start(config)
    assert str(newer) in said and "written by a newer gateway" in said


def test_a_file_locked_past_the_deadline_stops_the_start(tmp_path: Path, upstream: Process) -> None:
    """Another program holding the file's write lock (a backup, a sqlite3 shell in a
    transaction) for longer than connect_timeout: `run` says which file and what to do,
    and does not hang."""
    database = tmp_path / "held.db"
    config = write_config(tmp_path, upstream, database, connect_timeout="1s")[0]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(60)",
            str(database),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        said = refused_start(config)
        assert time.monotonic() - started < 20
        assert str(database) in said and "locked by another process" in said
    finally:
        holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()


def test_a_default_file_that_cannot_be_opened_names_store_url(
    tmp_path: Path, upstream: Process
) -> None:
    """With no store.url and a default path that cannot be a file (here a directory
    holds the name; elsewhere a read-only config directory), the start stops naming
    the path and the setting that moves it."""
    config, _ = write_config(tmp_path, upstream, tmp_path / "unused.db")
    written = yaml.safe_load(config.read_text())
    del written["store"]
    config.write_text(yaml.safe_dump(written))
    (tmp_path / "idempotency-gateway.db").mkdir()
    said = refused_start(config)
    assert str(tmp_path / "idempotency-gateway.db") in said
    assert "it is the default store (no store.url): set store.url" in said


@pytest.mark.slow
async def test_a_file_locked_while_running_is_a_503_then_service_resumes(
    tmp_path: Path, upstream: Process
) -> None:
    """Another program takes the file's write lock while the gateway runs (a backup, a
    sqlite3 shell left in a transaction): past store.socket_timeout a new key is
    answered 503 problem+json and never forwarded; once the lock is let go the same
    key runs once, and a key completed before the lock still replays."""
    database = tmp_path / "gateway.db"
    config, port = write_config(tmp_path, upstream, database, socket_timeout="1s")
    gateway = gateway_process(config, port)
    for_this_test(gateway)
    gateway.start()
    done, held = unique("sq-before-lock"), unique("sq-during-lock")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        first = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": done})
        assert first.status_code == 200, first.text
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sqlite3, sys\n"
                "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True)\n"
                "sys.stdin.readline()",
                str(database),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            refused = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": held})
            assert refused.status_code == 503, refused.text
            assert refused.headers["content-type"] == "application/problem+json"
            assert "locked" not in refused.text.lower()  # the driver's words stay in the log
        finally:
            assert holder.stdin is not None
            holder.stdin.close()  # the holder's readline ends: it exits, letting go
            holder.wait(10)
            if holder.stdout is not None:
                holder.stdout.close()
        assert await upstream_count(upstream, held) == 0
        ran = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": held})
        assert ran.status_code == 200, ran.text
        again = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": done})
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert await upstream_count(upstream, held) == 1
    assert await upstream_count(upstream, done) == 1


def children_of(pid: int) -> list[int]:
    """The processes `pid` started (Linux's /proc), e.g. a supervisor's workers."""
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in found]


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited, its parent not told yet


@pytest.mark.slow
async def test_workers_stop_when_their_supervisor_is_killed(
    tmp_path: Path, upstream: Process
) -> None:
    """`run --workers 2` whose supervisor is SIGKILLed (and nothing else): its workers
    notice and stop, as on SIGTERM, instead of answering on the shared listener with
    nobody to restart or stop them."""
    database = tmp_path / "gateway.db"
    config, port = write_config(tmp_path, upstream, database)
    gateway = gateway_process(config, port)
    gateway.args += ["--workers", "2"]
    for_this_test(gateway)
    gateway.start()
    assert gateway.proc is not None
    deadline = time.monotonic() + 30
    while len(workers := children_of(gateway.proc.pid)) < 2:
        assert time.monotonic() < deadline, "the workers never started"
        await asyncio.sleep(0.1)
    key = unique("sq-orphan")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        answer = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
    assert answer.status_code == 200, answer.text
    os.kill(gateway.proc.pid, signal.SIGKILL)  # the supervisor alone
    gateway.proc.wait(10)
    deadline = time.monotonic() + 30
    try:
        while any(alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"orphaned workers still running: {workers}"
            await asyncio.sleep(0.2)
    finally:
        for pid in workers:  # this test's own processes, if the assertion above failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
