"""Every answer of the admin listener is the gateway's own: problem+json on the
operator API, health and metrics paths, the console's HTML page under /console/;
never Starlette's or uvicorn's plain text (gateway/admin/listener.py, the handlers of
gateway/admin/api.py and gateway/console/site.py).

A real gateway process on a redis-server of the test's own, sent raw bytes: paths
nothing serves, methods a path does not take, a key with a newline, a body nested
past what the JSON reader takes, requests that are not HTTP (a raw newline or a byte
over 0x7F in the target, a line with no version, Content-Length with
Transfer-Encoding, an absolute target with no path), and a record someone with write
access to Redis broke, which fails inside the handlers (500).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gateway.errors import PROBLEM_BASE
from gateway.keying import record_digest
from gateway.store.redis.listing import bucket_of
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.servers import Process, RedisServer, free_port, gateway_process, wait_for_port
from tests.support.topologies import redis_cli

pytestmark = [pytest.mark.process, pytest.mark.redis]

TOKEN = "al-alice-token-0123456789abcdef"
SECRET = "al-console-secret-" + "z" * 32
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()


@dataclass
class Listener:
    process: Process
    port: int
    proxy: int
    prefix: str


@pytest.fixture(scope="module")
def listener(
    tmp_path_factory: pytest.TempPathFactory, upstream: Process, redis_server: RedisServer
) -> Iterator[Listener]:
    yield from running_listener(tmp_path_factory, upstream, redis_server, {})


@pytest.fixture(scope="module")
def strict(
    tmp_path_factory: pytest.TempPathFactory, upstream: Process, redis_server: RedisServer
) -> Iterator[Listener]:
    """A gateway whose deadlines are short and whose connection cap is low, for clients
    that are slow or greedy on purpose."""
    server = {"header_timeout": "1s", "body_timeout": "1s", "max_connections": 8}
    yield from running_listener(tmp_path_factory, upstream, redis_server, server)


def running_listener(
    tmp_path_factory: pytest.TempPathFactory,
    upstream: Process,
    redis_server: RedisServer,
    server: dict[str, object],
) -> Iterator[Listener]:
    port, admin_port = free_port(), free_port()
    prefix = unique("al") + ":"
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s", **server},
        "admin": {
            "listen": f"127.0.0.1:{admin_port}",
            "operators": [{"name": "alice", "role": "operator", "token_env": "AL_TOKEN"}],
            "session_secret_env": "AL_SECRET",
        },
        "store": {"url": redis_server.url, "prefix": prefix},
        "routes": [
            {
                "name": "jobs",
                "match": {"methods": ["POST"], "path": "/jobs/x"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "upstream_timeout": "200ms",
                "on_unknown_outcome": "park",
            }
        ],
    }
    path = tmp_path_factory.mktemp("admin-listener") / "admin.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port, env={"AL_TOKEN": TOKEN, "AL_SECRET": SECRET}).start()
    wait_for_port(admin_port)
    try:
        yield Listener(process, admin_port, port, prefix)
    finally:
        process.stop()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def send(port: int, request: bytes) -> Answer:
    """`request` as raw bytes on a new connection; the answer read to its end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(lines[0].split()[1]), headers, body)


def get(port: int, target: bytes, method: bytes = b"GET", extra: bytes = b"") -> Answer:
    return send(
        port,
        method + b" " + target + b" HTTP/1.1\r\nHost: a\r\n" + extra + b"Connection: close\r\n\r\n",
    )


def assert_problem(answer: Answer, status: int, slug: str, where: str) -> dict[str, object]:
    assert answer.headers.get("content-type") == "application/problem+json", (where, answer)
    doc = json.loads(answer.body)
    assert (answer.status, doc["status"], doc["type"]) == (status, status, PROBLEM_BASE + slug), (
        where,
        doc,
    )
    assert doc["title"], (where, doc)
    return dict(doc)


def assert_console_page(answer: Answer, status: int, words: str, where: str) -> None:
    assert answer.status == status, (where, answer)
    assert answer.headers.get("content-type", "").startswith("text/html"), (where, answer)
    text = answer.body.decode()
    assert '<link rel="stylesheet" href="/console/static/console.css' in text, (where, text)
    assert words in text, (where, text)
    assert "content-security-policy" in answer.headers, where


def test_paths_and_methods_nothing_serves_are_the_gateways_answers(
    listener: Listener, ledger: Ledger
) -> None:
    port = listener.port
    cases = [
        (b"/admin/nope", b"GET", 404, "unknown-path"),
        (b"/", b"GET", 404, "unknown-path"),
        (b"//admin/me", b"GET", 404, "unknown-path"),
        (b"*", b"OPTIONS", 404, "unknown-path"),
        (b"/admin/keys/jobs/k", b"DELETE", 405, "wrong-method"),
        (b"/healthz", b"POST", 405, "wrong-method"),
        (b"/admin/me", b"PUT", 405, "wrong-method"),
    ]
    for target, method, status, slug in cases:
        answer = get(port, target, method, AUTH)
        assert_problem(answer, status, slug, f"{method!r} {target!r}")
        if status == 405:
            assert answer.headers.get("allow"), answer
    # A key with a newline (which no record has: the proxy refuses such keys) is a key
    # the API looks up, not a path it does not serve.
    newline = assert_problem(
        get(port, b"/admin/keys/jobs/a%0Ab", extra=AUTH), 404, "unknown-key", "%0A"
    )
    assert newline["key"] == "a\nb"
    for target, method, status, words in [
        (b"/console/nope", b"GET", 404, "No such page"),
        (b"/console/static/nope.css", b"GET", 404, "No such page"),
        (b"/console/claim", b"GET", 405, "takes POST"),
        (b"/console/static/console.css", b"POST", 405, "takes GET"),
    ]:
        answer = get(port, target, method)
        assert_console_page(answer, status, words, f"{method!r} {target!r}")
    rows = get(port, b"/console/keys/rows")  # the live refresh, signed out
    assert_console_page(rows, 401, "Signed out", "keys/rows")
    ledger.record(
        "hostile input",
        "admin listener: paths and methods nothing serves",
        requests=len(cases) + 6,
        bad_inputs=len(cases) + 6,
        detail="every answer problem+json or the console's page, never plain text",
    )


def test_requests_that_are_not_http_get_a_problem(listener: Listener, ledger: Ledger) -> None:
    port = listener.port
    broken = {
        "a raw newline in the target": b"GET /admin/keys/jobs/a\nb HTTP/1.1\r\nHost: a\r\n\r\n",
        "a byte over 0x7F in the target": b"GET /admin/\xff HTTP/1.1\r\nHost: a\r\n\r\n",
        "a space in the target": b"GET /adm in HTTP/1.1\r\nHost: a\r\n\r\n",
        "no version": b"GARBAGE\r\n\r\n",
        "Content-Length with Transfer-Encoding": b"POST /admin/me HTTP/1.1\r\nHost: a\r\n"
        b"Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "an absolute target with no path": b"GET http://a HTTP/1.1\r\nHost: a\r\n\r\n",
    }
    for where, request in broken.items():
        answer = send(port, request)
        assert_problem(answer, 400, "not-http", where)
        assert answer.headers.get("connection") == "close", where
    ledger.record(
        "hostile input",
        "admin listener: requests that are not HTTP",
        requests=len(broken),
        bad_inputs=len(broken),
        detail="malformed heads answered problem+json, never uvicorn's plain text",
    )


def test_a_body_nested_deeper_than_json_is_read_is_refused(listener: Listener) -> None:
    body = b"[" * 30000 + b"]" * 30000
    answer = send(
        listener.port,
        b"POST /admin/keys/jobs/k/claim HTTP/1.1\r\nHost: a\r\n" + AUTH
        + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + body,
    )  # fmt: skip
    assert_problem(answer, 400, "not-a-json-object", "deep JSON")


def test_a_handler_that_fails_answers_in_the_gateways_words(
    listener: Listener, redis_server: RedisServer
) -> None:
    """A record someone with write access to Redis broke (its state is no state): the
    handlers that read it fail. The API answers problem+json 500, the console its 500
    page, neither with the exception's words; the log names the cause. `/metrics`
    reads counts, not records, and answers as ever."""
    key = unique("broken")
    body = json.dumps({"job_key": key}).encode()
    parked = send(
        listener.proxy,
        b"POST /jobs/x?sleep=0.4 HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body,
    )
    assert parked.status == 504, parked
    digest = record_digest("jobs", "", key)
    name = f"{listener.prefix}{{{bucket_of(digest):02x}}}:{digest}"
    assert redis_cli(redis_server.port, "hset", name, "s", "no-such-state").strip() == "0"
    api = get(listener.port, f"/admin/keys/jobs/{key}".encode(), extra=AUTH)
    doc = assert_problem(api, 500, "operator-call-failed", "a broken record")
    assert "no-such-state" not in api.body.decode() and "ValueError" not in api.body.decode()
    listing = get(listener.port, b"/admin/keys", extra=AUTH)
    assert_problem(listing, 500, "operator-call-failed", "a listing with a broken record")
    # The gauges read the store's counts, never a record: a broken one does not stop them.
    metrics = get(listener.port, b"/metrics")
    assert metrics.status == 200 and b"idempotency_gateway_keys" in metrics.body, metrics
    with_session = sign_in(listener.port)
    page = get(listener.port, b"/console/keys", extra=with_session)
    assert_console_page(page, 500, "Something went wrong", "console over a broken record")
    assert "no-such-state" not in page.body.decode()
    assert doc["detail"]
    listener.process.wait_for_output("no-such-state")  # the cause, in the log
    redis_cli(redis_server.port, "del", name)


def sign_in(port: int) -> bytes:
    """A Cookie header line of a fresh console session of alice."""
    form = f"token={TOKEN}".encode()
    answer = send(
        port,
        b"POST /console/signin HTTP/1.1\r\nHost: a\r\nOrigin: http://a\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\n"
        + f"Content-Length: {len(form)}\r\nConnection: close\r\n\r\n".encode()
        + form,
    )
    assert answer.status == 303, answer
    cookie = answer.headers["set-cookie"].split(";")[0]
    return f"Cookie: {cookie}\r\n".encode()


# -- clients that are hostile on purpose: the proxy listener's guards --------------------


def memory_peak(process: Process) -> int:
    """The process's peak resident memory so far, in bytes (VmHWM)."""
    assert process.proc is not None
    for line in Path(f"/proc/{process.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


MIB = 1024 * 1024


def flood(port: int, head: bytes, block: bytes, count: int) -> Answer:
    """`head`, then `block` `count` times as fast as the listener takes them (until it
    stops taking them), the answer read meanwhile."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    received: list[bytes] = []

    def read() -> None:
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                received.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        sock.sendall(head)
        with contextlib.suppress(OSError):
            for _ in range(count):
                sock.sendall(block)
        reader.join(30)
    finally:
        sock.close()
    return parsed(b"".join(received))


def parsed(data: bytes) -> Answer:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(lines[0].split()[1]) if data else 0, headers, body)


#: About 1 MiB of whole header lines.
LINES = (b"X-Line: " + b"a" * 1014 + b"\r\n") * 1024


@pytest.mark.parametrize(
    ("head", "block", "status", "slug"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-Big: ", b"a" * MIB, 431, "headers-too-large"),
        (b"GET /healthz?", b"a" * MIB, 414, "uri-too-long"),
        (b"GET /healthz HTTP/1.1\r\nHost: a\r\n", LINES, 431, "headers-too-large"),
    ],
    ids=["one header line", "the request target", "header lines that never end"],
)
def test_a_150_mb_head_is_cut_off_at_the_bound(
    listener: Listener, head: bytes, block: bytes, status: int, slug: str, ledger: Ledger
) -> None:
    """A request head of 150 MB (one header line, the request target, or header lines
    that never end) is refused once it passes server.max_header_bytes: problem+json,
    and the gateway holds no more of it than the bound (its peak memory grows by less
    than 8 MiB). The listener serves the next request."""
    before = memory_peak(listener.process)
    answer = flood(listener.port, head, block, 150)
    grown = memory_peak(listener.process) - before
    assert_problem(answer, status, slug, f"150 MB: {slug}")
    assert answer.headers.get("connection") == "close"
    assert grown < 8 * MIB, f"peak memory grew {grown / MIB:.1f} MiB"
    assert_problem(get(listener.port, b"/nope"), 404, "unknown-path", "after the flood")
    ledger.record(
        "hostile input",
        f"admin listener: a 150 MB request head ({slug})",
        requests=1,
        bad_inputs=1,
        detail=f"refused at server.max_header_bytes; peak memory +{grown / MIB:.1f} MiB",
    )


def test_a_trickled_head_and_a_stalled_body_time_out(strict: Listener, ledger: Ledger) -> None:
    """A head sent a header line at a time, never finished, gets 408 once
    server.header_timeout (1 s here) has passed since it began, however steadily it
    trickles; a body that stops arriving, 408 after server.body_timeout. Both
    problem+json, and the connection ends."""
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")
        data = b""
        with contextlib.suppress(OSError):
            for i in range(40):
                sock.sendall(b"X-%d: y\r\n" % i)
                time.sleep(0.2)
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    data += sock.recv(65536)
                sock.setblocking(True)
                if data:
                    break
            sock.settimeout(5)
            while chunk := sock.recv(65536):
                data += chunk
        took = time.monotonic() - started
    head = parsed(data)
    assert_problem(head, 408, "request-timeout", "a trickled head")
    assert data.lower().count(b"\r\ndate: ") == 1, data  # the listener's own, once
    assert took < 5, took
    stalled = send_stalled(
        strict.port,
        b"POST /admin/keys/jobs/k/claim HTTP/1.1\r\nHost: a\r\n" + AUTH
        + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"force\"",
    )  # fmt: skip
    assert_problem(stalled, 408, "request-timeout", "a stalled body")
    ledger.record(
        "hostile input",
        "admin listener: a trickled head, a stalled body",
        requests=2,
        bad_inputs=2,
        detail="408 problem+json at server.header_timeout and server.body_timeout",
    )


def send_stalled(port: int, request: bytes) -> Answer:
    """`request`, then nothing: the answer, read until the listener closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return parsed(data)


def test_connections_over_the_cap_are_refused(strict: Listener, ledger: Ledger) -> None:
    """server.max_connections (8 here) holds for the admin listener too, counted apart
    from the proxy's: with 8 connections each in the middle of a head, the next gets
    503 problem+json with Retry-After, and nothing is read from it; once they are
    gone, a request is served."""
    held = []
    try:
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", strict.port), timeout=10)
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            held.append(sock)
        time.sleep(0.2)
        over = get(strict.port, b"/healthz")
        proxy = send(strict.proxy, b"GET /nope HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    finally:
        for sock in held:
            sock.close()
    assert_problem(over, 503, "too-many-connections", "over the cap")
    assert over.headers.get("retry-after") == "1", over.headers
    assert proxy.status == 404, proxy  # the proxy listener's connections are its own
    deadline = time.monotonic() + 5
    while (answer := get(strict.port, b"/healthz")).status != 200:
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    ledger.record(
        "hostile input",
        "admin listener: connections over server.max_connections",
        requests=9,
        bad_inputs=1,
        detail="503 problem+json with Retry-After, counted apart from the proxy's",
    )


def test_a_body_larger_than_the_call_takes_is_refused_unread(listener: Listener) -> None:
    """A body declared larger than any call takes is refused before a byte of it is
    read: 413 problem+json, and the connection ends."""
    answer = send(
        listener.port,
        b"POST /admin/keys/jobs/k/claim HTTP/1.1\r\nHost: a\r\n" + AUTH
        + b"Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{",
    )  # fmt: skip
    assert_problem(answer, 413, "request-too-large", "a body of 1 TB")
    assert answer.headers.get("connection") == "close", answer.headers
