"""Upstream faults against real processes: two gateway processes, one redis-server, and
a raw-socket upstream (tests/support/raw_upstream.py) that breaks its answers on demand.

For every fault the promise is checked per key: the upstream ran the work at most once
(or, after a 5xx, once more and never two at a time); every caller got the first
response, a replay, or a problem+json a scheduler can act on; and a key whose outcome
is unknown stays open (parked, or checked by the reconciler), never silently free.

What happens to an answer that breaks after the status line (a half-sent response, a
body cut off, a body that never ends or outgrows `max_response_body`): the status says
the request arrived, and a streaming endpoint sends "200" before its work is done, so
the outcome is unknown. The caller gets 504 `outcome-unknown` with `upstream_status`;
the key stays open per route policy; a repeat gets 409 `outcome-pending` until it is
checked or a person resolves it. Nothing is resent.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.records import Record, State
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.raw_upstream import raw_upstream_server
from tests.support.records import read_record, until_state
from tests.support.servers import Process, RedisServer, free_port, gateway_process

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis]

AREA = "upstream faults"
PREFIX = unique("upf") + ":"
#: Nothing listens here until test_connection_refused starts an upstream on it.
REFUSED_PORT = free_port()


@pytest.fixture(scope="module")
def raw() -> Iterator[Process]:
    server = raw_upstream_server().start()
    yield server
    server.stop()


def _config(tmp: Path, raw: Process, redis: RedisServer) -> tuple[Path, int]:
    port = free_port()

    def route(name: str, **settings: Any) -> dict[str, Any]:
        return {
            "name": name,
            "match": {"methods": ["POST", "PUT"], "path": f"/{name}/{{job}}"},
            "upstream": raw.url,
            "key": {"header": "Idempotency-Key"},
            **settings,
        }

    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        # Store timeouts that a loaded machine meets (the storm sends 120 requests at
        # once); no test here waits for a lease: deadline + 7 s.
        "store": {
            "url": redis.url,
            "prefix": PREFIX,
            "socket_timeout": "1s",
            "connect_timeout": "1s",
        },
        "routes": [
            route(
                "jobs",
                upstream_timeout="1500ms",
                max_stored_body="1KiB",
                max_response_body="1MiB",
            ),
            route(
                "checked",
                upstream_timeout="1s",
                on_unknown_outcome="reconcile",
                reconcile={
                    "url": raw.url + "/_status/{key}",
                    "every": "300ms",
                    "timeout": "1s",
                    "park_after": "1h",
                },
            ),
            {
                **route("refused", upstream_timeout="2s"),
                "upstream": f"http://127.0.0.1:{REFUSED_PORT}",
            },
            route("storm", upstream_timeout="10s"),
            route(
                "later",
                upstream_timeout="1500ms",
                delivery="async",
                retry={"attempts": 3, "backoff": "100ms"},
            ),
            {
                "name": "open",
                "match": {"path": "/open/{job}"},
                "upstream": raw.url,
                "upstream_timeout": "1500ms",
                "max_stored_body": "1KiB",
            },
        ],
    }
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory, raw: Process, redis_server: RedisServer
) -> Iterator[list[Process]]:
    """Two gateway processes on one Redis, each sweeping, in front of the raw upstream."""
    tmp = tmp_path_factory.mktemp("upstream-faults")
    started: list[Process] = []
    try:
        for _ in range(2):
            path, port = _config(tmp, raw, redis_server)
            started.append(gateway_process(path, port).start())
        yield started
    finally:
        for gateway in started:
            gateway.stop()


@pytest.fixture
async def client(gateways: list[Process]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateways[0].url, timeout=30) as http:
        yield http


def key_header(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


async def upstream_stats(raw: Process, key: str) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{raw.url}/_count", params={"key": key})
        return {name: int(value) for name, value in response.json().items()}


async def until_upstream(raw: Process, key: str, field: str, at_least: int = 1) -> None:
    """Wait (bounded) until the raw upstream's figure for `key` reaches `at_least`."""
    deadline = time.monotonic() + 15
    while (await upstream_stats(raw, key))[field] < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"the upstream's {field} for {key} never reached {at_least}")
        await asyncio.sleep(0.05)


def is_problem(response: httpx.Response) -> bool:
    return response.headers.get("content-type") == "application/problem+json"


def problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    """The problem+json body, after checking it is the one a scheduler can act on."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc: dict[str, Any] = response.json()
    assert doc["type"].endswith("/" + slug), doc
    return doc


def note(
    ledger: Ledger, test: str, runs: int, *, requests: int, detail: str, records_lost: int = 0
) -> None:
    """The ledger row of one fault on one key: every run past the first is a duplicate."""
    ledger.record(
        AREA,
        test,
        requests=requests,
        faults=1,
        upstream_duplicates=max(0, runs - 1),
        records_lost=records_lost,
        detail=detail,
    )


def lost_unless_parked(record: Record | None) -> int:
    """1 when the key's record is gone or not parked: the open key was lost."""
    return int(record is None or record.state is not State.PARKED)


# -- slow: past the route's deadline ---------------------------------------------------


async def test_slow_upstream_past_timeout_is_parked_never_resent(
    client: httpx.AsyncClient, raw: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    key = unique("slow")
    params = {"sleep": "2.5"}  # the route's deadline is 1.5 s
    first = asyncio.create_task(client.post("/jobs/slow", params=params, headers=key_header(key)))
    await until_upstream(raw, key, "count")
    duplicate = await client.post("/jobs/slow", params=params, headers=key_header(key))
    answer = await first
    # The upstream finishes its work after the gateway gave up on it; then a repeat.
    await _until_done(raw, key)
    repeat = await client.post("/jobs/slow", params=params, headers=key_header(key))
    record = await read_record(redis_server, PREFIX, "jobs", key)
    runs = (await upstream_stats(raw, key))["count"]
    note(
        ledger,
        "slow past the deadline (park)",
        runs,
        requests=3,
        records_lost=lost_unless_parked(record),
        detail="upstream sleeps 2.5 s behind a 1.5 s deadline; a duplicate waits on it",
    )
    doc = problem(answer, 504, "outcome-unknown")
    assert "1.5s" in doc["detail"] and doc["key"] == key
    assert problem(duplicate, 409, "outcome-pending")["state"] == "parked"
    assert problem(repeat, 409, "outcome-pending")["state"] == "parked"
    assert record is not None and record.state is State.PARKED
    assert "no complete answer within 1.5s" in record.reason
    assert runs == 1


async def _until_done(raw: Process, key: str) -> None:
    deadline = time.monotonic() + 15
    async with httpx.AsyncClient(timeout=10) as http:
        while (await http.get(f"{raw.url}/_status/{key}")).status_code != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"the upstream never finished {key}")
            await asyncio.sleep(0.05)


async def test_slow_upstream_reconciled_once_it_finished(
    client: httpx.AsyncClient, raw: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """Policy reconcile: while the work still runs, the check is inconclusive and the
    repeat gets 409; once the upstream says it ran, the key completes, unrun twice."""
    key = unique("checked")
    params = {"sleep": "3"}  # the route's deadline is 1 s
    answer = await client.post("/checked/slow", params=params, headers=key_header(key))
    early = await client.post("/checked/slow", params=params, headers=key_header(key))
    record = await until_state(redis_server, PREFIX, "checked", key, State.COMPLETED)
    late = await client.post("/checked/slow", params=params, headers=key_header(key))
    runs = (await upstream_stats(raw, key))["count"]
    note(
        ledger,
        "slow past the deadline (reconcile)",
        runs,
        requests=3,
        detail="upstream sleeps 3 s behind a 1 s deadline; its status endpoint settles it",
    )
    problem(answer, 504, "outcome-unknown")
    assert problem(early, 409, "outcome-pending")["state"] == "unresolved"
    events = [event["event"] for event in record.history]
    assert events[0] == "unknown" and "reconcile" in events
    assert late.status_code == 200
    assert late.headers["idempotent-resolved-by"] == "reconciled"
    assert runs == 1


# -- answers that break after the request was sent --------------------------------------

BROKEN = {
    # fault: (what the record's reason says, the status the gateway saw first)
    "reset": ("connection broke", None),
    "half_headers": ("the upstream closed the connection after it answered 200", 200),
    "reset_mid_body": ("the body was cut off after it answered 200", 200),
    "close_mid_body": ("the body was cut off after it answered 200", 200),
}


@pytest.mark.parametrize("method", ["POST", "PUT"])
@pytest.mark.parametrize("fault", sorted(BROKEN))
async def test_broken_answer_is_never_resent(
    client: httpx.AsyncClient,
    raw: Process,
    redis_server: RedisServer,
    ledger: Ledger,
    fault: str,
    method: str,
) -> None:
    """RST before any answer, a status line and half the headers then FIN, a body cut
    by RST or FIN: the request reached the upstream, so it ran (or may have). PUT is
    here because aiohttp resends PUT, GET and DELETE by itself after such a break."""
    key = unique(fault)
    params = {"fault": fault}
    answer = await client.request(method, "/jobs/broken", params=params, headers=key_header(key))
    repeat = await client.request(method, "/jobs/broken", params=params, headers=key_header(key))
    record = await read_record(redis_server, PREFIX, "jobs", key)
    runs = (await upstream_stats(raw, key))["count"]
    note(
        ledger,
        f"{fault} ({method})",
        runs,
        requests=2,
        records_lost=lost_unless_parked(record),
        detail=f"raw upstream: {fault} after reading the request",
    )
    reason, status = BROKEN[fault]
    doc = problem(answer, 504, "outcome-unknown")
    assert doc.get("upstream_status") == status
    assert problem(repeat, 409, "outcome-pending")["state"] == "parked"
    assert record is not None and record.state is State.PARKED
    assert record.reason.startswith(reason), record.reason
    assert runs == 1


# -- a status line that is no HTTP status ----------------------------------------------


async def _answer_or_none(
    client: httpx.AsyncClient, path: str, params: dict[str, str], key: str
) -> httpx.Response | None:
    """The gateway's answer, or None when the connection ended without one."""
    try:
        return await client.post(path, params=params, headers=key_header(key))
    except httpx.TransportError:
        return None


@pytest.mark.parametrize("status", [600, 999])
@pytest.mark.parametrize("size", [0, 64 * 1024], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["jobs", "open"])
async def test_a_status_outside_100_to_599_is_an_unknown_outcome(
    client: httpx.AsyncClient,
    raw: Process,
    redis_server: RedisServer,
    ledger: Ledger,
    route: str,
    size: int,
    status: int,
) -> None:
    """`HTTP/1.1 600 Status` is no HTTP answer (RFC 9110 15: 100 to 599): the request
    was sent and what came back cannot be understood, so its outcome is unknown, as
    for any other answer the gateway cannot read. The caller gets 504 (a key's
    repeat, 409), never zero bytes; the job is not run again. The same for a body
    large enough to be streamed (jobs and open store 1 KiB)."""
    key = unique(f"s{status}")
    params = {"status": str(status), "fail": "1"} | ({"size": str(size)} if size else {})
    answer = await _answer_or_none(client, f"/{route}/odd", params, key)
    repeat = await _answer_or_none(client, f"/{route}/odd", params, key)
    runs = (await upstream_stats(raw, key))["count"]
    keyed = route == "jobs"
    record = await read_record(redis_server, PREFIX, route, key) if keyed else None
    note(
        ledger,
        f"status {status} on a {'keyed' if keyed else 'passthrough'} route"
        + (" (streamed)" if size else ""),
        runs if keyed else 1,
        requests=2,
        records_lost=lost_unless_parked(record) if keyed else 0,
        detail=f"raw upstream: HTTP/1.1 {status} with a {size}-byte body",
    )
    assert answer is not None, "the caller got no answer"
    doc = problem(answer, 504, "outcome-unknown")
    assert f"answered {status}" in doc["detail"] and "upstream_status" not in doc, doc
    assert repeat is not None, "the repeat got no answer"
    if keyed:
        assert problem(repeat, 409, "outcome-pending")["state"] == "parked"
        assert record is not None and record.state is State.PARKED
        assert runs == 1
    else:
        assert repeat.status_code == 200 and runs == 2  # passthrough: each request runs


@pytest.mark.parametrize("status", [600, 999])
async def test_a_delivery_answered_outside_100_to_599_is_never_attempted_again(
    client: httpx.AsyncClient,
    raw: Process,
    redis_server: RedisServer,
    ledger: Ledger,
    status: int,
) -> None:
    """An async route's attempt answered 600: the attempt's outcome is unknown, so the
    delivery is parked for a person, never retried like a 5xx."""
    key = unique(f"d{status}")
    accepted = await client.post(
        "/later/odd", params={"status": str(status), "fail": "1"}, headers=key_header(key)
    )
    assert accepted.status_code == 202, accepted.text
    record = await until_state(redis_server, PREFIX, "later", key, State.PARKED)
    await asyncio.sleep(0.5)  # five backoffs: a retry would have gone out by now
    runs = (await upstream_stats(raw, key))["count"]
    note(
        ledger,
        f"status {status} on a delivery",
        runs,
        requests=1,
        detail=f"raw upstream: HTTP/1.1 {status} to the first attempt",
    )
    assert f"answered {status}" in record.reason, record.reason
    assert runs == 1


# -- bytes after an answer's end ----------------------------------------------------------


async def test_stray_bytes_after_a_204_are_never_the_next_answer(
    client: httpx.AsyncClient, raw: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """The upstream answers 204 announcing Content-Length: 5, and answers the next
    request on that connection with a forged 200 before the real one. The gateway
    closes the 204's connection, so the next keyed request (on a new one) gets its
    real answer, stored and replayed; the forged one reaches nobody."""
    first, second = unique("stray"), unique("after-stray")
    answer = await client.post(
        "/jobs/stray", params={"fault": "stray_after_204"}, headers=key_header(first)
    )
    following = await client.post("/jobs/next", headers=key_header(second))
    repeat = await client.post("/jobs/next", headers=key_header(second))
    record = await read_record(redis_server, PREFIX, "jobs", second)
    runs = (await upstream_stats(raw, second))["count"]
    wrong = int(following.json() != {"key": second, "run": 1, "status": 200})
    ledger.record(
        AREA,
        "bytes after a 204 (a forged response on the connection)",
        requests=3,
        faults=1,
        upstream_duplicates=max(0, runs - 1),
        detail=f"204 with Content-Length: 5, then a forged 200; wrong answers: {wrong}",
    )
    assert answer.status_code == 204 and answer.content == b""
    assert following.status_code == 200 and not wrong, following.text
    assert repeat.headers["idempotent-replayed"] == "true"
    assert repeat.json() == following.json()
    assert record is not None and record.state is State.COMPLETED
    assert b"forged" not in (record.response.body if record.response else b"")
    assert runs == 1


# -- never sent: connection refused -------------------------------------------------------


async def test_connection_refused_releases_and_the_retry_runs_once(
    client: httpx.AsyncClient, redis_server: RedisServer, ledger: Ledger
) -> None:
    key = unique("refused")
    refused = await client.post("/refused/x", headers=key_header(key))
    released = await read_record(redis_server, PREFIX, "refused", key)
    late = raw_upstream_server(REFUSED_PORT).start()  # the upstream comes up
    try:
        retry = await client.post("/refused/x", headers=key_header(key))
        repeat = await client.post("/refused/x", headers=key_header(key))
        runs = (await upstream_stats(late, key))["count"]
    finally:
        late.stop()
    note(
        ledger,
        "connection refused",
        runs,
        requests=3,
        detail="nothing listens on the upstream's port, then an upstream starts there",
    )
    problem(refused, 502, "upstream-unreachable")
    assert released is None  # never sent: the key is free, nothing to check
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert repeat.status_code == 200 and repeat.headers["idempotent-replayed"] == "true"
    assert repeat.json() == retry.json() == {"key": key, "run": 1, "status": 200}
    assert runs == 1


# -- large and endless bodies -----------------------------------------------------------


async def test_response_larger_than_max_stored_body(
    client: httpx.AsyncClient, raw: Process, ledger: Ledger
) -> None:
    key = unique("big")
    params = {"size": "5000"}  # max_stored_body is 1 KiB
    first = await client.post("/jobs/big", params=params, headers=key_header(key))
    repeat = await client.post("/jobs/big", params=params, headers=key_header(key))
    runs = (await upstream_stats(raw, key))["count"]
    note(
        ledger,
        "response larger than max_stored_body",
        runs,
        requests=2,
        detail="5000-byte body, max_stored_body 1KiB",
    )
    assert first.status_code == 200 and first.content == b"s" * 5000
    assert repeat.status_code == 200 and repeat.content == b""
    assert repeat.headers["idempotent-replayed"] == "true"
    assert repeat.headers["idempotent-body-omitted"] == "true"
    assert runs == 1


async def test_endless_trickle_ends_at_the_deadline_and_stays_open(
    client: httpx.AsyncClient, raw: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    key = unique("trickle")
    params = {"fault": "endless", "rate": "trickle"}
    answer = await client.post("/jobs/endless", params=params, headers=key_header(key))
    repeat = await client.post("/jobs/endless", params=params, headers=key_header(key))
    await until_upstream(raw, key, "peer_closed")  # the gateway hung up on it
    record = await read_record(redis_server, PREFIX, "jobs", key)
    runs = (await upstream_stats(raw, key))["count"]
    note(
        ledger,
        "never-ending chunked body (trickle)",
        runs,
        requests=2,
        records_lost=lost_unless_parked(record),
        detail="a 16-byte chunk every 50 ms, forever; deadline 1.5 s",
    )
    doc = problem(answer, 504, "outcome-unknown")
    assert doc["upstream_status"] == 200
    assert problem(repeat, 409, "outcome-pending")["state"] == "parked"
    assert record is not None and record.state is State.PARKED
    assert record.reason == "no complete answer within 1.5s after it answered 200"
    assert runs == 1


async def test_endless_flood_and_oversized_bodies_stop_at_max_response_body(
    client: httpx.AsyncClient, raw: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """A body that never ends, as fast as the gateway reads, and one that announces
    1.5 MiB: the gateway reads at most max_response_body (1 MiB) and hangs up, so its
    memory is bounded by the route, not by the upstream. The work ran: the key stays
    open. The flood outgrew max_stored_body (1 KiB) first, so its caller was getting
    it streamed: its response is cut off (no last chunk), never completed. The other
    announced its length, so its caller gets 504 before a byte of it."""
    flood, oversized = unique("flood"), unique("oversized")
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
        await client.post(
            "/jobs/endless", params={"fault": "endless", "rate": "flood"}, headers=key_header(flood)
        )
    answer = await client.post(
        "/jobs/big", params={"size": str(1536 * 1024)}, headers=key_header(oversized)
    )
    await until_upstream(raw, flood, "peer_closed")
    sent = (await upstream_stats(raw, flood))["sent"]
    records = [await read_record(redis_server, PREFIX, "jobs", key) for key in (flood, oversized)]
    runs = [(await upstream_stats(raw, key))["count"] for key in (flood, oversized)]
    ledger.record(
        AREA,
        "never-ending body (flood) and body over max_response_body",
        requests=2,
        faults=2,
        upstream_duplicates=sum(max(0, n - 1) for n in runs),
        records_lost=sum(lost_unless_parked(r) for r in records),
        detail=f"max_response_body 1MiB; the flood had sent {sent:,} bytes at the hang-up",
    )
    doc = problem(answer, 504, "outcome-unknown")
    assert doc["upstream_status"] == 200
    assert "larger than max_response_body (1048576 bytes)" in doc["detail"]
    # 1 MiB read, plus what the sockets' buffers held; the flood goes on to 64 MiB.
    assert sent < 16 * 1024 * 1024
    for record in records:
        assert record is not None and record.state is State.PARKED
        assert "larger than max_response_body (1048576 bytes)" in record.reason
    assert runs == [1, 1]


# -- 5xx storm across two gateways ----------------------------------------------------------


async def test_5xx_storm_releases_and_retries_one_at_a_time(
    gateways: list[Process], raw: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """Many keys, four callers each spread over two gateway processes, all at once; the
    upstream answers each key's first two executions with 500 or 503 (not cached), the
    third with 200. Each 5xx releases the key, so a caller's retry (or a waiting
    duplicate) runs it again: never two at a time, never after the 200."""
    keys = [unique("storm") for _ in range(30)]
    callers_per_key, failures = 4, 2

    def params(i: int) -> dict[str, str]:
        return {"fail": str(failures), "status": "500" if i % 2 else "503", "sleep": "0.2"}

    async def caller(
        http: httpx.AsyncClient, key: str, params: dict[str, str]
    ) -> list[httpx.Response]:
        answers: list[httpx.Response] = []
        while True:
            answer = await http.post("/storm/x", params=params, headers=key_header(key))
            answers.append(answer)
            upstream_5xx = answer.status_code in (500, 503) and not is_problem(answer)
            # 409: wait for the run under way; 503: the store timed out (fail closed).
            retry_later = answer.status_code in (409, 503) and is_problem(answer)
            if "idempotent-replayed" in answer.headers and answer.status_code != 200:
                return answers  # a 5xx replayed: the checks below fail on it
            if upstream_5xx or retry_later:
                await asyncio.sleep(random.uniform(0.02, 0.15))
                continue
            return answers

    async with (
        httpx.AsyncClient(base_url=gateways[0].url, timeout=30) as one,
        httpx.AsyncClient(base_url=gateways[1].url, timeout=30) as two,
    ):
        jobs = [
            caller((one, two)[n % 2], key, params(i))
            for i, key in enumerate(keys)
            for n in range(callers_per_key)
        ]
        per_caller = await asyncio.wait_for(asyncio.gather(*jobs), 45)
        final = [
            await one.post("/storm/x", params=params(i), headers=key_header(key))
            for i, key in enumerate(keys)
        ]
    stats = {key: await upstream_stats(raw, key) for key in keys}
    answers = [a for answers in per_caller for a in answers]
    by_key: dict[str, list[httpx.Response]] = {key: [] for key in keys}
    for a in answers:
        by_key[a.request.headers["idempotency-key"]].append(a)
    duplicates = sum(
        max(0, s["count"] - failures - 1) + s["max_concurrent"] - 1 for s in stats.values()
    )
    ledger.record(
        AREA,
        "5xx storm, two gateways",
        requests=len(answers) + len(final),
        faults=len(keys) * failures,
        upstream_duplicates=duplicates,
        detail=f"{len(keys)} keys x {callers_per_key} callers; runs 1-{failures} answer 500/503",
    )
    for key, got in by_key.items():
        assert stats[key]["max_concurrent"] == 1, (key, stats[key])
        assert stats[key]["count"] == failures + 1, (key, stats[key])
        assert {a.status_code for a in got} <= {200, 409, 500, 503}, got
        # Every failed run reached exactly one caller; one caller got the first 200.
        assert sum(a.status_code >= 500 and not is_problem(a) for a in got) == failures
        firsts = [a for a in got if a.status_code == 200 and "idempotent-replayed" not in a.headers]
        assert len(firsts) == 1
        assert all(
            a.json() == {"key": key, "run": failures + 1, "status": 200}
            for a in got
            if a.status_code == 200
        )
        record = await read_record(redis_server, PREFIX, "storm", key)
        assert record is not None and record.state is State.COMPLETED
    assert all(a.status_code == 200 and a.headers["idempotent-replayed"] == "true" for a in final)
    assert all(s["count"] == failures + 1 for s in (await _stats(raw, keys)).values())


async def _stats(raw: Process, keys: list[str]) -> dict[str, dict[str, int]]:
    return {key: await upstream_stats(raw, key) for key in keys}
