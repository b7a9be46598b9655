"""`idempotency-gateway store copy` as a user runs it: the real CLI in a process of its
own, from a SQLite file a real gateway filled (and the store API beside it, for the
states a test cannot wait for) to a real PostgreSQL and a real redis-server, and back
from PostgreSQL to SQLite; then a gateway on the copy: a completed key replays its
stored response, a parked key (one an operator holds too) is still listed by the admin
API, and a queued delivery is delivered once. A destination that holds keys is refused.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.keying import record_digest
from gateway.records import KeyRef, StoredRequest, StoredResponse
from gateway.store import open_store
from gateway.store.base import NewDelivery, Store
from gateway.store.copy import tally
from tests.conftest import unique, upstream_count
from tests.support.postgres import PostgresServer
from tests.support.servers import (
    ROOT,
    Process,
    RedisServer,
    for_this_test,
    free_port,
    gateway_process,
)

pytestmark = [pytest.mark.anyio, pytest.mark.process]

TOKEN = "copy-test-operator-token-0123456789"
SYNC, ASYNC = "send-reminder", "deliver"
#: completed records besides the named ones: several export pages
BULK = 1200


def write_config(tmp_path: Path, upstream: Process, store: dict[str, Any]) -> tuple[Path, int, int]:
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {
            "listen": f"127.0.0.1:{admin_port}",
            "operators": [{"name": "alice", "role": "operator", "token_env": "COPY_TOKEN"}],
        },
        "store": store,
        "routes": [
            {
                "name": SYNC,
                "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
                "upstream": upstream.url,
                "key": {"header": "Idempotency-Key"},
                "response_ttl": "1h",
            },
            {
                "name": ASYNC,
                "match": {"methods": ["POST"], "path": "/jobs/deliver"},
                "upstream": upstream.url,
                "key": {"header": "Idempotency-Key"},
                "delivery": "async",
                "retry": {"attempts": 5, "backoff": "1h", "max_backoff": "1h"},
            },
        ],
    }
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port, admin_port


def start_gateway(config: Path, port: int) -> Process:
    gateway = gateway_process(config, port, env={**os.environ, "COPY_TOKEN": TOKEN})
    for_this_test(gateway)
    return gateway.start()


def run_copy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "store", "copy", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COPY_TOKEN": TOKEN},
    )


def ref(route: str, key: str) -> KeyRef:
    return KeyRef(record_digest(route, "", key), route, key)


async def fill(store: Store, tag: str) -> dict[str, KeyRef]:
    """Beside the completed key a gateway made: a record in every other state, an
    operator's hold on a parked key, a queued and a retrying delivery, and BULK
    completed records."""
    refs = {name: ref(SYNC, f"{tag}-{name}") for name in
            ("in_flight", "unresolved", "parked", "held", "released")}  # fmt: skip
    for name, r in refs.items():
        assert await store.claim(r, "run-1", "fp", 3600) is None
        if name != "in_flight":
            assert await store.mark_unresolved(r, "run-1", "timed out", park=name != "unresolved")
    assert (await store.operator_claim(refs["held"], "alice", False)).ok
    assert (await store.operator_claim(refs["released"], "alice", False)).ok
    assert (await store.operator_resolve(refs["released"], "alice", "retry", "", None, 3600)).ok
    for name in ("queued", "retrying"):
        key = f"{tag}-{name}"
        r = refs[name] = ref(ASYNC, key)
        body = b'{"job_key": "%s"}' % key.encode()
        request = StoredRequest(
            "POST", "/jobs/deliver", (("content-type", "application/json"),), body
        )
        accepted = await store.accept(NewDelivery(r, "run-a", "fp", request, "t" * 22))
        assert accepted.outcome == "queued"
    assert (await store.pick(ASYNC, refs["retrying"], "run-b", 30, 5, "x")).record is not None
    assert await store.retry_later(
        refs["retrying"], "run-b", 3600, {"result": "status", "status": 503}
    )
    response = StoredResponse(200, (("content-type", "text/plain"),), b"done")
    for start in range(0, BULK, 200):
        part = [ref(SYNC, f"{tag}-bulk-{i}") for i in range(start, min(BULK, start + 200))]
        assert all(
            c is None for c in await asyncio.gather(*(store.claim(r, "b", "fp", 60) for r in part))
        )
        assert all(await asyncio.gather(*(store.complete(r, "b", response, 3600) for r in part)))
    return refs


async def opened(config: StoreConfig) -> Store:
    store = open_store(config)
    await store.start()
    return store


async def source_on_sqlite(
    tmp_path: Path, upstream: Process, tag: str
) -> tuple[Path, dict[str, KeyRef], str]:
    """A SQLite file a real gateway completed a key in (its answer returned), then
    filled through the store API with the gateway stopped."""
    database = tmp_path / "source.db"
    config, port, _ = write_config(tmp_path, upstream, {"url": f"sqlite://{database}"})
    gateway = start_gateway(config, port)
    key = f"{tag}-completed"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        first = await client.post("/jobs/send-reminder", headers={"Idempotency-Key": key})
    assert first.status_code == 200, first.text
    gateway.stop()
    store = await opened(StoreConfig(url=f"sqlite://{database}"))
    try:
        refs = await fill(store, tag)
    finally:
        await store.close()
    refs["completed"] = ref(SYNC, key)
    return database, refs, first.text


async def check_gateway_on(
    tmp_path: Path,
    upstream: Process,
    store: dict[str, Any],
    refs: dict[str, KeyRef],
    answer: str,
    delivered: int = 0,
) -> None:
    """A gateway on the copy: the completed key replays, the parked and held keys are
    listed, and the queued delivery runs once (`delivered`: times it ran before)."""
    config, port, admin_port = write_config(tmp_path, upstream, store)
    gateway = start_gateway(config, port)
    completed = refs["completed"].key
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        replay = await client.post("/jobs/send-reminder", headers={"Idempotency-Key": completed})
    assert replay.status_code == 200
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.text == answer
    assert await upstream_count(upstream, completed) == 1
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}", timeout=30) as admin:
        listed = (
            await admin.get("/admin/keys?state=parked,claimed&limit=1000", headers=bearer)
        ).json()
    states = {row["key"]: row["state"] for row in listed["keys"]}
    assert states[refs["parked"].key] == "parked"
    assert states[refs["held"].key] == "claimed"
    queued = refs["queued"].key
    # Each copy holds the delivery: one delivered from an earlier copy counts already.
    for _ in range(100):
        if await upstream_count(upstream, queued) > delivered:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # a second delivery of it would have run by now
    assert await upstream_count(upstream, queued) == delivered + 1
    assert await upstream_count(upstream, refs["retrying"].key) == 0  # due in an hour
    gateway.stop()


async def expected_states(database: Path) -> dict[tuple[str, str], int]:
    store = await opened(StoreConfig(url=f"sqlite://{database}"))
    try:
        return dict(await tally(store))
    finally:
        await store.close()


@pytest.mark.postgres
@pytest.mark.slow
async def test_sqlite_to_postgresql_and_back(
    tmp_path: Path, upstream: Process, postgres_server: PostgresServer
) -> None:
    tag = unique("pg")
    database, refs, answer = await source_on_sqlite(tmp_path, upstream, tag)
    before = await expected_states(database)
    assert before[(SYNC, "completed")] == BULK + 1
    pg = {"url": postgres_server.url, "prefix": f"{tag}:"}
    config, _, _ = write_config(tmp_path, upstream, pg)
    done = run_copy("--from", f"sqlite://{database}", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert f"copied {BULK + 8} records" in done.stdout
    assert "the counts match" in done.stdout
    destination = await opened(StoreConfig(**pg))
    try:
        assert dict(await tally(destination)) == before
    finally:
        await destination.close()
    # Again into the same prefix: refused, nothing written.
    again = run_copy("--from", f"sqlite://{database}", "--config", str(config))
    assert again.returncode == 1
    assert "already holds records" in again.stderr and "empty store" in again.stderr
    # And back, from PostgreSQL to a new SQLite file, before any gateway ran on it.
    back = tmp_path / "back.db"
    returned = run_copy("--config", str(config), "--to", f"sqlite://{back}")
    assert returned.returncode == 0, returned.stderr
    assert await expected_states(back) == before
    await check_gateway_on(tmp_path, upstream, pg, refs, answer)
    await check_gateway_on(tmp_path, upstream, {"url": f"sqlite://{back}"}, refs, answer, 1)


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.long  # the PostgreSQL round trip stays default; the contract's covers Redis
async def test_sqlite_to_redis_and_back(tmp_path: Path, upstream: Process) -> None:
    tag = unique("rd")
    database, refs, answer = await source_on_sqlite(tmp_path, upstream, tag)
    before = await expected_states(database)
    server = for_this_test(RedisServer())
    server.start()
    url = server.url.replace("redis://", "redis://default:sekret-pw@")
    server_config = {"url": server.url, "prefix": f"{tag}:"}
    done = run_copy("--from", f"sqlite://{database}", "--to", server.url)
    assert done.returncode == 0, done.stderr
    assert "the counts match" in done.stdout
    # Into a store that holds keys now: refused, naming it without its password.
    again = run_copy("--from", f"sqlite://{database}", "--to", url)
    assert again.returncode == 1
    assert "already holds records" in again.stderr
    assert "sekret-pw" not in again.stdout + again.stderr
    # A prefix of its own is another, empty store.
    config, _, _ = write_config(tmp_path, upstream, server_config)
    prefixed = run_copy("--from", f"sqlite://{database}", "--config", str(config))
    assert prefixed.returncode == 0, prefixed.stderr
    destination = await opened(StoreConfig(**server_config))
    try:
        assert dict(await tally(destination)) == before
    finally:
        await destination.close()
    back = tmp_path / "back.db"
    returned = run_copy("--config", str(config), "--to", f"sqlite://{back}")
    assert returned.returncode == 0, returned.stderr
    assert await expected_states(back) == before
    await check_gateway_on(tmp_path, upstream, server_config, refs, answer)
    await check_gateway_on(tmp_path, upstream, {"url": f"sqlite://{back}"}, refs, answer, 1)
