"""Delayed delivery across real processes: an async route's `delivery.delay`, and the
caller's `Delivery-Delay` and `Delivery-Not-Before` headers. The first attempt is never
sent before the due time by the upstream's own clock, and is sent once after it; a
gateway stopped after the 202 and a new one started on the same store (a SQLite file,
a redis-server) keeps it; a repeat of the key keeps the first request's due time; the
headers never reach the upstream; and values that are not a delay or an HTTP-date, or
ask for more than `delivery.max_delay`, are refused with 400 and nothing queued.

Everything is a real process: the test upstream under uvicorn (it counts runs per key
and says when each arrived, `received_at`), redis-server, and `python -m gateway run`.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from email.utils import formatdate
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.errors import PROBLEM_BASE
from tests.conftest import unique, upstream_count
from tests.support.servers import (
    Process,
    RedisServer,
    for_this_test,
    free_port,
    gateway_process,
)

pytestmark = [pytest.mark.anyio, pytest.mark.process]

PATH = "/jobs/send-later"
OWN_PATH = "/jobs/own-delay"
#: Some slack for the clocks' resolution: the store's milliseconds, a float's rounding.
EPSILON = 0.005


def write_config(tmp_path: Path, upstream: Process, store: dict[str, Any]) -> tuple[Path, int]:
    port = free_port()
    common = {
        "upstream": upstream.url,
        "key": {"header": "Idempotency-Key"},
        "on_unknown_outcome": "park",
        "retry": {"attempts": 3, "backoff": "100ms", "max_backoff": "500ms"},
    }
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {"socket_timeout": "1s", "connect_timeout": "1s", **store},
        "routes": [
            {
                "name": "send-later",
                "match": {"methods": ["POST"], "path": PATH},
                "delivery": {"mode": "async", "max_delay": "1h"},
                **common,
            },
            {
                "name": "own-delay",
                "match": {"methods": ["POST"], "path": OWN_PATH},
                "delivery": {
                    "mode": "async",
                    "delay": "1500ms",
                    "max_delay": "1h",
                    "delay_header": "X-Run-In",
                    "not_before_header": False,
                },
                **common,
            },
        ],
    }
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def start_gateway(config: Path, port: int) -> Process:
    return for_this_test(gateway_process(config, port)).start()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> dict[str, Any]:
    return {"url": f"sqlite://{tmp_path / 'gateway.db'}"}


def when(text: str) -> float:
    """An RFC 3339 time of the gateway's bodies as POSIX time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


async def send(
    client: httpx.AsyncClient, gateway: Process, key: str, headers: dict[str, Any], path: str = PATH
) -> httpx.Response:
    return await client.post(
        gateway.url + path,
        json={"job_key": key},
        headers={"Idempotency-Key": key, **headers},
    )


async def delivered(
    client: httpx.AsyncClient, gateway: Process, url: str, timeout: float = 15
) -> dict[str, Any]:
    """The status body once the delivery completed (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        body: dict[str, Any] = (await client.get(gateway.url + url)).json()
        if body["state"] == "completed":
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.1)


def upstream_saw(status: dict[str, Any]) -> dict[str, Any]:
    """What the upstream answered the attempt: its run, arrival time and the headers."""
    answer: dict[str, Any] = json.loads(status["response"]["body"])
    return answer


async def test_a_delivery_delay_is_waited_for_then_delivered_once(
    tmp_path: Path, upstream: Process, sqlite_store: dict[str, Any]
) -> None:
    """`Delivery-Delay: 2s`: the 202 and the status URL say when it is due; nothing
    reaches the upstream before (by its own clock), then one attempt does, without the
    header; a repeat asking for another delay keeps the first due time."""
    gateway = start_gateway(*write_config(tmp_path, upstream, sqlite_store))
    key = unique("delay")
    async with httpx.AsyncClient(timeout=10) as client:
        sent_at = time.time()
        first = await send(client, gateway, key, {"Delivery-Delay": "2s"})
        assert first.status_code == 202, first.text
        body = first.json()
        due = when(body["due"])
        assert sent_at + 2 - EPSILON <= due <= time.time() + 2 + EPSILON
        status = (await client.get(gateway.url + body["status_url"])).json()
        assert status["state"] == "queued" and status["attempts"] == 0
        assert status["next_attempt_at"] == body["due"]
        repeat = await send(client, gateway, key, {"Delivery-Delay": "30m"})
        assert repeat.status_code == 202 and repeat.headers["idempotent-replayed"] == "true"
        assert repeat.json()["due"] == body["due"]
        assert await upstream_count(upstream, key) == 0
        done = await delivered(client, gateway, body["status_url"])
        after = await send(client, gateway, key, {})  # completed: nothing is due any more
    assert after.json()["state"] == "completed" and "due" not in after.json()
    assert done["attempts"] == 1 and await upstream_count(upstream, key) == 1
    answer = upstream_saw(done)
    assert answer["received_at"] >= due - EPSILON
    assert answer["received_at"] >= sent_at + 2 - EPSILON
    assert "delivery-delay" not in answer["headers"]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_delay_outlasts_a_gateway_restart(
    tmp_path: Path, upstream: Process, kind: str, request: pytest.FixtureRequest
) -> None:
    """The gateway that answered 202 is stopped while the delivery waits; a new one on
    the same store delivers it once, and not before its due time."""
    if kind == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        store = {"url": redis.url, "prefix": unique("delay") + ":"}
    else:
        store = {"url": f"sqlite://{tmp_path / 'gateway.db'}"}
    config, port = write_config(tmp_path, upstream, store)
    key = unique("restart")
    async with httpx.AsyncClient(timeout=10) as client:
        first = start_gateway(config, port)
        sent_at = time.time()
        accepted = await send(client, first, key, {"Delivery-Delay": "2500ms"})
        assert accepted.status_code == 202, accepted.text
        due = when(accepted.json()["due"])
        assert first.stop() == 0
        assert await upstream_count(upstream, key) == 0
        second = start_gateway(config, port)
        done = await delivered(client, second, accepted.json()["status_url"])
    assert done["attempts"] == 1 and await upstream_count(upstream, key) == 1
    arrived = upstream_saw(done)["received_at"]
    assert arrived >= due - EPSILON and arrived >= sent_at + 2.5 - EPSILON


async def test_a_route_delay_and_a_not_before_time(
    tmp_path: Path, upstream: Process, sqlite_store: dict[str, Any]
) -> None:
    """The route's own `delay` with no header; a header of the name the route sets
    (`X-Run-In`), never forwarded; `Delivery-Not-Before`, an HTTP-date, never forwarded;
    a time already past is due at once."""
    gateway = start_gateway(*write_config(tmp_path, upstream, sqlite_store))
    own, renamed, later, past = (unique(n) for n in ("own", "renamed", "later", "past"))
    async with httpx.AsyncClient(timeout=10) as client:
        sent_at = time.time()
        not_before = formatdate(int(sent_at) + 2, usegmt=True)  # whole seconds: >= 1 s on
        replies = await asyncio.gather(
            send(client, gateway, own, {}, OWN_PATH),
            send(client, gateway, renamed, {"X-Run-In": "1"}, OWN_PATH),
            send(client, gateway, later, {"Delivery-Not-Before": not_before}),
            send(client, gateway, past, {"Delivery-Not-Before": formatdate(0, usegmt=True)}),
        )
        assert [r.status_code for r in replies] == [202] * 4, [r.text for r in replies]
        assert "due" not in replies[3].json()
        done = await asyncio.gather(
            *(delivered(client, gateway, r.json()["status_url"]) for r in replies)
        )
    seen = [upstream_saw(d) for d in done]
    assert [d["attempts"] for d in done] == [1, 1, 1, 1]
    assert seen[0]["received_at"] >= sent_at + 1.5 - EPSILON
    assert seen[1]["received_at"] >= sent_at + 1 - EPSILON
    assert seen[1]["received_at"] < when(replies[0].json()["due"])  # its own, not the route's
    assert "x-run-in" not in seen[1]["headers"]
    assert seen[2]["received_at"] >= int(sent_at) + 2
    assert "delivery-not-before" not in seen[2]["headers"]
    assert seen[3]["received_at"] < sent_at + 1
    for key in (own, renamed, later, past):
        assert await upstream_count(upstream, key) == 1


HOSTILE = [
    # Header bytes are read as Latin-1: b"\xb2" is "\u00b2", which str.isdigit() takes.
    ("Delivery-Delay", "\u00b2".encode("latin-1")),
    ("Delivery-Delay", "\u00b2s".encode("latin-1")),
    ("Delivery-Delay", "\u0662s".encode()),  # Arabic-Indic two: int() takes it
    ("Delivery-Delay", "1e9"),
    ("Delivery-Delay", "-5"),
    ("Delivery-Delay", "-5s"),
    ("Delivery-Delay", "+5s"),
    ("Delivery-Delay", "5 fortnights"),
    ("Delivery-Delay", ""),
    ("Delivery-Delay", "0x10"),
    ("Delivery-Delay", "NaN"),
    ("Delivery-Delay", "inf"),
    ("Delivery-Delay", "2h 30m"),
    ("Delivery-Not-Before", "tomorrow"),
    ("Delivery-Not-Before", "Fri, 31 Feb 2026 10:00:00 GMT"),
    ("Delivery-Not-Before", "Fri, 04 Dec 2026 25:00:00 GMT"),
    ("Delivery-Not-Before", "Fri, 04 Dec 2026 18:00:61 GMT"),
    ("Delivery-Not-Before", "2026-12-04T18:00:00Z"),
    ("Delivery-Not-Before", "Fri, 04 Dec 2026 18:00:00 CET"),
    ("Delivery-Not-Before", "\u0661\u0662".encode()),
]
TOO_LONG = [
    ("Delivery-Delay", "2h"),
    ("Delivery-Delay", "3601"),
    ("Delivery-Delay", "9" * 400 + "d"),
    ("Delivery-Delay", "99999999999999999999999999"),
    ("Delivery-Not-Before", "Fri, 01 Jan 2100 00:00:00 GMT"),
]


async def test_hostile_delivery_times_are_refused_and_nothing_is_queued(
    tmp_path: Path, upstream: Process, sqlite_store: dict[str, Any]
) -> None:
    """Each value that is no delay or HTTP-date, or asks for more than max_delay (1h),
    or two delivery-time headers: 400 `bad-delivery-time` naming the header (and the
    cap), and the key stays free: the same key sent right is accepted, not replayed."""
    gateway = start_gateway(*write_config(tmp_path, upstream, sqlite_store))
    async with httpx.AsyncClient(timeout=10) as client:
        cases: list[tuple[list[tuple[str, Any]], str]] = [([pair], "malformed") for pair in HOSTILE]
        cases += [([pair], "too long") for pair in TOO_LONG]
        cases.append(([("Delivery-Delay", "1s"), ("Delivery-Delay", "1s")], "twice"))
        cases.append(
            ([("Delivery-Delay", "1s"), ("Delivery-Not-Before", formatdate(usegmt=True))], "both")
        )
        for headers, why in cases:
            key = unique("hostile")
            response = await client.post(
                gateway.url + PATH,
                json={"job_key": key},
                headers=[("Idempotency-Key", key), *headers],
            )
            assert response.status_code == 400, (headers, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            problem = response.json()
            assert problem["type"] == PROBLEM_BASE + "bad-delivery-time", problem
            assert problem["route"] == "send-later"
            if why in ("malformed", "too long"):
                assert problem["header"] == headers[0][0], problem
            if why == "malformed":
                assert "must be" in problem["detail"] and "max_delay_seconds" not in problem
            if why == "too long":
                assert problem["max_delay_seconds"] == 3600 and "1h" in problem["detail"]
            retried = await send(client, gateway, key, {})
            assert retried.status_code == 202 and "idempotent-replayed" not in retried.headers
            assert "due" not in retried.json()


async def test_a_leap_second_not_before_is_the_next_minute_never_the_second_before(
    tmp_path: Path, upstream: Process, sqlite_store: dict[str, Any]
) -> None:
    """`Delivery-Not-Before: ... HH:MM:60 GMT` (a leap second, which comes after :59)
    is due at the next minute's :00, never at :59: one second early is still early."""
    gateway = start_gateway(*write_config(tmp_path, upstream, sqlite_store))
    key = unique("leap")
    if time.time() % 60 > 55:  # the request's :60 must still be ahead when it arrives
        await asyncio.sleep(60 - time.time() % 60)
    minute = int(time.time()) // 60 * 60
    not_before = formatdate(minute, usegmt=True).replace(":00 GMT", ":60 GMT")
    async with httpx.AsyncClient(timeout=10) as client:
        accepted = await send(client, gateway, key, {"Delivery-Not-Before": not_before})
    assert accepted.status_code == 202, accepted.text
    assert when(accepted.json()["due"]) >= minute + 60, (not_before, accepted.json())


async def test_a_sync_route_reads_no_delivery_time_and_forwards_the_headers(
    tmp_path: Path, upstream: Process, sqlite_store: dict[str, Any]
) -> None:
    """A sync route has no delivery time to keep: the caller waits for the answer. The
    headers are the upstream's to read, forwarded as any other, and the request runs
    at once; a value the gateway would refuse on an async route is not refused."""
    config, port = write_config(tmp_path, upstream, sqlite_store)
    doc = yaml.safe_load(config.read_text())
    doc["routes"].append(
        {
            "name": "now",
            "match": {"methods": ["POST"], "path": "/jobs/now"},
            "upstream": upstream.url,
            "key": {"header": "Idempotency-Key"},
        }
    )
    config.write_text(yaml.safe_dump(doc))
    gateway = start_gateway(config, port)
    key = unique("sync")
    asked = {"Delivery-Delay": "2h", "Delivery-Not-Before": "tomorrow"}
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await send(client, gateway, key, asked, "/jobs/now")
    assert answer.status_code == 200, answer.text
    seen = answer.json()["headers"]
    assert seen["delivery-delay"] == "2h" and seen["delivery-not-before"] == "tomorrow"
    assert await upstream_count(upstream, key) == 1
