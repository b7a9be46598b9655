"""Async routes' lanes sharing one process's `server.max_deliveries`, with real
processes: a route whose only delivery waits for a far-off due time, or a route that
is paused, holds no delivery slot while it waits, so another route's due delivery is
attempted at once even when the process delivers one at a time.

Everything is a real process: the test upstream under uvicorn, a SQLite file, and
`python -m gateway run`.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import unique, upstream_count
from tests.support.servers import Process, for_this_test, free_port, gateway_process

pytestmark = [pytest.mark.anyio, pytest.mark.process]

TOKEN = "t0ken-for-the-lane-tests"


def start(tmp_path: Path, upstream: Process) -> tuple[Process, int]:
    """One gateway, `max_deliveries: 1`, two async routes: `later` (listed first, so
    its lane starts first) and `now`."""
    gateway, admin_port, _ = configured(tmp_path, upstream)
    return gateway, admin_port


def configured(tmp_path: Path, upstream: Process) -> tuple[Process, int, dict[str, Any]]:
    """`start`'s gateway, with its config file's document (its path: `path`)."""
    port, admin_port = free_port(), free_port()

    def route(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "match": {"methods": ["POST"], "path": f"/jobs/{name}"},
            "upstream": upstream.url,
            "key": {"header": "Idempotency-Key"},
            "delivery": {"mode": "async", "max_delay": "1h", "concurrency": 1},
            "on_unknown_outcome": "park",
        }

    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s", "max_deliveries": 1},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": TOKEN},
        "store": {"url": f"sqlite://{tmp_path / 'gateway.db'}"},
        "routes": [route("later"), route("now")],
    }
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    config["path"] = str(path)
    return for_this_test(gateway_process(path, port)).start(), admin_port, config


async def delivered_within(upstream: Process, key: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await upstream_count(upstream, key) == 1:
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.parametrize("held", ["delayed", "paused"])
async def test_a_waiting_route_does_not_hold_the_processs_delivery_slot(
    tmp_path: Path, upstream: Process, held: str
) -> None:
    """`later` waits (a delivery due in an hour, or an operator's pause with one
    queued); `now`'s delivery, due at once, reaches the upstream within seconds."""
    gateway, admin_port = start(tmp_path, upstream)
    waiting, due = unique("waiting"), unique("due")
    async with httpx.AsyncClient(timeout=10) as client:
        if held == "paused":
            paused = await client.post(
                f"http://127.0.0.1:{admin_port}/admin/routes/later/pause",
                json={"why": "upstream maintenance", "operator": "ops"},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert paused.status_code == 200, paused.text
        asked = {"Delivery-Delay": "1h"} if held == "delayed" else {}
        first = await client.post(
            gateway.url + "/jobs/later",
            json={"job_key": waiting},
            headers={"Idempotency-Key": waiting, **asked},
        )
        assert first.status_code == 202, first.text
        await asyncio.sleep(0.5)  # the later lane has its hint, and waits on it
        second = await client.post(
            gateway.url + "/jobs/now", json={"job_key": due}, headers={"Idempotency-Key": due}
        )
        assert second.status_code == 202, second.text
        assert await delivered_within(upstream, due, 5), "the due delivery was never attempted"
    assert await upstream_count(upstream, waiting) == 0


async def test_a_paused_route_made_sync_can_be_resumed_and_delivers_its_queue(
    tmp_path: Path, upstream: Process
) -> None:
    """An operator pauses `later` with a delivery queued, and a reload makes the route
    sync: its queued work is still the worker's to deliver, so its pause is still
    the operator's to lift. The resume is taken, and the delivery goes out once."""
    gateway, admin_port, config = configured(tmp_path, upstream)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    base = f"http://127.0.0.1:{admin_port}/admin/routes/later"
    key = unique("stranded")
    async with httpx.AsyncClient(timeout=10) as client:
        paused = await client.post(
            base + "/pause", json={"why": "maintenance", "operator": "ops"}, headers=auth
        )
        assert paused.status_code == 200, paused.text
        accepted = await client.post(
            gateway.url + "/jobs/later", json={"job_key": key}, headers={"Idempotency-Key": key}
        )
        assert accepted.status_code == 202, accepted.text
        path = Path(config.pop("path"))
        config["routes"][0]["delivery"] = "sync"
        path.write_text(yaml.safe_dump(config))
        gateway.signal(signal.SIGHUP)
        gateway.wait_for_output("config reloaded")
        resumed = await client.post(
            base + "/resume", json={"why": "maintenance over", "operator": "ops"}, headers=auth
        )
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["paused"] is None
        assert await delivered_within(upstream, key, 5), "the queued delivery stayed held"
    assert await upstream_count(upstream, key) == 1
