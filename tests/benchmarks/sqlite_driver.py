"""How the SQLite store reaches its file without blocking the event loop: a connection
in a thread of the store's own (gateway/store/sqlite/database.py, with and without
group commit) or aiosqlite, measured side by side on the gateway's request path.

    .venv/bin/python tests/benchmarks/sqlite_driver.py [--tasks 32] [--requests 3000] [--rounds 3]

Each contender gets a fresh file in a temp dir (WAL, synchronous=FULL unless
--synchronous normal) with a records table shaped like the store's, and is driven from
one asyncio (uvloop) process by `--tasks` concurrent tasks. A first request is two
transactions, as on the gateway:

  claim     INSERT ... ON CONFLICT DO NOTHING, then the row read back (a new key)
  complete  UPDATE ... SET state = 'completed', response = ... WHERE run_id = ...

and a replay is the claim on a completed key (the insert does nothing, the read finds
it). The contenders:

  thread+group  the store's Database: one thread, every waiting operation in one
                transaction, one commit (one fsync) per batch
  thread        the same thread, one operation per transaction (max_batch 1)
  aiosqlite     one aiosqlite connection; each operation its own transaction
                (BEGIN IMMEDIATE ... COMMIT, awaited step by step under a lock, since
                one connection has one transaction at a time)

Rounds alternate the contenders, so each sees the same machine; the table prints the
median of the rounds, this process's CPU per request and the commits per first
request (1 / the group commit's batch), and the ratios to aiosqlite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import aiosqlite  # noqa: E402
import uvloop  # noqa: E402

from gateway.store.sqlite.database import MAX_BATCH, Database  # noqa: E402

SCHEMA = """
CREATE TABLE IF NOT EXISTS bench (
    digest TEXT PRIMARY KEY, route TEXT NOT NULL, state TEXT NOT NULL,
    run_id TEXT NOT NULL, created_ms INTEGER NOT NULL, lease_until_ms INTEGER NOT NULL,
    history TEXT NOT NULL DEFAULT '[]', response BLOB
) WITHOUT ROWID
"""
CLAIM = (
    "INSERT INTO bench (digest, route, state, run_id, created_ms, lease_until_ms)"
    " VALUES (?, 'r', 'in_flight', ?, ?, ?) ON CONFLICT (digest) DO NOTHING"
)
READ = "SELECT state, run_id, created_ms, response FROM bench WHERE digest = ?"
COMPLETE = (
    "UPDATE bench SET state = 'completed', response = ? WHERE digest = ? AND run_id = ?"
    " AND state = 'in_flight'"
)
RESPONSE = b'{"status":201,"headers":[["content-type","application/json"]],"body":"ok"}'


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def setup(synchronous: str) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute(SCHEMA)

    return run


class Contender:
    name = ""
    commits = 0

    async def open(self, path: Path, synchronous: str) -> None: ...
    async def close(self) -> None: ...
    async def claim(self, digest: str, run: str) -> Any: ...
    async def complete(self, digest: str, run: str) -> Any: ...


class Thread(Contender):
    def __init__(self, max_batch: int) -> None:
        self.name = "thread+group" if max_batch > 1 else "thread"
        self.max_batch = max_batch

    async def open(self, path: Path, synchronous: str) -> None:
        self.db = Database(path, timeout=5.0, setup=setup(synchronous), max_batch=self.max_batch)
        await self.db.open()

    async def close(self) -> None:
        self.commits = self.db.commits
        await self.db.close()

    async def claim(self, digest: str, run: str) -> Any:
        def op(conn: sqlite3.Connection) -> Any:
            now = now_ms()
            conn.execute(CLAIM, (digest, run, now, now + 30000))
            return conn.execute(READ, (digest,)).fetchone()

        return await self.db.run(op, "claim")

    async def complete(self, digest: str, run: str) -> Any:
        def op(conn: sqlite3.Connection) -> int:
            return conn.execute(COMPLETE, (RESPONSE, digest, run)).rowcount

        return await self.db.run(op, "complete")


class Aio(Contender):
    name = "aiosqlite"

    async def open(self, path: Path, synchronous: str) -> None:
        self.conn = await aiosqlite.connect(path, isolation_level=None, timeout=5.0)
        await self.conn.execute("PRAGMA journal_mode = WAL")
        await self.conn.execute(f"PRAGMA synchronous = {synchronous}")
        await self.conn.execute(SCHEMA)
        self.lock = asyncio.Lock()

    async def close(self) -> None:
        await self.conn.close()

    async def claim(self, digest: str, run: str) -> Any:
        async with self.lock:
            await self.conn.execute("BEGIN IMMEDIATE")
            now = now_ms()
            await self.conn.execute(CLAIM, (digest, run, now, now + 30000))
            async with self.conn.execute(READ, (digest,)) as cursor:
                row = await cursor.fetchone()
            await self.conn.execute("COMMIT")
            self.commits += 1
            return row

    async def complete(self, digest: str, run: str) -> Any:
        async with self.lock:
            await self.conn.execute("BEGIN IMMEDIATE")
            cursor = await self.conn.execute(COMPLETE, (RESPONSE, digest, run))
            await self.conn.execute("COMMIT")
            self.commits += 1
            return cursor.rowcount


async def drive(call: Callable[[int], Awaitable[None]], requests: int, tasks: int) -> float:
    """Requests per second of `call(i)` for i in range(requests) over `tasks` tasks."""
    counter = iter(range(requests))

    async def worker() -> None:
        for i in counter:
            await call(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return requests / (time.perf_counter() - started)


async def measure(
    contender: Contender, folder: Path, synchronous: str, requests: int, tasks: int
) -> dict[str, float]:
    path = folder / f"{contender.name}-{secrets.token_hex(4)}.db"
    await contender.open(path, synchronous)
    digests = [secrets.token_hex(16) for _ in range(requests)]

    async def first(i: int) -> None:
        await contender.claim(digests[i], f"run-{i}")
        await contender.complete(digests[i], f"run-{i}")

    async def replay(i: int) -> None:
        await contender.claim(digests[i], "replay")

    cpu = time.process_time()
    firsts = await drive(first, requests, tasks)
    first_cpu = (time.process_time() - cpu) / requests
    first_commits = contender.db.commits if isinstance(contender, Thread) else contender.commits
    cpu = time.process_time()
    replays = await drive(replay, requests, tasks)
    replay_cpu = (time.process_time() - cpu) / requests
    await contender.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return {
        "first/s": firsts,
        "replay/s": replays,
        "first cpu ms": first_cpu * 1000,
        "replay cpu ms": replay_cpu * 1000,
        "commits/first": first_commits / requests,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="sqlite-bench-", dir=os.environ.get("BENCH_DIR")) as d:
        for _ in range(args.rounds):
            for contender in (Thread(MAX_BATCH), Thread(1), Aio()):
                found = await measure(
                    contender, Path(d), args.synchronous, args.requests, args.tasks
                )
                results.setdefault(contender.name, []).append(found)
    columns = list(next(iter(results.values()))[0])
    medians = {
        name: {column: statistics.median(r[column] for r in runs) for column in columns}
        for name, runs in results.items()
    }
    print(
        f"synchronous={args.synchronous}, {args.tasks} tasks, {args.requests} requests, "
        f"median of {args.rounds} rounds"
    )
    print(f"{'':14}" + "".join(f"{column:>15}" for column in columns))
    for name, row in medians.items():
        print(f"{name:14}" + "".join(f"{row[column]:>15.3f}" for column in columns))
    base = medians["aiosqlite"]
    print("ratios to aiosqlite (throughput: higher is better; cpu, commits: lower is better)")
    for name, row in medians.items():
        if name != "aiosqlite":
            print(
                f"{name:14}"
                + "".join(f"{row[column] / base[column]:>14.2f}x" for column in columns)
            )


if __name__ == "__main__":
    uvloop.run(main())
