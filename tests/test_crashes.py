"""Gateway processes that die or are told to stop, on a real Redis (and PostgreSQL:
a SIGKILLed gateway's lease runs out into the route's policy on either store)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.records import State
from tests.conftest import unique, upstream_count
from tests.support.records import StoreServer, read_record, until_state
from tests.support.servers import (
    ROOT,
    Process,
    RedisServer,
    free_port,
    gateway_process,
    wait_for_port,
)

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis]

TOKEN = "crash-test-token"


#: Short store timeouts keep the lease margin small: lease = deadline + about 2.2 s on
#: Redis. PostgreSQL's get 500 ms (lease = deadline + 4 s): a commit waits for its
#: fsync, which on a busy 2-core machine can take a good part of 200 ms.
STORE_TIMEOUT = {"redis": "200ms", "postgres": "500ms"}


def write_config(
    tmp_path: Path, upstream: Process, store: StoreServer, prefix: str, **route: Any
) -> tuple[Path, int, int]:
    port, admin_port = free_port(), free_port()
    timeout = STORE_TIMEOUT["postgres" if store.url.startswith("postgres") else "redis"]
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": route.pop("grace", "5s")},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": TOKEN},
        "store": {
            "url": store.url,
            "prefix": prefix,
            "socket_timeout": timeout,
            "connect_timeout": timeout,
        },
        "routes": [
            {
                "name": "charge",
                "match": {"methods": ["POST"], "path": "/jobs/charge"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "fingerprint": ["method", "path", "body"],
                **route,
            }
        ],
    }
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port, admin_port


@pytest.mark.slow
@pytest.mark.parametrize(
    ("store_kind", "policy"),
    [
        pytest.param("redis", "reconcile", id="reconcile"),
        pytest.param("redis", "park", id="park"),
        pytest.param("postgres", "reconcile", id="postgres-reconcile", marks=pytest.mark.postgres),
        pytest.param("postgres", "park", id="postgres-park", marks=pytest.mark.postgres),
    ],
)
async def test_sigkill_mid_request_then_new_gateway(
    tmp_path: Path,
    upstream: Process,
    store_kind: str,
    policy: str,
    request: pytest.FixtureRequest,
) -> None:
    """The gateway dies while the upstream holds the request; the next gateway's sweep
    finds the dead lease (by the store's clock) and opens the key per the route's
    policy: reconcile asks the upstream (done: completed), park leaves it to a person.
    Never resent blind, on Redis and on PostgreSQL alike."""
    server: StoreServer = request.getfixturevalue(
        "postgres_database" if store_kind == "postgres" else "redis_server"
    )
    prefix = unique("kill") + ":"
    extra: dict[str, Any] = {"upstream_timeout": "1s", "on_unknown_outcome": policy}
    if policy == "reconcile":
        extra["reconcile"] = {
            "url": upstream.url + "/_status/{key}",
            "every": "300ms",
            "timeout": "500ms",
        }
    path, port, _ = write_config(tmp_path, upstream, server, prefix, **extra)
    first = gateway_process(path, port).start()
    key = unique("charge")
    body = {"job_key": key}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        request = asyncio.create_task(
            client.post("/jobs/charge", json=body, params={"sleep": "0.8"}, timeout=10)
        )
        await asyncio.sleep(0.4)  # the upstream has the request
        first.kill()
        with pytest.raises(httpx.TransportError):
            await request
    record = await read_record(server, prefix, "charge", key)
    assert record is not None and record.state is State.IN_FLIGHT  # nobody settled it
    second = gateway_process(path, port).start()
    try:
        expected = State.COMPLETED if policy == "reconcile" else State.PARKED
        record = await until_state(server, prefix, "charge", key, expected, timeout=20)
        assert record.history[0] == {
            "at_ms": record.history[0]["at_ms"],
            "event": "unknown",
            "reason": "lease_expired",
        }
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            retry = await client.post("/jobs/charge", json=body, params={"sleep": "0.8"})
        if policy == "reconcile":
            assert (
                retry.status_code == 200 and retry.headers["idempotent-resolved-by"] == "reconciled"
            )
        else:
            assert retry.status_code == 409 and retry.json()["state"] == "parked"
        assert await upstream_count(upstream, key) == 1  # never resent blind
    finally:
        second.stop()


async def test_sigterm_past_grace_marks_in_flight_unresolved(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    prefix = unique("term") + ":"
    path, port, _ = write_config(
        tmp_path,
        upstream,
        redis_server,
        prefix,
        grace="500ms",
        upstream_timeout="10s",
        on_unknown_outcome="reconcile",
        reconcile={"url": upstream.url + "/_status/{key}", "every": "1h"},
    )
    gateway = gateway_process(path, port).start()
    key = unique("charge")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        request = asyncio.create_task(
            client.post("/jobs/charge", json={"job_key": key}, params={"sleep": "3"}, timeout=10)
        )
        await asyncio.sleep(0.3)
        started = time.monotonic()
        gateway.signal(signal.SIGTERM)
        response = await request
    assert response.status_code == 504
    assert "shut down" in response.json()["detail"]
    assert gateway.proc is not None and gateway.proc.wait(10) == 0
    assert time.monotonic() - started < 3  # it did not wait for the 3 s handler
    record = await read_record(redis_server, prefix, "charge", key)
    assert record is not None and record.state is State.UNRESOLVED
    assert record.reason == "the gateway shut down before the upstream answered"
    assert "marked unresolved" in gateway.output()


async def test_sigterm_lets_short_requests_finish(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    prefix = unique("term") + ":"
    path, port, _ = write_config(tmp_path, upstream, redis_server, prefix, grace="5s")
    gateway = gateway_process(path, port).start()
    key = unique("charge")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        request = asyncio.create_task(
            client.post("/jobs/charge", json={"job_key": key}, params={"sleep": "1"}, timeout=10)
        )
        await asyncio.sleep(0.3)
        gateway.signal(signal.SIGTERM)
        response = await request
    assert response.status_code == 200
    assert gateway.proc is not None and gateway.proc.wait(10) == 0
    record = await read_record(redis_server, prefix, "charge", key)
    assert record is not None and record.state is State.COMPLETED


def keys_cli(admin_port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GATEWAY_ADMIN_TOKEN": TOKEN}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "keys",
            "--admin-url",
            f"http://127.0.0.1:{admin_port}",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=30,
    )


async def test_keys_cli_lists_claims_and_resolves(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    prefix = unique("cli") + ":"
    path, port, admin_port = write_config(
        tmp_path, upstream, redis_server, prefix, upstream_timeout="200ms"
    )
    gateway = gateway_process(path, port).start()
    try:
        wait_for_port(admin_port)
        key = unique("charge")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (
                await client.post("/jobs/charge", json={"job_key": key}, params={"sleep": "0.4"})
            ).status_code == 504
        listing = keys_cli(admin_port, "list")
        assert listing.returncode == 0, listing.stderr
        assert "ROUTE" in listing.stdout and key in listing.stdout and "parked" in listing.stdout
        as_json = json.loads(keys_cli(admin_port, "--json", "list", "--state", "parked").stdout)
        assert key in [k["key"] for k in as_json["keys"]]
        assert keys_cli(admin_port, "claim", "charge", key, "--operator", "alice").returncode == 0
        held = keys_cli(admin_port, "claim", "charge", key, "--operator", "bob")
        assert (
            held.returncode == 1
            and "Another operator holds this key" in held.stderr
            and "alice" in held.stderr
        )
        resolved = keys_cli(
            admin_port, "resolve", "charge", key, "done", "--operator", "alice", "--note", "paid"
        )
        assert resolved.returncode == 0, resolved.stderr
        shown = keys_cli(admin_port, "show", "charge", key)
        assert "state:    completed" in shown.stdout
        # The timeline: the shared token's alice, marked as such, and the note.
        assert "claimed by alice (shared token)" in shown.stdout
        assert "resolved done by alice (shared token): paid" in shown.stdout
        unauthorized = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "keys",
                "--admin-url",
                f"http://127.0.0.1:{admin_port}",
                "list",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "GATEWAY_ADMIN_TOKEN": "wrong"},
            timeout=30,
        )
        assert unauthorized.returncode == 1 and "401" in unauthorized.stderr
    finally:
        gateway.stop()
