"""What a replay carries from a stored response's headers, whoever wrote them, and
what the operator API accepts as the response of a key it resolves.

A stored response may come from an older version, an operator, or anyone who can
write to Redis: its framing (Content-Length, Transfer-Encoding) and hop-by-hop headers
are never replayed, since every replay is framed by this hop for this caller.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from gateway.errors import BadResponse
from gateway.keying import record_digest
from gateway.records import KeyRef, State, StoredResponse
from gateway.store.redis import BUCKETS
from tests.conftest import GatewayClient, unique, upstream_count
from tests.support.rawhttp import connect, request
from tests.support.servers import Process, RedisServer, free_port, gateway_process, wait_for_port
from tests.test_unknown_outcomes import TOKEN, admin_client

pytestmark = pytest.mark.anyio

ROUTE = "charge"
Build = Callable[..., Any]


def read_responses(
    sock: socket.socket, count: int, timeout: float = 10
) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    """`count` responses off one connection, framed by their Content-Length, with every
    header line as sent (duplicates kept)."""
    deadline = time.monotonic() + timeout
    raw = b""
    answers: list[tuple[int, list[tuple[str, str]], bytes]] = []
    while len(answers) < count:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = [
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(":") for line in lines[1:])
            ]
            lengths = [int(v) for n, v in headers if n == "content-length"]
            length = lengths[0] if lengths else 0
            if len(rest) >= length:
                answers.append((int(lines[0].split(" ")[1]), headers, rest[:length]))
                raw = rest[length:]
                continue
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(answers)} of {count} responses: {raw!r}"
        sock.settimeout(left)
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(answers)} of {count} responses: {raw!r}"
        raw += chunk
    assert raw == b"", f"bytes after the last response: {raw!r}"
    return answers


@pytest.mark.redis
@pytest.mark.process
async def test_replay_drops_stored_framing_and_hop_by_hop_headers(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    """A record whose stored headers carry Content-Length, Transfer-Encoding,
    Connection (and what it names), Keep-Alive, Set-Cookie and the gateway's own
    replay header, written straight into Redis, replays with exactly one correct
    Content-Length and none of them: two pipelined replays on one connection
    arrive framed as two."""
    prefix = unique("framing") + ":"
    port = free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {"url": redis_server.url, "prefix": prefix},
        "routes": [
            {
                "name": ROUTE,
                "match": {"methods": ["POST"], "path": "/jobs/charge"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
            }
        ],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    key = unique()
    body = json.dumps({"job_key": key}).encode()
    post = request("POST", "/jobs/charge", [("Content-Type", "application/json")], body)
    gateway = gateway_process(path, port).start()
    try:
        wait_for_port(port)
        with connect(port) as sock:
            sock.sendall(post)
            [(status, _, _)] = read_responses(sock, 1)
        assert status == 200
        digest = record_digest(ROUTE, "", key)
        name = f"{prefix}{{{int(digest[:4], 16) % BUCKETS:02x}}}:{digest}"
        stored = StoredResponse(
            200,
            (
                ("content-type", "text/plain"),
                ("Content-Length", "999"),
                ("content-length", "0"),
                ("Transfer-Encoding", "chunked"),
                ("Connection", "close, X-Internal-Token"),
                ("x-internal-token", "s3cret"),
                ("Keep-Alive", "timeout=1"),
                ("Set-Cookie", "session=someone-else"),
                ("Idempotent-Replayed", "false"),
                ("Upgrade", "h2c"),
                ("x-kept", "yes"),
            ),
            b"stored body",
        )
        with redis.Redis(port=redis_server.port) as raw_redis:
            assert raw_redis.hget(name, "s") == b"completed"
            raw_redis.hset(name, "resp", stored.encode())
        with connect(port) as sock:
            sock.sendall(post + post)  # pipelined: the first replay's framing delimits it
            answers = read_responses(sock, 2)
    finally:
        gateway.stop()
    for status, headers, replayed in answers:
        names = [n for n, _ in headers]
        assert status == 200 and replayed == b"stored body"
        assert [v for n, v in headers if n == "content-length"] == ["11"], headers
        for gone in ("transfer-encoding", "connection", "x-internal-token", "keep-alive"):
            assert gone not in names, headers
        assert "set-cookie" not in names and "upgrade" not in names, headers
        assert [v for n, v in headers if n == "idempotent-replayed"] == ["true"], headers
        assert ("x-kept", "yes") in headers and ("content-type", "text/plain") in headers
    assert await upstream_count(upstream, key) == 1


# -- the operator API -----------------------------------------------------------------


BAD_RESPONSES: list[tuple[str, Any, str, str]] = [
    # (id, the response given, the field named, a phrase of the title)
    ("not-an-object", "ok", "response", "must be a JSON object"),
    ("unknown-field", {"status": 200, "header": {}}, "response", "unknown field: header"),
    ("status-text", {"status": "200"}, "response.status", "200 to 599"),
    ("status-float", {"status": 200.5}, "response.status", "200 to 599"),
    ("status-bool", {"status": True}, "response.status", "200 to 599"),
    ("status-1xx", {"status": 101}, "response.status", "200 to 599"),
    ("status-600", {"status": 600}, "response.status", "200 to 599"),
    ("headers-list", {"headers": [["a", "b"]]}, "response.headers", "JSON object"),
    (
        "content-length",
        {"headers": {"Content-Length": "0"}},
        "response.headers.Content-Length",
        "the gateway sets Content-Length itself",
    ),
    (
        "transfer-encoding",
        {"headers": {"transfer-encoding": "chunked"}},
        "response.headers.transfer-encoding",
        "frames the replay itself",
    ),
    (
        "connection",
        {"headers": {"Connection": "close"}},
        "response.headers.Connection",
        "hop-by-hop",
    ),
    ("keep-alive", {"headers": {"Keep-Alive": "5"}}, "response.headers.Keep-Alive", "hop-by-hop"),
    ("upgrade", {"headers": {"Upgrade": "h2c"}}, "response.headers.Upgrade", "hop-by-hop"),
    (
        "set-cookie",
        {"headers": {"Set-Cookie": "a=b"}},
        "response.headers.Set-Cookie",
        "never carries Set-Cookie",
    ),
    (
        "replay-header",
        {"headers": {"Idempotent-Replayed": "false"}},
        "response.headers.Idempotent-Replayed",
        "sets Idempotent-Replayed itself",
    ),
    ("name-space", {"headers": {"X Bad": "1"}}, "response.headers.X Bad", "not a header name"),
    ("name-colon", {"headers": {"X-A:": "1"}}, "response.headers.X-A:", "not a header name"),
    ("name-empty", {"headers": {"": "1"}}, "response.headers.", "not a header name"),
    ("value-crlf", {"headers": {"X-A": "1\r\nX-B: 2"}}, "response.headers.X-A", "cannot carry"),
    ("value-lf", {"headers": {"X-A": "1\nX-B: 2"}}, "response.headers.X-A", "cannot carry"),
    ("value-nul", {"headers": {"X-A": "a\x00b"}}, "response.headers.X-A", "cannot carry"),
    ("value-control", {"headers": {"X-A": "a\x1bb"}}, "response.headers.X-A", "cannot carry"),
    ("value-del", {"headers": {"X-A": "a\x7fb"}}, "response.headers.X-A", "cannot carry"),
    ("value-non-ascii", {"headers": {"X-A": "caf\u00e9"}}, "response.headers.X-A", "cannot carry"),
    ("value-object", {"headers": {"X-A": {"b": 1}}}, "response.headers.X-A", "must be text"),
    ("value-bool", {"headers": {"X-A": True}}, "response.headers.X-A", "must be text"),
    (
        "too-many-headers",
        {"headers": {f"x-{i}": "1" for i in range(101)}},
        "response.headers",
        "over 100 headers",
    ),
    ("body-too-large", {"body": "x" * 1025}, "response.body", "over 1024 bytes"),
    ("body-json-too-large", {"body": ["x" * 1024]}, "response.body", "over 1024 bytes"),
    ("body-with-204", {"status": 204, "body": "x"}, "response.body", "empty for status 204"),
    ("body-with-304", {"status": 304, "body": {}}, "response.body", "empty for status 304"),
]


async def claimed_key(gw: GatewayClient) -> tuple[str, str]:
    key = unique("charge")
    answer = await gw.post("/jobs/charge", json={"job_key": key}, params={"sleep": "0.4"})
    assert answer.status_code == 504, answer.text
    path = f"/admin/keys/{ROUTE}/{key}"
    async with admin_client(gw) as admin:
        assert (await admin.post(path + "/claim", json={"operator": "alice"})).status_code == 200
    return key, path


def charge_route(**changes: Any) -> dict[str, Any]:
    return {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": "/jobs/charge"},
        "key": {"body": "job_key"},
        "fingerprint": ["method", "path", "body"],
        "upstream_timeout": "200ms",
        "max_stored_body": "1KiB",
        **changes,
    }


@pytest.mark.parametrize("store_kind", ["memory"])
async def test_operator_response_is_validated(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([charge_route()], admin={"token": TOKEN})
    key, path = await claimed_key(gw)
    ref = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
    before = await gw.gateway.store.get(ref)
    refused: list[str] = []
    async with admin_client(gw) as admin:
        for case, given, field, title in BAD_RESPONSES:
            answer = await admin.post(
                path + "/resolve",
                json={"operator": "alice", "outcome": "done", "response": given},
            )
            assert answer.status_code == 400, (case, answer.text)
            assert answer.headers["content-type"] == "application/problem+json", case
            doc = answer.json()
            assert doc["type"].endswith("/bad-response") and doc["status"] == 400, case
            assert doc["field"] == field, (case, doc)
            assert doc["title"] == BadResponse.title, (case, doc)
            assert title in doc["detail"], (case, doc)
            refused.append(case)
        after = await gw.gateway.store.get(ref)
        assert after is not None and before is not None
        assert after.state is State.CLAIMED and after.history == before.history
        # A response it can replay as given is taken, names lower-cased.
        good = {
            "status": 201,
            "headers": {"Content-Type": "text/plain", "X-Ledger": 42, "Retry-After": " 5\t"},
            "body": "paid",
        }
        done = await admin.post(
            path + "/resolve", json={"operator": "alice", "outcome": "done", "response": good}
        )
        assert done.status_code == 200, done.text
    assert len(refused) == len(BAD_RESPONSES)
    repeat = await gw.post("/jobs/charge", json={"job_key": key}, params={"sleep": "0.4"})
    assert repeat.status_code == 201 and repeat.content == b"paid"
    assert repeat.headers.get_list("content-length") == ["4"]
    assert repeat.headers.get_list("content-type") == ["text/plain"]
    assert repeat.headers["x-ledger"] == "42" and repeat.headers["retry-after"] == "5"
    assert repeat.headers["idempotent-resolved-by"] == "operator"
    assert await upstream_count(upstream, key) == 1


@pytest.mark.parametrize("store_kind", ["memory"])
async def test_operator_api_bounds_the_request_body(gateway_for: Build, upstream: Process) -> None:
    gw = await gateway_for([charge_route()], admin={"token": TOKEN})
    _, path = await claimed_key(gw)
    async with admin_client(gw) as admin:
        # 6 x max_stored_body (1 KiB) + 64 KiB: the most a valid resolve can take.
        huge = {"operator": "alice", "outcome": "done", "note": "x" * (72 * 1024)}
        answer = await admin.post(path + "/resolve", json=huge)
        assert answer.status_code == 413 and answer.json()["type"].endswith("/request-too-large")
        claim = await admin.post(path + "/claim", json={"operator": "x" * (65 * 1024)})
        assert claim.status_code == 413


@pytest.mark.parametrize("store_kind", ["memory"])
async def test_default_operator_response_and_retry_ignore_nothing_given(
    gateway_for: Build, upstream: Process
) -> None:
    """No response given: the documented 2xx; `retry` does not look at a response."""
    gw = await gateway_for([charge_route()], admin={"token": TOKEN})
    key, path = await claimed_key(gw)
    async with admin_client(gw) as admin:
        done = await admin.post(path + "/resolve", json={"operator": "alice", "outcome": "done"})
        assert done.status_code == 200
        _, other_path = await claimed_key(gw)
        retry = await admin.post(
            other_path + "/resolve",
            json={"operator": "alice", "outcome": "retry", "response": "ignored"},
        )
        assert retry.status_code == 200 and retry.json()["state"] == "released"
    repeat = await gw.post("/jobs/charge", json={"job_key": key})
    # The shared token: the name given, marked as such.
    assert repeat.status_code == 200 and repeat.json()["resolved_by"] == "alice (shared token)"
    assert repeat.headers.get_list("content-length") == [str(len(repeat.content))]
