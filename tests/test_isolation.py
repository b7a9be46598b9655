"""Isolation and access: tenants never see each other's responses, the operator API
takes its token only from the header and changes nothing without it, the admin
listener stays on loopback by default, and neither /metrics nor the logs carry keys
(metrics), bodies, Authorization headers, admin tokens or Redis passwords.

Tests that try hostile input record their figures in the ledger (area "isolation").
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.admin.api import create_admin_app
from gateway.assembly import COUNTS_TTL
from gateway.config import AdminConfig, parse_config
from gateway.errors import ConfigError
from gateway.keying import record_digest
from gateway.records import KeyRef
from tests.conftest import GatewayClient, unique, upstream_count
from tests.support.ledger import Ledger
from tests.support.servers import (
    Process,
    RedisServer,
    free_port,
    gateway_process,
    wait_for_port,
)

Build = Callable[..., Any]
TOKEN = "adm-7Qk2-isolation-token"


def job_route(**overrides: Any) -> dict[str, Any]:
    return {
        "name": "send-invoices",
        "match": {"methods": ["POST"], "path": "/jobs/send-invoices"},
        "key": {"body": "job_key"},
        # The query string is this suite's control channel to the test upstream.
        "fingerprint": ["method", "path", "body"],
        **overrides,
    }


# -- scope: one tenant is never replayed another's response ---------------------------


@pytest.mark.anyio
async def test_scope_never_replays_across_tenants(
    gateway_for: Build, upstream: Process, ledger: Ledger
) -> None:
    gw = await gateway_for([job_route(key={"body": "job_key", "scope": ["header.Authorization"]})])
    key = unique("tenant")
    tenants = {"alice": "Bearer alice-1", "bob": "Bearer bob-2", "anonymous": None}

    async def send(auth: str | None, body: dict[str, Any] | None = None) -> httpx.Response:
        headers = {"Authorization": auth} if auth else {}
        return await gw.post(
            "/jobs/send-invoices",
            json=body or {"job_key": key},
            params={"sleep": "0.5"},
            headers=headers,
        )

    # All at once: none may wait on, or be replayed, another tenant's run.
    first = dict(
        zip(tenants, await asyncio.gather(*(send(a) for a in tenants.values())), strict=True)
    )
    again = dict(
        zip(tenants, await asyncio.gather(*(send(a) for a in tenants.values())), strict=True)
    )
    # Another tenant's different body is their own first request, not a 422 that
    # would tell them someone else used the key.
    other_body = await send("Bearer carol-3", {"job_key": key, "amount": 5})
    runs = await upstream_count(upstream, key)
    ledger.record(
        "isolation",
        "test_scope_never_replays_across_tenants",
        requests=2 * len(tenants) + 1,
        bad_inputs=len(tenants) + 1,
        upstream_duplicates=max(0, runs - len(tenants) - 1),
        detail="4 tenants, one key: concurrent firsts, then repeats",
    )
    for name, auth in tenants.items():
        assert first[name].status_code == 200, first[name].text
        assert "idempotent-replayed" not in first[name].headers, name
        assert first[name].json()["headers"].get("authorization") == auth
        assert again[name].headers["idempotent-replayed"] == "true", name
        assert again[name].content == first[name].content, f"{name} got another's response"
    assert other_body.status_code == 200 and "idempotent-replayed" not in other_body.headers
    assert len({r.json()["run"] for r in first.values()}) == len(tenants)
    assert runs == len(tenants) + 1  # one run per tenant, none twice


# -- the operator API's token ---------------------------------------------------------


def admin_http(gw: GatewayClient, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_admin_app(gw.gateway)),
        base_url="http://admin",
        **kwargs,
    )


@pytest.mark.anyio
@pytest.mark.parametrize("store_kind", ["memory"])
async def test_admin_token_is_compared_in_constant_time(
    gateway_for: Build, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision is hmac.compare_digest's: with it answering "no", the right
    token is refused; a plain `==` would let it through."""
    gw = await gateway_for([job_route()], admin={"token": TOKEN})
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return answer(a, b)

    answer: Callable[[bytes, bytes], bool] = lambda a, b: False  # noqa: E731
    monkeypatch.setattr(hmac, "compare_digest", spy)
    async with admin_http(gw, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
        refused = await admin.get("/admin/keys")
        answer = real
        allowed = await admin.get("/admin/keys")
    assert refused.status_code == 401
    assert allowed.status_code == 200
    # Compared as SHA-256 digests (gateway/operators/identity.py): one length, whatever was sent.
    digest = hashlib.sha256(TOKEN.encode()).digest()
    assert calls == [(digest, digest)] * 2


def _basic(secret: str) -> str:
    return "Basic " + base64.b64encode(f"admin:{secret}".encode()).decode()


#: Ways to present the admin token that must all be refused: only
#: `Authorization: Bearer <token>` counts.
BAD_AUTH: dict[str, dict[str, Any]] = {
    "none": {},
    "wrong": {"headers": {"Authorization": "Bearer wrong-token"}},
    "prefix": {"headers": {"Authorization": f"Bearer {TOKEN[:-1]}"}},
    "suffix": {"headers": {"Authorization": f"Bearer {TOKEN}x"}},
    "empty": {"headers": {"Authorization": "Bearer "}},
    "no-scheme": {"headers": {"Authorization": TOKEN}},
    "basic": {"headers": {"Authorization": _basic(TOKEN)}},
    "other-header": {"headers": {"X-Admin-Token": TOKEN, "X-Api-Key": TOKEN}},
    "cookie": {"headers": {"Cookie": f"token={TOKEN}; admin_token={TOKEN}"}},
    **{
        f"query-{name}": {"params": {name: TOKEN}}
        for name in ("token", "access_token", "admin_token", "auth", "authorization", "bearer")
    },
    "query-bearer-value": {"params": {"authorization": f"Bearer {TOKEN}"}},
}


def _snapshot(record: Any) -> dict[str, Any]:
    doc = dict(record.to_json())
    for moving in ("age_seconds", "state_age_seconds"):
        doc.pop(moving)
    return doc


@pytest.mark.anyio
async def test_bad_admin_tokens_get_401_and_change_nothing(
    gateway_for: Build, upstream: Process, ledger: Ledger
) -> None:
    """Every bad way to present the token, on every operator endpoint: 401 problem+json,
    and both records (one parked, one an operator holds) stay exactly as they were."""
    gw = await gateway_for(
        [job_route(upstream_timeout="200ms", on_unknown_outcome="park")], admin={"token": TOKEN}
    )
    parked, held = unique("parked"), unique("held")
    for key in (parked, held):
        await gw.post("/jobs/send-invoices", json={"job_key": key}, params={"sleep": "0.4"})
    refs = {
        key: KeyRef(record_digest("send-invoices", "", key), "send-invoices", key)
        for key in (parked, held)
    }
    good = {"Authorization": f"Bearer {TOKEN}"}
    async with admin_http(gw) as admin:
        taken = await admin.post(
            f"/admin/keys/send-invoices/{held}/claim", json={"operator": "alice"}, headers=good
        )
        assert taken.status_code == 200, taken.text
        before = {key: _snapshot(await gw.gateway.store.get(ref)) for key, ref in refs.items()}
        assert before[parked]["state"] == "parked" and before[held]["state"] == "claimed"
        calls = [
            ("GET", "/admin/keys", None),
            ("GET", f"/admin/keys/send-invoices/{parked}", None),
            ("POST", f"/admin/keys/send-invoices/{parked}/claim", {"operator": "eve"}),
            (
                "POST",
                f"/admin/keys/send-invoices/{held}/claim",
                {"operator": "eve", "force": True},
            ),
            (
                "POST",
                f"/admin/keys/send-invoices/{held}/resolve",
                {"operator": "alice", "outcome": "done", "note": "x"},
            ),
            (
                "POST",
                f"/admin/keys/send-invoices/{held}/resolve",
                {"operator": "alice", "outcome": "retry", "note": "x"},
            ),
        ]
        answers: dict[str, int] = {}
        changed: list[str] = []
        for name, auth in BAD_AUTH.items():
            for method, path, body in calls:
                extra = {"json": {**body, "token": TOKEN}} if body else {}
                response = await admin.request(method, path, **extra, **auth)
                answers[f"{name} {method} {path.rsplit('/', 1)[-1]}"] = response.status_code
                if response.status_code == 401:
                    assert response.headers["content-type"] == "application/problem+json"
                after = {key: _snapshot(await gw.gateway.store.get(r)) for key, r in refs.items()}
                if after != before:
                    changed.append(f"{name} {method} {path}")
                    before = after
        ledger.record(
            "isolation",
            "test_bad_admin_tokens_get_401_and_change_nothing",
            requests=len(answers) + 1,
            bad_inputs=len(answers),
            detail=f"{len(BAD_AUTH)} ways to present a token x {len(calls)} operator calls",
        )
        assert not changed, changed
        assert {status for status in answers.values()} == {401}, {
            k: v for k, v in answers.items() if v != 401
        }
        # The same calls with the token do work: the 401s were the token's doing.
        resolved = await admin.post(
            f"/admin/keys/send-invoices/{held}/resolve",
            json={"operator": "alice", "outcome": "retry", "note": "ok"},
            headers=good,
        )
        assert resolved.status_code == 200 and resolved.json()["state"] == "released"


# -- the admin listener's default address ------------------------------------------------


def test_admin_listener_defaults_to_loopback_in_config() -> None:
    config = parse_config(
        {
            "admin": {"token": "x"},
            "routes": [{"name": "a", "match": {"path": "/a"}, "upstream": "http://127.0.0.1:1"}],
        },
        "t.yaml",
    )
    assert config.admin.listen == AdminConfig().listen == "127.0.0.1:9090"
    assert config.server.listen.startswith("127.0.0.1:")


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            if family == socket.AF_INET:
                raw = raw[::-1]
            else:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
            found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.mark.process
def test_admin_listener_defaults_to_loopback_in_a_real_process(
    tmp_path: Path, upstream: Process
) -> None:
    """A config with no admin.listen: the running gateway's admin socket is bound to
    127.0.0.1 (port 9090, the default), and nothing it listens on is reachable from
    another host."""
    port = free_port()
    path = tmp_path / "gateway.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
                "admin": {"token": TOKEN},
                "routes": [job_route(upstream=upstream.url)],
            }
        )
    )
    # 9090 is the default, so another test run on this machine may hold it a moment.
    deadline = time.monotonic() + 45
    while not _port_free(9090):
        assert time.monotonic() < deadline, "port 9090 stayed busy; cannot test the default"
        time.sleep(0.5)
    gateway = gateway_process(path, port).start()
    try:
        wait_for_port(9090, gateway.proc)
        assert gateway.proc is not None
        sockets = _listening(gateway.proc.pid)
        with httpx.Client() as client:
            health = client.get("http://127.0.0.1:9090/healthz")
    finally:
        gateway.stop()
    assert health.status_code == 200
    assert ("127.0.0.1", 9090) in sockets, sockets
    assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets


# -- /metrics and logs carry no secrets --------------------------------------------------

REDIS_PASSWORD = "rpw-Hq83-zzcorrect"
ADMIN_TOKEN = "adm-tok-Pn41-live"
WRONG_TOKEN = "adm-tok-Wx99-guess"
AUTH = "Bearer caller-Aa77-authorization"
BODY_SECRET = "pan-4111-1111-1111-1111"
NUMBER_SECRET = 918273645546372  # a password or token YAML reads as a number


@dataclass
class Scenario:
    keys: list[str]
    scrapes: list[str]
    output: str
    requests: int
    bad_inputs: int
    faults: int


def _config(
    upstream: Process, redis_url: str, port: int, admin_port: int, **store: Any
) -> dict[str, Any]:
    routes = [
        job_route(name="charge", match={"methods": ["POST"], "path": "/jobs/charge"}),
        job_route(
            name="slow",
            match={"methods": ["POST"], "path": "/jobs/slow"},
            upstream_timeout="300ms",
            on_unknown_outcome="park",
        ),
        job_route(
            name="down",
            match={"methods": ["POST"], "path": "/jobs/down"},
            upstream=f"http://127.0.0.1:{free_port()}",  # nothing listens: never sent
        ),
    ]
    for spec in routes:
        spec.setdefault("upstream", upstream.url)
    return {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s", "log_format": "json"},
        "admin": {"listen": f"127.0.0.1:{admin_port}", "token": ADMIN_TOKEN},
        "store": {"url": redis_url, "socket_timeout": "300ms", "connect_timeout": "300ms", **store},
        "routes": routes,
    }


@pytest.fixture(scope="module")
def secrets_scenario(
    upstream: Process, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenario]:
    """A real gateway on a password-protected Redis, sent traffic that carries every
    secret, through the error paths too: upstream down, upstream too slow, a wrong
    admin token, Redis down, and config reloads that fail while naming the password."""
    redis = RedisServer("--requirepass", REDIS_PASSWORD).start()
    redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis.port}/0"
    port, admin_port = free_port(), free_port()
    path = tmp_path_factory.mktemp("secrets") / "gateway.yaml"
    path.write_text(yaml.safe_dump(_config(upstream, redis_url, port, admin_port)))
    gateway = gateway_process(path, port).start()
    keys = [unique(f"secret-key-{name}") for name in ("charge", "slow", "down", "redis")]
    scrapes: list[str] = []
    requests = bad = faults = 0
    try:
        wait_for_port(admin_port)
        with (
            httpx.Client(base_url=gateway.url, timeout=15) as proxy,
            httpx.Client(base_url=f"http://127.0.0.1:{admin_port}", timeout=15) as admin,
        ):

            def send(route: str, key: str, **body: Any) -> httpx.Response:
                nonlocal requests
                requests += 1
                return proxy.post(
                    f"/jobs/{route}",
                    json={"job_key": key, "card": BODY_SECRET, **body},
                    headers={"Authorization": AUTH},
                    params={"sleep": "0.6"} if route == "slow" else {},
                )

            charge, slow, down, during_outage = keys
            assert send("charge", charge).status_code == 200
            assert send("charge", charge).headers["idempotent-replayed"] == "true"
            assert send("charge", charge, extra=BODY_SECRET).status_code == 422
            assert send("slow", slow).status_code == 504  # parked: an open key at scrape time
            assert send("down", down).status_code == 502
            bad += 3
            for auth in ({"headers": {"Authorization": f"Bearer {WRONG_TOKEN}"}},
                         {"params": {"token": ADMIN_TOKEN}}):  # fmt: skip
                requests += 1
                bad += 1
                assert admin.get("/admin/keys", **auth).status_code == 401
            good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            requests += 2
            claim = admin.post(
                f"/admin/keys/slow/{slow}/claim", json={"operator": "alice"}, headers=good
            )
            assert claim.status_code == 200, claim.text
            resolve = admin.post(
                f"/admin/keys/slow/{slow}/resolve",
                json={"operator": "alice", "outcome": "done", "response": {"body": BODY_SECRET}},
                headers=good,
            )
            assert resolve.status_code == 200, resolve.text
            send("slow", unique("secret-key-parked"))  # left parked for the scrape
            scrapes.append(admin.get("/metrics").text)
            redis.kill()
            faults += 1
            assert send("charge", during_outage).status_code == 503
            assert admin.get("/admin/keys", headers=good).status_code == 503
            time.sleep(COUNTS_TTL)  # the counts the first scrape read are kept that long
            scrapes.append(admin.get("/metrics").text)
            redis.start()
            # Reloads that fail while the file holds the password and the token.
            broken = _config(upstream, redis_url, port, admin_port)
            broken["store"]["url"] = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis.port}/db0"
            broken["admin"]["token"] = NUMBER_SECRET
            broken["store"]["password"] = NUMBER_SECRET + 1
            path.write_text(yaml.safe_dump(broken))
            gateway.signal(signal.SIGHUP)
            gateway.wait_for_output("config reload rejected", 1)
            for rejected, url in enumerate(
                (
                    f"redsi://:{REDIS_PASSWORD}@127.0.0.1:{redis.port}/0",
                    f"redis://:{REDIS_PASSWORD}@127.0.0.1:99999/0",
                    f"redis://:{REDIS_PASSWORD}@[::1/0",
                ),
                start=2,
            ):
                broken["store"] = {"url": url}
                path.write_text(yaml.safe_dump(broken))
                gateway.signal(signal.SIGHUP)
                # One reload at a time: the next write truncates the file, and a reload
                # still reading it would see an empty file (and signals may coalesce).
                gateway.wait_for_output("config reload rejected", rejected)
            bad += 4
            faults += 4
            deadline = time.monotonic() + 15
            while send("charge", during_outage).status_code != 200:
                assert time.monotonic() < deadline, "the gateway never recovered from Redis"
                time.sleep(0.2)
            scrapes.append(admin.get("/metrics").text)
    finally:
        gateway.stop()
        redis.stop()
    yield Scenario(keys, scrapes, gateway.output(), requests, bad, faults)


@pytest.mark.process
@pytest.mark.redis
def test_metrics_expose_no_keys_or_bodies(secrets_scenario: Scenario, ledger: Ledger) -> None:
    scrapes = "\n".join(secrets_scenario.scrapes)
    secrets = [*secrets_scenario.keys, "secret-key", BODY_SECRET, AUTH, ADMIN_TOKEN, REDIS_PASSWORD]
    found = [s for s in secrets if s in scrapes]
    ledger.record(
        "isolation",
        "test_metrics_expose_no_keys_or_bodies",
        requests=secrets_scenario.requests,
        bad_inputs=secrets_scenario.bad_inputs,
        faults=secrets_scenario.faults,
        detail=f"{len(secrets_scenario.scrapes)} scrapes grepped for {len(secrets)} secrets",
    )
    assert not found, found
    # The scrapes did see the traffic (and the parked key), so the grep meant something.
    first = secrets_scenario.scrapes[0]
    assert 'idempotency_gateway_requests_total{outcome="forwarded",route="charge"} 1.0' in first
    assert 'idempotency_gateway_keys{route="slow",state="parked"} 1.0' in first
    assert "idempotency_gateway_store_up 0.0" in secrets_scenario.scrapes[1]


@pytest.mark.process
@pytest.mark.redis
def test_logs_never_contain_secrets(secrets_scenario: Scenario, ledger: Ledger) -> None:
    output = secrets_scenario.output
    secrets = [
        BODY_SECRET,
        AUTH,
        AUTH.split()[1],
        ADMIN_TOKEN,
        WRONG_TOKEN,
        REDIS_PASSWORD,
        str(NUMBER_SECRET),
        str(NUMBER_SECRET + 1),
    ]
    found = [s for s in secrets if s in output]
    ledger.record(
        "isolation",
        "test_logs_never_contain_secrets",
        bad_inputs=len(secrets),
        detail="access and error logs of one process through every error path",
    )
    assert not found, found
    # The error paths ran and were logged: the grep covered them.
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    messages = "\n".join(str(line.get("message", "")) for line in lines)
    assert "config reload rejected" in messages and "store.url" in messages
    assert "admin.token: expected text, got a number" in messages
    assert "store failed on route charge" in messages  # Redis down
    assert "outcome unknown" in messages
    outcomes = {line.get("outcome") for line in lines if line.get("logger") == "gateway.access"}
    assert {"forwarded", "replayed", "mismatch", "upstream_error", "store_error"} <= outcomes


def test_config_errors_never_show_passwords_or_tokens() -> None:
    """check-config and a rejected reload print these messages: a password inside a
    bad URL is masked, and a password or token of the wrong type is not repeated."""
    route = {"name": "a", "match": {"path": "/a"}, "upstream": "http://127.0.0.1:1"}
    cases = [
        {"store": {"url": f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/db1"}},
        {"store": {"url": f"redsi://:{REDIS_PASSWORD}@127.0.0.1:6379/0"}},
        {"store": {"url": f"redis://u:{REDIS_PASSWORD}@127.0.0.1:99999/0"}},
        {"store": {"url": f"redis://u:{REDIS_PASSWORD}@[::1/0"}},
        {"store": {"url": f"redis://:{REDIS_PASSWORD}@/0"}},
        {"store": {"url": f"redis://127.0.0.1/x?password={REDIS_PASSWORD}"}},
        {"store": {"url": f"postgresql://gateway:{REDIS_PASSWORD}@db"}},
        {"store": {"url": f"postgresq://gateway:{REDIS_PASSWORD}@db/gateway"}},
        {"store": {"url": f"postgresql://db/gateway?password={REDIS_PASSWORD}", "password": 5}},
        {"store": {"url": "redis://127.0.0.1/0", "password": NUMBER_SECRET}},
        {
            "store": {
                "sentinel": {"master": "m", "nodes": ["127.0.0.1:1"], "password": NUMBER_SECRET}
            }
        },
        {"admin": {"token": NUMBER_SECRET}},
    ]
    messages = []
    for case in cases:
        with pytest.raises(ConfigError) as caught:
            parse_config({**case, "routes": [route]}, "t.yaml")
        messages.append(str(caught.value))
    leaked = [m for m in messages if REDIS_PASSWORD in m or str(NUMBER_SECRET) in m]
    assert not leaked, leaked
    assert all("t.yaml: " in m for m in messages)  # still a useful error
    assert '"redis://:***@127.0.0.1:6379/db1"' in messages[0]
