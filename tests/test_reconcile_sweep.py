"""The reconcile sweep over a backlog, in-process: it holds the backlog's references,
not its records (it reads them a page at a time, the longest unresolved first, and
never lists every open record), and a route's checks take `reconcile.concurrency`
slots, which a repeat does not wait for; on a route with `delivery.rate`, the checks
take that limit's tokens.

A real memory store (counting the sweep's reads: a subclass, nothing replaced) and
the job service of tests/support/job_service.py as the status endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.assembly import Gateway
from gateway.keying import record_digest
from gateway.records import KeyRef, State
from gateway.store.memory import MemoryStore
from gateway.store.pages import PAGE_SIZE, Page
from tests.conftest import GatewayClient, config_for, unique
from tests.support.servers import Process

pytestmark = pytest.mark.anyio

ROUTE = "jobs"


class CountingStore(MemoryStore):
    """The memory store, counting the sweep-side reads it is asked for (and noting the
    rate limits taken from)."""

    def __init__(self) -> None:
        super().__init__()
        self.pages: list[int] = []
        self.listings = 0
        self.buckets: set[str] = set()

    async def take_token(self, name: str, per_second: float, burst: int) -> float:
        self.buckets.add(name)
        return await super().take_token(name, per_second, burst)

    async def list_records(
        self,
        states: frozenset[State],
        *,
        route: str | None = None,
        older_than: float = 0.0,
        cursor: str = "",
        limit: int = PAGE_SIZE,
    ) -> Page:
        page = await super().list_records(
            states, route=route, older_than=older_than, cursor=cursor, limit=limit
        )
        if limit > PAGE_SIZE:
            self.listings += 1  # open_records: every record at once
        else:
            self.pages.append(len(page.records))
        return page


def route(service: Process, **reconcile: Any) -> dict[str, Any]:
    return {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": "/jobs/run"},
        "key": {"header": "Idempotency-Key"},
        "fingerprint": "none",  # the backlog's records are made with none
        "on_unknown_outcome": "reconcile",
        "reconcile": {
            "url": service.url + "/jobs/status?key={key}",
            "every": "1h",
            "park_after": "1h",
            **reconcile,
        },
    }


@pytest.fixture
async def service(job_service: Process) -> AsyncIterator[Process]:
    async with httpx.AsyncClient() as client:
        await client.post(job_service.url + "/_reset")
    yield job_service
    async with httpx.AsyncClient() as client:
        await client.post(job_service.url + "/_reset")


async def backlog(gateway: Gateway, n: int) -> list[KeyRef]:
    """n unresolved records of ROUTE, made by the store's own operations, oldest first."""
    refs = []
    for _ in range(n):
        key = unique("backlog")
        ref = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
        assert await gateway.store.claim(ref, "run-1", "", 30) is None
        assert await gateway.store.mark_unresolved(ref, "run-1", "read timeout")
        refs.append(ref)
    return refs


async def checked(service: Process) -> list[str]:
    async with httpx.AsyncClient() as client:
        log = (await client.get(service.url + "/_log")).json()
    return [r["key"] for r in log["requests"] if r["of"] == "status"]


async def test_the_sweep_reads_the_backlog_a_page_at_a_time(service: Process) -> None:
    store = CountingStore()
    gateway = Gateway(config_for(service.url, [route(service)]), store=store, sweep=False)
    await gateway.start()
    try:
        refs = await backlog(gateway, 250)
        await gateway.reconciler.sweep()
        assert store.listings == 0, "the sweep read every open record at once"
        assert store.pages == [100, 100, 50]  # gateway.reconcile.PAGE
        assert sorted(await checked(service)) == sorted(r.key for r in refs)
        # The longest unresolved first: the first page's keys were checked first.
        made = [r for r in [await store.get(ref) for ref in refs] if r is not None]
        oldest = sorted(made, key=lambda r: (r.since_ms, r.digest))[:100]
        assert set((await checked(service))[:100]) == {r.key for r in oldest}
    finally:
        await gateway.close()


async def test_a_backlog_clears_at_the_bound_never_faster(service: Process) -> None:
    """N keys, checks of t seconds, concurrency c: about N / c x t, and at most c at
    once; the sweep uses all c."""
    gateway = Gateway(config_for(service.url, [route(service, concurrency=3)]), sweep=False)
    await gateway.start()
    try:
        await backlog(gateway, 30)
        async with httpx.AsyncClient() as client:
            await client.post(service.url + "/_config", json={"status_sleep": 0.1})
        started = time.monotonic()
        await gateway.reconciler.sweep()
        took = time.monotonic() - started
        async with httpx.AsyncClient() as client:
            most = (await client.get(service.url + "/_log")).json()["status_max_concurrent"]
        assert len(await checked(service)) == 30
        assert most == 3
        assert took >= 30 / 3 * 0.1 * 0.9, took
    finally:
        await gateway.close()


async def test_checks_take_the_routes_rate_limit(service: Process) -> None:
    """An async route with `delivery.rate: 20/s`: the sweep's checks of 20 keys take
    the tokens its deliveries take (one bucket in the store), so they reach the status
    endpoint at 20 a second, not at once; the sweep waits for each token (every key is
    checked), and the waits are counted."""
    limited = {**route(service, concurrency=8), "delivery": {"mode": "async", "rate": "20/s"}}
    store = CountingStore()
    gateway = Gateway(config_for(service.url, [limited]), store=store, sweep=False)
    await gateway.start()
    try:
        await backlog(gateway, 20)
        started = time.monotonic()
        await gateway.reconciler.sweep()
        took = time.monotonic() - started
        assert len(await checked(service)) == 20
        assert took >= 19 / 20 * 0.9, took
        held = gateway.metrics.registry.get_sample_value(
            "idempotency_gateway_delivery_rate_limited_total", {"route": ROUTE, "what": "check"}
        )
        assert held is not None and held > 0
        # The bucket the route's deliveries take from (DeliveryConfig.limit_name).
        assert store.buckets == {f"route:{ROUTE}"}
    finally:
        await gateway.close()


async def test_a_repeat_does_not_wait_for_a_slot(service: Process) -> None:
    """Every slot taken by the sweep: a repeat of an unresolved key is answered at once
    (409, unresolved) and starts no check of its own; with a slot free it checks."""
    gateway = Gateway(config_for(service.url, [route(service, concurrency=1)]), sweep=False)
    await gateway.start()
    client = GatewayClient(gateway)
    try:
        slow, mine = await backlog(gateway, 2)
        async with httpx.AsyncClient() as http:
            await http.post(service.url + "/_config", json={"status_sleep": 1.0})
        record = await gateway.store.get(slow)
        assert record is not None
        busy = asyncio.create_task(
            gateway.reconciler.check(gateway.config.routes[0], record, min_interval=0, wait=True)
        )
        await asyncio.sleep(0.2)  # the slow check holds the route's one slot
        started = time.monotonic()
        answer = await client.post("/jobs/run", headers={"Idempotency-Key": mine.key})
        assert answer.status_code == 409, answer.text
        assert time.monotonic() - started < 0.5
        assert await checked(service) == [slow.key]
        await busy
        async with httpx.AsyncClient() as http:
            await http.post(service.url + "/_config", json={"status_sleep": 0})
        # Its run never reached the service: the check says 404, and it runs now.
        again = await client.post(
            "/jobs/run", headers={"Idempotency-Key": mine.key}, json={"job_key": mine.key}
        )
        assert again.status_code == 200, again.text
        assert await checked(service) == [slow.key, mine.key]
    finally:
        await client.http.aclose()
        await gateway.close()


#: Routes the idle sweep walks, each with one key it keeps unresolved.
ROUTES = 20


async def test_an_idle_sweep_reads_each_route_once_per_every(service: Process) -> None:
    """Many routes, one unresolved key each, every check inconclusive (the status
    endpoint's 404 is in neither `done` nor `not_done`): between two checks, passes
    read the counts and no route's backlog, so an idle sweep costs O(routes) store
    reads per `every`, not per pass. A key newly unresolved is checked at the next
    pass, and each key again once its `every` has passed."""
    store = CountingStore()
    routes = []
    for i in range(ROUTES):
        each = route(service, every="2s", not_done=[410])
        each["name"], each["match"] = f"r{i}", {"methods": ["POST"], "path": f"/r{i}"}
        routes.append(each)
    gateway = Gateway(config_for(service.url, routes), store=store, sweep=False)
    await gateway.start()

    async def unresolved(name: str) -> KeyRef:
        key = unique("idle")
        ref = KeyRef(record_digest(name, "", key), name, key)
        assert await store.claim(ref, "run-1", "", 30) is None
        assert await store.mark_unresolved(ref, "run-1", "read timeout")
        return ref

    try:
        keys = [await unresolved(f"r{i}") for i in range(ROUTES)]
        started = time.monotonic()
        await gateway.reconciler.sweep()
        assert len(store.pages) == ROUTES
        assert sorted(await checked(service)) == sorted(k.key for k in keys)
        # Passes a tenth of a second apart for a second: nothing is due, nothing read.
        for _ in range(10):
            await asyncio.sleep(0.1)
            await gateway.reconciler.sweep()
        assert len(store.pages) == ROUTES, len(store.pages)
        # A key newly unresolved: its route is read and the key checked at once.
        fresh = await unresolved("r0")
        await gateway.reconciler.sweep()
        assert len(store.pages) == ROUTES + 1
        assert (await checked(service))[ROUTES:] == [fresh.key]
        # Once `every` has passed since the first checks, each key is checked again.
        await asyncio.sleep(max(0.0, started + 2.1 - time.monotonic()))
        await gateway.reconciler.sweep()
        again = (await checked(service))[ROUTES + 1 :]
        assert sorted(again) == sorted(k.key for k in keys), again
        assert len(store.pages) <= 2 * ROUTES + 1
    finally:
        await gateway.close()
