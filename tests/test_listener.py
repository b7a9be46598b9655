"""The proxy listener (gateway/http/protocol.py) against callers that misbehave, on purpose
or by bad timing: trailers posing as headers, slow heads and bodies, more connections
than the cap, Expect: 100-continue, a malformed request pipelined after a good one,
Date headers, and the keep-alive race.

Everything goes over raw sockets to real `python -m gateway run` processes, except the
keep-alive timer tests at the end: they drive the listener in-process, on both event
loops, to fire its timer at an exact moment.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import select
import signal
import socket
import struct
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import ServerConfig
from gateway.http.protocol import GatewayHttpProtocol, protocol_for
from gateway.serve import uvicorn_server
from tests.conftest import unique
from tests.support.loops import anyio_backend  # noqa: F401  (uvloop and asyncio)
from tests.support.raw_upstream import raw_upstream_server
from tests.support.rawhttp import connect
from tests.support.rawhttp import request as http_request
from tests.support.servers import Process, free_port, gateway_process
from tests.support.warm_pool import WarmPool

pytestmark = pytest.mark.process

PROBLEMS = "https://idempotency-gateway.dev/problems/"
HEAD_LIMIT = 16 * 1024  # server.max_header_bytes, the default
#: How long a test waits for something the gateway should do within a second or two.
PATIENCE = 15.0


# --- reading answers -------------------------------------------------------------------


#: The methods of uvicorn's HttpToolsProtocol that GatewayHttpProtocol overrides. An
#: override of a method uvicorn renamed or dropped is dead code that nothing calls, and
#: the listener's guard it held is gone without an error: pyproject.toml pins uvicorn
#: to the range tested, and this list is checked against the installed uvicorn.
OVERRIDDEN = (
    "__init__",
    "_unset_keepalive_if_required",
    "connection_lost",
    "connection_made",
    "data_received",
    "on_body",
    "on_header",
    "on_headers_complete",
    "on_message_begin",
    "on_message_complete",
    "on_response_complete",
    "on_url",
    "pause_writing",
    "resume_writing",
    "send_400_response",
    "shutdown",
    "timeout_keep_alive_handler",
)


def test_every_uvicorn_method_the_listener_overrides_still_exists_with_its_parameters() -> None:
    import inspect

    for name in OVERRIDDEN:
        assert name in vars(HttpToolsProtocol), f"uvicorn's HttpToolsProtocol has no {name}"
        ours = list(inspect.signature(getattr(GatewayHttpProtocol, name)).parameters)
        theirs = list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters)
        assert ours == theirs, f"{name}: uvicorn's takes {theirs}, the listener's {ours}"
    # and the list is whole: every method the listener defines that uvicorn's has
    defined = {n for n, v in vars(GatewayHttpProtocol).items() if inspect.isfunction(v)}
    assert defined & set(vars(HttpToolsProtocol)) == set(OVERRIDDEN)


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n == name]
        return values[-1] if values else None

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.headers if n == name)

    def problem(self) -> str:
        assert self.header("content-type") == "application/problem+json", self
        doc: dict[str, Any] = json.loads(self.body)
        assert doc["status"] == self.status, doc
        return str(doc["type"]).removeprefix(PROBLEMS)

    def json(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.body)
        return doc


@dataclass
class Stream:
    """Every response on a connection, interim ones too, in the order they came."""

    answers: list[Answer] = field(default_factory=list)
    closed: bool = False  # the gateway ended the connection (FIN or RST)
    reset: bool = False  # ... with a RST
    rest: bytes = b""  # bytes that are not (yet) a whole response


def _split(raw: bytes, bodyless: bool = False) -> tuple[list[Answer], bytes]:
    answers: list[Answer] = []
    while True:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        if not sep:
            return answers, raw
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower().decode("latin-1"), value.strip().decode()))
        length = 0 if status < 200 or bodyless else int(dict(headers).get("content-length", "0"))
        if len(rest) < length:
            return answers, raw
        answers.append(Answer(status, headers, rest[:length]))
        raw = rest[length:]


def read_answers(
    sock: socket.socket,
    count: int = 1,
    timeout: float = PATIENCE,
    *,
    until_close: bool = False,
    interim: bool = False,
    bodyless: bool = False,
) -> Stream:
    """Read until `count` final responses came (any responses, with `interim`; and,
    with `until_close`, the connection ended), or the connection ended, or `timeout`
    passed. `bodyless`: the answers are to HEAD requests."""
    deadline = time.monotonic() + timeout
    raw = b""
    stream = Stream()
    while True:
        stream.answers, stream.rest = _split(raw, bodyless)
        finals = sum(1 for a in stream.answers if interim or a.status >= 200)
        if stream.closed or (finals >= count and not until_close):
            return stream
        left = deadline - time.monotonic()
        if left <= 0:
            return stream
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return stream
        except ConnectionResetError:
            stream.closed = stream.reset = True
            continue
        if not chunk:
            stream.closed = True
        raw += chunk


def _readable(sock: socket.socket, wait: float = 0.0) -> bool:
    return bool(select.select([sock], [], [], wait)[0])


def _keyed(key: str, target: str = "/jobs/x", *more: tuple[str, str], body: bytes = b"{}") -> bytes:
    return http_request("POST", target, [("Idempotency-Key", key), *more], body)


# --- gateways ----------------------------------------------------------------------------


@dataclass
class Gateway:
    process: Process
    port: int
    upstream: Process

    def count(self, key: str) -> int:
        response = httpx.get(f"{self.upstream.url}/_count", params={"key": key}, timeout=10)
        return int(response.json()["count"])

    def release(self, key: str) -> None:
        httpx.post(f"{self.upstream.url}/_release", json={"key": key}, timeout=10)

    def wait_count(self, key: str, n: int = 1) -> None:
        deadline = time.monotonic() + PATIENCE
        while self.count(key) < n:
            assert time.monotonic() < deadline, f"{key} never reached the upstream"
            time.sleep(0.05)

    def output_is_clean(self) -> None:
        out = self.process.output()
        assert "Traceback" not in out and "Exception in ASGI" not in out, out[-3000:]


def _start(upstream: Process, directory: Path, server: dict[str, Any]) -> Gateway:
    port, admin_port = free_port(), free_port()
    common = {"upstream": upstream.url, "max_request_body": "64KB"}
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s", **server},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "keyed",
                "match": {"path": "/jobs/{name}"},
                "key": {"header": "Idempotency-Key"},
                **common,
            },
            {"name": "open", "match": {"path": "/open/{rest:path}"}, **common},
        ],
    }
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return Gateway(gateway_process(path, port).start(), port, upstream)


def _stop(gateway: Gateway) -> None:
    assert gateway.process.stop() == 0, gateway.process.output()[-3000:]


@pytest.fixture(scope="module")
def quick(upstream: Process, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Short deadlines, so a test sees them pass."""
    gateway = _start(
        upstream,
        tmp_path_factory.mktemp("quick"),
        {"header_timeout": "1s", "body_timeout": "2s"},
    )
    yield gateway
    _stop(gateway)


@pytest.fixture(scope="module")
def defaults(upstream: Process, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Every server setting at its default."""
    gateway = _start(upstream, tmp_path_factory.mktemp("defaults"), {})
    yield gateway
    _stop(gateway)


# --- trailers ---------------------------------------------------------------------------


def _trailers(key: str) -> bytes:
    return (
        b"X-User: admin\r\nX-Forwarded-For: 6.6.6.6\r\nHost: evil.example\r\n"
        b"Idempotency-Key: %s\r\nX-Forwarded-Host: evil.example\r\n\r\n" % key.encode()
    )


def _chunked(key: str) -> tuple[bytes, bytes]:
    body = json.dumps({"job_key": key}).encode()
    head = (
        b"POST /open/trailers HTTP/1.1\r\nHost: gateway.test\r\n"
        b"Transfer-Encoding: chunked\r\nTrailer: X-User\r\n\r\n"
    )
    return head, b"%x\r\n%s\r\n0\r\n" % (len(body), body)


@pytest.mark.parametrize(
    "cuts",
    [(), ("head",), ("head", "chunks"), ("trailer",)],
    ids=["one-packet", "head|rest", "head|chunks|trailers", "mid-trailer-field"],
)
def test_trailers_never_reach_the_upstream_as_headers(
    quick: Gateway, cuts: tuple[str, ...]
) -> None:
    """A chunked request's trailer fields are dropped, whatever the packet boundaries:
    the upstream never sees X-User, or a Host, X-Forwarded-* or key from a trailer."""
    key, trailer_key = unique("trailers"), unique("from-the-trailer")
    head, chunks = _chunked(key)
    trailers = _trailers(trailer_key)
    pieces = [head, chunks, trailers]
    if not cuts:
        pieces = [head + chunks + trailers]
    elif cuts == ("head",):
        pieces = [head, chunks + trailers]
    elif cuts == ("trailer",):
        pieces = [head + chunks + trailers[:10], trailers[10:]]
    with connect(quick.port) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.1)
        stream = read_answers(sock)
    assert [a.status for a in stream.answers] == [200], stream
    doc = stream.answers[0].json()
    seen = doc["headers"]
    assert "x-user" not in seen, seen
    assert not [v for v in seen.values() if "6.6.6.6" in v or "evil.example" in v], seen
    assert doc["key"] == key, doc
    assert quick.count(trailer_key) == 0


def _send_until_answered(sock: socket.socket, piece: bytes, cap: int = 16 << 20) -> int:
    sent = 0
    while sent < cap and not _readable(sock):
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(piece)
    return sent


def test_trailer_section_is_bounded_like_a_head(quick: Gateway) -> None:
    """Trailer bytes count against server.max_header_bytes: a trailer field that never
    ends is cut off while it streams, and many small ones over the limit are refused."""
    key = unique("trailers")
    head, chunks = _chunked(key)
    with connect(quick.port) as sock:
        sock.sendall(head + chunks + b"X-Endless: ")
        sent = _send_until_answered(sock, b"a" * 16384)
        endless = read_answers(sock)
    many = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"v" * 100) for i in range(HEAD_LIMIT // 100 + 10))
    with connect(quick.port) as sock:
        sock.sendall(head + chunks + many + b"\r\n")
        over = read_answers(sock, until_close=True)
    assert [a.status for a in endless.answers] == [431], (sent, endless)
    assert endless.answers[0].problem() == "headers-too-large"
    assert [a.status for a in over.answers] == [431], over
    assert over.closed
    assert quick.count(key) == 0


# --- slow callers -----------------------------------------------------------------------


def test_connection_that_never_sends_is_closed_quietly(quick: Gateway) -> None:
    """No byte of a request came: server.header_timeout ends the connection with a
    clean end of stream and no answer (nothing was refused)."""
    with connect(quick.port) as sock:
        opened = time.monotonic()
        stream = read_answers(sock, until_close=True)
        waited = time.monotonic() - opened
    assert stream.closed and not stream.reset, stream
    assert not stream.answers and not stream.rest, stream
    assert 0.9 < waited < PATIENCE, waited  # at header_timeout (1 s), not at once


def test_spare_connections_past_the_head_deadline_never_read_a_408(quick: Gateway) -> None:
    """Connections opened ahead of their first request (a pool's spares, a browser's
    preconnect, a load balancer's warm pool) and idle past server.header_timeout: a
    request written on one later reads a closed connection, never an answer to a
    request it had not sent."""
    keys = [unique("spare") for _ in range(5)]
    socks = [connect(quick.port) for _ in keys]
    try:
        time.sleep(1.5)  # over header_timeout (1 s)
        for sock, key in zip(socks, keys, strict=True):
            try:
                sock.sendall(_keyed(key))
            except OSError:
                pass  # already reset: no answer either
        streams = [read_answers(sock, until_close=True) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(s.closed and not s.answers and not s.rest for s in streams), streams
    assert [quick.count(key) for key in keys] == [0] * len(keys)


@pytest.mark.parametrize("begun", [b"P", b"\r\nPOST /jobs/x HTTP/1.1\r\nHost: x\r\n"])
def test_a_head_begun_and_left_unfinished_gets_408(quick: Gateway, begun: bytes) -> None:
    """One byte of a request is enough: a head that began and did not finish within
    server.header_timeout is answered 408 (the caller did send something)."""
    with connect(quick.port) as sock:
        sock.sendall(begun)
        stream = read_answers(sock, until_close=True)
    assert [a.status for a in stream.answers] == [408], stream
    assert stream.answers[0].problem() == "request-timeout"
    assert stream.closed and not stream.reset


def test_empty_lines_before_a_request_are_no_request(quick: Gateway) -> None:
    """CRLFs before a request line are not part of a request (RFC 9112 2.2: a server
    ignores them): a kept-alive connection that got only those is closed quietly."""
    with connect(quick.port) as sock:
        sock.sendall(_keyed(unique("first")))
        first = read_answers(sock)
        sock.sendall(b"\r\n")
        stream = read_answers(sock, until_close=True)
    assert [a.status for a in first.answers] == [200], first
    assert stream.closed and not stream.answers and not stream.rest, stream


def test_trickled_head_is_cut_at_the_head_deadline(quick: Gateway) -> None:
    """Bytes that keep coming do not extend server.header_timeout: the deadline is for
    the whole head."""
    key = unique("trickle")
    with connect(quick.port) as sock:
        sock.sendall(f"POST /jobs/x HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n".encode())
        sock.sendall(b"X-Slow: ")
        deadline = time.monotonic() + PATIENCE
        trickled = 0
        while not _readable(sock, 0.1) and time.monotonic() < deadline:
            sock.sendall(b"a")
            trickled += 1
        cut = _readable(sock)  # answered while the bytes still came
        stream = read_answers(sock, until_close=True)
    assert cut, f"not cut off after {trickled} bytes trickled over {PATIENCE} s"
    assert [a.status for a in stream.answers] == [408], (trickled, stream)
    assert stream.answers[0].problem() == "request-timeout"
    assert stream.closed
    assert quick.count(key) == 0


def test_half_sent_body_gets_408_and_is_not_forwarded(quick: Gateway) -> None:
    key = unique("half")
    with connect(quick.port) as sock:
        sock.sendall(_keyed(key, body=b"x" * 100)[:-90])
        stream = read_answers(sock, until_close=True)
    assert [a.status for a in stream.answers] == [408], stream
    assert stream.answers[0].problem() == "request-timeout"
    assert stream.closed
    assert quick.count(key) == 0


def test_slow_body_that_keeps_coming_is_read(quick: Gateway) -> None:
    """server.body_timeout is the silence between reads, not a deadline for the body."""
    key = unique("slow-body")
    body = json.dumps({"pad": "x" * 6}).encode()  # 16 bytes, one every 0.25 s: 4 s
    with connect(quick.port) as sock:
        request = _keyed(key, body=body)
        sock.sendall(request[: -len(body)])
        for byte in body:
            time.sleep(0.25)
            sock.sendall(bytes([byte]))
        stream = read_answers(sock)
    assert [a.status for a in stream.answers] == [200], stream
    assert stream.answers[0].json()["body"] == body.decode()


async def _outcome(client: httpx.AsyncClient, key: str) -> int | str:
    """The status httpx read, or "closed" when the server ended the connection
    without answering (httpx reports that; a client may retry on a new connection)."""
    try:
        response = await client.post("/jobs/x", headers={"Idempotency-Key": key}, json={})
    except httpx.RemoteProtocolError:
        return "closed"
    return response.status_code


@pytest.mark.anyio
async def test_a_real_client_never_reads_an_answer_it_did_not_cause(quick: Gateway) -> None:
    """httpx through a load balancer's warm pool (tests/support/warm_pool.py): its
    connections to the gateway were opened ahead and sat idle past
    server.header_timeout. Each request through one reads a closed connection, which
    httpx reports, and runs nowhere; the next ones, on new connections, are answered.
    httpx's own kept-alive connections, idle past header_timeout (under keep_alive),
    carry their next requests as usual."""
    async with WarmPool(quick.port, spares=6) as pool:
        await asyncio.sleep(1.5)  # over header_timeout (1 s)
        limits = httpx.Limits(max_connections=6)
        async with httpx.AsyncClient(base_url=pool.url, limits=limits, timeout=PATIENCE) as client:
            spare_keys = [unique("warm") for _ in range(6)]
            on_spares = await asyncio.gather(*(_outcome(client, k) for k in spare_keys))
            again = await asyncio.gather(*(_outcome(client, k) for k in spare_keys))
    url = f"http://127.0.0.1:{quick.port}"
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=PATIENCE) as client:
        kept_keys = [unique("kept") for _ in range(6)]
        first = await asyncio.gather(*(_outcome(client, k) for k in kept_keys))
        await asyncio.sleep(1.5)  # the pool's connections idle over header_timeout
        later = await asyncio.gather(*(_outcome(client, unique("kept")) for _ in kept_keys))
    assert on_spares == ["closed"] * 6, on_spares
    assert again == [200] * 6, again
    assert [quick.count(k) for k in spare_keys] == [1] * 6  # only the answered ones ran
    assert first == later == [200] * 6, (first, later)


def test_later_request_head_deadline_starts_at_its_first_byte(quick: Gateway) -> None:
    """An idle kept-alive connection is governed by server.keep_alive: a request that
    comes after more than server.header_timeout of quiet is read and answered."""
    with connect(quick.port) as sock:
        sock.sendall(_keyed(unique("first")))
        first = read_answers(sock)
        time.sleep(1.5)  # over header_timeout (1 s), well under keep_alive (75 s)
        sock.sendall(_keyed(unique("second")))
        second = read_answers(sock)
    assert [a.status for a in first.answers + second.answers] == [200, 200], (first, second)


def test_reload_applies_to_new_connections(upstream: Process, tmp_path: Path) -> None:
    """The listener reads server.* per connection: after a SIGHUP with a shorter
    header_timeout, a new connection that sends part of a head gets its 408 by it."""
    gateway = _start(upstream, tmp_path, {"header_timeout": "10m"})
    try:
        path = tmp_path / "gateway.yaml"
        config = yaml.safe_load(path.read_text())
        config["server"]["header_timeout"] = "1s"
        path.write_text(yaml.safe_dump(config))
        gateway.process.signal(signal.SIGHUP)
        gateway.process.wait_for_output("config reloaded")
        with connect(gateway.port) as sock:
            sock.sendall(b"GET /open/x HTTP/1.1\r\n")
            stream = read_answers(sock, until_close=True)
        assert [a.status for a in stream.answers] == [408], stream
    finally:
        _stop(gateway)


@pytest.fixture(scope="module")
def capped(upstream: Process, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = _start(upstream, tmp_path_factory.mktemp("capped"), {"max_connections": 2})
    yield gateway
    _stop(gateway)


def test_connection_over_the_cap_gets_503_and_idle_ones_make_room(capped: Gateway) -> None:
    """server.max_connections: with two requests under way, a third connection gets a
    503 problem+json with Retry-After and is closed cleanly; once those two are idle
    (kept alive), a new connection closes the oldest idle one and is served."""
    keys = [unique("busy"), unique("busy")]
    busy = [connect(capped.port) for _ in keys]
    try:
        for sock, key in zip(busy, keys, strict=True):
            sock.sendall(_keyed(key, "/jobs/x?hold=1"))
            capped.wait_count(key)  # read and forwarded: the connection is counted
        with connect(capped.port) as third:
            third.sendall(_keyed(unique("third")))
            refused = read_answers(third, until_close=True)
        held = []
        for sock, key in zip(busy, keys, strict=True):  # in turn: busy[0] is idle first
            capped.release(key)
            held.append(read_answers(sock))
        assert [a.status for a in refused.answers] == [503], refused
        assert refused.answers[0].problem() == "too-many-connections"
        assert refused.answers[0].header("retry-after") == "1"
        assert refused.closed and not refused.reset, refused
        assert [[a.status for a in s.answers] for s in held] == [[200], [200]], held
        # Both are idle now: a new connection takes the oldest one's place.
        with connect(capped.port) as fourth:
            fourth.sendall(_keyed(unique("fourth")))
            served = read_answers(fourth)
        oldest = read_answers(busy[0], 0, timeout=5, until_close=True)
        assert [a.status for a in served.answers] == [200], served
        assert oldest.closed and not oldest.reset and not oldest.answers, oldest
    finally:
        for sock in busy:
            sock.close()
    capped.output_is_clean()


# --- Expect: 100-continue --------------------------------------------------------------


def test_expect_100_continue_is_answered_by_the_gateway_not_forwarded(quick: Gateway) -> None:
    key = unique("continue")
    body = json.dumps({"job_key": key}).encode()
    request = http_request("POST", "/open/continue", [("Expect", "100-continue")], body)
    with connect(quick.port) as sock:
        sock.sendall(request[: -len(body)])
        interim = read_answers(sock, interim=True)
        sock.sendall(body)
        final = read_answers(sock)
    assert [a.status for a in interim.answers] == [100], interim
    assert [a.status for a in final.answers] == [200], final
    doc = final.answers[0].json()
    assert "expect" not in doc["headers"], doc["headers"]
    assert doc["key"] == key


@pytest.mark.parametrize(
    ("target", "length", "status"),
    [("/jobs/x", 1 << 20, 413), ("/nowhere", 10, 404)],
    ids=["413-by-content-length", "404"],
)
def test_answer_before_the_body_gets_no_100_and_closes(
    quick: Gateway, target: str, length: int, status: int
) -> None:
    """Refused before its body was asked for: the final answer alone, never a 100, and
    the connection closes after it (the client may send the body or not: what follows
    cannot be framed)."""
    head = http_request(
        "POST", target, [("Idempotency-Key", unique()), ("Expect", "100-continue")]
    ).replace(b"Content-Length: 0", b"Content-Length: %d" % length)
    with connect(quick.port) as sock:
        sock.sendall(head)
        stream = read_answers(sock, until_close=True, timeout=PATIENCE)
    assert [a.status for a in stream.answers] == [status], stream
    assert stream.answers[0].header("connection") == "close", stream
    assert stream.closed


@pytest.mark.slow
def test_answer_before_the_body_ends_a_body_that_keeps_coming(quick: Gateway) -> None:
    """A chunked body over the route's limit gets its 413 while it streams; the answer
    says Connection: close and the gateway half-closes, and although the client keeps
    sending, the connection ends (the gateway drains for at most connection.LINGER_MAX, so
    the 413 is not lost to a reset, then closes) instead of reading a discarded body
    for as long as the client likes."""
    key = unique("endless")
    chunk = b"%x\r\n%s\r\n" % (8192, b"x" * 8192)
    with connect(quick.port) as sock:
        sock.sendall(
            _keyed(key, body=b"").replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
        )
        _send_until_answered(sock, chunk)
        answered = read_answers(sock)
        deadline = time.monotonic() + 3 * PATIENCE
        half_closed = closed = False
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(chunk)
                if not half_closed and _readable(sock, 0.1):
                    half_closed = sock.recv(65536) == b""
                time.sleep(0.1)
            except OSError:
                closed = True  # the gateway's side is gone: a send met its reset
    assert [a.status for a in answered.answers] == [413], answered
    assert answered.answers[0].header("connection") == "close", answered
    assert half_closed, "no FIN after the 413"
    assert closed, "the gateway kept reading the body after its 413"
    assert quick.count(key) == 0


# --- pipelining ---------------------------------------------------------------------------

MALFORMED = {
    # refused while its head is parsed
    "bad-content-length": b"POST /open/bad HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "headers-over-the-limit": (
        b"POST /open/bad HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEAD_LIMIT + 10) + b"\r\n\r\n"
    ),
    # refused in its body, while it waits behind the first
    "bad-chunk": b"POST /open/bad HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("malformed", list(MALFORMED), ids=list(MALFORMED))
def test_refusal_pipelined_after_a_good_request_waits_for_its_answer(
    quick: Gateway, malformed: str
) -> None:
    """One packet: a keyed POST that takes a while upstream, then a malformed request.
    The POST's real answer comes first, then the refusal, then the close."""
    key = unique("pipelined")
    with connect(quick.port) as sock:
        sock.sendall(_keyed(key, "/jobs/x?sleep=0.3") + MALFORMED[malformed])
        stream = read_answers(sock, until_close=True)
    statuses = [a.status for a in stream.answers]
    assert statuses in ([200, 400], [200, 431]), stream
    assert stream.answers[0].json()["key"] == key
    assert stream.answers[1].header("content-type") == "application/problem+json"
    assert stream.closed and not stream.rest
    assert quick.count(key) == 1


@pytest.mark.parametrize("method", ["POST", "HEAD"])
def test_refusal_of_a_request_already_answered_is_not_sent(quick: Gateway, method: str) -> None:
    """A 404 goes out before the body is read; a bad chunk after it must not get a 400
    of its own, which the client would take for the answer to its next request. (The
    POST's answer closes the connection, as an answer before the body does; a HEAD's
    answer has no body write, so its connection reads on, into the bad chunk.)"""
    head = b"%s /nowhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    bodyless = method == "HEAD"
    with connect(quick.port) as sock:
        sock.sendall(head % method.encode())
        answered = read_answers(sock, bodyless=bodyless)
        sock.sendall(b"zz\r\n")
        after = read_answers(sock, 0, until_close=True, bodyless=bodyless)
    assert [a.status for a in answered.answers] == [404], answered
    assert after.closed and not after.answers and not after.rest, after


def test_upgrade_request_is_refused_and_nothing_is_forwarded(quick: Gateway) -> None:
    """llhttp stops reading HTTP at an upgrade request: its body, and a request
    pipelined after it, would be lost or misread (found by the h11 oracle: the POST
    was forwarded with an empty body)."""
    key = unique("upgrade")
    data = _keyed(key, "/jobs/x", ("Connection", "Upgrade"), ("Upgrade", "h2c"), body=b"{}")
    data += _keyed(unique("after"))
    with connect(quick.port) as sock:
        sock.sendall(data)
        stream = read_answers(sock, until_close=True)
    assert [a.status for a in stream.answers] == [400], stream
    assert stream.answers[0].problem() == "upgrade-refused"
    assert stream.closed and not stream.rest, stream
    assert quick.count(key) == 0


def test_a_fragment_in_the_target_is_refused(quick: Gateway) -> None:
    """RFC 9112 3.2: no fragment in a request target; dropping it would forward a
    request the caller did not write (found by the h11 oracle)."""
    key = unique("fragment")
    with connect(quick.port) as sock:
        sock.sendall(_keyed(key, "/jobs/x#frag"))
        stream = read_answers(sock, until_close=True)
    assert [a.status for a in stream.answers] == [400], stream
    assert stream.answers[0].problem() == "malformed-request"
    assert quick.count(key) == 0


@pytest.mark.parametrize("target", ["http://jobs.example", "http://jobs.example?sleep=0"])
def test_a_target_without_a_path_is_refused_with_an_answer(quick: Gateway, target: str) -> None:
    """An absolute-form target without a path passes llhttp; the listener read its path
    as None and crashed in the parser's callback, so the caller got no answer, only a
    closed connection, and the log a traceback (found by CI's oracle run). It is a 400
    now, after the answer of the request pipelined before it."""
    first, key = unique("before"), unique("pathless")
    with connect(quick.port) as sock:
        sock.sendall(_keyed(first) + _keyed(key, target))
        stream = read_answers(sock, until_close=True)
    assert [a.status for a in stream.answers] == [200, 400], stream
    assert stream.answers[1].problem() == "malformed-request"
    assert "no path" in stream.answers[1].body.decode()
    assert quick.count(first) == 1 and quick.count(key) == 0
    assert "Traceback" not in quick.process.output()


def test_refusal_of_a_head_request_has_no_body(quick: Gateway) -> None:
    """RFC 9110 9.3.2: an answer to HEAD has no body, a refusal's neither; bytes after
    it would be read as the next response (found by the h11 oracle)."""
    with connect(quick.port) as sock:
        sock.sendall(b"HEAD /jobs/x HTTP/1.2\r\nHost: x\r\n\r\n")
        stream = read_answers(sock, until_close=True, bodyless=True)
    assert [a.status for a in stream.answers] == [400], stream
    assert int(stream.answers[0].header("content-length") or 0) > 0  # as a GET's would be
    assert stream.closed and stream.rest == b"", stream


def test_pipelined_requests_are_answered_in_order(quick: Gateway) -> None:
    keys = [unique("order") for _ in range(3)]
    sleeps = ["0.4", "0.2", "0"]  # the first finishes last upstream
    data = b"".join(_keyed(key, f"/jobs/x?sleep={s}") for key, s in zip(keys, sleeps, strict=True))
    with connect(quick.port) as sock:
        sock.sendall(data)
        stream = read_answers(sock, 3)
    assert [a.json()["key"] for a in stream.answers] == keys, stream
    assert [quick.count(k) for k in keys] == [1, 1, 1]


# --- one Date -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dateless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway in front of an upstream that sends no Date."""
    upstream = raw_upstream_server().start()
    try:
        gateway = _start(upstream, tmp_path_factory.mktemp("dateless"), {})
        yield gateway
        _stop(gateway)
    finally:
        upstream.stop()


def _one(port: int, data: bytes) -> Answer:
    with connect(port) as sock:
        sock.sendall(data)
        stream = read_answers(sock)
    assert stream.answers, stream
    return stream.answers[-1]


def test_every_answer_has_exactly_one_date(quick: Gateway, dateless: Gateway) -> None:
    """Forwarded and replayed responses keep the upstream's Date (a replay its original
    one); the gateway's own answers, and upstream answers without one, get the
    gateway's."""
    key = unique("date")
    forwarded = _one(quick.port, _keyed(key))
    time.sleep(1.1)  # a Date made now would differ from the stored one
    replayed = _one(quick.port, _keyed(key))
    with connect(quick.port) as sock:
        sock.sendall(b"GET /open/date HTTP/1.1\r\n")
        timed_out = read_answers(sock)
    answers = {
        "forwarded": forwarded,
        "replayed": replayed,
        "passed-through": _one(quick.port, http_request("GET", "/open/date")),
        "no-route": _one(quick.port, http_request("GET", "/nowhere")),
        "malformed": _one(quick.port, b"GET /open HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
        "request-timeout": timed_out.answers[-1] if timed_out.answers else None,
        "upstream-without-date": _one(dateless.port, _keyed(unique("date"))),
    }
    dates = {name: a.count("date") if a else 0 for name, a in answers.items()}
    assert dates == dict.fromkeys(answers, 1), (dates, answers)
    assert replayed.header("idempotent-replayed") == "true"
    assert replayed.header("date") == forwarded.header("date")
    statuses = [a.status if a else 0 for a in answers.values()]
    assert statuses == [200, 200, 200, 404, 400, 408, 200], answers


# --- keep-alive -----------------------------------------------------------------------------


@pytest.mark.slow
def test_clients_coming_back_just_after_5s_are_all_answered(defaults: Gateway) -> None:
    """The keep-alive race from the duplicate storm, made deterministic: 20 kept-alive
    connections send their second request 5.0-5.2 s after their first answer (5 s is
    uvicorn's default idle limit, and httpx's). With server.keep_alive's default, well
    above common client expiries, every one is answered."""
    socks = [connect(defaults.port) for _ in range(20)]
    answered_at: list[float] = []
    seconds: list[Stream] = []
    try:
        for sock in socks:
            sock.sendall(_keyed(unique("race")))
        for sock in socks:
            first = read_answers(sock)
            assert [a.status for a in first.answers] == [200], first
            answered_at.append(time.monotonic())
        for i, (sock, at) in enumerate(zip(socks, answered_at, strict=True)):
            time.sleep(max(0.0, at + 5.0 + i * 0.01 - time.monotonic()))
            try:
                sock.sendall(_keyed(unique("race")))
            except OSError:
                pass  # a reset connection: no answer, counted below
        seconds = [read_answers(sock, timeout=10) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    dropped = [i for i, s in enumerate(seconds) if [a.status for a in s.answers] != [200]]
    assert not dropped, [seconds[i] for i in dropped]


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-length", b"5")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"hello"})


class InProcess:
    """The proxy listener with a trivial app on the test's own event loop, so a test
    can reach the protocol of a connection and fire its timers itself."""

    def __init__(self, settings: ServerConfig, app: Any = _hello) -> None:
        self.port = free_port()
        listen = f"127.0.0.1:{self.port}"
        self.server = uvicorn_server(app, listen, protocol_for(lambda: settings))
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> InProcess:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self.task is not None
        await self.task

    def protocol(self) -> GatewayHttpProtocol:
        (protocol,) = self.server.server_state.connections
        assert isinstance(protocol, GatewayHttpProtocol)
        return protocol

    async def exchange(self, sock: socket.socket, data: bytes) -> Stream:
        sock.sendall(data)
        return await asyncio.to_thread(read_answers, sock)


HELLO = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def _queued(transport: asyncio.BaseTransport) -> int:
    """Bytes waiting unread in the server side's socket."""
    fd = transport.get_extra_info("socket").fileno()
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


@pytest.mark.anyio
async def test_keep_alive_expiry_with_a_request_waiting_answers_it() -> None:
    """The timer fires while a request's bytes sit unread in the socket: the request
    is read and answered, not reset."""
    async with InProcess(ServerConfig(keep_alive=60)) as server:
        with connect(server.port) as sock:
            first = await server.exchange(sock, HELLO)
            protocol = server.protocol()
            assert protocol.timeout_keep_alive_task is not None  # idle, kept alive
            # No await from here to the timer: the loop cannot read the bytes first.
            sock.sendall(HELLO)
            deadline = time.monotonic() + PATIENCE
            while not _queued(protocol.transport):
                assert time.monotonic() < deadline
                time.sleep(0.001)
            protocol.timeout_keep_alive_handler()
            second = await asyncio.to_thread(read_answers, sock)
    assert [a.status for a in first.answers + second.answers] == [200, 200], second


@pytest.mark.anyio
async def test_keep_alive_expiry_half_closes_and_drains() -> None:
    """With nothing waiting, the timer half-closes: the client sees a clean end of
    stream, and a request that crosses the FIN is read and dropped, not answered with a
    RST; the connection closes when the client does."""
    async with InProcess(ServerConfig(keep_alive=60)) as server:
        sock = connect(server.port)
        try:
            await server.exchange(sock, HELLO)
            protocol = server.protocol()
            protocol.timeout_keep_alive_handler()
            ended = await asyncio.to_thread(read_answers, sock, 0, PATIENCE, until_close=True)
            errors = []
            for _ in range(3):  # requests that crossed the FIN
                try:
                    sock.sendall(HELLO)
                except OSError as exc:
                    errors.append(exc)
                await asyncio.sleep(0.1)
            after = await asyncio.to_thread(read_answers, sock, 0, 1.0, until_close=True)
            assert ended.closed and not ended.reset and not ended.answers, ended
            assert not errors and not after.reset and not after.answers, (errors, after)
            assert not protocol.transport.is_closing()  # lingering, reading what comes
        finally:
            sock.close()
        deadline = time.monotonic() + PATIENCE
        while not protocol.transport.is_closing():
            assert time.monotonic() < deadline, "the gateway never closed its side"
            await asyncio.sleep(0.02)


async def _fails(scope: dict[str, Any], receive: Any, send: Any) -> None:
    raise LookupError("internal detail 0x5eed")


@pytest.mark.anyio
async def test_an_app_that_fails_before_answering_gets_a_problem_not_a_bare_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The listener's last resort: an app that raises before its answer started gets
    problem+json `internal-error` written for it (not uvicorn's text/plain 500), with
    none of the exception's text; the log names the cause with its traceback."""
    async with InProcess(ServerConfig(), app=_fails) as server:
        with connect(server.port) as sock:
            stream = await asyncio.to_thread(
                lambda: (sock.sendall(HELLO), read_answers(sock, until_close=True))[1]
            )
    assert [a.status for a in stream.answers] == [500], stream
    answer = stream.answers[0]
    assert answer.problem() == "internal-error", answer
    assert b"0x5eed" not in answer.body and b"LookupError" not in answer.body, answer
    assert stream.closed
    (line,) = [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert "0x5eed" in line.getMessage() and line.exc_info is not None, line


def _answers_with(status: int) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"3")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"odd"})

    return app


@pytest.mark.anyio
@pytest.mark.parametrize("status", [599, 600, 999, 99])
async def test_an_answer_no_status_line_is_written_for_gets_a_problem(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A code from 100 to 599 is written, its reason phrase empty where HTTP names
    none (599). Any other is no HTTP status (RFC 9110 15): the app's answer fails
    before it starts, so the caller gets problem+json `internal-error`, never a
    connection closed without a byte."""
    async with InProcess(ServerConfig(), app=_answers_with(status)) as server:
        with connect(server.port) as sock:
            stream = await asyncio.to_thread(
                lambda: (sock.sendall(HELLO), read_answers(sock, until_close=status > 599))[1]
            )
    if status == 599:
        assert [(a.status, a.body) for a in stream.answers] == [(599, b"odd")], stream
        return
    assert [a.status for a in stream.answers] == [500], stream
    assert stream.answers[0].problem() == "internal-error"
    assert any(f"{status} is no HTTP status" in r.getMessage() for r in caplog.records)


class _CountingTransport:
    """A transport that counts its writes."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


@pytest.mark.anyio
async def test_whole_response_leaves_in_one_write() -> None:
    """The listener holds a response's head until its body (cycle.Cycle): the
    answer goes out in one write, where uvicorn makes two."""
    async with InProcess(ServerConfig()) as server:
        with connect(server.port) as sock:
            await server.exchange(sock, HELLO)  # connected and answered once
            protocol = server.protocol()
            counting = _CountingTransport(protocol.transport)
            protocol.transport = counting  # type: ignore[assignment]
            answered = await server.exchange(sock, HELLO)
    assert [a.status for a in answered.answers] == [200], answered
    assert len(counting.writes) == 1, counting.writes
    assert counting.writes[0].startswith(b"HTTP/1.1 200 ") and counting.writes[0].endswith(b"hello")
