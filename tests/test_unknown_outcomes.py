"""Unknown outcomes: checked, never resent blind; parked for a person; the handoff."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.admin.api import create_admin_app
from gateway.keying import record_digest
from gateway.records import KeyRef, Record, State
from tests.conftest import GatewayClient, unique, upstream_count
from tests.support.servers import Process

pytestmark = pytest.mark.anyio

Build = Callable[..., Any]
TOKEN = "s3cret-admin-token"


def job_route(upstream: Process, **overrides: Any) -> dict[str, Any]:
    return {
        "name": "send-invoices",
        "match": {"methods": ["POST"], "path": "/jobs/send-invoices"},
        "key": {"body": "job_key"},
        # The query string is this suite's control channel to the test upstream.
        "fingerprint": ["method", "path", "body"],
        **overrides,
    }


def reconcile(upstream: Process, **overrides: Any) -> dict[str, Any]:
    return {
        "on_unknown_outcome": "reconcile",
        "reconcile": {
            "url": upstream.url + "/_status/{key}",
            "done": [200],
            "not_done": [404],
            "timeout": "500ms",
            "every": "300ms",
            "park_after": "1h",
            **overrides,
        },
    }


async def record_of(gw: GatewayClient, key: str, route: str = "send-invoices") -> Record | None:
    return await gw.gateway.store.get(KeyRef(record_digest(route, "", key), route, key))


async def wait_for_state(gw: GatewayClient, key: str, state: State, timeout: float = 10) -> Record:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = await record_of(gw, key)
        if record is not None and record.state is state:
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never became {state}: {await record_of(gw, key)}")


async def set_status(upstream: Process, key: str, status: int, sleep: float = 0) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(
            upstream.url + "/_set_status", json={"key": key, "status": status, "sleep": sleep}
        )


async def status_calls(upstream: Process, key: str) -> int:
    async with httpx.AsyncClient() as client:
        response = await client.get(upstream.url + "/_count", params={"key": key, "of": "status"})
        return int(response.json()["count"])


@pytest.mark.slow
async def test_article_case_checked_never_resent(gateway_for: Build, upstream: Process) -> None:
    """The handler takes 3.5 s, the gateway's deadline is 3 s: the retry does not
    reach the upstream; once the status endpoint says done, it gets a 2xx replay."""
    gw = await gateway_for([job_route(upstream, upstream_timeout="3s", **reconcile(upstream))])
    key = unique("invoices")
    body = {"job_key": key}
    first = await gw.post("/jobs/send-invoices", json=body, params={"sleep": "3.5"})
    assert first.status_code == 504
    retry = await gw.post("/jobs/send-invoices", json=body, params={"sleep": "3.5"})
    assert retry.status_code == 409  # the handler is still running: the check says 202
    assert retry.json()["state"] == "unresolved"
    assert "checked" in retry.json()["detail"] or "unknown" in retry.json()["detail"]
    await asyncio.sleep(0.8)  # the handler finishes
    retry = await gw.post("/jobs/send-invoices", json=body, params={"sleep": "3.5"})
    assert retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.headers["idempotent-resolved-by"] == "reconciled"
    assert retry.json()["reconciled"] is True
    assert await upstream_count(upstream, key) == 1
    record = await record_of(gw, key)
    assert record is not None and record.state is State.COMPLETED
    events = [e["event"] for e in record.history]
    assert events == ["unknown", "reconcile", "reconcile"]
    assert [e["answer"]["status"] for e in record.history[1:]] == [202, 200]
    registry = gw.gateway.metrics.registry
    assert (
        registry.get_sample_value(
            "idempotency_gateway_reconcile_total", {"route": "send-invoices", "result": "done"}
        )
        == 1
    )


async def test_status_not_done_runs_it_once_more_and_only_once(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([job_route(upstream, upstream_timeout="300ms", **reconcile(upstream))])
    key = unique("invoices")
    body = {"job_key": key}
    await set_status(upstream, key, 404)  # e.g. the handler failed before doing anything
    assert (
        await gw.post("/jobs/send-invoices", json=body, params={"sleep": "0.5"})
    ).status_code == 504
    await asyncio.sleep(0.3)
    retry = await gw.post("/jobs/send-invoices", json=body)
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    again = await gw.post("/jobs/send-invoices", json=body)
    assert again.headers["idempotent-replayed"] == "true"
    assert await upstream_count(upstream, key) == 2
    record = await record_of(gw, key)
    assert record is not None
    assert [e["event"] for e in record.history] == ["unknown", "reconcile", "released", "completed"]


@pytest.mark.parametrize("failure", ["hang", "error"])
async def test_inconclusive_checks_never_resend_and_park_after(
    gateway_for: Build, upstream: Process, failure: str
) -> None:
    gw = await gateway_for(
        [job_route(upstream, upstream_timeout="300ms", **reconcile(upstream, park_after="1s"))],
        sweep=True,
    )
    key = unique("invoices")
    body = {"job_key": key}
    await set_status(upstream, key, 500, sleep=2 if failure == "hang" else 0)
    assert (
        await gw.post("/jobs/send-invoices", json=body, params={"sleep": "0.4"})
    ).status_code == 504
    for _ in range(3):
        repeat = await gw.post("/jobs/send-invoices", json=body)
        assert repeat.status_code == 409
    record = await wait_for_state(gw, key, State.PARKED)
    assert await upstream_count(upstream, key) == 1
    checks = [e for e in record.history if e["event"] == "reconcile"]
    assert checks and all(e["result"] == "inconclusive" for e in checks)
    assert record.history[-1]["event"] == "parked"
    parked = await gw.post("/jobs/send-invoices", json=body)
    assert parked.status_code == 409 and parked.json()["state"] == "parked"
    assert await upstream_count(upstream, key) == 1


async def test_default_policy_parks_at_once(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([job_route(upstream, upstream_timeout="200ms")])
    key = unique()
    assert (
        await gw.post("/jobs/send-invoices", json={"job_key": key}, params={"sleep": "0.4"})
    ).status_code == 504
    record = await record_of(gw, key)
    assert record is not None and record.state is State.PARKED
    assert "0.2s" in record.reason


@pytest.mark.redis
@pytest.mark.parametrize("store_kind", ["redis"])
async def test_two_replicas_check_each_key_once_per_every(
    gateway_for: Build, upstream: Process, store_kind: str
) -> None:
    route = job_route(upstream, upstream_timeout="200ms", **reconcile(upstream, every="1s"))
    a = await gateway_for([route])
    keys = [unique("sweep") for _ in range(4)]
    for key in keys:
        await set_status(upstream, key, 500)  # inconclusive forever
        assert (
            await a.post("/jobs/send-invoices", json={"job_key": key}, params={"sleep": "0.3"})
        ).status_code == 504
    b = await gateway_for([route], sweep=True)
    c = await gateway_for([route], sweep=True)
    started = time.monotonic()
    await asyncio.sleep(3.3)
    elapsed = time.monotonic() - started
    for key in keys:
        calls = await status_calls(upstream, key)
        # Two sweepers uncoordinated would check ~2x; coordinated, once per `every`.
        assert 1 <= calls <= int(elapsed / 1.0) + 1, (key, calls)
    assert b.gateway is not c.gateway


#: What the shared token's actions are recorded as: the name given, marked.
ALICE = "alice (shared token)"


async def test_operator_handoff_recorded_and_enforced(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([job_route(upstream, upstream_timeout="200ms")], admin={"token": TOKEN})
    key = unique("invoices")
    assert (
        await gw.post("/jobs/send-invoices", json={"job_key": key}, params={"sleep": "0.4"})
    ).status_code == 504
    admin = admin_client(gw)
    path = f"/admin/keys/send-invoices/{key}"

    listing = (await admin.get("/admin/keys", params={"state": "parked"})).json()
    assert [k["key"] for k in listing["keys"] if k["key"] == key] == [key]

    alice = await admin.post(path + "/claim", json={"operator": "alice"})
    assert alice.status_code == 200 and alice.json()["holder"] == ALICE
    bob = await admin.post(path + "/claim", json={"operator": "bob"})
    assert bob.status_code == 409
    assert (
        bob.json()["holder"] == ALICE
        and bob.json()["holder_since_ms"] == alice.json()["holder_since_ms"]
    )
    refused = await admin.post(path + "/resolve", json={"operator": "bob", "outcome": "done"})
    assert refused.status_code == 409 and refused.json()["holder"] == ALICE
    done = await admin.post(
        path + "/resolve",
        json={"operator": "alice", "outcome": "done", "note": "invoice 42 went out"},
    )
    assert done.status_code == 200 and done.json()["state"] == "completed"
    history = done.json()["history"]
    assert [e["event"] for e in history] == [
        "forwarded",
        "unknown",
        "parked",
        "claimed",
        "resolved",
    ]
    assert history[-1] == {
        "at_ms": history[-1]["at_ms"],
        "event": "resolved",
        "operator": ALICE,
        "outcome": "done",
        "note": "invoice 42 went out",
    }
    repeat = await gw.post("/jobs/send-invoices", json={"job_key": key}, params={"sleep": "0.4"})
    assert repeat.status_code == 200 and repeat.headers["idempotent-resolved-by"] == "operator"
    assert repeat.json()["resolved_by"] == ALICE
    assert await upstream_count(upstream, key) == 1
    late = await admin.post(path + "/claim", json={"operator": "carol"})
    assert late.status_code == 409 and late.json()["state"] == "completed"
    registry = gw.gateway.metrics.registry
    assert (
        registry.get_sample_value(
            "idempotency_gateway_operator_actions_total", {"action": "claim", "role": "operator"}
        )
        == 1
    )


async def test_forced_takeover_and_retry(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([job_route(upstream, upstream_timeout="200ms")], admin={"token": TOKEN})
    key = unique("invoices")
    await gw.post("/jobs/send-invoices", json={"job_key": key}, params={"sleep": "0.4"})
    admin = admin_client(gw)
    path = f"/admin/keys/send-invoices/{key}"
    await admin.post(path + "/claim", json={"operator": "alice"})
    taken = await admin.post(path + "/claim", json={"operator": "bob", "force": True})
    assert taken.status_code == 200 and taken.json()["holder"] == "bob (shared token)"
    retry = await admin.post(
        path + "/resolve", json={"operator": "bob", "outcome": "retry", "note": "never sent"}
    )
    assert retry.status_code == 200 and retry.json()["state"] == "released"
    await asyncio.sleep(0.3)
    rerun = await gw.post("/jobs/send-invoices", json={"job_key": key})
    assert rerun.status_code == 200 and "idempotent-replayed" not in rerun.headers
    assert await upstream_count(upstream, key) == 2
    record = await record_of(gw, key)
    assert record is not None
    claims = [e for e in record.history if e["event"] == "claimed"]
    assert claims[-1]["takeover_from"] == ALICE


@pytest.mark.parametrize(
    "auth",
    [
        {},
        {"headers": {"Authorization": "Bearer wrong"}},
        {"params": {"token": TOKEN}},
        {"headers": {"Authorization": TOKEN}},
    ],
    ids=["none", "wrong", "query-string", "no-scheme"],
)
async def test_admin_api_refuses_bad_tokens_and_changes_nothing(
    gateway_for: Build, upstream: Process, auth: dict[str, Any]
) -> None:
    gw = await gateway_for([job_route(upstream, upstream_timeout="200ms")], admin={"token": TOKEN})
    key = unique()
    await gw.post("/jobs/send-invoices", json={"job_key": key}, params={"sleep": "0.4"})
    anonymous = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_admin_app(gw.gateway)), base_url="http://admin"
    )
    async with anonymous:
        response = await anonymous.post(
            f"/admin/keys/send-invoices/{key}/claim", json={"operator": "eve"}, **auth
        )
        listing = await anonymous.get("/admin/keys", **auth)
    assert response.status_code == 401 and listing.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    record = await record_of(gw, key)
    assert record is not None and record.state is State.PARKED and record.holder == ""


async def test_admin_api_unknown_key_and_disabled_without_token(
    gateway_for: Build, upstream: Process
) -> None:
    gw = await gateway_for([job_route(upstream)], admin={"token": TOKEN})
    admin = admin_client(gw)
    missing = await admin.get("/admin/keys/send-invoices/nope")
    assert missing.status_code == 404
    off = await gateway_for([job_route(upstream)])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_admin_app(off.gateway)), base_url="http://admin"
    ) as client:
        disabled = await client.get("/admin/keys", headers={"Authorization": "Bearer x"})
    assert disabled.status_code == 404 and "disabled" in disabled.json()["title"]


async def test_key_metrics_read_from_the_store(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([job_route(upstream, upstream_timeout="200ms")], admin={"token": TOKEN})
    for _ in range(2):
        await gw.post("/jobs/send-invoices", json={"job_key": unique()}, params={"sleep": "0.4"})
    await asyncio.sleep(0.2)
    text = (await admin_client(gw).get("/metrics")).text
    assert 'idempotency_gateway_keys{route="send-invoices",state="parked"} 2.0' in text
    assert 'idempotency_gateway_keys{route="send-invoices",state="claimed"} 0.0' in text
    age = [
        line
        for line in text.splitlines()
        if line.startswith(
            'idempotency_gateway_oldest_key_age_seconds{route="send-invoices",state="parked"}'
        )
    ]
    assert age and float(age[0].split()[-1]) >= 0.2
    assert (
        "idempotency_gateway_last_success_timestamp_seconds" not in text.split("parked")[0] or True
    )


async def test_last_success_timestamp(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([job_route(upstream)])
    before = time.time()
    await gw.post("/jobs/send-invoices", json={"job_key": unique()})
    value = gw.gateway.metrics.registry.get_sample_value(
        "idempotency_gateway_last_success_timestamp_seconds", {"route": "send-invoices"}
    )
    assert value is not None and value >= before - 1


def admin_client(gw: GatewayClient) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_admin_app(gw.gateway)),
        base_url="http://admin",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
