"""Many gateway processes on one Redis: replicas, workers, reload, Redis outages, logs."""

from __future__ import annotations

import asyncio
import json
import re
import signal
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
    ROOT,
    Process,
    RedisServer,
    free_port,
    gateway_process,
    wait_for_port,
)

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis]


def config_file(
    tmp_path: Path,
    upstream: Process,
    store: dict[str, Any],
    routes: list[dict[str, Any]] | None = None,
    **server: Any,
) -> tuple[Path, int, int]:
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "3s", **server},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": "t"},
        "store": {"socket_timeout": "300ms", "connect_timeout": "300ms", **store},
        "routes": routes
        or [
            {
                "name": "send-reminder",
                "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "fingerprint": ["method", "path", "body"],
            }
        ],
    }
    path = tmp_path / f"config-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port, admin_port


async def storm(
    ports: list[int], keys: list[str], copies: int = 50, **params: str
) -> dict[str, list[httpx.Response]]:
    """`copies` parallel copies of each key's request, spread over `ports`."""
    # No keep-alive: on a loaded machine a pooled connection can sit idle past the
    # server's keep-alive timeout before its next request, and a request sent as the
    # server closes it fails without reaching the gateway (a client-side race).
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def one(i: int, key: str) -> tuple[str, httpx.Response]:
            port = ports[i % len(ports)]
            response = await client.post(
                f"http://127.0.0.1:{port}/jobs/send-reminder", json={"job_key": key}, params=params
            )
            return key, response

        results = await asyncio.gather(*[one(i, key) for key in keys for i in range(copies)])
    by_key: dict[str, list[httpx.Response]] = {}
    for key, response in results:
        by_key.setdefault(key, []).append(response)
    return by_key


async def assert_once_each(upstream: Process, by_key: dict[str, list[httpx.Response]]) -> None:
    for key, responses in by_key.items():
        assert {r.status_code for r in responses} == {200}, [
            r.text for r in responses if r.status_code != 200
        ][:3]
        assert len({r.content for r in responses}) == 1, "every caller gets the same body"
        assert await upstream_count(upstream, key) == 1, key


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.long
async def test_replicas_on_one_redis_run_each_key_once(
    tmp_path: Path, upstream: Process, redis_server: RedisServer, replicas: int
) -> None:
    prefix = unique("rep") + ":"
    gateways = []
    try:
        for _ in range(replicas):
            path, port, _ = config_file(
                tmp_path, upstream, {"url": redis_server.url, "prefix": prefix}
            )
            gateways.append(gateway_process(path, port).start())
        keys = [unique("storm") for _ in range(12)]
        by_key = await storm([g.port for g in gateways], keys, sleep="0.2")
        await assert_once_each(upstream, by_key)
        served_by = {r.json()["pid"] for rs in by_key.values() for r in rs}
        assert len(served_by) == 1  # the upstream process; the gateways all forwarded to it
    finally:
        for gateway in gateways:
            gateway.stop()


@pytest.mark.slow
async def test_workers_share_listeners_and_count_each_request_once(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    path, port, admin_port = config_file(
        tmp_path, upstream, {"url": redis_server.url, "prefix": unique("w") + ":"}
    )
    supervisor = Process(
        [sys.executable, "-m", "gateway", "run", "--config", str(path), "--workers", "2"],
        port,
        "workers",
    ).start()
    try:
        wait_for_port(admin_port)
        keys = [unique("wstorm") for _ in range(10)]
        by_key = await storm([port], keys, copies=30, sleep="0.2")
        await assert_once_each(upstream, by_key)
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{admin_port}/metrics")).text
        total = sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("idempotency_gateway_requests_total{")
        )
        assert total == 300, text
        forwarded = [
            line
            for line in text.splitlines()
            if 'outcome="forwarded"' in line and "requests_total" in line
        ]
        assert forwarded and float(forwarded[0].split()[-1]) == 10
        pids = {
            line for line in supervisor.output().splitlines() if "Started server process" in line
        }
        assert len(pids) >= 2  # two workers (each starts two servers)
    finally:
        assert supervisor.stop() == 0


def test_memory_store_refuses_several_workers(tmp_path: Path, upstream: Process) -> None:
    path, _, _ = config_file(tmp_path, upstream, {"url": "memory://"})
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--config", str(path), "--workers", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert result.returncode == 1
    assert (
        "memory://" in result.stderr
        and "--workers 1" in result.stderr
        and "Traceback" not in result.stderr
    )


async def test_sighup_reloads_routes_and_rejects_bad_config(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    path, port, _ = config_file(
        tmp_path, upstream, {"url": redis_server.url, "prefix": unique("hup") + ":"}
    )
    gateway = gateway_process(path, port).start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert (await client.post("/jobs/other", json={"job_key": "x"})).status_code == 404
            slow = asyncio.create_task(
                client.post(
                    "/jobs/send-reminder", json={"job_key": unique()}, params={"sleep": "1"}
                )
            )
            await asyncio.sleep(0.2)
            config = yaml.safe_load(path.read_text())
            config["routes"].append(
                {
                    "name": "other",
                    "match": {"path": "/jobs/other"},
                    "upstream": upstream.url,
                    "key": {"body": "job_key"},
                }
            )
            path.write_text(yaml.safe_dump(config))
            gateway.signal(signal.SIGHUP)
            await asyncio.to_thread(gateway.wait_for_output, "config reloaded")
            assert (await slow).status_code == 200  # in flight during the reload: finished
            assert (await client.post("/jobs/other", json={"job_key": unique()})).status_code == 200
            path.write_text("routes: [{name: broken}]\n")
            gateway.signal(signal.SIGHUP)
            await asyncio.to_thread(gateway.wait_for_output, "config reload rejected")
            assert (await client.post("/jobs/other", json={"job_key": unique()})).status_code == 200
        output = gateway.output()
        assert "config reloaded" in output
        assert "config reload rejected" in output and "routes[0].match" in output
    finally:
        assert gateway.stop() == 0


@pytest.mark.slow
async def test_redis_down_fails_closed_or_open_per_route_then_recovers(
    tmp_path: Path, upstream: Process
) -> None:
    redis = RedisServer().start()
    routes = [
        {
            "name": name,
            "match": {"methods": ["POST"], "path": f"/jobs/{name}"},
            "upstream": upstream.url,
            "key": {"body": "job_key"},
            "on_store_error": policy,
        }
        for name, policy in (("closed", "fail_closed"), ("open", "fail_open"))
    ]
    path, port, admin_port = config_file(tmp_path, upstream, {"url": redis.url}, routes)
    gateway = gateway_process(path, port).start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            before = unique("closed")
            assert (await client.post("/jobs/closed", json={"job_key": before})).status_code == 200
            redis.kill()
            closed_key, open_key = unique("closed"), unique("open")
            for _ in range(3):
                closed = await client.post("/jobs/closed", json={"job_key": closed_key})
                assert closed.status_code == 503 and closed.headers["retry-after"]
                assert (
                    await client.post("/jobs/open", json={"job_key": open_key})
                ).status_code == 200
            assert await upstream_count(upstream, closed_key) == 0  # nothing reached it while down
            assert await upstream_count(upstream, open_key) == 3  # fail open: forwarded, no dedupe
            ready = await client.get(f"http://127.0.0.1:{admin_port}/readyz")
            assert ready.status_code == 503
            redis.start()  # same port, no data: no persistence in this test
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                response = await client.post("/jobs/closed", json={"job_key": closed_key})
                if response.status_code == 200:
                    break
                await asyncio.sleep(0.2)
            assert response.status_code == 200
            repeat = await client.post("/jobs/closed", json={"job_key": closed_key})
            assert repeat.headers["idempotent-replayed"] == "true"
            assert await upstream_count(upstream, closed_key) == 1
            metrics = (await client.get(f"http://127.0.0.1:{admin_port}/metrics")).text
        assert (
            'idempotency_gateway_requests_total{outcome="store_bypassed",route="open"} 3.0'
            in metrics
        )
        assert 'idempotency_gateway_requests_total{outcome="store_error",route="closed"}' in metrics
    finally:
        gateway.stop()
        redis.stop()


async def test_access_log_is_json_lines_without_secrets(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    routes = [
        {
            "name": "secret",
            "match": {"methods": ["POST"], "path": "/jobs/secret"},
            "upstream": upstream.url,
            "key": {"body": "job_key"},
            "sensitive_keys": True,
        },
        {
            "name": "plain",
            "match": {"methods": ["POST"], "path": "/jobs/plain"},
            "upstream": upstream.url,
            "key": {"body": "job_key"},
        },
    ]
    path, port, _ = config_file(
        tmp_path, upstream, {"url": redis_server.url, "prefix": unique("log") + ":"}, routes
    )
    gateway = gateway_process(path, port).start()
    secret_key, plain_key = unique("card-4242"), unique("plain")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            headers = {"Authorization": "Bearer top-secret-token"}
            await client.post(
                "/jobs/secret",
                json={"job_key": secret_key, "pan": "4242424242424242"},
                headers=headers,
            )
            await client.post(
                "/jobs/plain",
                json={"job_key": plain_key, "pan": "4242424242424242"},
                headers=headers,
            )
            await client.post(
                "/jobs/plain",
                json={"job_key": plain_key, "pan": "4242424242424242"},
                headers=headers,
            )
    finally:
        gateway.stop()
    output = gateway.output()
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    access = [line for line in lines if line["logger"] == "gateway.access"]
    assert len(access) == 3
    plain = [a for a in access if a["route"] == "plain"]
    assert [a["outcome"] for a in plain] == ["forwarded", "replayed"]
    assert plain[0]["key"] == plain_key and plain[0]["upstream_status"] == 200
    assert plain[0]["run_id"] and plain[0]["duration_ms"] >= 0 and plain[0]["status"] == 200
    secret = next(a for a in access if a["route"] == "secret")
    assert secret["key"].startswith("sha256:")
    for forbidden in (secret_key, "4242424242424242", "top-secret-token", "Bearer"):
        assert forbidden not in output


@pytest.mark.parametrize("kind", ["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_success_through_one_replica_shows_in_the_others_overview(
    tmp_path: Path, upstream: Process, request: pytest.FixtureRequest, kind: str
) -> None:
    """Replica A forwards a keyed request (200): replica B, which forwarded nothing,
    shows the route's last success in its overview (the API and the console page),
    read from the store. A's unkeyed request never reaches the store: only A shows it
    (its own gauge), which is the overview's fallback."""
    server: Any = request.getfixturevalue(
        "redis_server" if kind == "redis" else "postgres_database"
    )
    store = {"url": server.url, "prefix": unique("ls") + ":"}
    routes = [
        {
            "name": "send-reminder",
            "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
            "upstream": upstream.url,
            "key": {"body": "job_key"},
        },
        {
            "name": "ping",
            "match": {"methods": ["POST"], "path": "/jobs/ping"},
            "upstream": upstream.url,
        },
    ]
    env = {"OPS_TOKEN": "ops-" + "x" * 24, "CONSOLE_SECRET": "s" * 32}
    replicas = []
    try:
        for _ in range(2):
            path, port, admin_port = config_file(tmp_path, upstream, store, routes)
            doc = yaml.safe_load(path.read_text())
            doc["admin"] |= {
                "operators": [{"name": "olga", "role": "viewer", "token_env": "OPS_TOKEN"}],
                "session_secret_env": "CONSOLE_SECRET",
            }
            path.write_text(yaml.safe_dump(doc))
            replicas.append((gateway_process(path, port, env=env).start(), admin_port))
            wait_for_port(admin_port)
        (a, a_admin), (_, b_admin) = replicas
        async with httpx.AsyncClient(timeout=10) as client:
            base = f"http://127.0.0.1:{a.port}/jobs/"
            answer = await client.post(base + "send-reminder", json={"job_key": unique("ls")})
            assert answer.status_code == 200, answer.text
            assert (await client.post(base + "ping", json={})).status_code == 200

            async def ages(admin_port: int) -> dict[str, Any]:
                doc = (
                    await client.get(
                        f"http://127.0.0.1:{admin_port}/admin/overview",
                        headers={"Authorization": "Bearer t"},
                    )
                ).json()
                assert doc["store"]["reachable"], doc
                return {row["route"]: row["last_success_age_seconds"] for row in doc["routes"]}

            on_b, on_a = await ages(b_admin), await ages(a_admin)
            assert on_b["send-reminder"] is not None and on_b["send-reminder"] >= 0, on_b
            assert on_b["ping"] is None and on_a["ping"] is not None, (on_a, on_b)
            # B's console page says so too, signed in as a viewer.
            console = f"http://127.0.0.1:{b_admin}/console"
            headers = {"Origin": f"http://127.0.0.1:{b_admin}"}
            signed = await client.post(
                console + "/signin",
                data={"token": env["OPS_TOKEN"], "next": "/console/"},
                headers=headers,
            )
            assert signed.status_code == 303, signed.text
            page = (await client.get(console + "/", headers=headers)).text
            row = re.search(r'<tr data-route="send-reminder">.*?</tr>', page, re.S)
            assert row is not None and "none yet" not in row[0] and " ago<" in row[0], page
            row = re.search(r'<tr data-route="ping">.*?</tr>', page, re.S)
            assert row is not None and "none yet" in row[0], page
    finally:
        for process, _ in replicas:
            process.stop()
