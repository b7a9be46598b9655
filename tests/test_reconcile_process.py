"""Reconcile checks across real processes: a gateway process, redis-server, the job
service of tests/support/job_service.py and, where the attack needs one, a stock nginx
in front of it.

- A caller's key never changes where a check goes: `..` in `reconcile.url`'s path,
  resolved by nginx to another location whose 404 would release the key, is never sent;
  the key stays unresolved and parks, and the job runs once.
- The sweep never floods the job service: with a backlog of unresolved keys, the status
  checks that reach it at once never exceed `reconcile.concurrency`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.keying import record_digest
from gateway.records import KeyRef, State
from gateway.store import open_store
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.nginx import access_lines, nginx_front
from tests.support.records import read_record, until_state
from tests.support.servers import Process, RedisServer, for_this_test, free_port, gateway_process

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis]

AREA = "reconcile url attacks"
ROUTE = "jobs"

#: A job service behind nginx as sites route one: its paths to it, anything else
#: answered by nginx (404). nginx decodes the path, resolves `.` and `..` and merges
#: `//` before it picks a location, and a proxy_pass with a path sends that result on.
LOCATIONS = """
    location /jobs/ {{ proxy_pass http://127.0.0.1:{port}/jobs/; }}
    location / {{ return 404; }}
"""


def gateway_config(
    tmp: Path, service: Process, redis: RedisServer, prefix: str, **reconcile: Any
) -> Process:
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": redis.url, "prefix": prefix, "socket_timeout": "1s"},
        "routes": [
            {
                "name": ROUTE,
                "match": {"methods": ["POST"], "path": "/jobs/run"},
                "upstream": service.url,
                "key": {"header": "Idempotency-Key"},
                "fingerprint": ["method", "path", "body"],
                "upstream_timeout": "300ms",
                "on_unknown_outcome": "reconcile",
                "reconcile": {"every": "300ms", "timeout": "2s", "park_after": "2s", **reconcile},
            }
        ],
    }
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = for_this_test(gateway_process(path, port))
    gateway.admin_url = f"http://127.0.0.1:{admin_port}"  # type: ignore[attr-defined]
    return gateway.start()


async def runs_of(service: Process, key: str) -> int:
    async with httpx.AsyncClient() as client:
        return int((await client.get(service.url + "/_log")).json()["runs"].get(key, 0))


async def metric(gateway: Process, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(gateway.admin_url + "/metrics")).text  # type: ignore[attr-defined]
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
        elif head == name and not wanted:
            total += float(value)
    return total


#: Keys whose check a path carries elsewhere: /jobs/../status and
#: /jobs/x%2F..%2F..%2Fstatus/status are nginx's /status (its own 404),
#: /jobs/./status is /jobs/status, /jobs/a%2Fb/status is /jobs/a/b/status.
DOT_KEYS = ["..", ".", "x/../../status", "a/b"]


async def reset(service: Process) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(service.url + "/_reset")


@pytest.mark.parametrize("key", DOT_KEYS)
async def test_a_key_never_sends_its_check_to_another_location(
    tmp_path: Path,
    job_service: Process,
    redis_server: RedisServer,
    ledger: Ledger,
    key: str,
) -> None:
    """reconcile.url http://nginx/jobs/{key}/status and the key `..`: sent, the check is
    `GET /jobs/../status`, which nginx answers from `location /` (404, not_done): the
    key would be released and the job run again. It is never sent: the key stays
    unresolved, parks after park_after, and the job runs once."""
    prefix = unique("rc") + ":"
    await reset(job_service)
    job = key  # the job service counts runs, and answers checks, by the body's job_key
    with nginx_front(tmp_path, LOCATIONS.format(port=job_service.port)) as nginx:
        gateway = gateway_config(
            tmp_path, job_service, redis_server, prefix, url=nginx.url + "/jobs/{key}/status"
        )
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            send = {"headers": {"Idempotency-Key": key}, "json": {"job_key": job}}
            first = await client.post("/jobs/run", params={"sleep": "1"}, **send)
            assert first.status_code == 504
            await asyncio.sleep(1.2)  # the run finishes: a check that arrives says 200
            again = await client.post("/jobs/run", **send)
        record = await read_record(redis_server, prefix, ROUTE, key)
        seen = [line for line in access_lines(nginx) if "/status" in line]
        runs = await runs_of(job_service, job)
        ledger.record(
            AREA,
            f"dot key {key!r} through nginx",
            requests=2,
            bad_inputs=1,
            upstream_duplicates=runs - 1,
        )
        assert runs == 1, f"ran again after {seen}: {again.text}"
        assert again.status_code == 409, again.text
        assert seen == [], "a check went out"
        assert record is not None and record.state is State.UNRESOLVED
        assert "check not sent" in record.reconcile["error"]
        parked = await until_state(redis_server, prefix, ROUTE, key, State.PARKED, timeout=10)
        checks = [e for e in parked.history if e["event"] == "reconcile"]
        assert checks and all(e["result"] == "inconclusive" for e in checks)
        assert await runs_of(job_service, job) == 1
        assert await metric(gateway, "idempotency_gateway_reconcile_unsent_total", route=ROUTE) >= 1
        gateway.stop()
        assert "check not sent" in gateway.output()


async def test_the_query_is_the_safe_place_for_a_key(
    tmp_path: Path, job_service: Process, redis_server: RedisServer
) -> None:
    """The same keys in the query are checked, through the same nginx, and say done."""
    prefix = unique("rc") + ":"
    await reset(job_service)
    with nginx_front(tmp_path, LOCATIONS.format(port=job_service.port)) as nginx:
        gateway = gateway_config(
            tmp_path, job_service, redis_server, prefix, url=nginx.url + "/jobs/status?key={key}"
        )
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            for key in DOT_KEYS:
                send = {"headers": {"Idempotency-Key": key}, "json": {"job_key": key}}
                first = await client.post("/jobs/run", params={"sleep": "1"}, **send)
                assert first.status_code == 504
                await asyncio.sleep(1.2)
                again = await client.post("/jobs/run", **send)
                assert again.status_code == 200, again.text
                assert again.headers["idempotent-resolved-by"] == "reconciled", key
                assert await runs_of(job_service, key) == 1
        gateway.stop()


# -- the sweep never floods the job service ----------------------------------------------


async def configure(service: Process, **settings: float) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(service.url + "/_config", json=settings)


async def max_concurrent_checks(service: Process) -> int:
    async with httpx.AsyncClient() as client:
        return int((await client.get(service.url + "/_log")).json()["status_max_concurrent"])


async def unresolved_backlog(gateway: Process, keys: list[str]) -> None:
    """Each key's first run outlives the gateway's deadline: all of them unresolved."""
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=limits) as client:
        answers = await asyncio.gather(
            *(
                client.post(
                    "/jobs/run",
                    params={"sleep": "0.4"},
                    headers={"Idempotency-Key": key},
                    json={"job_key": key},
                )
                for key in keys
            )
        )
    assert [a.status_code for a in answers] == [504] * len(keys)


@pytest.mark.slow
async def test_checks_at_once_never_exceed_the_bound(
    tmp_path: Path, job_service: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """200 unresolved keys, each repeated by its caller at once while the sweep runs:
    the job service never answers more than reconcile.concurrency (default 4) checks
    at a time, and every key is still checked and completed, each run once."""
    await reset(job_service)
    prefix = unique("rc") + ":"
    keys = [unique("backlog") for _ in range(200)]
    gateway = gateway_config(
        tmp_path,
        job_service,
        redis_server,
        prefix,
        url=job_service.url + "/jobs/status?key={key}",
        every="1s",
        park_after="1h",
    )
    # A check takes 0.5 s while the backlog builds and the callers repeat, so that the
    # sweep's checks and the repeats' overlap; then 20 ms while the sweep clears the rest.
    await configure(job_service, status_sleep=0.5)
    await unresolved_backlog(gateway, keys)
    await asyncio.sleep(0.5)  # every first run has finished: a check says done
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=limits) as client:
        repeats = await asyncio.gather(
            *(
                client.post("/jobs/run", headers={"Idempotency-Key": k}, json={"job_key": k})
                for k in keys
            )
        )
    statuses = {a.status_code for a in repeats}
    await configure(job_service, status_sleep=0.02)
    deadline = time.monotonic() + 60
    for key in keys:
        while (record := await read_record(redis_server, prefix, ROUTE, key)) is None or (
            record.state is not State.COMPLETED
        ):
            assert time.monotonic() < deadline, record
            await asyncio.sleep(0.1)
    most = await max_concurrent_checks(job_service)
    async with httpx.AsyncClient() as client:
        runs = (await client.get(job_service.url + "/_log")).json()["runs"]
    ledger.record(
        AREA,
        "200 unresolved keys repeated at once during a sweep",
        requests=2 * len(keys),
        upstream_duplicates=sum(runs[k] - 1 for k in keys),
        detail=f"at most {most} checks at once (bound 4)",
    )
    assert statuses <= {200, 409}, statuses
    assert most <= 4, f"{most} checks at once"
    assert all(runs[k] == 1 for k in keys)
    gateway.stop()


# -- one slow route holds up no other ----------------------------------------------------


async def silent_server() -> tuple[asyncio.Server, list[asyncio.StreamWriter]]:
    """A status endpoint that takes every connection and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    return await asyncio.start_server(hold, "127.0.0.1", 0), held


async def unresolved_in_store(redis: RedisServer, prefix: str, route: str, keys: list[str]) -> None:
    """Unresolved records of `route`, made by the store's own operations."""
    store = open_store(StoreConfig(url=redis.url, prefix=prefix))
    await store.start()
    try:
        for key in keys:
            ref = KeyRef(record_digest(route, "", key), route, key)
            assert await store.claim(ref, "run-1", "", 30) is None
            assert await store.mark_unresolved(ref, "run-1", "read timeout")
    finally:
        await store.close()


async def test_a_slow_route_holds_up_no_other_and_not_the_lease_expiry(
    tmp_path: Path, job_service: Process, redis_server: RedisServer
) -> None:
    """Route `slow` has 40 unresolved keys and a status endpoint that never answers
    (timeout 2 s, concurrency 4: its backlog takes 20 s to go through). Meanwhile a key
    of route `jobs` becomes unresolved and another's gateway dies mid-request (a claim
    whose lease runs out): within a few sweep periods the first is checked and the
    second opened, not after the slow route's sweep ends."""
    await reset(job_service)
    server, held = await silent_server()
    silent = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    prefix = unique("rc") + ":"
    port, admin_port = free_port(), free_port()
    jobs = {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": "/jobs/run"},
        "upstream": job_service.url,
        "key": {"header": "Idempotency-Key"},
        "fingerprint": "none",
        "on_unknown_outcome": "reconcile",
        "reconcile": {
            "url": job_service.url + "/jobs/status?key={key}",
            "every": "300ms",
            "park_after": "1h",
        },
    }
    slow = {
        **jobs,
        "name": "slow",
        "match": {"methods": ["POST"], "path": "/slow/run"},
        "reconcile": {**jobs["reconcile"], "url": silent + "/status?key={key}", "timeout": "2s"},
    }
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": redis_server.url, "prefix": prefix, "socket_timeout": "1s"},
        "routes": [jobs, slow],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    await unresolved_in_store(redis_server, prefix, "slow", [unique("slow") for _ in range(40)])
    gateway = for_this_test(gateway_process(path, port)).start()
    try:
        deadline = time.monotonic() + 10
        while len(held) < 4:  # the slow route's sweep is under way, its slots taken
            assert time.monotonic() < deadline, "the slow route's checks never started"
            await asyncio.sleep(0.05)
        key, lost = unique("fresh"), unique("lost")
        await unresolved_in_store(redis_server, prefix, ROUTE, [key])
        store = open_store(StoreConfig(url=redis_server.url, prefix=prefix))
        await store.start()
        try:
            ref = KeyRef(record_digest(ROUTE, "", lost), ROUTE, lost)
            assert await store.claim(ref, "run-2", "", 0.5) is None
        finally:
            await store.close()
        started = time.monotonic()
        # Released: the job service never ran it, so its check answers 404 (not done).
        while (record := await read_record(redis_server, prefix, ROUTE, key)) is not None and (
            record.state is State.UNRESOLVED
        ):
            assert time.monotonic() - started < 5, "the fresh key waited for the slow route"
            await asyncio.sleep(0.1)
        # Opened (unresolved, then checked and released like the fresh key).
        while (record := await read_record(redis_server, prefix, ROUTE, lost)) is not None and (
            record.state is State.IN_FLIGHT
        ):
            assert time.monotonic() - started < 5, "the dead lease waited for the slow route"
            await asyncio.sleep(0.1)
        assert record is not None and record.reason == "lease_expired", record
        assert len(held) <= 4 + 4, "the slow route was swept twice at once"
    finally:
        gateway.stop()
        server.close()
        for writer in held:
            writer.close()
