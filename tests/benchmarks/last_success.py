"""The store's own CPU per completion, of two source trees side by side (what the
last success, written by every completion, costs).

    .venv/bin/python tests/benchmarks/last_success.py [N] [ROUNDS] SRC [SRC...]
    # e.g. SRC=/path/to/a/worktree/of/main and . (this tree)

One redis-server (`--save "" --appendonly no`) and one PostgreSQL (tests/support/
postgres.py: fsync and synchronous_commit on) of its own. Each round runs, for each
tree in turn (the order alternating), a child process with that tree on its path: a
store of a fresh prefix (and, on PostgreSQL, a fresh database that tree's `store
migrate` made), N claims, then N completions with a 200, one at a time on one
connection (PostgreSQL: the pool's max_connections 1; Redis: the store's own script
connection). The figures are the store's CPU over the
completions alone: redis-server's EVALSHA time from INFO commandstats (usec per call)
and its process CPU (/proc); the CPU of the postmaster and all its processes (/proc:
the WAL writer, the checkpointer and autovacuum too) and of the one backend alone
(the statement and its commit). CPU time, not
wall time: the machine's load moves it less. The last lines are each tree's figure
relative to the first SRC's, per store (the median of the rounds).
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from tests.support.postgres import PostgresServer  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")

CHILD = r"""
import asyncio, json, os, secrets, sys, time
from gateway.config import StoreConfig
from gateway.records import KeyRef, StoredResponse
kind, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
pids = [int(p) for p in sys.argv[4].split(",")]
TICK = os.sysconf("SC_CLK_TCK")

def cpu(pids):
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICK

def children(postmaster):
    found = [postmaster]
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                found.append(int(name))
    return found

async def main():
    prefix = "b" + secrets.token_hex(4) + ":"
    one = {"max_connections": 1} if kind == "postgres" else {}  # Redis: the script connection
    config = StoreConfig(url=url, prefix=prefix, socket_timeout=10, **one)
    if kind == "redis":
        from gateway.store.redis import RedisStore
        store = RedisStore(config)
    else:
        from gateway.store.postgres import PostgresStore
        from gateway.store.postgres.schema import migrate_store
        status, said = await migrate_store(config)
        assert status == 0, said
        store = PostgresStore(config)
    await store.start()
    response = StoredResponse(200, (("content-type", "application/json"),), b'{"ok":true}')
    refs = [KeyRef(secrets.token_hex(16), "bench", str(i)) for i in range(n)]
    for ref in refs:
        assert await store.claim(ref, "run", "", 60.0) is None
    async def evalsha():
        if kind != "redis":
            return 0, 0
        stats = await store.client.info("commandstats")
        found = stats.get("cmdstat_evalsha", {})
        return found.get("calls", 0), found.get("usec", 0)
    watched = pids if kind == "redis" else children(pids[0])
    backend = []
    if kind == "postgres":  # the one connection's own process: the statement and its commit
        backend = [await store.db.call(lambda c: c.fetchval("SELECT pg_backend_pid()"), "pid")]
    calls, usec = await evalsha()
    before, before_backend = cpu(watched), cpu(backend)
    for ref in refs:
        assert await store.complete(ref, "run", response, 3600.0)
    spent, spent_backend = cpu(watched) - before, cpu(backend) - before_backend
    calls2, usec2 = await evalsha()
    await store.close()
    script = (usec2 - usec) / max(1, calls2 - calls) if kind == "redis" else None
    print(json.dumps({"cpu_us": spent * 1e6 / n, "backend_us": spent_backend * 1e6 / n,
                      "script_us": script}))

asyncio.run(main())
"""


def run(src: str, kind: str, url: str, n: int, pids: list[int]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, url, str(n), ",".join(map(str, pids))],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"{kind} on {src} failed:\n{out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    srcs = [str(Path(s).resolve()) for s in sys.argv[3:]] or [str(REPO)]
    redis = RedisServer()
    redis.start()
    postgres = PostgresServer()
    postgres.start()
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        assert redis.proc is not None and postgres.proc is not None
        for r in range(rounds):
            order = srcs if r % 2 == 0 else srcs[::-1]
            for src in order:
                database = "bench_" + secrets.token_hex(4)
                postgres.sql(f"CREATE DATABASE {database}")
                for kind, url, pids in (
                    ("redis", redis.url, [redis.proc.pid]),
                    ("postgres", postgres.dsn(database), [postgres.proc.pid]),
                ):
                    got = run(src, kind, url, n, pids)
                    results.setdefault((src, kind), []).append(got)
                    print(f"round {r} {kind:8} {src}: {got}", flush=True)
    finally:
        redis.stop()
        postgres.stop()
        postgres.remove()
    print(f"\nmedians over {rounds} rounds of {n} completions, store CPU us per completion:")
    for kind in ("redis", "postgres"):
        base = statistics.median(g["cpu_us"] for g in results[(srcs[0], kind)])
        for src in srcs:
            cpu = statistics.median(g["cpu_us"] for g in results[(src, kind)])
            line = f"{kind:8} {src}: process CPU {cpu:.1f} ({cpu / base:.3f}x)"
            field, label = (
                ("script_us", "EVALSHA") if kind == "redis" else ("backend_us", "backend")
            )
            own = statistics.median(g[field] for g in results[(src, kind)])
            first = statistics.median(g[field] for g in results[(srcs[0], kind)])
            line += f", {label} {own:.2f} us ({own / first:.3f}x)"
            print(line)


if __name__ == "__main__":
    main()
