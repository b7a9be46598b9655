"""`delivery.rate` across real processes: gateway replicas (and `--workers`) on one
store deliver a queue of accepted keys to the test upstream, which notes when each
run arrived. The upstream's own arrival times, never the gateways' word, show the
limit held over every process together: no one-second window holds more than the
rate (a few percent over, for the time between a token and its arrival) plus the
burst; every key ran exactly once, each in one attempt; the deliveries held back are
counted, none of them as an attempt, and a lane asks the store about once per token
while the limit binds, not once per slot.

Every delivering process is up (each worker answers readiness) before the keys
arrive, spread over the replicas, so all of them deliver at once.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.keying import record_digest
from gateway.records import KeyRef, State
from gateway.store import open_store
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.records import StoreServer
from tests.support.servers import Process, RedisServer
from tests.test_delivery_process import PATH, ROUTE, Site, SqliteFile

pytestmark = [pytest.mark.anyio, pytest.mark.process]


async def _fill(gateways: list[Process], prefix: str, count: int) -> list[str]:
    """`count` new keys at once, spread over the replicas: each is delivered at once
    by the replica that accepted it, were it not for the limit."""
    keys = [f"{prefix}-{i:04d}" for i in range(count)]
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(timeout=10, limits=limits) as client:
        answers = await asyncio.gather(
            *(
                client.post(
                    gateways[i % len(gateways)].url + PATH,
                    content=b"{}",
                    headers={"Idempotency-Key": key},
                )
                for i, key in enumerate(keys)
            )
        )
    assert [a.status_code for a in answers] == [202] * count, [a.text for a in answers][:3]
    return keys


async def _arrivals(upstream: Process, prefix: str) -> dict[str, list[float]]:
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(f"{upstream.url}/_counts", params={"prefix": prefix})
    found: dict[str, list[float]] = answer.json()["arrivals"]
    return found


async def _metric_sum(gateways: list[Process], name: str, labels: str) -> float:
    total = 0.0
    pattern = re.compile(rf"^idempotency_gateway_{name}\{{([^}}]*)\}} (\S+)$", re.M)
    async with httpx.AsyncClient(timeout=10) as client:
        for gateway in gateways:
            admin = f"http://127.0.0.1:{gateway.admin_port}"  # type: ignore[attr-defined]
            text = (await client.get(admin + "/metrics")).text
            for found in pattern.finditer(text):
                if all(part in found.group(1) for part in labels.split(",")):
                    total += float(found.group(2))
    return total


def _busiest_second(times: list[float]) -> int:
    """The most arrivals in any one-second window (each starting at an arrival)."""
    times = sorted(times)
    most, end = 0, 0
    for start, at in enumerate(times):
        while end < len(times) and times[end] < at + 1.0:
            end += 1
        most = max(most, end - start)
    return most


async def _rate_limited_delivery(
    tmp_path: Path,
    upstream: Process,
    server: StoreServer,
    ledger: Ledger,
    *,
    rate: int,
    burst: int,
    count: int,
    replicas: int,
    workers: int,
) -> None:
    delivery = {"mode": "async", "rate": f"{rate}/s", "burst": burst, "concurrency": 8}
    site = Site(tmp_path, upstream, server, delivery=delivery)
    gateways = [site.gateway(workers=workers) for _ in range(replicas)]
    async with httpx.AsyncClient(timeout=10) as client:
        for gateway in gateways:  # every worker up, each answering readiness
            admin = f"http://127.0.0.1:{gateway.admin_port}"  # type: ignore[attr-defined]
            for _ in range(4 * max(workers, 1)):
                assert (await client.get(admin + "/readyz")).status_code == 200
    prefix = unique("rate")
    keys = await _fill(gateways, prefix, count)
    deadline = time.monotonic() + count / rate * 3 + 20
    arrivals: dict[str, list[float]] = {}
    while sum(map(len, arrivals.values())) < count:
        assert time.monotonic() < deadline, f"{len(arrivals)} of {count} delivered"
        await asyncio.sleep(0.2)
        arrivals = await _arrivals(upstream, prefix)
    await asyncio.sleep(0.5)  # a duplicate, had there been one, arrives meanwhile
    arrivals = await _arrivals(upstream, prefix)
    times = sorted(at for runs in arrivals.values() for at in runs)
    busiest = _busiest_second(times)
    span = times[-1] - times[0]
    attempts = await _metric_sum(gateways, "delivery_attempts_total", f'route="{ROUTE}"')
    held = await _metric_sum(
        gateways, "delivery_rate_limited_total", f'route="{ROUTE}",what="delivery"'
    )
    store = open_store(site.store_config)
    await store.start()
    try:
        records = [
            await store.get(KeyRef(record_digest(ROUTE, "", key), ROUTE, key)) for key in keys
        ]
    finally:
        await store.close()
    ledger.record(
        "async delivery",
        f"rate[{rate}/s, {replicas}x{max(workers, 1)} processes, {site.store_config.kind}]",
        requests=count,
        upstream_duplicates=sum(max(0, len(runs) - 1) for runs in arrivals.values()),
        records_lost=sum(r is None or r.state is not State.COMPLETED for r in records),
        detail=f"busiest second {busiest} (rate {rate} + burst {burst}); {count} in "
        f"{span:.2f} s; {held:.0f} holds; {attempts:.0f} attempts",
    )
    assert {key: len(arrivals.get(key, [])) for key in keys} == dict.fromkeys(keys, 1)
    assert busiest <= rate * 1.05 + burst, (busiest, rate, burst)
    # No faster than the rate over the whole run (the first `burst` come at once).
    assert span >= (count - burst) / rate * 0.95, (span, count, rate)
    assert all(r is not None and r.state is State.COMPLETED for r in records)
    assert [r.attempts for r in records if r is not None] == [1] * count
    assert attempts == count, attempts  # a held-back delivery is no attempt
    assert held > 0
    # While the limit binds, a lane asks for one token at a time: about one refusal per
    # process per delivery, not one per concurrency slot (8 here).
    assert held <= 4 * replicas * max(workers, 1) * count, held


@pytest.mark.parametrize("store_kind", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def test_two_processes_keep_to_one_rate(
    tmp_path: Path,
    upstream: Process,
    store_kind: str,
    request: pytest.FixtureRequest,
    ledger: Ledger,
) -> None:
    """Two gateway processes on one store, `rate: 50/s` with a burst of 2, 100 queued
    deliveries: each process alone could send them all at once (concurrency 8), and
    together they keep to 50 a second."""
    server: Any = (
        SqliteFile(f"sqlite://{tmp_path / 'gateway.db'}")
        if store_kind == "sqlite"
        else request.getfixturevalue("redis_server")
    )
    await _rate_limited_delivery(
        tmp_path, upstream, server, ledger, rate=50, burst=2, count=100, replicas=2, workers=0
    )


@pytest.mark.long
@pytest.mark.redis
async def test_three_replicas_of_two_workers_keep_to_one_rate(
    tmp_path: Path, upstream: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """Three replicas of `--workers 2` (six processes) on one redis-server, `rate:
    20/s` with a burst of 3, 200 queued deliveries: the upstream sees at most about 20 a
    second throughout (about ten seconds), each delivery once."""
    await _rate_limited_delivery(
        tmp_path,
        upstream,
        redis_server,
        ledger,
        rate=20,
        burst=3,
        count=200,
        replicas=3,
        workers=2,
    )
