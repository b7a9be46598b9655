"""delivery: async: 202 at once, then the gateway delivers, in-process.

Real stores (memory and a redis-server of the tests' own), the real test upstream
under uvicorn, gateways in this process driven through ASGI; the worker is the
gateway's own (`Gateway.start`), woken by the store's notices.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import format_datetime
from ipaddress import ip_network
from typing import Any

import httpx
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from gateway.assembly import Gateway
from gateway.config import DeliveryConfig, KeySource, KeySpec, RetryConfig, Route
from gateway.delivery import attempt as delivery_attempt
from gateway.delivery.retry import next_delay, parse_retry_after, plan
from gateway.engine.accept import stored_request
from gateway.engine.outbound import Origin
from gateway.errors import StoreError
from gateway.headers import NO_PROXIES, TrustedProxies, forwarded_headers
from gateway.keying import RequestParts, record_digest
from gateway.records import KeyRef, Record, State, StoredResponse, attempts_of
from gateway.store.base import Accepted, NewDelivery
from gateway.store.memory import MemoryStore
from tests.conftest import ALL_STORES, GatewayClient, config_for, unique, upstream_count
from tests.support.faulty_store import LostPickReply, UnforeseenFault
from tests.support.ledger import Ledger
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


def test_retry_after_is_read_as_rfc_9110_writes_it_and_nothing_else() -> None:
    """delta-seconds is ASCII `1*DIGIT`, an HTTP-date one of RFC 9110's three formats
    in GMT; anything else is ignored, never an exception (`²` passes str.isdigit() and
    then float() refuses it; float() takes `٢٠` and `1_0`)."""
    now = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC).timestamp()
    for ignored in (
        "²",  # superscript two: str.isdigit() says yes, float() raises
        "¹²",
        "٢٠",  # Arabic-Indic twenty: float() reads 20
        "\uff12\uff10",  # fullwidth twenty
        "1_0",
        "+5",
        "5e1",
        "0x10",
        "\u20035",  # an em space is not OWS
        "5\u00a0",
        "NaN",
        "inf",
        "Thu, 03 Dec 2026 12:00:30 +0000",  # not GMT
        "Thu, ٠٣ Dec 2026 12:00:30 GMT",  # another script's digits in a date
        "Thu, 03 dec 2026 12:00:30 GMT",  # the month is case-sensitive
        "Thu, 3 Dec 2026 12:00:30 GMT",  # two digits for the day
        "Thu, 03 Dec 2026 24:00:30 GMT",
        "Thu, 31 Feb 2026 12:00:30 GMT",
        "Thu, 03 Dec 2026 12:00:30 GMT trailing",
        "Thu, 03 Dec 99999 12:00:30 GMT",
    ):
        assert parse_retry_after(ignored, now) is None, ignored
    assert parse_retry_after("\t 30 \t", now) == 30.0  # OWS around it is not the value
    assert parse_retry_after("007", now) == 7.0
    # RFC 9111 1.2.2: a delta-seconds too large to hold is 2^31, never an infinity
    # (which no store's JSON can hold) nor an error.
    assert parse_retry_after("9" * 400, now) == 2.0**31
    assert parse_retry_after("0" * 400 + "12", now) == 12.0
    assert parse_retry_after("2147483649", now) == 2.0**31
    # The three HTTP-date formats (RFC 9110 5.6.7), each 30 s after `now`.
    for date in (
        "Thu, 03 Dec 2026 12:00:30 GMT",
        "Thursday, 03-Dec-26 12:00:30 GMT",
        "Thu Dec  3 12:00:30 2026",
    ):
        assert parse_retry_after(date, now) == 30.0, date
    # A two-digit year more than 50 years ahead is the last such year in the past.
    assert parse_retry_after("Monday, 03-Dec-90 12:00:30 GMT", now) == 0.0
    assert parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", now) == 2.0**31


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
    """The case of "Make scheduled job handlers idempotent: safe to run twice", scaled
    down: a 3.5 s handler, a caller that gives up after 1 s. The caller has its 202 long
    before the handler finishes; the handler runs once; repeats get the same 202 and
    never reach it."""
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


class AnswerLostOnce(MemoryStore):
    """A store whose first accept of each key is written and its answer then lost (a
    connection cut after the write, and on the retry too): the gateway cannot know
    whether the request is queued. It is."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: set[str] = set()

    async def accept(self, delivery: NewDelivery) -> Accepted:
        accepted = await super().accept(delivery)
        if delivery.ref.digest not in self.lost:
            self.lost.add(delivery.ref.digest)
            raise StoreError("connection lost after the accept was written")
        return accepted


async def test_an_accept_whose_answer_was_lost_is_not_said_to_be_refused(
    upstream: Process,
) -> None:
    """The store failed on the accept after it wrote it: the job is queued and will
    run, though the gateway could not confirm it. The 503 says it may be queued and
    that a repeat with the same key shows its state; it never says the request was
    not forwarded or not accepted. The job runs once; the repeat gets its 202."""
    gateway = Gateway(config_for(upstream.url, [async_route()]), store=AnswerLostOnce())
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        key = unique("lost-accept")
        first = await send(gw, key)
        await wait_for_state(gw, key, State.COMPLETED)
        repeat = await send(gw, key)
    finally:
        await gw.http.aclose()
        await gateway.close()
    doc = first.json()
    assert first.status_code == 503 and first.headers["retry-after"], doc
    assert doc["type"].endswith("/store-unavailable"), doc
    assert "did not forward" not in doc["detail"] and "may be queued" in doc["detail"], doc
    assert "same key" in doc["detail"], doc
    assert await upstream_count(upstream, key) == 1
    assert (repeat.status_code, repeat.json()["state"]) == (202, "completed"), repeat.text


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
    # The run log: each attempt, its replica, how long, its status, the next due time.
    runs = attempts_of(record)
    assert [(a.number, a.outcome, a.status) for a in runs] == [
        (1, "retry_scheduled", 503),
        (2, "retry_scheduled", 503),
        (3, "retry_scheduled", 503),
        (4, "completed", 200),
    ]
    assert [a.failure for a in runs] == ["status", "status", "status", ""]
    assert all(a.replica and a.run_id and a.duration_ms is not None for a in runs)
    for earlier, later in itertools.pairwise(runs):
        assert earlier.ended_ms <= earlier.next_due_ms <= later.started_ms
        assert earlier.detail == "upstream answered 503"
    assert runs[-1].next_due_ms == 0 and runs[-1].detail == ""


async def test_a_rate_limited_route_delivers_in_due_order(
    gateway_for: Build, upstream: Process
) -> None:
    """`delivery: {rate: 20/s, concurrency: 1}`: eight keys accepted one after another
    reach the upstream in that order (one held back by the limit goes back to its
    place, not behind the later ones), at the rate, each in one attempt."""
    delivery = {"mode": "async", "rate": "20/s", "concurrency": 1}
    gw = await gateway_for([async_route(delivery=delivery)])
    prefix = unique("order")
    # One delivered first: the store's notices are heard by then (Redis subscribes as
    # the gateway starts, and a rescan would find keys accepted before in its order).
    assert (await send(gw, prefix)).status_code == 202
    await wait_for_state(gw, prefix, State.COMPLETED)
    keys = [f"{prefix}-{i}" for i in range(8)]
    for key in keys:
        assert (await send(gw, key)).status_code == 202
    records = [await wait_for_state(gw, key, State.COMPLETED) for key in keys]
    async with httpx.AsyncClient() as client:
        counts = (await client.get(f"{upstream.url}/_counts", params={"prefix": prefix})).json()
    arrived = {key: runs[0] for key, runs in counts["arrivals"].items() if key != prefix}
    assert sorted(keys, key=arrived.__getitem__) == keys
    assert max(arrived.values()) - min(arrived.values()) >= 7 / 20 * 0.9
    assert [r.attempts for r in records] == [1] * 8


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
    assert attempts_of(record)[0].failure == "not_sent"
    assert attempts_of(record)[0].status is None
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


async def wait_until_settled(gw: GatewayClient, key: str, timeout: float = 15) -> Record:
    """The record once its delivery has come to rest: completed, parked or unresolved."""
    rest = (State.COMPLETED, State.PARKED, State.UNRESOLVED)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = await record_of(gw, key)
        if record is not None and record.state in rest:
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never came to rest: {await record_of(gw, key)}")


@pytest.mark.parametrize("status", [301, 302, 303, 304, 307, 308])
async def test_a_redirect_completes_the_delivery(
    gateway_for: Build, upstream: Process, status: int, ledger: Ledger
) -> None:
    """A job endpoint in the Post/Redirect/Get style does the work and answers 303 (or
    any 3xx): the delivery is completed by its first attempt, never attempted again,
    and its status URL shows the redirect with its Location."""
    gw = await gateway_for([async_route()])
    key = unique(f"redirect{status}")
    query = f"status={status}&location=/jobs/done/{key}"
    accepted = await send(gw, key, query)
    assert accepted.status_code == 202
    record = await wait_until_settled(gw, key)
    assert record.state is State.COMPLETED, (record.state, record.last_attempt)
    assert record.attempts == 1 and events(record, "retry_scheduled") == []
    assert record.response is not None and record.response.status == status
    assert ("location", f"/jobs/done/{key}") in record.response.headers
    again = await send(gw, key, query)
    assert (again.status_code, again.json()["state"]) == (202, "completed")
    assert again.headers["idempotent-replayed"] == "true"
    shown = (await gw.request("GET", again.json()["status_url"])).json()
    assert shown["response"]["status"] == status
    assert ["location", f"/jobs/done/{key}"] in shown["response"]["headers"]
    assert shown["last_attempt"]["status"] == status
    await asyncio.sleep(0.3)  # FAST_RETRY's backoff is at most 200 ms: none follows
    runs = await upstream_count(upstream, key)
    ledger.record(
        "redirects", f"async route, {status}", requests=2, upstream_duplicates=max(0, runs - 1)
    )
    assert runs == 1


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
    full = await send(gw, unique("q"))  # at once: the store counts, in the same step
    assert full.status_code == 503
    assert full.json()["type"].endswith("queue-full")
    assert full.headers["retry-after"] == "30"
    again = await send(gw, first)
    assert (again.status_code, again.json()["state"]) == (202, "queued")
    assert await upstream_count(upstream, first) == 0


@pytest.mark.parametrize("store_kind", ALL_STORES)
async def test_an_accept_refused_at_the_bound_keeps_nothing_and_says_retry_later(
    gateway_for: Build, upstream: Process
) -> None:
    """At max_queued a new key gets 503 queue-full whose words say it was not queued,
    with Retry-After; the store keeps nothing for it (no record, no place in the
    bound: on a Cluster no admission mark), so once the queue has room the same key is
    accepted and delivered."""
    route = async_route(delivery={"mode": "async", "max_queued": 1})
    gw = await gateway_for([route], server={"max_deliveries": 0})
    first, refused = unique("q"), unique("q")
    assert (await send(gw, first)).status_code == 202
    full = await send(gw, refused)
    assert full.status_code == 503 and full.headers["retry-after"] == "30"
    assert full.headers["content-type"] == "application/problem+json"
    doc = full.json()
    assert doc["type"].endswith("queue-full") and doc["key"] == refused
    assert "not queued" in doc["detail"] and "nothing was kept" in doc["detail"]
    assert "again" in doc["detail"] and "Retry-After" in doc["detail"]
    assert await record_of(gw, refused) is None
    [stat] = await gw.gateway.store.queue_stats()
    assert (stat.queued, stat.retrying) == (1, 0)
    store = gw.gateway.store
    picked = await store.pick(ROUTE, ref_of(first), "run-1", 30, 8, "replica-a")
    assert picked.record is not None and picked.record.state is State.IN_FLIGHT
    assert await store.complete(ref_of(first), "run-1", StoredResponse(200, (), b"{}"), 60)
    again = await send(gw, refused)
    assert (again.status_code, again.json()["state"]) == (202, "queued"), again.text
    assert "idempotent-replayed" not in again.headers


async def test_a_burst_of_new_keys_is_admitted_up_to_max_queued_exactly(
    gateway_for: Build, upstream: Process
) -> None:
    """Forty new keys at once on a route with max_queued 5: five 202s, thirty-five 503
    queue-full, and five deliveries queued; the next new key is refused too."""
    route = async_route(delivery={"mode": "async", "max_queued": 5})
    gw = await gateway_for([route], server={"max_deliveries": 0})
    keys = [unique("burst") for _ in range(40)]
    answers = await asyncio.gather(*(send(gw, key) for key in keys))
    statuses = [a.status_code for a in answers]
    assert statuses.count(202) == 5 and statuses.count(503) == 35, statuses
    assert all(a.json()["type"].endswith("queue-full") for a in answers if a.status_code == 503)
    [stat] = await gw.gateway.store.queue_stats()
    assert (stat.queued, stat.retrying) == (5, 0)
    assert (await send(gw, unique("late"))).status_code == 503


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
        "sqlite",
    ],
)
async def test_storm_two_gateways_one_delivery_per_key(
    make_store: Callable[[], Any], upstream: Process, store_kind: str
) -> None:
    """20 keys x 5 parallel copies, spread over two gateways on one Redis (or one
    PostgreSQL, whose pick is FOR UPDATE SKIP LOCKED, or one SQLite file, whose pick
    holds its write lock): each caller gets a 202 for its key, and each key is
    delivered exactly once."""
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


# -- whatever the upstream answers, an attempt settles its record ------------------------


class RawAnswers:
    """A loopback upstream of plain asyncio streams, in the test's own loop: each
    request, read whole, is answered with the bytes given for its key (a plain 200 for
    any other), then the connection closes."""

    def __init__(self) -> None:
        self.answers: dict[str, bytes] = {}
        self.seen: set[str] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
            )
            await reader.readexactly(int(fields.get(b"content-length", b"0")))
            key = fields.get(b"idempotency-key", b"").decode("latin-1")
            writer.write(self.answers.get(key, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"))
            self.seen.add(key)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


#: Retry-After values a broken or hostile upstream may send, beside arbitrary bytes.
_ODD_RETRY_AFTER = [
    b"\xb2",  # latin-1 "²": str.isdigit() says yes, float() refuses it
    b"\xb9\xb2\xb3",
    b"1\xb2",
    b"\xc2\xb2",
    b"9" * 400,
    b"99999999999999999999",
    b"-1",
    b"1.5",
    b"1_0",
    b"inf",
    b"NaN",
    b"Thu, 03 Dec 2026 12:00:30 GMT",
    b"Thu, 03 Dec 99999 12:00:30 GMT",
    b"Thursday, 03-Dec-26 12:00:30 GMT",
    b"Thu Dec  3 12:00:30 2026",
    b"Mon, 01 Jan 0001 00:00:00 GMT",
    b"Fri, 31 Dec 9999 23:59:59 GMT",
    b"",
]
_header_names = st.one_of(
    st.sampled_from(
        [b"Retry-After", b"retry-after", b"Location", b"Content-Type", b"Date", b"X-Job"]
    ),
    st.binary(min_size=1, max_size=12),
)
_retry_after = st.one_of(
    st.sampled_from(_ODD_RETRY_AFTER),
    st.binary(max_size=40),
    st.integers(min_value=0, max_value=10**40).map(lambda n: str(n).encode()),
)
_answer_headers = st.lists(
    st.one_of(
        st.tuples(st.just(b"Retry-After"), _retry_after),
        st.tuples(_header_names, st.binary(max_size=40)),
    ),
    max_size=4,
)
_statuses = st.sampled_from([200, 201, 204, 301, 303, 304, 404, 408, 429, 500, 503])


def test_no_answer_leaves_a_delivery_in_flight(ledger: Ledger) -> None:
    """Whatever header bytes the upstream's answer carries (Retry-After among them,
    arbitrary bytes, names and values), a real delivery attempt against a raw-socket
    upstream settles its record: completed, retrying, parked or unresolved, never left
    in flight for its lease to find (which would park an answered request as an unknown
    outcome)."""
    loop = asyncio.new_event_loop()
    raw = RawAnswers()
    examples = 0
    stranded: list[tuple[int, list[tuple[bytes, bytes]], str]] = []

    async def setup() -> GatewayClient:
        url = await raw.start()
        retry = {"attempts": 2, "backoff": "10m", "max_backoff": "10m"}
        config = config_for(url, [async_route(retry=retry, upstream_timeout="2s")])
        gateway = Gateway(config, store=MemoryStore(), sweep=False)
        await gateway.start()
        return GatewayClient(gateway)

    gw = loop.run_until_complete(setup())

    async def attempt(status: int, headers: list[tuple[bytes, bytes]]) -> State:
        key = unique("answer")
        lines = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        raw.answers[key] = b"HTTP/1.1 %d X\r\n%scontent-length: 2\r\n\r\nok" % (status, lines)
        assert (await send(gw, key)).status_code == 202
        deadline = time.monotonic() + 5  # the lease is 15 s and more: a stranded one shows
        while True:
            record = await record_of(gw, key)
            assert record is not None
            if key in raw.seen and record.state not in (State.QUEUED, State.IN_FLIGHT):
                return record.state
            if time.monotonic() > deadline:
                stranded.append((status, headers, str(record.state)))
                return record.state
            await asyncio.sleep(0.01)

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )
    @example(status=503, headers=[(b"Retry-After", b"\xb2")])
    @example(status=429, headers=[(b"Retry-After", b"9" * 400)])
    @given(status=_statuses, headers=_answer_headers)
    def check(status: int, headers: list[tuple[bytes, bytes]]) -> None:
        nonlocal examples
        examples += 1
        state = loop.run_until_complete(attempt(status, headers))
        assert state not in (State.QUEUED, State.IN_FLIGHT), (status, headers, state)

    try:
        check()
    finally:
        ledger.record(
            "properties",
            "test_no_answer_leaves_a_delivery_in_flight",
            requests=examples,
            bad_inputs=examples,
            records_lost=len(stranded),
            detail=f"{examples} answers with arbitrary header bytes; left in flight: "
            f"{stranded[:3]}",
        )

        async def teardown() -> None:
            await gw.http.aclose()
            await gw.gateway.close()
            assert raw.server is not None
            raw.server.close()

        loop.run_until_complete(teardown())
        loop.close()


async def test_a_fault_before_sending_schedules_the_next_attempt(gateway_for: Build) -> None:
    """An error the client does not expect before a byte leaves (a host label over 63
    characters: UnicodeError from the resolver) is a request never sent: each attempt
    is retried per the schedule and, when none is left, parked; none stays in flight."""
    retry = {"attempts": 2, "backoff": "10ms", "max_backoff": "10ms"}
    gw = await gateway_for([async_route(upstream="http://" + "a" * 64 + ".example", retry=retry)])
    key = unique("label")
    assert (await send(gw, key)).status_code == 202
    record = await wait_until_settled(gw, key, timeout=5)
    assert record.state is State.PARKED and record.attempts == 2, record
    assert [e["attempt"]["result"] for e in events(record, "retry_scheduled")] == [
        "retry_scheduled"
    ]
    assert record.last_attempt["error"].startswith("not sent: the gateway failed")


async def test_a_fault_while_building_the_request_is_a_request_never_sent(
    gateway_for: Build, upstream: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stored request cannot be turned into the one to send, once, for a reason
    nobody foresaw: nothing was sent, so the attempt is scheduled again (not left in
    flight), and the next attempt delivers it once."""
    faults = [RuntimeError("an unforeseen fault while building the request")]
    build = delivery_attempt.delivery_outbound

    def failing_once(*args: Any) -> Any:
        if faults:
            raise faults.pop()
        return build(*args)

    monkeypatch.setattr(delivery_attempt, "delivery_outbound", failing_once)
    gw = await gateway_for([async_route()])
    key = unique("build")
    assert (await send(gw, key)).status_code == 202
    record = await wait_until_settled(gw, key, timeout=5)
    assert record.state is State.COMPLETED and record.attempts == 2, record
    (scheduled,) = events(record, "retry_scheduled")
    assert scheduled["attempt"]["error"].startswith("not sent: the gateway failed")
    assert await upstream_count(upstream, key) == 1


@pytest.mark.parametrize(
    ("fail", "query"), [("retry_later", "fail_first=1&retry_after=1"), ("complete", "")]
)
async def test_a_fault_while_settling_an_attempt_leaves_it_unresolved_not_in_flight(
    upstream: Process, fail: str, query: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The upstream answered (503, or 200); recording that answer fails with an error
    nobody foresaw. The request was sent, so the attempt is settled as an unknown
    outcome at once (parked, the route's policy) and logged with its traceback: never
    left in flight until its lease runs out, and never sent again blind."""
    store = UnforeseenFault(fail)
    gateway = Gateway(config_for(upstream.url, [async_route()]), store=store, sweep=False)
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        key = unique(f"fault-{fail}")
        assert (await send(gw, key, query)).status_code == 202
        record = await wait_until_settled(gw, key, timeout=5)
        assert record.state is State.PARKED, record
        assert "the gateway failed" in record.reason
        assert store.raised == 1
        assert any(
            r.exc_info is not None and "unforeseen fault" in str(r.exc_info[1])
            for r in caplog.records
        ), "logged with its traceback"
        await asyncio.sleep(0.3)
        assert await upstream_count(upstream, key) == 1
    finally:
        await gw.http.aclose()
        await gateway.close()


@pytest.mark.parametrize("fail", ["queue_stats", "due_candidates"])
async def test_a_fault_in_the_queue_watch_or_rescan_leaves_the_worker_delivering(
    upstream: Process, fail: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's queue watch (or its rescan) fails with an error nobody foresaw, as
    a driver's own exception escaping the store does (redis-py's RuntimeError on a
    connection its cluster client closed, after a failover). It is logged with its
    traceback and the worker goes on: a delivery accepted after it runs, once. The
    watch's failure ended the worker's lanes with it: nothing was delivered again."""
    store = UnforeseenFault(fail)
    gateway = Gateway(config_for(upstream.url, [async_route()]), store=store, sweep=False)
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        deadline = time.monotonic() + 5
        while not store.raised:  # both run at start
            assert time.monotonic() < deadline, f"{fail} never called"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        key = unique(f"watch-{fail}")
        assert (await send(gw, key)).status_code == 202
        record = await wait_for_state(gw, key, State.COMPLETED, timeout=5)
        assert record.attempts == 1, record
        assert any(
            r.exc_info is not None and "unforeseen fault" in str(r.exc_info[1])
            for r in caplog.records
        ), "logged with its traceback"
        assert await upstream_count(upstream, key) == 1
    finally:
        await gw.http.aclose()
        await gateway.close()


async def test_a_pick_whose_reply_was_lost_is_found_by_its_repeat(upstream: Process) -> None:
    """A pick takes the delivery, and its reply is lost (a store error). The worker
    tries the pick again as the same attempt (its run id), finds what its first try
    took, and sends it: once, at once. A repeat under a new run id would find the
    delivery in flight and leave it there, unsent, until its lease made it an unknown
    outcome."""
    store = LostPickReply()
    gateway = Gateway(config_for(upstream.url, [async_route()]), store=store, sweep=False)
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        key = unique("lost-pick")
        assert (await send(gw, key)).status_code == 202
        record = await wait_for_state(gw, key, State.COMPLETED, timeout=5)
        assert store.lost == 1
        assert record.attempts == 1 and len(events(record, "attempt")) == 1, record
        assert await upstream_count(upstream, key) == 1
    finally:
        await gw.http.aclose()
        await gateway.close()


# -- what an attempt says of the upstream, for the route's pause ---------------------------


async def test_a_refused_probe_is_not_an_attempt_of_its_delivery(gateway_for: Build) -> None:
    """Paused after one refusal, with two attempts allowed: each refused probe gives its
    attempt back, so many probes park nothing; its history says the probe was refused,
    and the delivery's runs read it."""
    route = async_route(
        retry={"attempts": 2, "backoff": "50ms"},
        delivery={"mode": "async", "pause_after": 1, "probe_every": "100ms"},
    )
    gw = await gateway_for([route])
    key = unique("probed")
    assert (await send(gw, key, "status=503")).status_code == 202
    deadline = time.monotonic() + 10
    probes: list[dict[str, Any]] = []
    while len(probes) < 4:  # more probes than attempts allowed
        assert time.monotonic() < deadline, await record_of(gw, key)
        await asyncio.sleep(0.05)
        record = await record_of(gw, key)
        assert record is not None and record.state is not State.PARKED, record
        probes = [
            e
            for e in events(record, "retry_scheduled")
            if e.get("attempt", {}).get("result") == "probe_refused"
        ]
    assert (await gw.gateway.store.route_pause(ROUTE)).paused
    assert record.attempts in (1, 2)  # the first attempt's, and a probe's while in flight
    assert probes[0]["attempt"]["status"] == 503
    runs = record.to_json()["delivery"]["runs"]
    assert runs[1]["outcome"] == "retry_scheduled" and runs[1]["status"] == 503, runs
    assert runs[1]["detail"], runs


async def test_a_probe_answered_with_a_status_not_cached_is_an_attempt(gateway_for: Build) -> None:
    """Only a refused probe gives its attempt back: one answered (a 408, not cached)
    resumes the route and counts, so its delivery is parked after its two attempts."""
    route = async_route(
        retry={"attempts": 2, "backoff": "50ms"},
        delivery={"mode": "async", "pause_after": 1, "probe_every": "100ms"},
    )
    gw = await gateway_for([route])
    assert (await send(gw, unique("refused"), "status=503")).status_code == 202
    deadline = time.monotonic() + 5
    while not (await gw.gateway.store.route_pause(ROUTE)).paused:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    answered = unique("answered")
    assert (await send(gw, answered, "status=408")).status_code == 202
    record = await wait_for_state(gw, answered, State.PARKED)
    assert len(events(record, "attempt")) == 2, record.history
    assert record.attempts == 2


async def test_the_pause_counts_refusals_not_unknown_outcomes_and_an_answer_resets_it(
    gateway_for: Build,
) -> None:
    """A 503 counts toward `delivery.pause_after`; an attempt sent and then timed out
    (an unknown outcome) leaves the count as it is, neither a refusal nor an answer; an
    answered attempt resets it."""
    route = async_route(
        upstream_timeout="500ms",
        on_unknown_outcome="park",
        retry={"attempts": 1, "backoff": "50ms"},
        delivery={"mode": "async", "pause_after": 3, "probe_every": "10s"},
    )
    gw = await gateway_for([route])
    store = gw.gateway.store

    async def failures_become(n: int) -> None:
        deadline = time.monotonic() + 5
        while (await store.route_pause(ROUTE)).failures != n:
            assert time.monotonic() < deadline, await store.route_pause(ROUTE)
            await asyncio.sleep(0.02)

    assert (await send(gw, unique("refused"), "status=503")).status_code == 202
    await failures_become(1)
    unknown = unique("unknown")
    assert (await send(gw, unknown, "sleep=1.5")).status_code == 202
    await wait_for_state(gw, unknown, State.PARKED)
    await asyncio.sleep(0.2)  # the count is written after the settlement
    state = await store.route_pause(ROUTE)
    assert (state.failures, state.paused) == (1, False)
    answered = unique("answered")
    assert (await send(gw, answered, "")).status_code == 202
    await wait_for_state(gw, answered, State.COMPLETED)
    await failures_become(0)
