"""Which PostgreSQL driver the store uses: psycopg 3 (with psycopg_pool) or asyncpg,
measured side by side on the gateway's first-request path.

    .venv/bin/python tests/benchmarks/pg_driver.py [--tasks 32] [--requests 3000] [--rounds 5]

Starts a PostgreSQL of its own (initdb into a temp dir, a free port, fsync and
synchronous_commit on, as the store is meant to run), makes a records table shaped
like the store's, and drives it from one asyncio (uvloop) process with `--tasks`
concurrent tasks through a pool of `--pool` connections per driver. A first request is
two statements, each its own transaction, as on the gateway:

  claim     INSERT ... ON CONFLICT (prefix, digest) DO UPDATE ... WHERE state = 'released'
            RETURNING ...   (a new key: inserted, in flight)
  complete  UPDATE ... SET state = 'completed', response = ... WHERE ... AND run_id = ...
            AND state IN ('in_flight', 'unresolved') RETURNING waiting

and a replay is the claim statement on a completed key (its read path, the CTE's
second branch). Rounds alternate the drivers (ABAB...), so both see the same machine;
the table prints the median of the rounds, this process's CPU per request (the
gateway's cost: on 2 cores it is what competes with the upstream and the server) and
the server's (the postmaster's and its backends', from /proc), and the ratios asyncpg / psycopg.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
import psycopg  # noqa: E402
import uvloop  # noqa: E402
from psycopg_pool import AsyncConnectionPool  # noqa: E402

from tests.support.postgres import PostgresServer  # noqa: E402

SCHEMA = """
CREATE TABLE bench_records (
    prefix text NOT NULL,
    digest text NOT NULL,
    route text NOT NULL,
    key text NOT NULL,
    state text NOT NULL,
    run_id text NOT NULL,
    fingerprint text NOT NULL,
    created_ms bigint NOT NULL,
    since_ms bigint NOT NULL,
    lease_until_ms bigint NOT NULL DEFAULT 0,
    expires_ms bigint,
    response bytea,
    history jsonb NOT NULL DEFAULT '[]',
    waiting boolean NOT NULL DEFAULT false,
    PRIMARY KEY (prefix, digest)
);
CREATE INDEX bench_open ON bench_records (prefix, state, since_ms)
    WHERE state IN ('in_flight', 'unresolved', 'parked', 'claimed');
"""

NOW = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

CLAIM = f"""
WITH t AS (SELECT {NOW} AS now),
ins AS (
    INSERT INTO bench_records AS r (prefix, digest, route, key, state, run_id, fingerprint,
                                    created_ms, since_ms, lease_until_ms)
    SELECT $1, $2, $3, $4, 'in_flight', $5, $6, t.now, t.now, t.now + $7 FROM t
    ON CONFLICT (prefix, digest) DO UPDATE SET
        state = 'in_flight', run_id = excluded.run_id, fingerprint = excluded.fingerprint,
        created_ms = excluded.created_ms, since_ms = excluded.since_ms,
        lease_until_ms = excluded.lease_until_ms, response = NULL, expires_ms = NULL
    WHERE r.state = 'released' OR r.expires_ms <= excluded.created_ms
    RETURNING r.state, r.run_id, r.fingerprint, r.created_ms, r.response
)
SELECT true, t.now, ins.* FROM ins, t
UNION ALL
SELECT false, t.now, r.state, r.run_id, r.fingerprint, r.created_ms, r.response
FROM bench_records r, t
WHERE r.prefix = $1 AND r.digest = $2 AND NOT EXISTS (SELECT 1 FROM ins)
"""

COMPLETE = f"""
UPDATE bench_records SET state = 'completed', response = $3, since_ms = {NOW},
    expires_ms = {NOW} + $5, lease_until_ms = 0
WHERE prefix = $1 AND digest = $2 AND run_id = $4 AND state IN ('in_flight', 'unresolved')
RETURNING waiting
"""

RESPONSE = b'[200,[["content-type","application/json"]],0,"upstream"]\n{"ok":true}'


def psycopg_sql(sql: str) -> tuple[str, list[int]]:
    """The same statement with %s placeholders, and which $n each one takes."""
    order = [int(n) for n in re.findall(r"\$(\d+)", sql)]
    return re.sub(r"\$\d+", "%s", sql), order


class Driver:
    name = ""

    async def open(self, url: str, size: int) -> None: ...
    async def close(self) -> None: ...
    async def run(self, sql: str, args: tuple[Any, ...]) -> Any: ...


class Psycopg(Driver):
    name = "psycopg"

    async def open(self, url: str, size: int) -> None:
        self.pool = AsyncConnectionPool(
            url, min_size=size, max_size=size, kwargs={"autocommit": True}, open=False
        )
        await self.pool.open(wait=True)
        self.sql: dict[str, tuple[str, list[int]]] = {}

    async def close(self) -> None:
        await self.pool.close()

    async def run(self, sql: str, args: tuple[Any, ...]) -> Any:
        text, order = self.sql.get(sql) or self.sql.setdefault(sql, psycopg_sql(sql))
        async with self.pool.connection() as conn:
            cursor = await conn.execute(text, [args[n - 1] for n in order], prepare=True)
            return await cursor.fetchone()


class Asyncpg(Driver):
    name = "asyncpg"

    async def open(self, url: str, size: int) -> None:
        self.pool = await asyncpg.create_pool(url, min_size=size, max_size=size)

    async def close(self) -> None:
        await self.pool.close()

    async def run(self, sql: str, args: tuple[Any, ...]) -> Any:
        async with self.pool.acquire() as conn:
            return await conn.fetchrow(sql, *args)


async def first_request(driver: Driver, prefix: str) -> None:
    digest, run = secrets.token_hex(16), secrets.token_hex(8)
    claimed = await driver.run(CLAIM, (prefix, digest, "r", "k", run, "fp", 30000))
    assert claimed[0] is True
    done = await driver.run(COMPLETE, (prefix, digest, RESPONSE, run, 86400000))
    assert done is not None


async def replay(driver: Driver, prefix: str, digests: list[str], i: int) -> None:
    found = await driver.run(CLAIM, (prefix, digests[i % len(digests)], "r", "k", "x", "fp", 30000))
    assert found[0] is False and found[2] == "completed"


async def drive(call: Callable[[int], Awaitable[None]], requests: int, tasks: int) -> float:
    counter = iter(range(requests))

    async def worker() -> None:
        for i in counter:
            await call(i)

    await asyncio.gather(*(worker() for _ in range(tasks)))
    return 0.0


def server_cpu(server: PostgresServer) -> float:
    """CPU seconds of the postmaster and its processes (the backends: a pool's stay)."""
    assert server.proc is not None
    total = 0
    for pid in [server.proc.pid, *server.children()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


async def measure(
    driver: Driver, kind: str, requests: int, tasks: int, digests: list[str], server: PostgresServer
) -> tuple[float, float, float]:
    prefix = secrets.token_hex(4)
    if kind == "first":
        call: Callable[[int], Awaitable[None]] = lambda i: first_request(driver, prefix)  # noqa: E731
    else:
        call = lambda i: replay(driver, "replays", digests, i)  # noqa: E731
    await drive(call, min(200, requests), tasks)  # warm the prepared statements
    cpu, wall, db = time.process_time(), time.perf_counter(), server_cpu(server)
    await drive(call, requests, tasks)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    db = server_cpu(server) - db
    return requests / wall, cpu / requests * 1e6, db / requests * 1e6


async def main(args: argparse.Namespace) -> None:
    server = PostgresServer()
    server.start()
    try:
        server.sql(SCHEMA)
        drivers: list[Driver] = [Psycopg(), Asyncpg()]
        for driver in drivers:
            await driver.open(server.url, args.pool)
        digests = []
        for _ in range(500):  # completed keys for the replay rows
            digest, run = secrets.token_hex(16), secrets.token_hex(8)
            await drivers[0].run(CLAIM, ("replays", digest, "r", "k", run, "fp", 30000))
            await drivers[0].run(COMPLETE, ("replays", digest, RESPONSE, run, 86400000))
            digests.append(digest)
        assert server.proc is not None
        results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for round_ in range(args.rounds):
            order = drivers if round_ % 2 == 0 else drivers[::-1]
            for kind in ("first", "replay"):
                for driver in order:
                    got = await measure(driver, kind, args.requests, args.tasks, digests, server)
                    results.setdefault((kind, driver.name), []).append(got)
        for driver in drivers:
            await driver.close()
    finally:
        server.stop()
        server.remove()
    print(
        f"PostgreSQL {psycopg.__version__=} {asyncpg.__version__=}; {args.tasks} tasks, "
        f"pool {args.pool}, {args.requests} requests x {args.rounds} rounds (median), "
        "synchronous_commit on"
    )
    print("| path | driver | requests/s | client CPU us/request | server CPU us/request |")
    print("|---|---|--:|--:|--:|")
    for (kind, name), rows in results.items():
        rate = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        server_us = statistics.median(r[2] for r in rows)
        print(f"| {kind} | {name} | {rate:,.0f} | {cpu:.0f} | {server_us:.0f} |")
    for kind in ("first", "replay"):
        pg, apg = results[(kind, "psycopg")], results[(kind, "asyncpg")]
        rate = statistics.median(r[0] for r in apg) / statistics.median(r[0] for r in pg)
        cpu = statistics.median(r[1] for r in apg) / statistics.median(r[1] for r in pg)
        print(f"{kind}: asyncpg / psycopg = {rate:.2f}x requests/s, {cpu:.2f}x CPU per request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--pool", type=int, default=10)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    uvloop.run(main(parser.parse_args()))
