"""A paused async route, with real processes: two gateway replicas on one redis-server
deliver to an upstream that is stopped (its port refuses connections) and started
again. After `delivery.pause_after` refused attempts the route pauses on both
replicas: no attempt is made but one probe every `probe_every` over both, nothing is
parked for exhaustion (with `retry.attempts` that the outage would otherwise use up),
and once the upstream is back a probe is answered, the route resumes and every key is
delivered once. The status URL's body says the route is paused, since when, and when
the next probe goes out. Attempts are counted from the gateways' own metrics.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import unique, upstream_count
from tests.support.servers import (
    Process,
    RedisServer,
    for_this_test,
    free_port,
    gateway_process,
    upstream_server,
)

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis, pytest.mark.slow]

ROUTE = "send-invoices"
PATH = "/jobs/send-invoices"
ATTEMPTS = "idempotency_gateway_delivery_attempts_total"
TOKEN = "t0ken-for-the-pause-tests"


def gateways(
    tmp_path: Path,
    redis: RedisServer,
    upstream: Process,
    n: int,
    probe_every: float = 0.5,
    attempts: int = 5,
) -> list[Process]:
    prefix = unique("pause") + ":"
    route = {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": PATH},
        "upstream": upstream.url,
        "key": {"header": "Idempotency-Key"},
        "delivery": {
            "mode": "async",
            "concurrency": 1,
            "pause_after": 3,
            "probe_every": f"{int(probe_every * 1000)}ms",
        },
        "retry": {"attempts": attempts, "backoff": "100ms", "max_backoff": "200ms"},
        "upstream_timeout": "3s",
        "on_unknown_outcome": "park",
    }
    started = []
    for _ in range(n):
        port, admin_port = free_port(), free_port()
        config = {
            "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
            "admin": {"listen": f"127.0.0.1:{admin_port}", "token": TOKEN},
            "store": {"url": redis.url, "prefix": prefix},
            "routes": [route],
        }
        path = tmp_path / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = for_this_test(gateway_process(path, port))
        gateway.admin_port = admin_port  # type: ignore[attr-defined]
        started.append(gateway.start())
    return started


async def attempts(gateways: list[Process]) -> dict[str, float]:
    """Attempts by result, summed over the replicas' metrics."""
    found: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=5) as client:
        for gateway in gateways:
            text = (await client.get(f"http://127.0.0.1:{admin(gateway)}/metrics")).text
            for result, value in re.findall(
                ATTEMPTS + r'\{result="(\w+)",route="' + ROUTE + r'"\} (\S+)', text
            ):
                found[result] = found.get(result, 0) + float(value)
    return found


def admin(gateway: Process) -> int:
    port: int = gateway.admin_port  # type: ignore[attr-defined]
    return port


def tried(counts: dict[str, float]) -> float:
    return sum(counts.values())


async def until(check: Any, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("window", "probe_every", "retries"),
    [
        pytest.param(3.0, 0.5, 5, id="3s-outage"),
        pytest.param(30.0, 1.0, 12, marks=pytest.mark.long, id="30s-outage"),
    ],
)
async def test_a_refusing_upstream_pauses_the_route_and_a_probe_resumes_it(
    tmp_path: Path, redis_server: RedisServer, window: float, probe_every: float, retries: int
) -> None:
    """`retries` attempts per key: 4 keys would use all of them in under 2 s of backoff
    without the pause; the probes of a `window` spread over the keys stay below it."""
    upstream = for_this_test(upstream_server())  # not started: its port refuses
    replicas = gateways(tmp_path, redis_server, upstream, 2, probe_every, retries)
    keys = [unique("job") for _ in range(4)]
    locations = []
    async with httpx.AsyncClient(base_url=replicas[0].url, timeout=10) as client:
        for key in keys:
            answer = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
            assert answer.status_code == 202, answer.text
            locations.append(answer.headers["location"])

        async def paused() -> bool:
            return bool((await client.get(locations[0])).json()["paused"])

        await until(paused)
        body = (await client.get(locations[0])).json()
        assert body["state"] in ("queued", "retrying")
        assert set(body["paused"]) == {"since", "next_probe_at"}
        assert body["paused"]["next_probe_at"] is not None
        at_pause = tried(await attempts(replicas))
        # At pause_after, and at most one more per replica already past its look.
        assert 3 <= at_pause <= 3 + len(replicas), at_pause
        await asyncio.sleep(window)
        during = await attempts(replicas)
        probes = tried(during) - at_pause
        # One probe every 500ms over both replicas, not one per replica nor per key.
        expected = window / probe_every
        assert expected - 2 <= probes <= expected + 1, (probes, during)
        assert during.get("exhausted", 0) == 0, during  # nothing parked: 4 keys x 5 would be

        upstream.start()
        for key in keys:

            async def delivered(key: str = key) -> bool:
                return await upstream_count(upstream, key) >= 1

            await until(delivered)

        async def resumed() -> bool:
            bodies = [(await client.get(url)).json() for url in locations]
            return all(b["state"] == "completed" and b["paused"] is None for b in bodies)

        await until(resumed)
    assert [await upstream_count(upstream, key) for key in keys] == [1] * len(keys)
    finished = await attempts(replicas)
    assert finished.get("exhausted", 0) == 0 and finished["completed"] == len(keys)
    logs = "".join(gateway.output() for gateway in replicas)
    assert logs.count(f"route {ROUTE} paused after") == 1, logs
    assert f"route {ROUTE} resumed: a probe was answered" in logs


def cli(gateway: Process, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GATEWAY_ADMIN_TOKEN": TOKEN}
    env.pop("GATEWAY_OPERATOR_TOKEN", None)
    url = f"http://127.0.0.1:{admin(gateway)}"
    return subprocess.run(
        [sys.executable, "-m", "gateway", "keys", *args, "--admin-url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


async def test_an_operator_pauses_and_resumes_a_route_through_the_cli_and_the_api(
    tmp_path: Path, redis_server: RedisServer, upstream: Process
) -> None:
    """A manual pause sends nothing, not even a probe, and shows in the overview, the
    gauge and the status URL; an answer cannot lift it, a resume does; who and why are
    recorded and logged."""
    (gateway,) = gateways(tmp_path, redis_server, upstream, 1)
    paused = cli(gateway, "pause", ROUTE, "--why", "upstream maintenance", "--operator", "alice")
    assert paused.returncode == 0, paused.stderr
    assert f"route {ROUTE}: paused since" in paused.stdout and "by alice" in paused.stdout
    key = unique("job")
    base = f"http://127.0.0.1:{admin(gateway)}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.post(
            gateway.url + PATH, content=b"{}", headers={"Idempotency-Key": key}
        )
        assert answer.status_code == 202
        await asyncio.sleep(1.5)  # three probe intervals: an operator's pause sends none
        assert await upstream_count(upstream, key) == 0
        body = (await client.get(gateway.url + answer.headers["location"])).json()
        assert body["state"] == "queued" and body["paused"]["next_probe_at"] is None
        overview = (await client.get(base + "/admin/overview", headers=auth)).json()
        (row,) = overview["routes"]
        assert (
            row["paused"]["by"] == "alice (shared token)"
            and row["paused"]["why"] == "upstream maintenance"
        )
        metrics = (await client.get(base + "/metrics")).text
        assert f'idempotency_gateway_route_paused{{by="operator",route="{ROUTE}"}} 1.0' in metrics
        assert f'idempotency_gateway_route_paused{{by="auto",route="{ROUTE}"}} 0.0' in metrics

        refused = await client.post(
            base + f"/admin/routes/{ROUTE}/resume", headers=auth, json={"operator": "bob"}
        )
        assert refused.status_code == 400 and refused.json()["field"] == "why"
        unknown = await client.post(
            base + "/admin/routes/nope/pause", headers=auth, json={"why": "x", "operator": "bob"}
        )
        assert unknown.status_code == 404
        assert unknown.json()["type"].endswith("/unknown-route")
        resumed = await client.post(
            base + f"/admin/routes/{ROUTE}/resume",
            headers=auth,
            json={"why": "maintenance over", "operator": "bob"},
        )
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["paused"] is None and resumed.json()["by"] == "bob (shared token)"

        async def delivered() -> bool:
            return await upstream_count(upstream, key) >= 1

        await until(delivered)
    assert await upstream_count(upstream, key) == 1
    logs = gateway.output()
    assert "operator alice" in logs and "pause_route: route " + ROUTE in logs
    assert "operator bob" in logs and "resume_route: route " + ROUTE in logs
    again = cli(gateway, "resume", ROUTE, "--why", "again", "--operator", "carol")
    assert (
        again.returncode == 0
        and "delivering (resumed by carol (shared token): again)" in again.stdout
    )


async def test_a_long_pause_parks_nothing_for_exhaustion(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """One delivery, five attempts, the route paused after three refused: the outage
    outlasts many probes, all of this one delivery; paused, it is never parked for
    exhaustion, and the upstream back, it is delivered once."""
    upstream = for_this_test(upstream_server())  # not started: its port refuses
    (gateway,) = gateways(tmp_path, redis_server, upstream, 1, probe_every=0.2, attempts=5)
    key = unique("job")
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
        answer = await client.post(PATH, content=b"{}", headers={"Idempotency-Key": key})
        assert answer.status_code == 202, answer.text
        location = answer.headers["location"]

        async def paused() -> bool:
            return bool((await client.get(location)).json()["paused"])

        await until(paused)
        await asyncio.sleep(2)  # ten probes
        body = (await client.get(location)).json()
        counts = await attempts([gateway])
        assert counts.get("exhausted", 0) == 0, counts
        assert body["state"] in ("queued", "retrying"), body
        upstream.start()

        async def delivered() -> bool:
            return await upstream_count(upstream, key) >= 1

        await until(delivered)
    assert await upstream_count(upstream, key) == 1
