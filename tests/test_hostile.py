"""Hostile and bad input: every one gets a clear 4xx problem+json answer, never a 500,
never a crash, never a wrong replay, and never reaches the upstream as a request the
caller did not send.

Where the HTTP framing itself is the input, the requests go over raw sockets to a real
`python -m gateway run` process (uvicorn + httptools + gateway/http/protocol.py). Where the
input is about keys (every key source kind, JSON bodies, namespaces), the gateway runs
in-process on a real store with a real upstream.
"""

from __future__ import annotations

import io
import json
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.assembly import Gateway
from gateway.config import StoreConfig, parse_config
from gateway.errors import ConfigError
from gateway.keying import key_header_value
from gateway.logs import AccessWriter, Trace
from gateway.store.redis import RedisStore
from tests.conftest import GatewayClient, config_for, unique, upstream_count
from tests.support.ledger import Ledger
from tests.support.rawhttp import RawResponse, connect, exchange, read_response
from tests.support.rawhttp import request as http_request
from tests.support.servers import Process, RedisServer, free_port, gateway_process
from tests.support.topologies import redis_cli

PROBLEMS = "https://idempotency-gateway.dev/problems/"
HEAD_LIMIT = 16 * 1024  # server.max_header_bytes, the default
BODY_LIMIT = 64 * 1024  # max_request_body of the routes below
#: Bytes a streaming test sends at most. The request never ends, so an answer at all
#: proves the cut-off; "sent" counts what the kernel took, buffers included.
CAP = 16 * 1024 * 1024


@dataclass
class RawGateway:
    process: Process
    port: int
    upstream: Process

    def count(self, key: str) -> int:
        response = httpx.get(f"{self.upstream.url}/_count", params={"key": key}, timeout=10)
        return int(response.json()["count"])

    def alive(self) -> None:
        """The process still runs and serves a normal keyed request, then replays it."""
        assert self.process.proc is not None and self.process.proc.poll() is None
        key = unique("alive")
        data = http_request("POST", "/jobs/x", [("Idempotency-Key", key)], b"{}")
        first, again = exchange(self.port, data), exchange(self.port, data)
        assert first.status == 200 and "idempotent-replayed" not in first.headers, first
        assert again.headers.get("idempotent-replayed") == "true", again
        assert self.count(key) == 1

    def output_is_clean(self) -> None:
        out = self.process.output()
        assert "Traceback" not in out and "Exception in ASGI" not in out, out[-3000:]
        assert '"status": 500' not in out, out[-3000:]


@pytest.fixture(scope="module")
def raw_gateway(
    upstream: Process, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RawGateway]:
    port, admin_port = free_port(), free_port()
    common = {"upstream": upstream.url, "max_request_body": "64KB"}
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "keyed",
                "match": {"path": "/jobs/{name}"},
                "key": {"header": "Idempotency-Key"},
                **common,
            },
            {
                "name": "pathkey",
                "match": {"path": "/p/{rest:path}"},
                "key": {"header": "Idempotency-Key"},
                **common,
            },
            {"name": "open", "match": {"path": "/open/{rest:path}"}, **common},
            {
                "name": "bodykey",
                "match": {"path": "/b/{name}"},
                "key": {"body": "job_key"},
                "upstream": upstream.url,
                "max_request_body": "2MiB",
            },
        ],
    }
    path = tmp_path_factory.mktemp("hostile") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port).start()
    try:
        yield RawGateway(process, port, upstream)
    finally:
        assert process.stop() == 0, process.output()[-3000:]


def smuggled(key: str) -> bytes:
    """A request hidden in another's body: it must never reach the upstream."""
    return (
        f"POST /open/smuggled HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n"
        "Content-Length: 0\r\n\r\n"
    ).encode()


def head(key: str, *lines: str, target: str = "/jobs/x", end: str = "\r\n") -> bytes:
    text = end.join([f"POST {target} HTTP/1.1", "Host: x", f"Idempotency-Key: {key}", *lines])
    return (text + end + end).encode("latin-1")


def _cl_te(outer: str, inner: str) -> bytes:
    body = b"0\r\n\r\n" + smuggled(inner)
    return head(outer, f"Content-Length: {len(body)}", "Transfer-Encoding: chunked") + body


def _te_cl(outer: str, inner: str) -> bytes:
    hidden = smuggled(inner)
    body = f"{len(hidden):x}\r\n".encode() + hidden + b"\r\n0\r\n\r\n"
    return head(outer, "Transfer-Encoding: chunked", "Content-Length: 4") + body


def _after(*lines: str, body: bytes = b"0\r\n\r\n") -> Callable[[str, str], bytes]:
    """A request with these header lines, its body, then a smuggled request."""
    return lambda outer, inner: head(outer, *lines) + body + smuggled(inner)


#: Requests whose framing the gateway cannot trust. (name, builder(outer key, smuggled
#: key)). All are refused with 400 malformed-request and the connection closed, so
#: nothing after them is read as another request.
AMBIGUOUS: list[tuple[str, Callable[[str, str], bytes]]] = [
    ("content-length+transfer-encoding", _cl_te),
    ("transfer-encoding+content-length", _te_cl),
    ("two-content-lengths", _after("Content-Length: 5", "Content-Length: 0")),
    ("same-content-length-twice", _after("Content-Length: 0", "Content-Length: 0", body=b"")),
    ("content-length-list", _after("Content-Length: 0, 5", body=b"")),
    ("content-length-letters", _after("Content-Length: abc", body=b"")),
    ("content-length-negative", _after("Content-Length: -1", body=b"")),
    ("content-length-plus", _after("Content-Length: +0", body=b"")),
    ("content-length-hex", _after("Content-Length: 0x0", body=b"")),
    ("content-length-two-numbers", _after("Content-Length: 0 0", body=b"")),
    ("content-length-overflow", _after("Content-Length: 99999999999999999999999", body=b"")),
    ("transfer-encoding-xchunked", _after("Transfer-Encoding: xchunked")),
    ("transfer-encoding-space-before-colon", _after("Transfer-Encoding : chunked")),
    (
        "transfer-encoding-chunked-twice",
        _after("Transfer-Encoding: chunked", "Transfer-Encoding: chunked"),
    ),
    ("transfer-encoding-chunked-not-last", _after("Transfer-Encoding: chunked, gzip")),
    ("transfer-encoding-vertical-tab", _after("Transfer-Encoding:\x0bchunked")),
    ("bare-lf-line-ends", lambda o, i: head(o, "Content-Length: 0", end="\n") + smuggled(i)),
    ("obsolete-line-folding", _after("X-A: a", " folded", "Content-Length: 0", body=b"")),
    ("nul-in-header-value", _after("X-A: a\x00b", "Content-Length: 0", body=b"")),
    ("cr-in-header-value", _after("X-A: a\rb", "Content-Length: 0", body=b"")),
    ("space-in-header-name", _after("Idempotency Key: k", "Content-Length: 0", body=b"")),
    ("bad-chunk-size", _after("Transfer-Encoding: chunked", body=b"zz\r\nabc\r\n0\r\n\r\n")),
    ("chunk-size-overflow", _after("Transfer-Encoding: chunked", body=b"f" * 20 + b"\r\nabc\r\n")),
    ("chunk-without-crlf", _after("Transfer-Encoding: chunked", body=b"3\r\nabcX\r\n0\r\n\r\n")),
    (
        "non-ascii-target",
        lambda o, i: head(o, "Content-Length: 0", target="/jobs/\xff") + smuggled(i),
    ),
    ("http2-preface", lambda o, i: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + smuggled(i)),
    (
        "bad-method",
        lambda o, i: head(o, "Content-Length: 0").replace(b"POST", b"P@ST", 1) + smuggled(i),
    ),
    (
        "bad-version",
        lambda o, i: (
            head(o, "Content-Length: 0").replace(b"HTTP/1.1", b"HTTP/1.x", 1) + smuggled(i)
        ),
    ),
    (
        "tls-client-hello",
        lambda o, i: b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + smuggled(i),
    ),
]


def test_ambiguous_framing_is_refused_and_nothing_is_forwarded(
    raw_gateway: RawGateway, ledger: Ledger
) -> None:
    """Smuggling-style and malformed requests: a 400 problem+json, the connection
    closed, and the upstream sees neither the request nor the one hidden in it."""
    answers: dict[str, RawResponse] = {}
    keys: dict[str, tuple[str, str]] = {}
    for name, build in AMBIGUOUS:
        keys[name] = outer, inner = unique("outer"), unique("smuggled")
        answers[name] = exchange(raw_gateway.port, build(outer, inner))
    reached = {name: raw_gateway.count(o) + raw_gateway.count(i) for name, (o, i) in keys.items()}
    wrong = {
        name: answer.raw[:200]
        for name, answer in answers.items()
        if answer.status != 400 or not answer.closed
    }
    ledger.record(
        "hostile input",
        "ambiguous framing (raw sockets, real process)",
        requests=len(AMBIGUOUS),
        bad_inputs=len(AMBIGUOUS),
        upstream_duplicates=sum(reached.values()),
        detail=f"{len(wrong)} answered other than 400 + close",
    )
    assert not wrong
    assert not {name: n for name, n in reached.items() if n}
    for answer in answers.values():
        assert answer.problem()["type"] == PROBLEMS + "malformed-request"
        assert answer.headers["connection"] == "close"
    raw_gateway.alive()
    raw_gateway.output_is_clean()


def test_transfer_codings_other_than_chunked_are_refused(
    raw_gateway: RawGateway, ledger: Ledger
) -> None:
    """`gzip, chunked` parses, but the upstream would get gzip bytes without the coding
    that says so: refused, not forwarded."""
    key = unique()
    body = b"5\r\nhello\r\n0\r\n\r\n"
    answer = exchange(raw_gateway.port, head(key, "Transfer-Encoding: gzip, chunked") + body)
    ledger.record("hostile input", "transfer coding other than chunked", requests=1, bad_inputs=1)
    assert answer.status == 400
    assert answer.problem()["type"] == PROBLEMS + "malformed-request"
    assert raw_gateway.count(key) == 0


def test_pipelined_requests_each_reach_the_upstream_once(raw_gateway: RawGateway) -> None:
    """The control for the smuggling cases: two real requests on one connection are
    two requests, in order, each forwarded once."""
    a, b = unique(), unique()
    data = http_request("POST", "/open/a", [("Idempotency-Key", a)]) + http_request(
        "POST", "/open/b", [("Idempotency-Key", b), ("Connection", "close")]
    )
    with connect(raw_gateway.port) as sock:
        sock.sendall(data)
        first = read_response(sock, 10)
    assert first.status == 200 and json.loads(first.body)["key"] == a
    deadline = time.monotonic() + 10
    while raw_gateway.count(b) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (raw_gateway.count(a), raw_gateway.count(b)) == (1, 1)


def test_truncated_body_is_never_forwarded(raw_gateway: RawGateway, ledger: Ledger) -> None:
    """A caller that hangs up before its declared body is complete did not send that
    request: the part that arrived must not run upstream under its key."""
    keys = [unique("cut"), unique("cut")]
    with connect(raw_gateway.port) as sock:
        sock.sendall(head(keys[0], "Content-Length: 100") + b"0123456789")
        time.sleep(0.2)
    with connect(raw_gateway.port) as sock:
        sock.sendall(head(keys[1], "Transfer-Encoding: chunked") + b"a\r\n0123456789\r\n")
        time.sleep(0.2)
    time.sleep(0.5)  # the gateway would forward within milliseconds if it did
    counts = [raw_gateway.count(k) for k in keys]
    ledger.record(
        "hostile input",
        "body cut short by a disconnect",
        requests=2,
        bad_inputs=2,
        upstream_duplicates=sum(counts),
    )
    assert counts == [0, 0]
    raw_gateway.alive()


def test_a_body_built_to_parse_slowly_is_answered_while_others_are(
    raw_gateway: RawGateway, ledger: Ledger
) -> None:
    """A key read from a JSON body: 65 brackets (past the depth check's threshold),
    then a string of escaped quotes that never closes, 1 MiB of it, sent four times
    over. A quadratic parse held the event loop about an hour per body; a linear one
    answers each 400 at once. Requests sent meanwhile are answered as usual (how the
    parse's time grows with the body: tests/test_keys.py)."""
    attack = b"[" * 65 + b'"' + b'\\"' * (512 * 1024)
    data = http_request("POST", "/b/x", [("Content-Type", "application/json")], attack)
    answers: list[RawResponse] = []

    def attacker() -> None:
        for _ in range(4):
            answers.append(exchange(raw_gateway.port, data, timeout=60))

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    served = 0
    while thread.is_alive() or served < 3:
        raw_gateway.alive()  # a keyed request and its replay, each within 10 s
        served += 1
    thread.join()
    ledger.record(
        "hostile input",
        "a body built to parse slowly (1 MiB of escaped quotes)",
        requests=len(answers) + 2 * served,
        bad_inputs=len(answers),
        detail=f"{len(answers)} answered 400; {served} keyed requests served meanwhile",
    )
    assert [a.status for a in answers] == [400] * 4, answers
    assert all(a.problem()["type"] == PROBLEMS + "bad-request" for a in answers)
    raw_gateway.output_is_clean()


# --- sizes ---------------------------------------------------------------------------


def test_oversized_headers_get_431_and_target_414(raw_gateway: RawGateway, ledger: Ledger) -> None:
    many = [f"X-Pad-{i}: {'v' * 100}" for i in range(HEAD_LIMIT // 100 + 10)]
    answers = {
        "many headers": exchange(raw_gateway.port, head(unique(), *many, "Content-Length: 0")),
        "one long header": exchange(
            raw_gateway.port, head(unique(), f"X-Big: {'a' * 100_000}", "Content-Length: 0")
        ),
        "long target": exchange(
            raw_gateway.port, head(unique(), "Content-Length: 0", target="/jobs/" + "a" * 50_000)
        ),
    }
    ledger.record("hostile input", "oversized head", requests=3, bad_inputs=3)
    statuses = {name: a.status for name, a in answers.items()}
    assert statuses == {"many headers": 431, "one long header": 431, "long target": 414}
    assert answers["many headers"].problem()["type"] == PROBLEMS + "headers-too-large"
    assert answers["long target"].problem()["type"] == PROBLEMS + "uri-too-long"
    assert all(a.closed for a in answers.values())
    # Just under the limit is fine.
    fits = [f"X-Pad-{i}: {'v' * 100}" for i in range(HEAD_LIMIT // 150)]
    assert exchange(raw_gateway.port, head(unique(), *fits, "Content-Length: 0")).status == 200


def test_endless_header_line_is_cut_off_while_it_streams(
    raw_gateway: RawGateway, ledger: Ledger
) -> None:
    """A header line that never ends is refused after a bounded amount, not buffered
    until the sender stops: the 431 arrives while the sender is still sending."""
    with connect(raw_gateway.port) as sock:
        sock.sendall(head(unique(), "Content-Length: 0")[:-4] + b"\r\nX-Endless: ")
        answer: RawResponse | None = None
        sent = _send_until_answered(sock, b"a" * 16384)
        answer = read_response(sock, 10)
    ledger.record(
        "hostile input",
        "endless header line",
        requests=1,
        bad_inputs=1,
        detail=f"cut off after {sent} bytes sent",
    )
    assert answer.status == 431, answer.raw[:300]
    assert answer.problem()["type"] == PROBLEMS + "headers-too-large"
    raw_gateway.alive()


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _send_until_answered(
    sock: socket.socket, piece: bytes, *, counts: int | None = None, pause: float = 0.0
) -> int:
    """Send `piece` over and over until the gateway answers (the socket turns readable)
    or hangs up, or CAP bytes were counted; `counts` bytes count per piece (its length
    unless given), `pause` seconds between pieces. The bytes counted."""
    step = len(piece) if counts is None else counts
    sent = 0
    while sent < CAP:
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += step
        if _readable(sock):
            break
        if pause:
            time.sleep(pause)
    return sent


def test_declared_body_over_the_limit_is_413_before_it_is_sent(
    raw_gateway: RawGateway, ledger: Ledger
) -> None:
    key = unique()
    with connect(raw_gateway.port) as sock:
        sock.sendall(head(key, f"Content-Length: {10 * BODY_LIMIT}"))
        answer = read_response(sock, 10)
    ledger.record("hostile input", "declared body over the limit", requests=1, bad_inputs=1)
    assert answer.status == 413
    assert answer.problem()["type"] == PROBLEMS + "payload-too-large"
    assert raw_gateway.count(key) == 0


def test_chunked_body_growing_past_the_limit_is_cut_off_while_streaming(
    raw_gateway: RawGateway, ledger: Ledger
) -> None:
    """No length up front: the gateway counts as the chunks arrive and answers 413
    once the limit is passed, while the body is still unfinished."""
    key = unique()
    chunk = b"x" * 8192
    with connect(raw_gateway.port) as sock:
        sock.sendall(head(key, "Transfer-Encoding: chunked"))
        framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        # Never sends the last chunk; counts body bytes, not the framing.
        sent = _send_until_answered(sock, framed, counts=len(chunk), pause=0.001)
        answer = read_response(sock, 10)
    ledger.record(
        "hostile input",
        "chunked body past the limit",
        requests=1,
        bad_inputs=1,
        detail=f"413 after {sent} body bytes sent, limit {BODY_LIMIT}",
    )
    assert answer.status == 413, answer.raw[:300]
    assert answer.problem()["type"] == PROBLEMS + "payload-too-large"
    assert raw_gateway.count(key) == 0


# --- paths ---------------------------------------------------------------------------


def test_encoded_paths_are_forwarded_as_sent(raw_gateway: RawGateway, ledger: Ledger) -> None:
    """%3F must not become a query, %0D%0A must not become a line break in the upstream
    request, %2F must not become a separator: the upstream gets the path as sent (on a
    passthrough route for %2F: keyed routes refuse it, see test_paths.py)."""
    sent = {
        "/jobs/a%3Fstatus=418": ("/jobs/a%3Fstatus=418", ""),
        "/jobs/a%0D%0AX-Injected:%20yes": ("/jobs/a%0D%0AX-Injected:%20yes", ""),
        "/open/a%2F..%2Fb?q=1": ("/open/a%2F..%2Fb", "q=1"),
    }
    seen = {}
    for target in sent:
        answer = exchange(
            raw_gateway.port, http_request("POST", target, [("Idempotency-Key", unique())])
        )
        assert answer.status == 200, answer.raw[:300]
        doc = json.loads(answer.body)
        assert "x-injected" not in doc["headers"]
        seen[target] = (doc["raw_path"], doc["query"])
    n = len(sent)
    ledger.record("hostile input", "percent-encoded paths", requests=n, bad_inputs=n)
    assert seen == sent


def test_two_paths_that_decode_alike_do_not_share_a_response(raw_gateway: RawGateway) -> None:
    """/p/a%2Fb and /p/a/b decode alike and may be different upstream requests: on a
    keyed route the first is refused (never forwarded, nothing claimed), so the same
    key on the second is its first run, not a replay of the other's response."""
    key = unique()
    first = exchange(raw_gateway.port, http_request("POST", "/p/a%2Fb", [("Idempotency-Key", key)]))
    assert first.status == 400, first.raw[:300]
    assert first.problem()["type"] == PROBLEMS + "ambiguous-path"
    assert raw_gateway.count(key) == 0
    second = exchange(raw_gateway.port, http_request("POST", "/p/a/b", [("Idempotency-Key", key)]))
    assert second.status == 200, second.raw[:300]
    assert "idempotent-replayed" not in second.headers
    assert raw_gateway.count(key) == 1


def test_path_that_is_not_utf8_is_refused(raw_gateway: RawGateway) -> None:
    for target in ("/jobs/%FF", "/jobs/a%C3"):
        answer = exchange(
            raw_gateway.port, http_request("POST", target, [("Idempotency-Key", unique())])
        )
        assert answer.status == 400
        assert answer.problem()["type"] == PROBLEMS + "malformed-request"


# --- keys, in-process: every source kind ---------------------------------------------

Build = Callable[..., Any]

KEY_ROUTES: list[dict[str, Any]] = [
    {"name": "hdr", "match": {"path": "/h"}, "key": {"header": "Idempotency-Key"}},
    {
        "name": "hdr10",
        "match": {"path": "/h10"},
        "key": {"header": "Idempotency-Key", "max_length": 10},
    },
    {"name": "qry", "match": {"path": "/q"}, "key": {"query": "k"}},
    {"name": "body", "match": {"path": "/b"}, "key": {"body": "job_key"}},
    {
        "name": "tpl",
        "match": {"path": "/t"},
        "key": {"template": "r:{body.user_id}:{header.X-Day}"},
    },
    {
        "name": "hash",
        "match": {"path": "/hash"},
        "key": {"hash": ["method", "path", "header.X-Tag", "body"]},
    },
    {"name": "period", "match": {"path": "/period"}, "key": {"period": "1d"}},
]
for _route in KEY_ROUTES:
    _route["max_request_body"] = "64KB"


def _u(n: int = 0) -> str:
    """A fresh key, padded to n characters."""
    return uuid.uuid4().hex.ljust(n, "k")


def _json(doc: str) -> dict[str, Any]:
    return {"content": doc.encode(), "headers": {"content-type": "application/json"}}


def _hdr(value: str | bytes, **more: Any) -> dict[str, Any]:
    return {"headers": [("Idempotency-Key", value)], **more}


#: (id, path, request kwargs (a callable: fresh keys each run), status, problem slug,
#: detail fragment). Status 200: a good key; it must run once and not be a replay.
KEY_CASES: list[tuple[str, str, Callable[[], dict[str, Any]], int, str, str]] = [
    # header
    ("header-missing", "/h", lambda: {}, 400, "missing-key", "Idempotency-Key"),
    ("header-empty", "/h", lambda: _hdr(""), 400, "missing-key", ""),
    ("header-blank", "/h", lambda: _hdr("   "), 400, "missing-key", ""),
    ("header-empty-quoted", "/h", lambda: _hdr('""'), 400, "missing-key", ""),
    ("header-over-255", "/h", lambda: _hdr(_u(256)), 400, "bad-request", "at most 255"),
    ("header-at-255", "/h", lambda: _hdr(_u(255)), 200, "", ""),
    ("header-over-route-limit", "/h10", lambda: _hdr(_u(11)), 400, "bad-request", "at most 10"),
    ("header-nul", "/h", lambda: _hdr(_u() + "\x00"), 400, "malformed-request", "control"),
    ("header-tab", "/h", lambda: _hdr(_u() + "\tx"), 400, "bad-request", "control"),
    ("header-del", "/h", lambda: _hdr(_u() + "\x7f"), 400, "malformed-request", "control"),
    (
        "header-c1-as-utf8",
        "/h",
        lambda: _hdr(f"{_u()}\u0085".encode()),
        400,
        "bad-request",
        "control",
    ),
    ("header-not-utf8", "/h", lambda: _hdr(_u().encode() + b"\xff"), 400, "bad-request", "UTF-8"),
    ("header-cut-utf8", "/h", lambda: _hdr(_u().encode() + b"\xc3"), 400, "bad-request", "UTF-8"),
    ("header-utf8", "/h", lambda: _hdr(f"ключ…{_u()}".encode()), 200, "", ""),
    ("header-bad-quoting", "/h", lambda: _hdr(f'"{_u()}'), 400, "bad-request", "quoted"),
    (
        "header-twice",
        "/h",
        lambda: {"headers": [("Idempotency-Key", _u()), ("Idempotency-Key", _u())]},
        400,
        "bad-request",
        "2 times",
    ),
    # query
    ("query-missing", "/q", lambda: {}, 400, "missing-key", "query k"),
    ("query-empty", "/q", lambda: {"params": {"k": ""}}, 400, "missing-key", ""),
    ("query-over-255", "/q", lambda: {"params": {"k": _u(256)}}, 400, "bad-request", "255"),
    ("query-nul", "/q", lambda: {"url": f"/q?k={_u()}%00"}, 400, "bad-request", "control"),
    ("query-newline", "/q", lambda: {"url": f"/q?k={_u()}%0A"}, 400, "bad-request", "control"),
    ("query-not-utf8", "/q", lambda: {"url": f"/q?k={_u()}%FF"}, 400, "bad-request", "UTF-8"),
    ("query-cut-utf8", "/q", lambda: {"url": f"/q?k={_u()}%C3"}, 400, "bad-request", "UTF-8"),
    (
        "query-overlong-utf8",
        "/q",
        lambda: {"url": f"/q?k={_u()}%C0%AF"},
        400,
        "bad-request",
        "UTF-8",
    ),
    (
        "query-utf8-surrogate",
        "/q",
        lambda: {"url": f"/q?k={_u()}%ED%A0%80"},
        400,
        "bad-request",
        "UTF-8",
    ),
    ("query-utf8", "/q", lambda: {"url": f"/q?k=%D0%BA{_u()}"}, 200, "", ""),
    # body (JMESPath)
    ("body-no-field", "/b", lambda: _json('{"other": 1}'), 400, "missing-key", "body job_key"),
    ("body-empty", "/b", lambda: _json(""), 400, "missing-key", ""),
    ("body-null-key", "/b", lambda: _json('{"job_key": null}'), 400, "missing-key", ""),
    ("body-empty-key", "/b", lambda: _json('{"job_key": ""}'), 400, "missing-key", ""),
    ("body-array", "/b", lambda: _json("[1, 2]"), 400, "missing-key", ""),
    ("body-string", "/b", lambda: _json('"job_key"'), 400, "missing-key", ""),
    ("body-malformed", "/b", lambda: _json("{not json"), 400, "bad-request", "not valid JSON"),
    (
        "body-trailing",
        "/b",
        lambda: _json(f'{{"job_key": "{_u()}"}} x'),
        400,
        "bad-request",
        "JSON",
    ),
    ("body-bom", "/b", lambda: _json(f'\ufeff{{"job_key": "{_u()}"}}'), 400, "bad-request", "JSON"),
    (
        "body-not-utf8",
        "/b",
        lambda: {
            "content": b'{"job_key": "\xff"}',
            "headers": {"content-type": "application/json"},
        },
        400,
        "bad-request",
        "UTF-8",
    ),
    (
        "body-lone-surrogate",
        "/b",
        lambda: _json('{"job_key": "\\ud800"}'),
        400,
        "bad-request",
        "UTF-8",
    ),
    (
        "body-control",
        "/b",
        lambda: _json(f'{{"job_key": "{_u()}\\u0000"}}'),
        400,
        "bad-request",
        "control",
    ),
    (
        "body-key-over-255",
        "/b",
        lambda: _json(f'{{"job_key": "{_u(300)}"}}'),
        400,
        "bad-request",
        "255",
    ),
    ("body-deep-arrays", "/b", lambda: _json("[" * 60_000), 400, "bad-request", "deeper"),
    ("body-deep-objects", "/b", lambda: _json('{"a":' * 10_000), 400, "bad-request", "deeper"),
    (
        "body-duplicate-key-field",
        "/b",
        lambda: _json(f'{{"job_key": "{_u()}", "job_key": "{_u()}"}}'),
        400,
        "bad-request",
        "more than once",
    ),
    (
        "body-duplicate-other-field",
        "/b",
        lambda: _json(f'{{"job_key": "{_u()}", "n": 1, "n": 2}}'),
        400,
        "bad-request",
        "more than once",
    ),
    ("body-nan", "/b", lambda: _json('{"job_key": NaN}'), 400, "bad-request", "NaN"),
    (
        "body-overflowing-number",
        "/b",
        lambda: _json('{"job_key": 1e999}'),
        400,
        "bad-request",
        "too large",
    ),
    (
        "body-huge-integer",
        "/b",
        lambda: _json('{"job_key": 1' + "0" * 5000 + "}"),
        400,
        "bad-request",
        "JSON",
    ),
    ("body-object-key", "/b", lambda: _json('{"job_key": {"a": 1}}'), 400, "bad-request", "object"),
    (
        "body-form-type",
        "/b",
        lambda: {
            "content": b"job_key=a",
            "headers": {"content-type": "application/x-www-form-urlencoded"},
        },
        400,
        "bad-request",
        "x-www-form-urlencoded",
    ),
    (
        "body-multipart-type",
        "/b",
        lambda: {
            "content": b"--x--",
            "headers": {"content-type": "multipart/form-data; boundary=x"},
        },
        400,
        "bad-request",
        "multipart",
    ),
    (
        "body-over-limit",
        "/b",
        lambda: _json(f'{{"job_key": "{_u()}", "p": "{"x" * 70_000}"}}'),
        413,
        "payload-too-large",
        "",
    ),
    ("body-number-key", "/b", lambda: _json(f'{{"job_key": {uuid.uuid4().int}}}'), 200, "", ""),
    # template
    ("template-no-header", "/t", lambda: _json(f'{{"user_id": "{_u()}"}}'), 400, "missing-key", ""),
    (
        "template-no-body-part",
        "/t",
        lambda: {"headers": {"X-Day": "3"}, **_json("{}")},
        400,
        "missing-key",
        "",
    ),
    (
        "template-header-not-utf8",
        "/t",
        lambda: {"content": f'{{"user_id": "{_u()}"}}'.encode(), "headers": [("X-Day", b"\xff")]},
        400,
        "bad-request",
        "UTF-8",
    ),
    (
        "template-header-control",
        "/t",
        lambda: {
            "content": f'{{"user_id": "{_u()}"}}'.encode(),
            "headers": [("X-Day", "3\u0085".encode())],
        },
        400,
        "bad-request",
        "control",
    ),
    (
        "template-body-surrogate",
        "/t",
        lambda: {"headers": {"X-Day": "3"}, "content": b'{"user_id": "\\udfff"}'},
        400,
        "bad-request",
        "UTF-8",
    ),
    (
        "template-over-255",
        "/t",
        lambda: {"headers": {"X-Day": "3"}, "content": f'{{"user_id": "{_u(300)}"}}'.encode()},
        400,
        "bad-request",
        "255",
    ),
    (
        "template-body-array",
        "/t",
        lambda: {"headers": {"X-Day": "3"}, "content": b'{"user_id": [1]}'},
        400,
        "bad-request",
        "object or array",
    ),
    (
        "template-body-malformed",
        "/t",
        lambda: {"headers": {"X-Day": "3"}, "content": b"{"},
        400,
        "bad-request",
        "JSON",
    ),
    (
        "template-good",
        "/t",
        lambda: {"headers": {"X-Day": "3"}, "content": f'{{"user_id": "{_u()}"}}'.encode()},
        200,
        "",
        "",
    ),
    # hash and period: the request cannot inject a key, any bytes are hashed or ignored
    (
        "hash-any-bytes",
        "/hash",
        lambda: {
            "headers": [("X-Tag", b"\xff\x85" + _u().encode())],
            "content": b"\xff\xfe\x00",
        },
        200,
        "",
        "",
    ),
    (
        "control-in-another-header",
        "/hash",
        lambda: {"headers": [("X-Other", f"{_u()}\x01")]},
        400,
        "malformed-request",
        "x-other",
    ),
    ("hash-no-header", "/hash", lambda: {"content": _u().encode()}, 200, "", ""),
]


@pytest.mark.anyio
@pytest.mark.parametrize("store_kind", ["memory"])
@pytest.mark.parametrize(
    ("path", "send", "status", "slug", "fragment"),
    [pytest.param(*case[1:], id=case[0]) for case in KEY_CASES],
)
async def test_bad_keys_get_a_clear_answer_for_every_source_kind(
    gateway_for: Build,
    ledger: Ledger,
    request: pytest.FixtureRequest,
    path: str,
    send: Callable[[], dict[str, Any]],
    status: int,
    slug: str,
    fragment: str,
) -> None:
    gw = await gateway_for(KEY_ROUTES)
    kwargs = send()
    url = kwargs.pop("url", path)
    response = await gw.post(url, **kwargs)
    ledger.record(
        "hostile input",
        f"key: {request.node.callspec.id}",
        requests=1,
        bad_inputs=int(status != 200),
    )
    assert response.status_code == status, response.text
    if status == 200:
        assert "idempotent-replayed" not in response.headers
        return
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["type"] == PROBLEMS + slug and doc["status"] == status, doc
    assert fragment in doc.get("detail", ""), doc


@pytest.mark.anyio
@pytest.mark.parametrize("store_kind", ["memory"])
async def test_different_bytes_never_share_a_key_or_a_response(
    gateway_for: Build, upstream: Process, ledger: Ledger
) -> None:
    """Inputs that a lossy decoding would merge stay apart: hash keys over bytes that
    are not UTF-8, and bodies that differ only in the order of duplicate fields (the
    header-keyed route does not parse them, so the raw bytes are fingerprinted)."""
    gw = await gateway_for(KEY_ROUTES)
    body = uuid.uuid4().hex.encode()
    tags = [b"\xff", b"\xfe", b"\xc3\xbf"]  # the last is U+00FF; latin-1 of the first
    hashed = [await gw.post("/hash", headers=[("X-Tag", t)], content=body) for t in tags]
    key = unique()
    dup = [
        await gw.post("/h", headers={"Idempotency-Key": key}, content=doc)
        for doc in (b'{"a": 1, "a": 2}', b'{"a": 2, "a": 1}')
    ]
    # HTTP trims spaces and tabs around a value, nothing else: NBSP and LS are key text.
    spaced = [
        await gw.post("/h", headers=[("Idempotency-Key", (key + tail).encode())])
        for tail in ("-ws", "-ws\u00a0", "-ws\u2028")
    ]
    ledger.record(
        "hostile input", "lossy decodings that would merge keys", requests=8, bad_inputs=8
    )
    assert [r.status_code for r in spaced] == [200, 200, 200]
    assert not any("idempotent-replayed" in r.headers for r in spaced)
    assert [r.status_code for r in hashed] == [200, 200, 200]
    assert not any("idempotent-replayed" in r.headers for r in hashed)
    assert len({r.json()["key"] for r in hashed}) == 3
    assert [r.status_code for r in dup] == [200, 422]
    assert await upstream_count(upstream, key) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("store_kind", ["memory"])
async def test_period_key_ignores_hostile_parts(gateway_for: Build, ledger: Ledger) -> None:
    """A period route's key is the window alone: junk in the request cannot change or
    break it, and the fingerprint still tells different bodies apart."""
    gw = await gateway_for([{**KEY_ROUTES[-1], "match": {"path": "/period-" + _u()}}])
    path = gw.gateway.config.routes[0].path
    junk = {"headers": [("X-Junk", b"\xff\x85"), ("Idempotency-Key", b"\xff")]}
    first = await gw.post(path, content=b"\xff\xfe", **junk)
    again = await gw.post(path, content=b"\xff\xfe", **junk)
    other = await gw.post(path, content=b"\xfe\xff", **junk)
    ledger.record("hostile input", "period key with junk", requests=3, bad_inputs=3)
    assert (first.status_code, again.status_code, other.status_code) == (200, 200, 422)
    assert again.headers.get("idempotent-replayed") == "true"


# --- namespaces, on a real Redis -----------------------------------------------------

#: Keys that would escape a naive `prefix + route + ":" + key` layout or a glob.
ESCAPING_KEYS = [
    "../",
    "../../other-route/k",
    "*",
    "?",
    "[a-z]*",
    "{tag}",
    "{hdr}",
    "}{",
    ":",
    "a:b:c",
    "idem:{00}:i:in_flight",
    "\\",
    "%2F..%2F",
    "k k",
    "ключ/{x}",
    "k" * 255,
]


@pytest.mark.anyio
@pytest.mark.redis
async def test_escaping_keys_stay_in_their_namespace_on_redis(
    redis_server: RedisServer, upstream: Process, ledger: Ledger
) -> None:
    """Every Redis name the gateway writes is the hashed, tagged form; a key built to
    look like another route's, scope's or the index's name only ever reaches its own
    record: two routes and two tenants give three records per key, never fewer."""
    import redis.asyncio as aioredis

    prefix = unique("ns") + ":"
    routes = [
        {
            "name": "alpha",
            "match": {"path": "/alpha"},
            "key": {"header": "Idempotency-Key", "scope": ["header.X-Tenant"]},
        },
        {"name": "beta", "match": {"path": "/beta"}, "key": {"header": "Idempotency-Key"}},
    ]
    store = RedisStore(StoreConfig(url=redis_server.url, prefix=prefix))
    gateway = Gateway(config_for(upstream.url, routes), store=store, sweep=False)
    await gateway.start()
    client = GatewayClient(gateway)
    marker = unique("m")  # keeps this run's keys apart from other runs' at the upstream
    keys = [k if k == "k" * 255 else k + marker for k in ESCAPING_KEYS]
    keys[-1] = marker + "k" * (255 - len(marker))
    places = [("/alpha", "tenant-a"), ("/alpha", "tenant-b"), ("/beta", "tenant-a")]
    try:
        rounds = []
        for _ in range(2):
            answers = []
            for key in keys:
                for path, tenant in places:
                    answers.append(
                        await client.post(
                            path,
                            headers={"Idempotency-Key": key.encode(), "X-Tenant": tenant},
                        )
                    )
            rounds.append(answers)
        sent_bad = [
            await client.post("/alpha", headers={"Idempotency-Key": k, "X-Tenant": "tenant-a"})
            for k in ("a\nb" + marker, "k" * 256)
        ]
        scan = aioredis.Redis.from_url(redis_server.url)
        try:
            names = [n.decode() async for n in scan.scan_iter(match=prefix + "*", count=1000)]
        finally:
            await scan.aclose()
    finally:
        await client.http.aclose()
        await gateway.close()
    # The upstream counts by the Idempotency-Key it got: the key's spelling on the wire.
    runs = {k: await upstream_count(upstream, key_header_value(k)) for k in keys}
    records = [
        n for n in names if re.fullmatch(re.escape(prefix) + r"\{[0-9a-f]{2}\}:[0-9a-f]{32}", n)
    ]
    others = [
        n
        for n in names
        if n not in records
        and not re.fullmatch(
            re.escape(prefix) + r"\{[0-9a-f]{2}\}:(i:(in_flight|unresolved|parked|claimed)|m|ls)", n
        )
    ]
    ledger.record(
        "hostile input",
        "namespace-escaping keys on Redis",
        requests=2 * len(keys) * len(places) + len(sent_bad),
        bad_inputs=len(keys) + len(sent_bad),
        upstream_duplicates=sum(max(0, n - len(places)) for n in runs.values()),
        detail=f"{len(names)} Redis names scanned",
    )
    assert not others, others
    assert len(records) == len(keys) * len(places)
    assert all(r.status_code == 200 for answers in rounds for r in answers)
    assert not any("idempotent-replayed" in r.headers for r in rounds[0])
    assert all(r.headers.get("idempotent-replayed") == "true" for r in rounds[1])
    assert runs == {k: len(places) for k in keys}
    assert [r.status_code for r in sent_bad] == [400, 400]


def test_expect_continue_and_head_answers_are_not_held(raw_gateway: RawGateway) -> None:
    """The listener holds a response's head until its body, to send both in one write
    (gateway/http/protocol.py). A 100 Continue must still go out at once, and a HEAD answer,
    which has no body, must not wait for one."""
    key = unique("continue")
    head = http_request("POST", "/jobs/x", [("Idempotency-Key", key), ("Expect", "100-continue")])
    with connect(raw_gateway.port) as sock:
        sock.sendall(head.replace(b"Content-Length: 0", b"Content-Length: 2"))
        sock.settimeout(5)
        interim = b""
        while b"\r\n\r\n" not in interim:
            chunk = sock.recv(1024)
            assert chunk, interim
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n"), interim
        sock.sendall(b"{}")
        response = read_response(sock, 10)
    assert response.status == 200, response
    assert raw_gateway.count(key) == 1
    with connect(raw_gateway.port) as sock:
        sock.sendall(http_request("HEAD", "/open/head"))
        sock.settimeout(5)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 "), answer


def test_text_access_log_line_cannot_be_forged_by_the_path() -> None:
    """A path with a decoded %0D%0A stays on its own access-log line."""
    stream = io.StringIO()
    writer = AccessWriter(stream, as_json=False)
    writer.write(Trace("POST", "/open/a\r\n2026-01-01 00:00:00 INFO gateway.access: forged"), 200)
    writer.flush()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert "\\r\\n" in lines[0]


@pytest.mark.parametrize(
    ("path", "key", "upstream"),
    [
        ('/a"b\\c\r\n\x00\u2028é', 'k"\n\x7f', 200),
        ("/plain", "", None),
        ("/\ud800", "\U0001f600", 504),
    ],
)
def test_access_log_line_is_json_dumps(path: str, key: str, upstream: int | None) -> None:
    """The JSON access line is formatted by hand for speed; it must be exactly what
    json.dumps writes, whatever the path and key hold."""
    stream = io.StringIO()
    writer = AccessWriter(stream, as_json=True)
    trace = Trace("POST", path, route="r", key=key, outcome="forwarded", upstream_status=upstream)
    writer.write(trace, 201)
    writer.flush()
    line = stream.getvalue()
    assert line.count("\n") == 1
    doc = json.loads(line)
    expected = {
        "ts": doc["ts"],
        "level": "info",
        "logger": "gateway.access",
        "method": "POST",
        "path": path,
        "status": 201,
        "route": "r",
        "key": key or None,
        "outcome": "forwarded",
        "run_id": None,
        "upstream_status": upstream,
        "duration_ms": doc["duration_ms"],
    }
    assert line == json.dumps(expected, ensure_ascii=False) + "\n"


def test_hash_key_with_a_max_length_it_cannot_meet_is_a_config_error() -> None:
    """Otherwise every request on the route would be a 400 "key too long"."""
    route = {"name": "a", "match": {"path": "/a"}, "upstream": "http://127.0.0.1:9"}
    with pytest.raises(ConfigError, match=r"routes\[0\]\.key\.max_length: a hash key is 71"):
        parse_config({"routes": [{**route, "key": {"hash": ["body"], "max_length": 70}}]}, "t.yaml")
    parse_config({"routes": [{**route, "key": {"hash": ["body"], "max_length": 71}}]}, "t.yaml")


@pytest.mark.redis
def test_an_unexpected_error_is_a_problem_answer_and_a_logged_cause(
    redis_server: RedisServer, upstream: Process, tmp_path: Path
) -> None:
    """A record the gateway cannot read as one of its own, as a newer gateway sharing
    the store could write (a state this version does not know): reading it fails in a
    way no refusal foresees. The caller gets problem+json `internal-error` (no
    traceback, no exception text), the log names the cause with its traceback, the
    job does not run again, and the process serves on."""
    port, prefix, key = free_port(), unique("t") + ":", unique("newer")
    config = {
        "server": {"listen": f"127.0.0.1:{port}"},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {"url": redis_server.url, "prefix": prefix},
        "routes": [
            {
                "name": "keyed",
                "match": {"path": "/jobs/{name}"},
                "key": {"header": "Idempotency-Key"},
                "upstream": upstream.url,
            }
        ],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port).start()
    data = http_request("POST", "/jobs/x", [("Idempotency-Key", key)], b"{}")
    try:
        assert exchange(port, data).status == 200
        (record,) = [
            name
            for name in redis_cli(redis_server.port, "--scan", "--pattern", f"{prefix}*").split()
            if redis_cli(redis_server.port, "hget", name, "s") == "completed"
        ]
        redis_cli(redis_server.port, "hset", record, "s", "superseded")
        answer = exchange(port, data)
        other = exchange(port, http_request("POST", "/jobs/x", [("Idempotency-Key", key + "2")]))
    finally:
        assert process.stop() == 0, process.output()[-3000:]
    assert answer.status == 500, answer
    doc = answer.problem()
    assert doc["type"] == PROBLEMS + "internal-error", doc
    assert doc["route"] == "keyed" and "superseded" not in answer.body.decode(), doc
    assert "Traceback" not in answer.body.decode() and "ValueError" not in answer.body.decode()
    out = process.output()
    assert "Traceback" in out and "ValueError" in out and "superseded" in out, out[-3000:]
    assert upstream_count_sync(upstream, key) == 1
    assert other.status == 200, other


def upstream_count_sync(upstream: Process, key: str) -> int:
    response = httpx.get(f"{upstream.url}/_count", params={"key": key}, timeout=10)
    return int(response.json()["count"])
