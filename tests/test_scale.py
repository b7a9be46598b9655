"""Operator surfaces at 50,000 waiting keys: the operator API's listing and overview,
the console's keys page and its live refresh, and the unauthenticated /metrics.

After an outage, tens of thousands of keys wait for a person, and that is when
operators open the console. Each surface must answer with a body the size of a page
(or of the routes' figures) and do work that does not grow with the number of keys,
on the proxy's own event loop. Measured, not timed: the body's bytes, and the store's
work: Redis's own command count (INFO commandstats) around each request, on the
memory store the Python allocations it makes (tracemalloc's peak).
"""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.admin.api import create_admin_app
from gateway.assembly import Gateway
from gateway.store.base import Store
from gateway.store.pages import READ_ROUNDS
from gateway.store.redis import RedisStore
from tests.conftest import config_for
from tests.support.bulk import park_many
from tests.support.ledger import Ledger

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

N = 50_000
ROUTE = "charge"
TOKEN = "alice-" + "a" * 24
ORIGIN = "http://admin"
#: A page of 100 keys as JSON or HTML is 30-70 KB; the figures of two routes far less.
MAX_BODY = 256 * 1024
#: Redis commands per request: a page reads the counts (65), its candidates (about one
#: script per bucket, twice at most) and 101 records; the overview, counts and heads.
MAX_COMMANDS = 1_000
#: Python memory allocated at the peak of one request on the memory store.
MAX_ALLOCATED = 4 * 1024 * 1024


@dataclass
class Site:
    gateway: Gateway
    app: Starlette
    store: Store

    def client(self) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app, client=("127.0.0.1", 40000))
        return httpx.AsyncClient(
            transport=transport, base_url=ORIGIN, headers={"Origin": ORIGIN}, timeout=120
        )


@pytest.fixture
async def site(
    make_store: Callable[[], Store], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Site]:
    monkeypatch.setenv("ALICE_TOKEN", TOKEN)
    monkeypatch.setenv("CONSOLE_SECRET", "s" * 40)
    admin = {
        "operators": [{"name": "alice", "role": "operator", "token_env": "ALICE_TOKEN"}],
        "session_secret_env": "CONSOLE_SECRET",
    }
    routes = [
        {"name": ROUTE, "match": {"path": "/c"}, "key": {"body": "k"}},
        {"name": "refund", "match": {"path": "/r"}, "key": {"body": "k"}},
    ]
    config = config_for("http://127.0.0.1:9", routes, admin=admin)
    store = make_store()
    gateway = Gateway(config, store=store, sweep=False)
    await gateway.start()
    await park_many(store, ROUTE, N)
    await park_many(store, "refund", 3, prefix="few")
    yield Site(gateway, create_admin_app(gateway), store)
    await gateway.close()


async def signed_in(client: httpx.AsyncClient) -> None:
    answer = await client.post("/console/signin", data={"token": TOKEN})
    assert answer.status_code == 303, answer.text


async def redis_commands(store: Store) -> int:
    assert isinstance(store, RedisStore)
    stats = await store.client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


async def measured(site: Site, call: Callable[[], Any]) -> tuple[httpx.Response, int]:
    """The response, and the work it took: Redis commands, or bytes allocated."""
    if isinstance(site.store, RedisStore):
        before = await redis_commands(site.store)
        response = await call()
        return response, await redis_commands(site.store) - before
    tracemalloc.start()
    try:
        response = await call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return response, peak


@pytest.mark.long
async def test_operator_surfaces_hold_at_50000_parked_keys(site: Site, ledger: Ledger) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    bound = MAX_COMMANDS if isinstance(site.store, RedisStore) else MAX_ALLOCATED
    async with site.client() as client:
        await signed_in(client)
        surfaces = {
            "/admin/keys": lambda: client.get("/admin/keys", headers=bearer),
            "/admin/keys?route=refund": lambda: client.get(
                "/admin/keys", params={"route": "refund"}, headers=bearer
            ),
            "/console/keys": lambda: client.get("/console/keys"),
            "/console/keys/rows": lambda: client.get("/console/keys/rows"),
            "/admin/overview": lambda: client.get("/admin/overview", headers=bearer),
            "/metrics": lambda: client.get("/metrics"),
        }
        # What the indexes cannot serve (a key prefix, a status) a page drops after
        # reading, READ_ROUNDS rounds of a page at most: bounded, a few times a page's.
        filtered = {
            "/admin/keys?key_prefix=none&status=503": lambda: client.get(
                "/admin/keys",
                params={"route": ROUTE, "key_prefix": "none", "status": "503"},
                headers=bearer,
            ),
            "/admin/keys?since=&until=": lambda: client.get(
                "/admin/keys",
                params={"route": ROUTE, "since": "1", "until": "2"},
                headers=bearer,
            ),
            "/console/keys?key_prefix=none": lambda: client.get(
                "/console/keys", params={"route": ROUTE, "key_prefix": "none"}
            ),
        }
        ledger.record(
            "operator surfaces at 50,000 keys",
            type(site.store).__name__,
            requests=len(surfaces),
            detail=f"{N:,} parked keys: every surface a bounded page and kept counts",
        )
        for name, call in [*surfaces.items(), *filtered.items()]:
            response, work = await measured(site, call)
            assert response.status_code == 200, (name, response.text[:500])
            assert len(response.content) <= MAX_BODY, (name, len(response.content))
            assert work <= (READ_ROUNDS * bound if name in filtered else bound), (name, work)
        # What they said: a page of the oldest 100, and every key counted.
        listing = (await client.get("/admin/keys", headers=bearer)).json()
        assert len(listing["keys"]) == 100 and listing["next_cursor"]
        only = (await client.get("/admin/keys?route=refund", headers=bearer)).json()
        assert sorted(k["key"] for k in only["keys"]) == ["few-0", "few-1", "few-2"]
        overview = (await client.get("/admin/overview", headers=bearer)).json()
        [charge] = [r for r in overview["routes"] if r["route"] == ROUTE]
        assert charge["keys"]["parked"]["count"] == N
        metrics = (await client.get("/metrics")).text
        assert re.search(
            r'idempotency_gateway_keys\{route="charge",state="parked"\} 50000(\.0)?\n', metrics
        )
        # A key prefix no key has: a short page with a cursor, never a walk of them all.
        none = await client.get(
            "/admin/keys", params={"route": ROUTE, "key_prefix": "none"}, headers=bearer
        )
        assert none.json()["keys"] == [] and none.json()["next_cursor"]
        rows = (await client.get("/console/keys/rows")).text
        assert rows.count("<tr data-key=") == 100
        assert "50,003 keys in these states" in rows


@pytest.mark.long
async def test_a_walk_through_the_pages_lists_each_of_50000_keys_once(site: Site) -> None:
    """`next_cursor` from page to page, 1,000 at a time: every key once, oldest first."""
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    seen: list[str] = []
    cursor = ""
    async with site.client() as client:
        while True:
            params = {"limit": "1000", "route": ROUTE, **({"cursor": cursor} if cursor else {})}
            doc = (await client.get("/admin/keys", params=params, headers=bearer)).json()
            seen += [row["key"] for row in doc["keys"]]
            if not doc["next_cursor"]:
                break
            cursor = doc["next_cursor"]
    assert len(seen) == N and len(set(seen)) == N
