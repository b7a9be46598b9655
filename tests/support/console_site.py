"""A console site for tests and for docs/console.md's screenshots: gateway replicas on
a redis-server of their own, with operators who have tokens of their own.

alice and bob are operators, vera a viewer, carol an operator whom
tests/test_console.py removes. Parked keys are made the way production makes them:
a request whose upstream outlives the route's upstream_timeout (504, parked), or a
delivery whose one attempt the upstream refuses (parked).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml
from playwright.sync_api import Page, expect

from tests.support.browser import WAIT_MS
from tests.support.servers import Process, RedisServer, free_port, gateway_process

SECRET = secrets.token_urlsafe(32)
ROLES = {"alice": "operator", "bob": "operator", "vera": "viewer", "carol": "operator"}
TOKENS = {name: f"{name}-{secrets.token_urlsafe(24)}" for name in ROLES}
SHARED = "shared-" + secrets.token_urlsafe(24)
HOSTILE = '"><img src=x onerror=alert(1)>'
HOSTILE_NOTE = "<script>alert('note')</script> checked & <b>paid</b>"


def env() -> dict[str, str]:
    values = {f"{name.upper()}_TOKEN": token for name, token in TOKENS.items()}
    return values | {"CONSOLE_SECRET": SECRET, "SHARED_TOKEN": SHARED}


def config(
    redis: RedisServer, upstream: Process, operators: list[str], max_deliveries: int = 8
) -> dict[str, Any]:
    return {
        "server": {
            "listen": f"127.0.0.1:{free_port()}",
            "shutdown_grace": "2s",
            "max_deliveries": max_deliveries,
        },
        "admin": {
            "listen": f"127.0.0.1:{free_port()}",
            "token": "${SHARED_TOKEN}",
            "operators": [
                {"name": name, "role": ROLES[name], "token_env": f"{name.upper()}_TOKEN"}
                for name in operators
            ],
            "session_secret_env": "CONSOLE_SECRET",
        },
        "store": {
            "url": redis.url,
            "prefix": "console:",
            "socket_timeout": "2s",
            "connect_timeout": "2s",
        },
        "routes": [
            {
                "name": "charge",
                "match": {"methods": ["POST"], "path": "/jobs/charge"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "fingerprint": ["method", "path", "body"],
                "upstream_timeout": "500ms",
                "on_unknown_outcome": "park",
            },
            {
                "name": "deliver",
                "match": {"methods": ["POST"], "path": "/jobs/deliver"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "fingerprint": ["method", "path", "body"],
                "delivery": "async",
                "retry": {"attempts": 1},
            },
        ],
    }


@dataclass
class Replica:
    process: Process
    path: Path
    doc: dict[str, Any]

    @property
    def proxy(self) -> str:
        return "http://" + self.doc["server"]["listen"]

    @property
    def admin(self) -> str:
        return "http://" + self.doc["admin"]["listen"]

    def write(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.path.write_text(yaml.safe_dump(doc))


def start_replica(tmp: Path, doc: dict[str, Any]) -> Replica:
    port = int(doc["admin"]["listen"].rsplit(":", 1)[1])
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(doc))
    process = gateway_process(path, port, env=env()).start()
    return Replica(process, path, doc)


@dataclass
class Site:
    redis: RedisServer
    upstream: Process
    replicas: list[Replica]
    tmp: Path

    def api(self, name: str = "alice") -> httpx.Client:
        headers = {"Authorization": f"Bearer {TOKENS[name]}"}
        return httpx.Client(base_url=self.replicas[0].admin, headers=headers, timeout=10)

    def record(self, route: str, key: str) -> dict[str, Any]:
        with self.api() as client:
            answer = client.get(f"/admin/keys/{route}/{quote(key, safe='')}")
        assert answer.status_code == 200, answer.text
        doc: dict[str, Any] = answer.json()
        return doc

    def wait_for_state(self, route: str, key: str, state: str) -> dict[str, Any]:
        """The record once the store says it is in `state` (bounded: a delivery's
        attempt is a worker's, made when it gets to it)."""
        deadline = time.monotonic() + WAIT_MS / 1000
        while True:
            with self.api() as client:
                answer = client.get(f"/admin/keys/{route}/{quote(key, safe='')}")
            if answer.status_code == 200 and answer.json()["state"] == state:
                doc: dict[str, Any] = answer.json()
                return doc
            assert time.monotonic() < deadline, f"{key} never became {state}: {answer.text}"
            time.sleep(0.1)

    def park(self, key: str) -> None:
        """A key parked the production way: the upstream outlives upstream_timeout."""
        answer = httpx.post(
            self.replicas[0].proxy + "/jobs/charge",
            params={"sleep": "3"},
            json={"job_key": key},
            timeout=10,
        )
        assert answer.status_code == 504, answer.text
        self.wait_for_state("charge", key, "parked")

    def park_delivery(self, key: str, headers: dict[str, str]) -> None:
        """A delivery parked the production way: its one attempt answered 503."""
        answer = httpx.post(
            self.replicas[0].proxy + "/jobs/deliver",
            params={"status": "503"},
            json={"job_key": key},
            headers=headers,
            timeout=10,
        )
        assert answer.status_code == 202, answer.text
        self.wait_for_state("deliver", key, "parked")


@contextmanager
def running_site(tmp: Path, upstream: Process, replicas: int = 2) -> Iterator[Site]:
    """`replicas` gateway processes on a redis-server of their own, stopped after."""
    redis = RedisServer()
    redis.start()
    started: list[Replica] = []
    try:
        for _ in range(replicas):
            started.append(start_replica(tmp, config(redis, upstream, list(ROLES))))
        yield Site(redis, upstream, started, tmp)
    finally:
        for replica in started:
            replica.process.stop()
        redis.stop()


def sign_in(page: Page, replica: Replica, name: str) -> Page:
    """`name` signs in through the console's form, as a person would."""
    page.goto(replica.admin + "/console/")
    expect(page).to_have_url(re.compile(r"/console/signin\?next="))
    page.get_by_label("Operator token").fill(TOKENS[name])
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator(".me")).to_have_text(name)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    return page


def key_row(page: Page, key: str) -> Any:
    """The keys table's row of `key` (found by its link, so a hostile key matches as text)."""
    return page.locator("tr", has=page.get_by_role("link", name=key, exact=True))
