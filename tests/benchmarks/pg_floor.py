"""What the PostgreSQL store's first request and replay cost the database, beside the
least any write or read can cost it: the floor under the store's throughput targets.

    .venv/bin/python tests/benchmarks/pg_floor.py [N] [ROUNDS]

One PostgreSQL of its own (tests/support/postgres.py: fsync and synchronous_commit on),
one session, N calls of each, one at a time; the figure is that backend's CPU per call
(/proc: user + system, so the commit's WAL flush is in it), which the machine's load
moves less than wall time. Rows:

- `SELECT 1`, a `SELECT` by primary key: the least a round trip costs the backend;
- an `INSERT` and an `UPDATE` of a one-index table, each its own committed
  transaction, and the `INSERT` with `synchronous_commit = off`: the least a write that
  must be on disk before the answer costs;
- the store's own claim (a first request's write), completion and a replay's claim
  (the same functions the gateway calls, `store migrate`'s schema).

A first request makes two committed writes (claim and completion: its two round
trips), so twice the one-index `INSERT`/`UPDATE` row is its floor on this machine.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gateway.config import StoreConfig  # noqa: E402
from gateway.records import KeyRef, StoredResponse  # noqa: E402
from gateway.store.postgres import PostgresStore  # noqa: E402
from gateway.store.postgres.schema import migrate_store  # noqa: E402
from tests.benchmarks._harness import cpu_seconds  # noqa: E402
from tests.support.postgres import PostgresServer  # noqa: E402

RESPONSE = StoredResponse(200, (("content-type", "application/json"),), b'{"ok":true}')


async def per_call(pid: int, n: int, call: Callable[[int], Awaitable[Any]]) -> float:
    before = cpu_seconds([pid])
    for i in range(n):
        await call(i)
    return (cpu_seconds([pid]) - before) * 1e6 / n


async def one_round(url: str, n: int) -> dict[str, float]:
    config = StoreConfig(url=url, prefix="f" + secrets.token_hex(4) + ":", max_connections=1)
    status, said = await migrate_store(config)
    assert status == 0, said
    store = PostgresStore(config)
    await store.start()
    try:
        db = store.db

        async def sql(query: str, *args: Any) -> Any:
            return await db.call(lambda conn: conn.execute(query, *args), "floor")

        pid = int(await db.call(lambda conn: conn.fetchval("SELECT pg_backend_pid()"), "pid"))
        table = "floor_" + secrets.token_hex(4)
        await sql(f"CREATE TABLE {table} (k text PRIMARY KEY, v text, n int)")
        keys = [secrets.token_hex(16) for _ in range(n)]
        refs = [KeyRef(secrets.token_hex(16), "bench", str(i)) for i in range(n)]
        found: dict[str, float] = {}
        found["SELECT 1"] = await per_call(pid, n, lambda i: sql("SELECT 1"))
        found["SELECT by key"] = await per_call(
            pid, n, lambda i: sql(f"SELECT * FROM {table} WHERE k = $1", keys[i])
        )
        found["INSERT, committed"] = await per_call(
            pid, n, lambda i: sql(f"INSERT INTO {table} VALUES ($1, 'x', 0)", keys[i])
        )
        found["UPDATE, committed"] = await per_call(
            pid, n, lambda i: sql(f"UPDATE {table} SET v = $2, n = 1 WHERE k = $1", keys[i], "y")
        )
        await sql("SET synchronous_commit = off")
        found["INSERT, synchronous_commit off"] = await per_call(
            pid, n, lambda i: sql(f"INSERT INTO {table} VALUES ($1, 'x', 0)", "o" + keys[i])
        )
        await sql("SET synchronous_commit = on")
        found["store: claim of a new key"] = await per_call(
            pid, n, lambda i: store.claim(refs[i], "run", "", 60.0)
        )
        found["store: completion"] = await per_call(
            pid, n, lambda i: store.complete(refs[i], "run", RESPONSE, 3600.0)
        )
        found["store: a replay's claim"] = await per_call(
            pid, n, lambda i: store.claim(refs[i], "run-2", "", 60.0)
        )
        await sql(f"DROP TABLE {table}")
        return found
    finally:
        await store.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    server = PostgresServer()
    server.start()
    try:
        runs = [asyncio.run(one_round(server.url, n)) for _ in range(rounds)]
    finally:
        server.stop()
        server.remove()
    print(f"backend CPU per call, us (median of {rounds} rounds of {n}; each round's in brackets)")
    for name in runs[0]:
        each = [r[name] for r in runs]
        print(f"  {name:34} {statistics.median(each):7.0f}   {[round(x) for x in each]}")
    floor = statistics.median(r["INSERT, committed"] + r["UPDATE, committed"] for r in runs)
    store = statistics.median(r["store: claim of a new key"] + r["store: completion"] for r in runs)
    print(f"  first request: the store's {store:.0f} us against a floor of {floor:.0f} us")


if __name__ == "__main__":
    main()
