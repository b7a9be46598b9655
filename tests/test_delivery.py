"""delivery: async (issue 14): 202 at once, then the gateway delivers, in-process.

Real stores (memory and a redis-server of the tests' own), the real test upstream
under uvicorn, gateways in this process driven through ASGI; the worker is the
gateway's own (`Gateway.start`), woken by the store's notices.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import format_datetime
from ipaddress import ip_network
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.app import Gateway
from gateway.config import DeliveryConfig, KeySource, KeySpec, RetryConfig, Route
from gateway.delivery import next_delay, parse_retry_after, plan
from gateway.forwarding import NO_PROXIES, TrustedProxies, forwarded_headers
from gateway.keys import RequestParts, record_digest
from gateway.outbound import Origin
from gateway.records import KeyRef, Record, State
from gateway.settlement import stored_request
from tests.conftest import GatewayClient, config_for, unique, upstream_count
from tests.support.servers import Process, upstream_server

pytestmark = pytest.mark.anyio

Build = Callable[..., Any]
ROUTE = "send-invoices"
FAST_RETRY = {"attempts": 5, "backoff": "50ms", "max_backoff": "200ms"}


def async_route(**overrides: Any) -> dict[str, Any]:
    return {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": "/jobs/send-invoices"},
        "key": {"header": "Idempotency-Key"},
        # The query string is this suite's control channel to the test upstream.
        "fingerprint": ["method", "path", "body"],
        "delivery": "async",
        "retry": FAST_RETRY,
        **overrides,
    }


def ref_of(key: str) -> KeyRef:
    return KeyRef(record_digest(ROUTE, "", key), ROUTE, key)


async def record_of(gw: GatewayClient, key: str) -> Record | None:
    return await gw.gateway.store.get(ref_of(key))


async def wait_for_state(gw: GatewayClient, key: str, state: State, timeout: float = 15) -> Record:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = await record_of(gw, key)
        if record is not None and record.state is state:
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never became {state}: {await record_of(gw, key)}")


async def send(gw: GatewayClient, key: str, query: str = "", body: bytes = b"{}") -> httpx.Response:
    path = "/jobs/send-invoices" + (f"?{query}" if query else "")
    return await gw.post(path, content=body, headers={"Idempotency-Key": key})


def events(record: Record, name: str) -> list[dict[str, Any]]:
    return [e for e in record.to_json()["history"] if e["event"] == name]


# -- the schedule, alone ------------------------------------------------------------------


def test_next_delay_full_jitter_and_cap() -> None:
    retry = RetryConfig(attempts=8, backoff=2.0, max_backoff=10.0)
    asked: list[tuple[float, float]] = []

    def rand(low: float, high: float) -> float:
        asked.append((low, high))
        return high / 2

    assert next_delay(retry, 1, None, rand) == 1.0
    assert next_delay(retry, 2, None, rand) == 2.0
    assert next_delay(retry, 3, None, rand) == 4.0
    assert next_delay(retry, 9, None, rand) == 5.0  # capped at max_backoff
    assert asked == [(0, 2.0), (0, 4.0), (0, 8.0), (0, 10.0)]
    # Retry-After is the upstream's own time: no jitter, capped by max_backoff.
    assert next_delay(retry, 1, 7.0, rand) == 7.0
    assert next_delay(retry, 1, 600.0, rand) == 10.0
    assert len(asked) == 4
    # Full jitter with the real generator: spread over [0, ceiling], never the ceiling alone.
    draws = {next_delay(retry, 3, None) for _ in range(50)}
    assert all(0 <= d <= 8.0 for d in draws)
    assert len(draws) > 40 and min(draws) < 4.0


def test_plan_parks_when_the_attempts_are_used() -> None:
    route = Route(
        name="r",
        path="/r",
        upstream="http://127.0.0.1:1",
        retry=RetryConfig(attempts=3, backoff=1.0, max_backoff=1.0),
    )
    assert plan(route, 1, 0.5) == 0.5
    assert plan(route, 2, None) is not None
    assert plan(route, 3, None) is None
    assert plan(route, 3, 1.0) is None


def test_parse_retry_after() -> None:
    now = time.time()
    assert parse_retry_after(None, now) is None
    assert parse_retry_after("120", now) == 120.0
    assert parse_retry_after(" 0 ", now) == 0.0
    soon = format_datetime(datetime.fromtimestamp(now + 30, UTC), usegmt=True)
    parsed = parse_retry_after(soon, now)
    assert parsed is not None and 28 <= parsed <= 31
    past = format_datetime(datetime.fromtimestamp(now - 30, UTC), usegmt=True)
    assert parse_retry_after(past, now) == 0.0
    for bad in ("", "-5", "1.5", "soon", "Mon, 99 Foo 2026 00:00:00 GMT"):
        assert parse_retry_after(bad, now) is None


# -- in-process gateways --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "store_kind",
    [
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_article_case_accepted_then_delivered_once(
    gateway_for: Build, upstream: Process
) -> None:
    """The article's case, scaled down: a 3.5 s handler, a caller that gives up after
    1 s. The caller has its 202 long before the handler finishes; the handler runs once;
    repeats get the same 202 and never reach it."""
    gw = await gateway_for([async_route(upstream_timeout="10s")])
    key = unique("article")
    started = time.monotonic()
    first = await asyncio.wait_for(send(gw, key, "sleep=3.5"), 1.0)  # the caller's 1 s
    assert first.status_code == 202
    doc = first.json()
    assert doc["route"] == ROUTE and doc["key"] == key and doc["state"] == "queued"
    assert first.headers["location"] == doc["status_url"]
    assert doc["status_url"].startswith(f"/_idempotency/status/{ROUTE}/{ref_of(key).digest}/")
    assert first.headers["cache-control"] == "no-store"
    assert "idempotent-replayed" not in first.headers
    for _ in range(5):
        again = await asyncio.wait_for(send(gw, key, "sleep=3.5"), 1.0)
        assert again.status_code == 202
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["location"] == first.headers["location"]
        assert again.json()["state"] in ("queued", "in_flight")
    record = await wait_for_state(gw, key, State.COMPLETED)
    assert time.monotonic() - started >= 3.5
    assert record.response is not None and record.response.status == 200
    assert await upstream_count(upstream, key) == 1
    status = await gw.http.get(first.headers["location"])  # from the 202, on the proxy port
    assert (status.status_code, status.json()["state"]) == (200, "completed")
    after = await send(gw, key, "sleep=3.5")
    assert (after.status_code, after.json()["state"]) == (202, "completed")
    assert after.headers["location"] == first.headers["location"]
    assert await upstream_count(upstream, key) == 1
    # Another request under the same key is refused, as on a sync route.
    other = await send(gw, key, "sleep=3.5", body=b'{"other": 1}')
    assert other.status_code == 422


async def test_retries_until_the_upstream_answers(gateway_for: Build, upstream: Process) -> None:
    """Down (503) for the first three attempts, up at the fourth: delivered once, the
    attempts and the retries in the history."""
    gw = await gateway_for([async_route()])
    key = unique("down3")
    assert (await send(gw, key, "fail_first=3")).status_code == 202
    record = await wait_for_state(gw, key, State.COMPLETED)
    assert record.attempts == 4
    assert len(events(record, "attempt")) == 4
    assert len(events(record, "retry_scheduled")) == 3
    assert record.response is not None and record.response.status == 200
    async with httpx.AsyncClient() as client:
        counts = (await client.get(f"{upstream.url}/_counts", params={"prefix": key})).json()
    assert counts["answers"][key] == {"503": 3, "200": 1}  # one delivery, three refusals


async def test_never_sent_is_retried(gateway_for: Build) -> None:
    """The upstream is not listening at first (connection refused: never sent), then
    starts: the delivery goes through once it is up."""
    down = upstream_server()
    retry = {"attempts": 30, "backoff": "100ms", "max_backoff": "300ms"}
    gw = await gateway_for([async_route(upstream=down.url, retry=retry)])
    key = unique("refused")
    assert (await send(gw, key)).status_code == 202
    deadline = time.monotonic() + 10
    while (record := await record_of(gw, key)) is None or record.attempts < 2:
        assert time.monotonic() < deadline, record
        await asyncio.sleep(0.05)
    assert record.last_attempt["result"] == "retry_scheduled"
    assert record.last_attempt["error"].startswith("not sent")
    down.start()
    try:
        record = await wait_for_state(gw, key, State.COMPLETED)
        assert await upstream_count(down, key) == 1
        assert record.attempts >= 3
    finally:
        down.stop()


async def test_retry_after_sets_the_next_attempt(gateway_for: Build, upstream: Process) -> None:
    """A 503 with Retry-After: 1 is tried again after 1 s, not after the 10 ms backoff;
    one asking for 30 s waits max_backoff (2 s) instead."""
    retry = {"attempts": 3, "backoff": "10ms", "max_backoff": "2s"}
    gw = await gateway_for([async_route(retry=retry)])
    named, capped = unique("ra1"), unique("ra30")
    assert (await send(gw, named, "fail_first=1&retry_after=1")).status_code == 202
    assert (await send(gw, capped, "fail_first=1&retry_after=30")).status_code == 202
    for key, low, high in ((named, 0.95, 1.9), (capped, 1.95, 4.0)):
        record = await wait_for_state(gw, key, State.COMPLETED)
        first, second = (e["at_ms"] for e in events(record, "attempt"))
        assert low <= (second - first) / 1000 <= high, (key, second - first)
        (scheduled,) = events(record, "retry_scheduled")
        assert scheduled["attempt"]["status"] == 503


async def test_exhausted_attempts_park_the_key(gateway_for: Build, upstream: Process) -> None:
    retry = {"attempts": 3, "backoff": "10ms", "max_backoff": "50ms"}
    gw = await gateway_for([async_route(retry=retry)])
    key = unique("exhaust")
    assert (await send(gw, key, "fail_first=10")).status_code == 202
    record = await wait_for_state(gw, key, State.PARKED)
    assert record.attempts == 3
    assert "attempts exhausted" in record.reason
    await asyncio.sleep(0.3)
    assert await upstream_count(upstream, key) == 3  # no attempt over the limit
    again = await send(gw, key, "fail_first=10")
    assert (again.status_code, again.json()["state"]) == (202, "parked")
    assert await upstream_count(upstream, key) == 3


def reconcile_block(upstream: Process) -> dict[str, Any]:
    return {
        "on_unknown_outcome": "reconcile",
        "reconcile": {
            "url": upstream.url + "/_status/{key}",
            "timeout": "500ms",
            "every": "200ms",
        },
    }


async def set_status(upstream: Process, key: str, status: int) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(upstream.url + "/_set_status", json={"key": key, "status": status})


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["park", "reconcile-done", "reconcile-not_done"])
async def test_unknown_outcome_follows_policy(
    gateway_for: Build, upstream: Process, policy: str
) -> None:
    """The first attempt times out after it was sent: its outcome is unknown, and it is
    never retried blind. Parked, it waits for a person; reconciled, `done` completes it
    without a second attempt and `not_done` delivers it once more."""
    extra = reconcile_block(upstream) if policy != "park" else {"on_unknown_outcome": "park"}
    gw = await gateway_for([async_route(upstream_timeout="500ms", **extra)], sweep=True)
    key = unique(policy)
    if policy == "reconcile-not_done":
        await set_status(upstream, key, 404)
    assert (await send(gw, key, "sleep=1.5&sleep_runs=1")).status_code == 202
    if policy == "park":
        record = await wait_for_state(gw, key, State.PARKED)
        await asyncio.sleep(2.0)  # the job finishes upstream; nothing sends it again
        record = await wait_for_state(gw, key, State.PARKED)
        assert record.attempts == 1
        assert await upstream_count(upstream, key) == 1
        return
    record = await wait_for_state(gw, key, State.COMPLETED)
    assert events(record, "retry_scheduled") == [] or policy == "reconcile-not_done"
    if policy == "reconcile-done":
        assert record.attempts == 1
        assert record.response is not None and record.response.origin == "reconciled"
        await asyncio.sleep(0.5)
        assert await upstream_count(upstream, key) == 1
    else:
        assert record.attempts == 2
        assert record.response is not None and record.response.origin == "upstream"
        assert await upstream_count(upstream, key) == 2


async def test_stop_picking_then_drain_leaves_nothing_lost(
    gateway_for: Build, upstream: Process
) -> None:
    """SIGTERM's order (serve): no new pick at once, then the grace for attempts under
    way, then those still out are unresolved (here parked, the route's policy). What
    was queued stays queued, for the other replicas."""
    gw = await gateway_for([async_route(upstream_timeout="10s")])
    running, waiting = unique("running"), unique("waiting")
    assert (await send(gw, running, "sleep=5")).status_code == 202
    await wait_for_state(gw, running, State.IN_FLIGHT)
    gw.gateway.delivery.stop_picking()
    assert (await send(gw, waiting)).status_code == 202
    await gw.gateway.engine.drain(0.3)
    record = await wait_for_state(gw, running, State.PARKED)
    assert "shut down" in record.reason
    await asyncio.sleep(0.5)
    assert (await record_of(gw, waiting)).state is State.QUEUED  # type: ignore[union-attr]
    assert await upstream_count(upstream, waiting) == 0


async def test_stored_request_drops_headers_and_the_key(
    gateway_for: Build, upstream: Process
) -> None:
    """What is stored is what the upstream gets, minus drop_headers and the key header;
    the key header is added again at each attempt."""
    dl = {"mode": "async", "drop_headers": ["X-Secret"]}
    gw = await gateway_for([async_route(delivery=dl)], server={"max_deliveries": 0})
    key = unique("headers")
    path = "/jobs/send-invoices?a=1"
    headers = {"Idempotency-Key": key, "X-Secret": "hunter2", "X-Keep": "yes"}
    assert (await gw.post(path, content=b"{}", headers=headers)).status_code == 202
    stored = await gw.gateway.store.get_request(ref_of(key))
    assert stored is not None
    names = {n.lower() for n, _ in stored.headers}
    assert "x-keep" in names and "x-forwarded-for" in names
    assert "x-secret" not in names and "idempotency-key" not in names
    assert (stored.method, stored.target, stored.body) == ("POST", path, b"{}")
    # A reload lets this process deliver (its lanes start, their rescan finds the
    # item): the upstream sees the key, not the secret.
    gw.gateway.reload(config_for(upstream.url, [async_route(delivery=dl)]))
    record = await wait_for_state(gw, key, State.COMPLETED)
    assert record.response is not None
    seen = json.loads(record.response.body)["headers"]
    assert seen["idempotency-key"] == key and seen["x-keep"] == "yes"
    assert "x-secret" not in seen


_NAMES = st.sampled_from(
    "x-secret cookie idempotency-key x-idem x-keep connection host x-forwarded-for "
    "forwarded content-type x-real-ip te".split()
)


def _any_case(name: str) -> st.SearchStrategy[str]:
    return st.tuples(*(st.sampled_from([c.lower(), c.upper()]) for c in name)).map("".join)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(
    drop=st.lists(_NAMES.flatmap(_any_case), max_size=3),
    key_header=st.one_of(st.none(), _NAMES.flatmap(_any_case)),
    headers=st.lists(st.tuples(_NAMES, st.text(max_size=4)), max_size=10),
    proxies=st.sampled_from([NO_PROXIES, TrustedProxies([ip_network("127.0.0.0/8")])]),
)
def test_stored_request_keeps_what_the_set_filter_kept(
    drop: list[str], key_header: str | None, headers: list[tuple[str, str]], proxies: Any
) -> None:
    """The stored request's headers are those forwarded, minus drop_headers and the key
    header (either in any case), in order: as the filter that lower-cased every name
    against a set built per request kept them (the request's names are lower-case)."""
    route = Route(
        name="r",
        path="/r",
        upstream="http://127.0.0.1:1",
        key=KeySpec((KeySource("header", "Idempotency-Key"),)),
        forward_key_header=key_header,
        delivery=DeliveryConfig(mode="async", drop_headers=drop),
    )
    parts = RequestParts("POST", "/r", "a=1", headers, b"{}")
    origin = Origin("127.0.0.1", "http", proxies)
    forwarded = forwarded_headers(parts.headers, origin.client, origin.scheme, proxies)
    never = {n.lower() for n in drop} | ({key_header.lower()} if key_header else set())
    kept = tuple((n, v) for n, v in forwarded if n.lower() not in never)
    stored = stored_request(route, parts, origin)
    assert stored.headers == kept
    assert (stored.method, stored.target, stored.body) == ("POST", "/r?a=1", b"{}")


async def test_queue_full_refuses_new_keys_only(gateway_for: Build, upstream: Process) -> None:
    """max_deliveries: 0 accepts only; at max_queued new keys get 503 queue-full with
    Retry-After, repeats of queued ones still their 202."""
    route = async_route(delivery={"mode": "async", "max_queued": 2})
    gw = await gateway_for([route], server={"max_deliveries": 0})
    first, second = unique("q"), unique("q")
    assert (await send(gw, first)).status_code == 202
    assert (await send(gw, second)).status_code == 202
    await asyncio.sleep(1.5)  # the admission depth is at most QUEUE_WATCH old
    full = await send(gw, unique("q"))
    assert full.status_code == 503
    assert full.json()["type"].endswith("queue-full")
    assert full.headers["retry-after"] == "30"
    again = await send(gw, first)
    assert (again.status_code, again.json()["state"]) == (202, "queued")
    assert await upstream_count(upstream, first) == 0


async def test_deliveries_of_a_removed_route_are_parked(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([async_route()], server={"max_deliveries": 0})
    key = unique("orphan")
    assert (await send(gw, key)).status_code == 202
    renamed = {**async_route(), "name": "other", "match": {"path": "/other"}}
    gw.gateway.reload(config_for(upstream.url, [renamed], server={"max_deliveries": 0}))
    await asyncio.sleep(1.5)  # the queue watch sees the route's pending work
    gw.gateway.store.due.lost()  # a rescan, as after a reconnect
    record = await wait_for_state(gw, key, State.PARKED)
    assert record.reason == f"route {ROUTE!r} is no longer configured"
    assert record.attempts == 0
    assert await upstream_count(upstream, key) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "store_kind",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_storm_two_gateways_one_delivery_per_key(
    make_store: Callable[[], Any], upstream: Process, store_kind: str
) -> None:
    """20 keys x 5 parallel copies, spread over two gateways on one Redis (or one
    PostgreSQL, whose pick is FOR UPDATE SKIP LOCKED): each caller gets a 202 for its
    key, and each key is delivered exactly once."""
    config = config_for(upstream.url, [async_route()])
    gateways = [Gateway(config, store=make_store(), sweep=False) for _ in range(2)]
    clients = [GatewayClient(g) for g in gateways]
    for g in gateways:
        await g.start()
    try:
        prefix = unique("storm")
        keys = [f"{prefix}-{i}" for i in range(20)]
        calls = [
            send(clients[(i + copy) % 2], key, "sleep=0.2")
            for i, key in enumerate(keys)
            for copy in range(5)
        ]
        answers = await asyncio.gather(*calls)
        assert all(a.status_code == 202 for a in answers)
        assert sorted({a.json()["key"] for a in answers}) == sorted(keys)
        for key in keys:
            await wait_for_state(clients[0], key, State.COMPLETED)
        async with httpx.AsyncClient() as client:
            counts = await client.get(f"{upstream.url}/_counts", params={"prefix": prefix})
        assert counts.json()["runs"] == {key: 1 for key in keys}
    finally:
        for c in clients:
            await c.http.aclose()
        for g in gateways:
            await g.close()


async def test_work_accepted_before_a_reload_made_the_route_sync_is_delivered(
    gateway_for: Build, upstream: Process
) -> None:
    """A 202 is a promise: a reload that makes the route sync keeps a lane for what it
    accepted while async, until that is delivered; the sync repeat then replays it."""
    gw = await gateway_for([async_route()], server={"max_deliveries": 0})
    key = unique("resync")
    assert (await send(gw, key)).status_code == 202
    await asyncio.sleep(1.5)  # the queue watch sees the route's pending work
    sync = {k: v for k, v in async_route().items() if k not in ("delivery", "retry")}
    gw.gateway.reload(config_for(upstream.url, [sync]))
    record = await wait_for_state(gw, key, State.COMPLETED)
    assert record.attempts == 1
    assert await upstream_count(upstream, key) == 1
    again = await send(gw, key)
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert await upstream_count(upstream, key) == 1


async def test_a_gateway_that_delivers_nothing_does_not_listen_for_delivery_notices(
    gateway_for: Build, upstream: Process
) -> None:
    """max_deliveries 0, or no async route: the gateway's store does not hear due and
    taken notices (on Redis it does not subscribe to them, so an accept costs it no
    message). A reload that lets it deliver makes it listen, and what it accepted
    before is delivered; one that stops it delivering stops it listening."""
    sync = {k: v for k, v in async_route().items() if k not in ("delivery", "retry")}
    assert not (await gateway_for([sync])).gateway.store.due.listening
    gw = await gateway_for([async_route()], server={"max_deliveries": 0})
    assert not gw.gateway.store.due.listening
    key = unique("listen")
    assert (await send(gw, key)).status_code == 202
    gw.gateway.reload(config_for(upstream.url, [async_route()]))
    assert gw.gateway.store.due.listening
    record = await wait_for_state(gw, key, State.COMPLETED)
    assert record.attempts == 1 and await upstream_count(upstream, key) == 1
    gw.gateway.reload(config_for(upstream.url, [async_route()], server={"max_deliveries": 0}))
    assert not gw.gateway.store.due.listening
