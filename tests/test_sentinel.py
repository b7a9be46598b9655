"""Redis Sentinel: the master is killed under load; no key runs twice, requests during
the switch fail closed, and the gateway recovers by itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import State
from gateway.store.redis import RedisStore
from tests.conftest import unique, upstream_count
from tests.support.servers import Process, free_port, gateway_process
from tests.support.topologies import SentinelSetup, redis_cli

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.process,
    pytest.mark.redis,
    pytest.mark.sentinel,
    pytest.mark.slow,
]


@pytest.fixture
def sentinel() -> Iterator[SentinelSetup]:
    setup = SentinelSetup().start()
    yield setup
    setup.stop()


@pytest.mark.timeout(150)  # a failover, then leases of keys caught in it must run out
@pytest.mark.long
async def test_master_killed_mid_load(
    tmp_path: Path, upstream: Process, sentinel: SentinelSetup
) -> None:
    port = free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}"},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {
            "sentinel": {"master": sentinel.master_name, "nodes": sentinel.nodes},
            "socket_timeout": "300ms",
            "connect_timeout": "300ms",
            # A claim is confirmed by the replica before the request is sent, so a
            # failover cannot lose it (async replication would) and run a key twice.
            "wait_for_replicas": 1,
        },
        "routes": [
            {
                "name": "charge",
                "match": {"methods": ["POST"], "path": "/jobs/charge"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "upstream_timeout": "5s",
            }
        ],
    }
    path = tmp_path / "sentinel.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = gateway_process(path, port).start()
    assert gateway.proc is not None
    pid = gateway.proc.pid
    keys: list[str] = []
    statuses: list[tuple[float, int, str, str]] = []
    stop = asyncio.Event()

    async def load(client: httpx.AsyncClient) -> None:
        # Each key is sent, then repeated: a repeat after the failover must replay,
        # be refused (503/409), but never run the job a second time.
        while not stop.is_set():
            key = unique("sentinel")
            keys.append(key)
            for _ in range(2):
                response = await client.post("/jobs/charge", json={"job_key": key})
                statuses.append(
                    (
                        time.monotonic(),
                        response.status_code,
                        response.headers.get("retry-after", ""),
                        key,
                    )
                )
            await asyncio.sleep(0.02)

    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            workers = [asyncio.create_task(load(client)) for _ in range(4)]
            await asyncio.sleep(1.0)
            old_master = sentinel.current_master_port()
            killed_at = time.monotonic()
            sentinel.master.kill()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and sentinel.current_master_port() == old_master:
                await asyncio.sleep(0.2)
            assert sentinel.current_master_port() != old_master, "no failover happened"
            # The old master comes back as the new master's replica: claims can be
            # confirmed again (wait_for_replicas: 1). Not as an empty master: see
            # restart_as_replica.
            sentinel.restart_as_replica(sentinel.master)
            recovered = None
            while time.monotonic() < deadline:
                fresh = [s for s in statuses[-8:] if s[0] > killed_at]
                if len(fresh) == 8 and all(code == 200 for _, code, _, _ in fresh):
                    recovered = statuses[-1][0]
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # a little load on the new master
            stop.set()
            await asyncio.gather(*workers)
            # Repeat every key once more, now that things are calm.
            for key in keys:
                response = await client.post("/jobs/charge", json={"job_key": key})
                assert response.status_code in (200, 409), response.text
    finally:
        gateway.stop()
    assert recovered is not None, "the gateway did not recover after the failover"
    assert gateway.proc.pid == pid  # no restart
    during = [s for s in statuses if s[0] > killed_at and s[0] < recovered]
    # The switch itself answers 503. A key whose completion could not be stored while
    # the master was down stays in flight, its lease turns it unresolved, and its
    # repeats get 409: also an explicit answer, never a second run.
    refused = [s for s in during if s[1] != 200]
    assert any(code == 503 for _, code, _, _ in refused), refused[:5]
    assert all(code in (503, 409) and retry for _, code, retry, _ in refused), [
        s for s in refused if s[1] not in (503, 409) or not s[2]
    ][:5]
    assert {code for _, code, _, _ in statuses} <= {200, 409, 503}
    for key in keys:
        if await upstream_count(upstream, key) > 1:
            raise AssertionError(duplicate_report(key, statuses, gateway, sentinel))
    assert len(keys) > 20


def duplicate_report(
    key: str, statuses: list[tuple[float, int, str, str]], gateway: Process, sentinel: SentinelSetup
) -> str:
    """What a duplicate's key saw, for the CI log: its answers, the gateway's lines
    about it, and every master switch the sentinels made."""
    answers = [(round(at, 3), code) for at, code, _, k in statuses if k == key]
    lines = [line for line in gateway.output().splitlines() if key in line]
    switches = sorted(
        {
            line.split(" # ", 1)[-1]
            for s in sentinel.sentinels
            for line in s.output().splitlines()
            if "switch-master" in line or "+promoted" in line or "+failover-end" in line
        }
    )
    return f"{key} ran twice; answers {answers}; gateway: {lines[:20]}; sentinels: {switches}"


@pytest.mark.timeout(90)
async def test_the_operator_roster_survives_a_failover(sentinel: SentinelSetup) -> None:
    """The roster (store/operator_roster.py) on Sentinel: after the master is killed,
    the new master gives the times the old one gave, and an operator removed before the
    failover and added again after it gets a time later than before."""
    store = RedisStore(
        StoreConfig(
            sentinel_master=sentinel.master_name,
            sentinel_nodes=tuple(("127.0.0.1", s.port) for s in sentinel.sentinels),
            prefix=unique("roster") + ":",
            socket_timeout=0.5,
            connect_timeout=0.5,
        )
    )
    try:
        first = await store.record_roster({"token:alice": "a", "token:bob": "b"})
        await store.record_roster({"token:bob": "b"})
        assert redis_cli(sentinel.master.port, "wait", "1", "5000").strip() == "1"
        old_master = sentinel.current_master_port()
        sentinel.master.kill()
        deadline = time.monotonic() + 30
        while sentinel.current_master_port() == old_master:
            assert time.monotonic() < deadline, "no failover happened"
            await asyncio.sleep(0.2)
        while True:
            try:
                after = await store.roster()
                break
            except StoreError:
                assert time.monotonic() < deadline, "the new master never answered"
                await asyncio.sleep(0.2)
        assert after == {"token:bob": first["token:bob"]}
        back = await store.record_roster({"token:alice": "a", "token:bob": "b"})
        assert back["token:bob"] == first["token:bob"]
        assert back["token:alice"].since_ms > first["token:alice"].since_ms
    finally:
        await store.close()


async def test_a_burst_past_the_pool_waits_for_a_connection(redis_sentinel: SentinelSetup) -> None:
    """More store calls at once than `store.pool_size` connections: each waits for a
    free connection, as on one server, instead of failing with MaxConnectionsError
    (a StoreError: 503s for a burst of requests, or a listing's bucket reads)."""
    config = StoreConfig(
        sentinel_master=redis_sentinel.master_name,
        sentinel_nodes=tuple(("127.0.0.1", s.port) for s in redis_sentinel.sentinels),
        prefix=unique("burst") + ":",
        max_connections=2,
        wait_for_replicas=1,  # the store's calls go through redis-py's pool
    )
    store = RedisStore(config)
    await store.start()
    try:
        burst = await asyncio.gather(
            *(store.client.get(f"{config.prefix}n{i}") for i in range(200)),
            return_exceptions=True,
        )
        assert [r for r in burst if isinstance(r, BaseException)] == []
        page = await store.list_records(frozenset({State.PARKED}))
        assert page.records == []
    finally:
        await store.close()
