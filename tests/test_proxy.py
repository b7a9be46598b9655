"""The core semantics, on both stores: a real upstream process, the gateway in-process."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import warnings
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.assembly import Gateway
from gateway.records import State
from tests.conftest import (
    ALL_STORES,
    REDIS_STORES,
    GatewayClient,
    config_for,
    unique,
    upstream_count,
)
from tests.support.faulty_store import LateClaim, UnforeseenFault
from tests.support.ledger import Ledger
from tests.support.servers import Process, free_port

pytestmark = pytest.mark.anyio

Build = Callable[..., Any]

REMINDER = {
    "name": "send-reminder",
    "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
    "key": {"body": "job_key"},
}


def route(**overrides: Any) -> dict[str, Any]:
    return {**REMINDER, **overrides}


def problem(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"] == "application/problem+json"
    doc: dict[str, Any] = response.json()
    assert (
        doc["type"].startswith("https://")
        and doc["title"]
        and doc["status"] == response.status_code
    )
    return doc


async def metric(gw: GatewayClient, name: str, **labels: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_first_request_forwarded_then_replayed(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route()])
    key = unique()
    body = {"job_key": key, "user_id": 42}
    first = await gw.post("/jobs/send-reminder", json=body)
    assert first.status_code == 200
    assert "idempotent-replayed" not in first.headers
    second = await gw.post("/jobs/send-reminder", json=body)
    assert second.status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == first.content
    assert second.headers["x-run"] == "1"
    assert await upstream_count(upstream, key) == 1
    assert (
        await metric(
            gw, "idempotency_gateway_requests_total", route="send-reminder", outcome="replayed"
        )
        == 1
    )
    assert (
        await metric(gw, "idempotency_gateway_duplicates_suppressed_total", route="send-reminder")
        == 1
    )


@pytest.mark.parametrize(
    "store_kind",
    [
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_article_parallel_pair(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route()])
    key = unique()
    body = {"job_key": key, "user_id": 42}
    a, b = await asyncio.gather(
        gw.post("/jobs/send-reminder", json=body, params={"sleep": "0.3"}),
        gw.post("/jobs/send-reminder", json=body, params={"sleep": "0.3"}),
    )
    assert a.status_code == b.status_code == 200
    assert a.content == b.content
    assert sorted(
        [a.headers.get("idempotent-replayed"), b.headers.get("idempotent-replayed")], key=str
    ) == [
        "true",
        None,
    ] or a.headers.get("idempotent-replayed") != b.headers.get("idempotent-replayed")
    assert await upstream_count(upstream, key) == 1


@pytest.mark.slow
@pytest.mark.parametrize("store_kind", ALL_STORES)
async def test_storm_of_50_copies_for_20_keys(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route()])
    keys = [unique("storm") for _ in range(20)]
    requests = [
        gw.post("/jobs/send-reminder", json={"job_key": key}, params={"sleep": "0.05"})
        for key in keys
        for _ in range(50)
    ]
    responses = await asyncio.gather(*requests)
    by_key: dict[str, set[bytes]] = {}
    for key, response in zip([k for k in keys for _ in range(50)], responses, strict=True):
        assert response.status_code == 200, response.text
        by_key.setdefault(key, set()).add(response.content)
    for key in keys:
        assert len(by_key[key]) == 1, "every caller of a key gets the same body"
        assert await upstream_count(upstream, key) == 1


# memory stores share nothing; two SQLite stores on one file are two workers
@pytest.mark.parametrize("store_kind", [pytest.param("redis", marks=pytest.mark.redis), "sqlite"])
async def test_duplicate_in_flight_waits_across_gateways(
    gateway_for: Build, upstream: Process, store_kind: str
) -> None:
    a = await gateway_for([route()])
    b = await gateway_for([route()])  # another gateway on the same Redis
    key = unique()
    body = {"job_key": key}
    first = asyncio.create_task(a.post("/jobs/send-reminder", json=body, params={"sleep": "0.5"}))
    await asyncio.sleep(0.2)
    second = await b.post("/jobs/send-reminder", json=body, params={"sleep": "0.5"})
    assert second.status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == (await first).content
    assert await upstream_count(upstream, key) == 1
    assert (
        await metric(
            b, "idempotency_gateway_requests_total", route="send-reminder", outcome="waited"
        )
        == 1
    )


async def test_concurrent_reject_gives_409_with_retry_after(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route(concurrent="reject")])
    key = unique()
    first = asyncio.create_task(
        gw.post("/jobs/send-reminder", json={"job_key": key}, params={"sleep": "0.5"})
    )
    await asyncio.sleep(0.2)
    second = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"sleep": "0.5"})
    assert second.status_code == 409
    assert int(second.headers["retry-after"]) >= 1
    doc = problem(second)
    assert doc["key"] == key and doc["route"] == "send-reminder"
    assert (await first).status_code == 200
    assert await upstream_count(upstream, key) == 1


async def test_wait_timeout_gives_409(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route(wait_timeout="200ms")])
    key = unique()
    first = asyncio.create_task(
        gw.post("/jobs/send-reminder", json={"job_key": key}, params={"sleep": "1"})
    )
    await asyncio.sleep(0.1)
    second = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"sleep": "1"})
    assert second.status_code == 409
    assert "retry-after" in second.headers
    assert "Waited" in problem(second)["detail"]
    assert (await first).status_code == 200
    assert await upstream_count(upstream, key) == 1


async def test_same_key_different_body_is_422(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route()])
    key = unique()
    assert (
        await gw.post("/jobs/send-reminder", json={"job_key": key, "user_id": 1})
    ).status_code == 200
    other = await gw.post("/jobs/send-reminder", json={"job_key": key, "user_id": 2})
    assert other.status_code == 422
    assert problem(other)["key"] == key
    assert await upstream_count(upstream, key) == 1


async def test_fingerprint_none_replays_despite_different_body(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route(fingerprint="none")])
    key = unique()
    await gw.post("/jobs/send-reminder", json={"job_key": key, "user_id": 1})
    other = await gw.post("/jobs/send-reminder", json={"job_key": key, "user_id": 2})
    assert other.status_code == 200 and other.headers["idempotent-replayed"] == "true"


async def test_uncached_status_releases_key_so_retry_runs(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route()])
    key = unique()
    body = {"job_key": key}
    failed = await gw.post("/jobs/send-reminder", json=body, params={"status": "503"})
    assert failed.status_code == 503  # the upstream's own response
    assert failed.json()["run"] == 1
    retry = await gw.post("/jobs/send-reminder", json=body)
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert await upstream_count(upstream, key) == 2
    again = await gw.post("/jobs/send-reminder", json=body)
    assert again.headers["idempotent-replayed"] == "true"


async def test_cached_4xx_is_replayed_but_408_is_not(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route()])
    key = unique()
    for _ in range(2):
        r = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"status": "400"})
        assert r.status_code == 400
    assert await upstream_count(upstream, key) == 1
    key = unique()
    for _ in range(2):
        r = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"status": "408"})
    assert await upstream_count(upstream, key) == 2


#: Every redirect a job endpoint may answer with (Post/Redirect/Get answers 303).
REDIRECTS = (301, 302, 303, 304, 307, 308)


@pytest.mark.parametrize("status", REDIRECTS)
async def test_a_redirect_is_an_answer_stored_and_replayed(
    gateway_for: Build, upstream: Process, status: int, ledger: Ledger
) -> None:
    """A job endpoint that does the work and answers 3xx has handled the request: the
    key completes, repeats replay the redirect with its Location, and the upstream runs
    once. The gateway never follows a redirect itself."""
    gw = await gateway_for([route()])
    key = unique(f"redirect{status}")
    body = {"job_key": key}
    params = {"status": str(status), "location": f"/jobs/done/{key}"}
    first = await gw.post("/jobs/send-reminder", json=body, params=params)
    assert first.status_code == status
    assert first.headers["location"] == f"/jobs/done/{key}"
    assert "idempotent-replayed" not in first.headers
    for _ in range(2):
        again = await gw.post("/jobs/send-reminder", json=body, params=params)
        assert again.status_code == status
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["location"] == f"/jobs/done/{key}"
        assert again.content == first.content
    runs = await upstream_count(upstream, key)
    ledger.record(
        "redirects", f"sync route, {status}", requests=3, upstream_duplicates=max(0, runs - 1)
    )
    assert runs == 1
    assert (
        await metric(
            gw, "idempotency_gateway_requests_total", route="send-reminder", outcome="replayed"
        )
        == 2
    )


async def test_the_last_success_gauge_counts_what_the_upstream_handled(
    gateway_for: Build, upstream: Process
) -> None:
    """The route's last success (its gauge, and the store's) follows the rule that
    decides a key: a 429 or a 408 asks to be tried again and is no success; a 303 is."""
    gw = await gateway_for([route()])
    metrics = gw.gateway.metrics
    for status in (429, 408, 503):
        params = {"status": str(status)}
        answer = await gw.post("/jobs/send-reminder", json={"job_key": unique()}, params=params)
        assert answer.status_code == status
    assert metrics.last_success_age("send-reminder") is None
    params = {"status": "303", "location": "/jobs/done"}
    assert (
        await gw.post("/jobs/send-reminder", json={"job_key": unique()}, params=params)
    ).status_code == 303
    age = metrics.last_success_age("send-reminder")
    assert age is not None and 0 <= age < 5


@pytest.mark.parametrize("status", [204, 304])
async def test_an_answer_without_content_has_no_content_length(
    gateway_for: Build, upstream: Process, status: int
) -> None:
    """204 and 304 carry no content: the answer and its replay say nothing about a
    length (RFC 9110 8.6: never for a 204; for a 304 only the length the 200 would
    have had, which the gateway does not know)."""
    gw = await gateway_for([route()])
    key = unique(f"empty{status}")
    params = {"status": str(status)}
    for replayed in (None, "true"):
        answer = await gw.post("/jobs/send-reminder", json={"job_key": key}, params=params)
        assert answer.status_code == status and answer.content == b""
        assert answer.headers.get("idempotent-replayed") == replayed
        assert "content-length" not in answer.headers, answer.headers
    assert await upstream_count(upstream, key) == 1


async def test_waiting_duplicates_contend_again_after_release(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route()])
    key = unique()
    body = {"job_key": key}
    responses = await asyncio.gather(
        *[
            gw.post("/jobs/send-reminder", json=body, params={"status": "503", "sleep": "0.2"})
            for _ in range(3)
        ]
    )
    # Each failure released the key; each waiter then ran it in turn, never two at once.
    assert sorted(r.json()["run"] for r in responses) == [1, 2, 3]


async def test_connection_refused_is_502_and_releases(
    gateway_for: Build, upstream: Process
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway_for([route(upstream=dead)])
    key = unique()
    response = await gw.post("/jobs/send-reminder", json={"job_key": key})
    assert response.status_code == 502
    assert "not sent" in problem(response)["title"]
    # Released: the next request is a first request again (and fails the same way).
    again = await gw.post("/jobs/send-reminder", json={"job_key": key})
    assert again.status_code == 502
    assert (
        await metric(
            gw,
            "idempotency_gateway_requests_total",
            route="send-reminder",
            outcome="upstream_error",
        )
        == 2
    )


async def test_a_fault_before_sending_is_never_sent_and_releases(
    gateway_for: Build, caplog: pytest.LogCaptureFixture
) -> None:
    """A host name the resolver refuses with an error the client does not expect (a
    label over 63 characters: UnicodeError, not OSError) fails before a byte leaves:
    502 and the key released, like a refused connection, logged with its traceback;
    never an error that leaves the key in flight for its lease."""
    gw = await gateway_for([route(upstream="http://" + "a" * 64 + ".example")])
    key = unique()
    for _ in range(2):  # released: the second is a first request again
        response = await gw.post("/jobs/send-reminder", json={"job_key": key})
        assert response.status_code == 502
        assert "not sent" in problem(response)["title"]
        assert await _record(gw, key) is None or (await _record(gw, key)).state is State.RELEASED
    assert any(r.exc_info is not None for r in caplog.records), "logged with its traceback"


async def test_a_fault_after_sending_is_an_unknown_outcome(
    gateway_for: Build, upstream: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error nobody foresaw once the request's bytes have left (here while the
    client hands on a streamed answer) is an unknown outcome, as a broken connection
    is: 504, the key parked, the work never run again."""
    from gateway.upstream import BodyStream

    def fault(self: BodyStream, give_up: float, deadline: float) -> None:
        raise RuntimeError("an unforeseen fault after sending")

    monkeypatch.setattr(BodyStream, "begin", fault)
    gw = await gateway_for([route(max_stored_body="1KiB")])
    key = unique()
    params = {"size": "5000"}
    first = await gw.post("/jobs/send-reminder", json={"job_key": key}, params=params)
    assert first.status_code == 504, first.text
    assert "failed after sending" in problem(first)["detail"]
    repeat = await gw.post("/jobs/send-reminder", json={"job_key": key}, params=params)
    assert repeat.status_code == 409 and problem(repeat)["state"] == "parked"
    assert await upstream_count(upstream, key) == 1


async def test_timeout_after_send_is_504_and_never_resent(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route(upstream_timeout="300ms")])
    key = unique()
    body = {"job_key": key}
    first = await gw.post("/jobs/send-reminder", json=body, params={"sleep": "1"})
    assert first.status_code == 504
    assert problem(first)["key"] == key
    repeat = await gw.post("/jobs/send-reminder", json=body, params={"sleep": "1"})
    assert repeat.status_code == 409
    assert problem(repeat)["state"] == "parked"  # the default policy hands it to a person
    await asyncio.sleep(0.8)  # the handler finishes; still nothing is resent
    again = await gw.post("/jobs/send-reminder", json=body, params={"sleep": "1"})
    assert again.status_code == 409
    assert await upstream_count(upstream, key) == 1
    record = await _record(gw, key)  # kept, not released
    assert record is not None and record.state is State.PARKED
    assert "0.3s" in record.reason


async def test_a_fault_while_completing_a_key_leaves_it_unresolved_and_answers(
    upstream: Process, caplog: pytest.LogCaptureFixture
) -> None:
    """The upstream answered; storing that answer fails with an error nobody foresaw
    (not a StoreError). The caller still gets the upstream's answer, the key is
    settled at once as an unknown outcome (parked, the route's policy) with the fault
    logged and its traceback, never left in flight for its lease, and never run again."""
    store = UnforeseenFault("complete")
    gateway = Gateway(config_for(upstream.url, [route()]), store=store, sweep=False)
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        key = unique("fault")
        first = await gw.post("/jobs/send-reminder", json={"job_key": key})
        assert first.status_code == 200 and first.json()["run"] == 1
        record = await _record(gw, key)
        assert record is not None and record.state is State.PARKED, record
        assert "the gateway failed" in record.reason
        assert any(
            r.exc_info is not None and "unforeseen fault" in str(r.exc_info[1])
            for r in caplog.records
        )
        repeat = await gw.post("/jobs/send-reminder", json={"job_key": key})
        assert repeat.status_code == 409 and problem(repeat)["state"] == "parked"
        assert await upstream_count(upstream, key) == 1
    finally:
        await gw.http.aclose()
        await gateway.close()


async def test_a_claim_that_lands_after_its_release_is_released_too(
    upstream: Process,
) -> None:
    """A claim that failed (503, nothing sent) lands in the store after the release
    meant to undo it has run: the gateway reads the key back after its release and
    releases it again, so the retry runs the job, once."""
    store = LateClaim()
    gateway = Gateway(
        config_for(upstream.url, [route(wait_timeout="1s")]), store=store, sweep=False
    )
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        key = unique("late")
        first = await gw.post("/jobs/send-reminder", json={"job_key": key})
        assert first.status_code == 503 and problem(first)["status"] == 503

        async def settled() -> bool:
            return store.landed == 1 and not gateway.engine._cleanups

        for _ in range(100):
            if await settled():
                break
            await asyncio.sleep(0.01)
        assert await settled()
        assert await _record(gw, key) is None
        retry = await gw.post("/jobs/send-reminder", json={"job_key": key})
        assert retry.status_code == 200 and retry.json()["run"] == 1
        assert await upstream_count(upstream, key) == 1
    finally:
        await gw.http.aclose()
        await gateway.close()


async def test_unknown_outcome_release_policy(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route(upstream_timeout="200ms", on_unknown_outcome="release")])
    key = unique()
    first = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"sleep": "0.5"})
    assert first.status_code == 504
    await asyncio.sleep(0.5)
    retry = await gw.post("/jobs/send-reminder", json={"job_key": key})
    assert retry.status_code == 200
    assert await upstream_count(upstream, key) == 2


async def test_large_body_reaches_first_caller_repeats_get_headers_only(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route(max_stored_body="1KiB")])
    key = unique()
    first = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"size": "5000"})
    assert first.status_code == 200 and len(first.content) == 5000
    repeat = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"size": "5000"})
    assert repeat.status_code == 200
    assert repeat.content == b""
    assert repeat.headers["idempotent-body-omitted"] == "true"
    assert repeat.headers["idempotent-replayed"] == "true"
    assert repeat.headers["content-type"].startswith("text/plain")
    assert await upstream_count(upstream, key) == 1


async def test_set_cookie_and_strip_headers_never_replayed(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route(strip_headers=["X-Run"])])
    key = unique()
    first = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"cookie": "1"})
    assert "set-cookie" in first.headers and first.headers["x-run"] == "1"
    repeat = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"cookie": "1"})
    assert repeat.headers["idempotent-replayed"] == "true"
    assert "set-cookie" not in repeat.headers
    assert "x-run" not in repeat.headers


async def test_encoded_body_stored_raw_with_its_encoding(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route()])
    key = unique()
    first = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"gzip": "1"})
    repeat = await gw.post("/jobs/send-reminder", json={"job_key": key}, params={"gzip": "1"})
    assert repeat.headers["content-encoding"] == "gzip"
    assert repeat.headers["idempotent-replayed"] == "true"
    assert json.loads(repeat.content) == json.loads(first.content)  # httpx decoded both
    raw = await gw.http.post(
        "/jobs/send-reminder",
        json={"job_key": key},
        params={"gzip": "1"},
        headers={"accept-encoding": "identity"},
    )
    stream_bytes = raw.read()
    assert json.loads(stream_bytes)["run"] == 1
    assert gzip  # the upstream compressed it; the gateway never re-encoded


async def test_forwarded_request_headers(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route()])
    key = unique()
    response = await gw.post(
        "/jobs/send-reminder?x=1",
        json={"job_key": key},
        headers={"Connection": "keep-alive, X-Hop", "X-Hop": "secret", "X-Custom": "yes"},
    )
    seen = response.json()
    headers = seen["headers"]
    assert seen["query"] == "x=1"
    assert headers["idempotency-key"] == key
    assert headers["x-custom"] == "yes"
    assert "x-hop" not in headers
    assert headers["x-forwarded-proto"] == "http"
    assert headers["x-forwarded-host"] == "gateway.test"
    assert "x-forwarded-for" in headers


async def test_header_bytes_reach_the_upstream_unchanged(
    gateway_for: Build, upstream: Process
) -> None:
    """A header value that is not ASCII (UTF-8 here, opaque bytes to HTTP) is forwarded
    byte for byte, not decoded and re-encoded as something else."""
    gw = await gateway_for([route()])
    sent = "Zoë, café \u2713".encode()
    response = await gw.post(
        "/jobs/send-reminder", json={"job_key": unique()}, headers={"X-Name": sent}
    )
    assert response.status_code == 200
    # The upstream (Starlette) reads header bytes as latin-1, like the gateway.
    assert response.json()["headers"]["x-name"].encode("latin-1") == sent


async def test_missing_key_rejected_or_forwarded(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for(
        [
            route(),
            route(
                name="lenient",
                match={"path": "/jobs/lenient"},
                key={"body": "job_key", "on_missing": "forward"},
            ),
        ]
    )
    rejected = await gw.post("/jobs/send-reminder", json={"user_id": 1})
    assert rejected.status_code == 400
    doc = problem(rejected)
    assert "job_key" in doc["detail"] and doc["route"] == "send-reminder"
    first = await gw.post("/jobs/lenient", json={"user_id": 1})
    second = await gw.post("/jobs/lenient", json={"user_id": 1})
    assert first.status_code == second.status_code == 200
    assert "idempotent-replayed" not in second.headers
    assert (
        await metric(
            gw,
            "idempotency_gateway_requests_total",
            route="lenient",
            outcome="missing_key_forwarded",
        )
        == 2
    )


async def test_route_without_key_passes_through(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([{"name": "plain", "match": {"path": "/jobs/plain"}}])
    a = await gw.post("/jobs/plain", json={"job_key": "same"})
    b = await gw.post("/jobs/plain", json={"job_key": "same"})
    assert "idempotent-replayed" not in b.headers
    assert b.json()["run"] == a.json()["run"] + 1


async def test_requests_leave_no_reference_cycles(gateway_for: Build, upstream: Process) -> None:
    """What a request allocates is freed when it ends, by reference counting. A cycle
    per request (the upstream client's parser and its exchange, once) left the
    collector a pile to walk: about 8% of the gateway's CPU, measured."""
    gw = await gateway_for([route(), {"name": "plain", "match": {"path": "/jobs/plain"}}])
    repeat = {"job_key": unique()}
    assert (await gw.post("/jobs/send-reminder", json=repeat)).status_code == 200  # warm
    with warnings.catch_warnings():
        # What earlier tests left for the collector is not this test's subject.
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # the collector keeps what it finds, to look at
    try:
        for _ in range(3):
            first = await gw.post("/jobs/send-reminder", json={"job_key": unique()})
            assert first.status_code == 200
        replay = await gw.post("/jobs/send-reminder", json=repeat)
        assert replay.headers["idempotent-replayed"] == "true"
        assert (await gw.post("/jobs/plain", json={})).status_code == 200
        gc.collect()
        # The test's own HTTP client (httpx over ASGI) is not the gateway: only
        # objects of the gateway's modules count.
        cyclic = sorted(
            {type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("gateway")}
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []


async def test_a_content_length_is_a_number_only_in_ascii_digits(
    gateway_for: Build, upstream: Process
) -> None:
    """A Content-Length the server let through that is no number (`²` passes
    str.isdigit(), int() refuses it) is refused as malformed before anything is
    claimed, never an error."""
    gw = await gateway_for([route()])
    key = unique()
    for declared in (b"\xb2", b"1\xb9", b"\xb3" * 3):
        answer = await gw.post(
            "/jobs/send-reminder",
            content=json.dumps({"job_key": key}).encode(),
            headers={"content-type": "application/json", "content-length": declared},
        )
        assert answer.status_code == 400, (declared, answer.text)
        assert problem(answer)["type"].endswith("/malformed-request")
    assert await _record(gw, key) is None
    assert await upstream_count(upstream, key) == 0


async def test_no_route_is_404_problem(gateway_for: Build) -> None:
    gw = await gateway_for([route()])
    response = await gw.post("/nowhere", json={})
    assert response.status_code == 404
    assert "No route" in problem(response)["detail"]


async def test_body_over_limit_is_413(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route(max_request_body="100B")])
    response = await gw.post("/jobs/send-reminder", json={"job_key": unique(), "pad": "x" * 200})
    assert response.status_code == 413
    problem(response)


async def test_malformed_json_is_400(gateway_for: Build) -> None:
    gw = await gateway_for([route()])
    response = await gw.post(
        "/jobs/send-reminder", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    problem(response)


@pytest.mark.parametrize(
    ("key_spec", "send"),
    [
        ({"header": "Idempotency-Key"}, lambda k: {"headers": {"Idempotency-Key": k}}),
        ({"query": "run"}, lambda k: {"params": {"run": k}}),
        (
            {"template": "r:{body.user_id}:{header.X-Day}"},
            lambda k: {"json": {"user_id": k}, "headers": {"X-Day": "3"}},
        ),
        ({"hash": ["method", "path", "body"]}, lambda k: {"json": {"id": k}}),
    ],
    ids=["header", "query", "template", "hash"],
)
async def test_each_key_source_dedupes(
    gateway_for: Build, upstream: Process, key_spec: Any, send: Any
) -> None:
    gw = await gateway_for([route(key=key_spec, fingerprint=["method", "path"])])
    k = unique()
    first = await gw.post("/jobs/send-reminder", **send(k))
    second = await gw.post("/jobs/send-reminder", **send(k))
    other = await gw.post("/jobs/send-reminder", **send(unique()))
    assert first.status_code == 200
    assert second.headers.get("idempotent-replayed") == "true"
    assert "idempotent-replayed" not in other.headers


async def test_quoted_and_bare_header_keys_are_the_same(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([route(key={"header": "Idempotency-Key"})])
    k = unique()
    await gw.post("/jobs/send-reminder", headers={"Idempotency-Key": f'"{k}"'})
    bare = await gw.post("/jobs/send-reminder", headers={"Idempotency-Key": k})
    assert bare.headers.get("idempotent-replayed") == "true"
    assert await upstream_count(upstream, k) == 1


async def test_period_key_runs_once_per_window(gateway_for: Build, upstream: Process) -> None:
    name = unique("daily")
    gw = await gateway_for(
        [
            route(
                name="daily",
                key={"template": name + ":{period}", "period": "1d", "timezone": "UTC"},
            )
        ]
    )
    first = await gw.post("/jobs/send-reminder")
    second = await gw.post("/jobs/send-reminder")
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    assert second.headers["idempotent-replayed"] == "true"
    assert first.json()["key"].startswith(name + ":20")


async def test_scope_separates_tenants(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([route(key={"body": "job_key", "scope": ["header.Authorization"]})])
    k = unique()
    alice = await gw.post(
        "/jobs/send-reminder", json={"job_key": k}, headers={"Authorization": "Bearer alice"}
    )
    bob = await gw.post(
        "/jobs/send-reminder", json={"job_key": k}, headers={"Authorization": "Bearer bob"}
    )
    assert "idempotent-replayed" not in bob.headers
    assert bob.json()["headers"]["authorization"] == "Bearer bob"
    assert alice.json()["run"] == 1 and bob.json()["run"] == 2


async def _record(gw: GatewayClient, key: str) -> Any:
    from gateway.keying import record_digest
    from gateway.records import KeyRef

    return await gw.gateway.store.get(
        KeyRef(record_digest("send-reminder", "", key), "send-reminder", key)
    )


@pytest.mark.parametrize("store_kind", REDIS_STORES)
@pytest.mark.long  # counts every script on the server: background reads can land in it
async def test_waiting_duplicate_does_not_poll_redis(
    gateway_for: Build,
    upstream: Process,
    store_kind: str,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A duplicate waiting 2 s in another gateway is woken by a notification; its
    store traffic stays a handful of commands, not a polling loop."""
    ports = _redis_ports(store_kind, request)
    a = await gateway_for([route()])
    b = await gateway_for([route()])
    await _quiet(ports)  # the gateways' start-up reads (counts, markers) are done
    key = unique()
    body = {"job_key": key}
    first = asyncio.create_task(a.post("/jobs/send-reminder", json=body, params={"sleep": "2"}))
    await asyncio.sleep(0.2)
    before = await _script_calls(ports)
    second = await b.post("/jobs/send-reminder", json=body, params={"sleep": "2"})
    calls = await _script_calls(ports) - before
    assert second.headers["idempotent-replayed"] == "true"
    assert (await first).status_code == 200
    # the first's completion (1) + the waiter's claim, its fallback re-reads (at most
    # one per 0.5 s) and its final read: a tight loop would be hundreds
    assert calls <= 8, calls
    # The subscribers held: on a cluster, a cross-slot SSUBSCRIBE once failed and
    # left waiters to the fallback re-read alone.
    assert not [r for r in caplog.records if "notifications lost" in r.getMessage()]


@pytest.mark.parametrize("store_kind", REDIS_STORES)
@pytest.mark.long  # counts every script on the server: background reads can land in it
async def test_waiting_duplicate_costs_one_round_trip(
    gateway_for: Build, upstream: Process, store_kind: str, request: pytest.FixtureRequest
) -> None:
    """The completion's notice carries the response: a duplicate waiting in another
    gateway replays it from there, so the pair costs 3 scripts (claim, claim, complete),
    not 4 (a re-read after the wake-up)."""
    ports = _redis_ports(store_kind, request)
    a = await gateway_for([route()])
    b = await gateway_for([route()])
    b.gateway.store.fallback_wait = (60.0, 60.0)  # only the notification may wake it
    for gateway in (a.gateway, b.gateway):
        # A claim made before the subscribers are up is woken when they come up, and
        # reads again: right, but not the round trip this test counts.
        await asyncio.wait_for(gateway.store.subscribed.wait(), 30)  # type: ignore[attr-defined]
    await _load_scripts(ports)  # a first NOSCRIPT would count twice
    key = unique()
    body = {"job_key": key}
    before = await _script_calls(ports)
    first = asyncio.create_task(a.post("/jobs/send-reminder", json=body, params={"sleep": "1"}))
    while await _script_calls(ports) == before:  # a has claimed
        await asyncio.sleep(0.02)
    second = await b.post("/jobs/send-reminder", json=body, params={"sleep": "1"})
    assert (await first).status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert second.content == (await first).content
    assert await _script_calls(ports) - before == 3
    assert await upstream_count(upstream, key) == 1


def _redis_ports(store_kind: str, request: pytest.FixtureRequest) -> list[int]:
    """The ports of the Redis servers behind `store_kind`: the cluster's nodes, or the one."""
    if store_kind == "cluster":
        return [node.port for node in request.getfixturevalue("redis_cluster").nodes]
    return [request.getfixturevalue("redis_server").port]


async def _load_scripts(ports: list[int]) -> None:
    import redis.asyncio as aioredis

    from gateway.store.redis.scripts import script_source

    for port in ports:
        client = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            for name in ("claim", "complete"):
                await client.script_load(script_source(name))
        finally:
            await client.aclose()


async def _quiet(ports: list[int], timeout: float = 15) -> None:
    """Until no script has run for 0.5 s: what runs after is the test's own traffic."""
    deadline = asyncio.get_running_loop().time() + timeout
    calls = await _script_calls(ports)
    while True:
        await asyncio.sleep(0.5)
        now = await _script_calls(ports)
        if now == calls or asyncio.get_running_loop().time() > deadline:
            return
        calls = now


async def _script_calls(ports: list[int]) -> int:
    import redis.asyncio as aioredis

    total = 0
    for port in ports:
        client = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            stats = await client.info("commandstats")
        finally:
            await client.aclose()
        total += sum(
            int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval")
        )
    return total
