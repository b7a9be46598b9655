"""Behaviour that is about processes: the real `run`, `demo` and CLI commands."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.cli import build_parser
from tests.conftest import unique, upstream_count
from tests.support.servers import ROOT, Process, free_port, gateway_process, wait_for_port

pytestmark = [pytest.mark.anyio, pytest.mark.process]


def write_config(
    tmp_path: Path, upstream_url: str, store_url: str = "memory://", **route: Any
) -> tuple[Path, int, int]:
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": store_url},
        "routes": [
            {
                "name": "send-reminder",
                "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
                "upstream": upstream_url,
                "key": {"body": "job_key"},
                **route,
            }
        ],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port, admin_port


async def test_caller_hangup_does_not_cancel_the_forward(tmp_path: Path, upstream: Process) -> None:
    """The case of "Make scheduled job handlers idempotent: safe to run twice" without
    an unknown outcome: the handler outlives the caller's timeout, but not the
    gateway's, so the retry gets the response."""
    path, port, _ = write_config(tmp_path, upstream.url, upstream_timeout="10s")
    gateway = gateway_process(path, port).start()
    try:
        key = unique()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(
                    "/jobs/send-reminder",
                    json={"job_key": key},
                    params={"sleep": "1.5"},
                    timeout=0.5,
                )
            retry = await client.post(
                "/jobs/send-reminder", json={"job_key": key}, params={"sleep": "1.5"}, timeout=10
            )
        assert retry.status_code == 200
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.json()["run"] == 1
        assert await upstream_count(upstream, key) == 1
    finally:
        assert gateway.stop() == 0, gateway.output()


async def test_run_serves_admin_endpoints(tmp_path: Path, upstream: Process) -> None:
    path, port, admin_port = write_config(tmp_path, upstream.url)
    gateway = gateway_process(path, port).start()
    try:
        wait_for_port(admin_port)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}") as admin:
            assert (await admin.get("/healthz")).status_code == 200
            ready = await admin.get("/readyz")
            assert ready.status_code == 200 and ready.json()["ready"] is True
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                await client.post("/jobs/send-reminder", json={"job_key": unique()})
            text = (await admin.get("/metrics")).text
        assert (
            'idempotency_gateway_requests_total{outcome="forwarded",route="send-reminder"} 1.0'
            in text
        )
    finally:
        gateway.stop()


async def test_readyz_fails_when_redis_is_unreachable(tmp_path: Path, upstream: Process) -> None:
    path, port, admin_port = write_config(
        tmp_path, upstream.url, store_url=f"redis://127.0.0.1:{free_port()}/0"
    )
    gateway = gateway_process(path, port).start()
    try:
        wait_for_port(admin_port)
        async with httpx.AsyncClient() as client:
            ready = await client.get(f"http://127.0.0.1:{admin_port}/readyz")
            assert ready.status_code == 503 and ready.json()["ready"] is False
            response = await client.post(
                f"http://127.0.0.1:{port}/jobs/send-reminder", json={"job_key": unique()}
            )
        assert response.status_code == 503
        assert response.headers["retry-after"]
        assert response.headers["content-type"] == "application/problem+json"
    finally:
        gateway.stop()


async def test_demo_runs_the_job_once_for_two_parallel_callers() -> None:
    port, admin_port, job_port = free_port(), free_port(), free_port()
    demo = Process(
        [
            sys.executable,
            "-m",
            "gateway",
            "demo",
            "--port",
            str(port),
            "--admin-port",
            str(admin_port),
            "--job-port",
            str(job_port),
        ],
        port,
        "demo",
    ).start()
    try:
        body = {"job_key": "test-1", "user_id": 42}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            a, b = await asyncio.gather(
                client.post("/jobs/send-reminder", json=body),
                client.post("/jobs/send-reminder", json=body),
            )
        assert a.status_code == b.status_code == 200
        assert a.json() == b.json() == {"status": "sent", "user_id": 42}
        assert {a.headers.get("idempotent-replayed"), b.headers.get("idempotent-replayed")} == {
            "true",
            None,
        }
        # The async route, as instructions() shows it: 202 twice, one status URL, one run.
        invoices = {"job_key": "invoices-2026-11", "period": "2026-11"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            first = await client.post("/jobs/send-invoices", json=invoices)
            again = await client.post("/jobs/send-invoices", json=invoices)
            assert first.status_code == again.status_code == 202, first.text
            location = first.headers["location"]
            assert again.headers["location"] == location == first.json()["status_url"]
            assert again.headers["idempotent-replayed"] == "true"
            deadline = asyncio.get_running_loop().time() + 15
            while (status := (await client.get(location)).json())["state"] != "completed":
                assert status["state"] in ("queued", "in_flight"), status
                assert asyncio.get_running_loop().time() < deadline, status
                await asyncio.sleep(0.2)
        assert status["attempts"] == 1
    finally:
        assert demo.stop() == 0
    output = demo.output()
    assert output.count("sending reminder to user 42") == 1, output
    assert output.count("sending invoices for period 2026-11") == 1, output
    assert "for i in 1 2; do" in output
    assert "/jobs/send-invoices" in output and "Location" in output


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=30,
    )


def test_check_config_accepts_the_example() -> None:
    result = cli("check-config", str(ROOT / "config.example.yaml"))
    assert result.returncode == 0, result.stderr
    assert "send-reminder" in result.stdout and "OK" in result.stdout
    assert "warning" not in result.stderr  # the example shows the safe forms


def test_check_config_reports_errors_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "routes:\n"
        "  - name: a\n"
        "    match: {path: /a}\n"
        "    upstream: http://127.0.0.1:5000\n"
        "    upstream_timeout: 30 seconds\n"
        "    key: {body: 'foo[['}\n"
        "    kye: 1\n"
    )
    result = cli("check-config", str(bad))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{bad}:5:23: routes[0].upstream_timeout" in result.stderr
    assert "routes[0].key.body" in result.stderr and "JMESPath" in result.stderr
    assert "routes[0].kye" in result.stderr and "key" in result.stderr


def test_check_config_bad_yaml_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("routes:\n  - name: a\n   match: [\n")
    result = cli("check-config", str(bad))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "line" in result.stderr


def test_numeric_arguments_are_ascii_digits(capsys: pytest.CaptureFixture[str]) -> None:
    """`--workers` and the demo's ports are ASCII digits: int() would take another
    script's digits ("\u0662" as 2) and "2_0" as 20."""
    parser = build_parser()
    for args in (
        ["run", "--workers", "\u0662"],
        ["run", "--workers", "2_0"],
        ["run", "--workers", "²"],
        ["run", "--workers", "0"],
        ["demo", "--port", "\u0668\u0660\u0668\u0660"],
        ["demo", "--job-port", "99999"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(args)
        assert "Traceback" not in capsys.readouterr().err
    assert parser.parse_args(["run", "--workers", "2"]).workers == 2
    assert parser.parse_args(["demo", "--port", "8081"]).port == 8081


def test_explain_says_an_async_route_and_its_first_delays(tmp_path: Path) -> None:
    route = {
        "name": "send-invoices",
        "match": {"methods": ["POST"], "path": "/jobs/send-invoices"},
        "upstream": "http://127.0.0.1:9",
        "key": {"body": "job_key"},
        "delivery": {"mode": "async", "concurrency": 2, "max_queued": 50},
    }
    short = {**route, "name": "short", "match": {"path": "/short"}, "delivery": "async"}
    short["retry"] = {"attempts": 3, "backoff": "1s", "max_backoff": "3s"}
    config = tmp_path / "async.yaml"
    config.write_text(yaml.safe_dump({"server": {"max_deliveries": 9}, "routes": [route, short]}))
    body = '{"job_key": "inv-7"}'
    result = cli("explain", "--config", str(config), "POST", "/jobs/send-invoices", "-d", body)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert lines["delivery"].strip() == (
        "async: 202 at once, delivered by every process (2 at a time each, 9 in all); "
        "up to 50 queued"
    )
    assert lines["retry"].strip() == (
        "8 attempts; before attempt 2: 0-2s, 3: 0-4s, 4: 0-8s, 5: 0-16s, 6: 0-32s, ... "
        "at most 10m (full jitter; Retry-After wins); then parked"
    )
    assert lines["answers"].strip() == (
        "200-407, 409-428, 430-499 complete the delivery; any other status, and a request "
        "never sent, are attempted again"
    )
    digest = lines["record"].strip()
    assert (
        lines["status url"]
        .strip()
        .startswith(f"/_idempotency/status/send-invoices/{digest}/<token>")
    )
    result = cli("explain", "--config", str(config), "POST", "/short", "-d", body)
    assert "retry:       3 attempts; before attempt 2: 0-1s, 3: 0-2s; at most 3s" in result.stdout
    config.write_text(yaml.safe_dump({"server": {"max_deliveries": 0}, "routes": [short]}))
    result = cli("explain", "--config", str(config), "POST", "/short", "-d", body)
    assert "this process never delivers (server.max_deliveries: 0)" in result.stdout


def test_explain_shows_route_key_and_fingerprint() -> None:
    example = str(ROOT / "config.example.yaml")
    result = cli(
        "explain",
        "--config",
        example,
        "POST",
        "http://localhost:8080/jobs/send-reminder",
        "-H",
        "Content-Type: application/json",
        "-d",
        '{"job_key": "reminder:user42:trial-day-3"}',
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "route:       send-reminder" in result.stdout
    assert "key:         reminder:user42:trial-day-3" in result.stdout
    assert "fingerprint: " in result.stdout and "record:" in result.stdout
    assert "delivery:    sync: the caller waits" in result.stdout
    assert "retry:" not in result.stdout and "status url:" not in result.stdout
    missing = cli("explain", "--config", example, "POST", "/jobs/send-reminder", "-d", "{}")
    assert missing.returncode == 1 and "400" in missing.stdout
    none = cli("explain", "--config", example, "GET", "/nowhere")
    assert none.returncode == 1 and "404" in none.stdout
