"""A misbehaving upstream against the gateway's upstream client (gateway/upstream/client.py):
bytes after an answer's end, a connection closed as it is handed on, a keep-alive that
races the gateway's, trailers and Connection-named headers, a head that never ends, a
TLS body cut without close_notify.

The upstream here is a raw-socket server in the test's own event loop (uvloop and
asyncio, see tests/support/loops.py), so a test decides each packet: what goes out in
one send, and when a FIN follows it. Where the stored and replayed response is the
point, an in-process gateway (memory store, a real upstream client with a pool of one)
sits in front of it; the TLS test's server is a thread with blocking sockets, so it can
close the TCP connection under the TLS session.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.assembly import Gateway
from gateway.config import ServerConfig, parse_config
from gateway.errors import ConfigError, NotSent, OutcomeLost
from gateway.store.memory import MemoryStore
from gateway.upstream import Upstream
from gateway.upstream.parser import MAX_RESPONSE_FIELDS, MAX_RESPONSE_HEAD
from tests.conftest import GatewayClient, config_for, unique
from tests.support.loops import anyio_backend  # noqa: F401  (uvloop and asyncio)
from tests.test_upstream import _self_signed

pytestmark = pytest.mark.anyio

FORGED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 17\r\n\r\n" + (
    b'{"forged": true} '
)


def answer(status: int, body: bytes, *headers: str) -> bytes:
    head = f"HTTP/1.1 {status} Status\r\n" + "".join(h + "\r\n" for h in headers)
    return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body


class Peer:
    """One connection the raw server accepted: a non-blocking socket and what it read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    async def request(self) -> tuple[bytes, bytes] | None:
        """The next request's head and body, or None once the client closed."""
        loop = asyncio.get_running_loop()
        while b"\r\n\r\n" not in self.buffer:
            data = await loop.sock_recv(self.sock, 65536)
            if not data:
                return None
            self.buffer += data
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(self.buffer) < length:
            data = await loop.sock_recv(self.sock, 65536)
            if not data:
                return None
            self.buffer += data
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return head, body

    def send_now(self, data: bytes) -> None:
        """One send, in this step of the loop: the client reads none of it before the
        test's next statement (a FIN after it is in the same kernel queue)."""
        sent = self.sock.send(data)
        assert sent == len(data), "a test packet must fit the socket buffer"

    async def send(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)


Handler = Callable[[Peer], Awaitable[None]]


class RawServer:
    """Accepts connections on loopback and runs `handler` on each."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.peers: list[Peer] = []
        self.accepting: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            sock.setblocking(False)
            self.connections += 1
            peer = Peer(sock)
            self.peers.append(peer)
            task = asyncio.create_task(self._serve(peer))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _serve(self, peer: Peer) -> None:
        try:
            await self.handler(peer)
        except (ConnectionError, OSError):
            pass  # the client hung up on a misbehaving answer: what it should do
        finally:
            peer.sock.close()

    async def stop_listening(self) -> None:
        """Nothing accepts a connection on the port any more: a connect is refused."""
        if self.accepting is not None:
            self.accepting.cancel()
            await asyncio.gather(self.accepting, return_exceptions=True)
        self.listener.close()

    def close(self) -> None:
        if self.accepting is not None:
            self.accepting.cancel()
        for task in list(self.tasks):
            task.cancel()
        for peer in self.peers:
            peer.sock.close()
        self.listener.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], RawServer]]:
    started: list[RawServer] = []

    def start(handler: Handler) -> RawServer:
        server = RawServer(handler)
        server.accepting = asyncio.create_task(server.run())
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()
    await asyncio.sleep(0)


@pytest.fixture
async def client() -> AsyncIterator[Upstream]:
    upstream = Upstream(connections=1)
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.close()


async def post(client: Upstream, url: str, deadline: float = 5) -> Any:
    return await client.forward("POST", url, [], b"", deadline, 1 << 20)


def keyed_routes() -> list[dict[str, Any]]:
    return [
        {
            "name": "jobs",
            "match": {"methods": ["POST"], "path": "/jobs/{job}"},
            "key": {"header": "Idempotency-Key"},
            "upstream_timeout": "5s",
        }
    ]


@pytest.fixture
async def gateway_on() -> AsyncIterator[Callable[..., Awaitable[GatewayClient]]]:
    """`await gateway_on(server, **top)`: an in-process gateway in front of a raw
    server, with a memory store; its upstream client has one connection, or is the
    one the gateway builds from its config with `own_upstream=True`."""
    opened: list[GatewayClient] = []

    async def build(server: RawServer, own_upstream: bool = False, **top: Any) -> GatewayClient:
        config = config_for(server.url, keyed_routes(), **top)
        gateway = Gateway(
            config,
            store=MemoryStore(),
            upstream=None if own_upstream else Upstream(connections=1),
            sweep=False,
        )
        await gateway.start()
        opened.append(GatewayClient(gateway))
        return opened[-1]

    yield build
    for gw in opened:
        await gw.http.aclose()
        await gw.gateway.close()


def real_answer(run: int) -> bytes:
    body = json.dumps({"real": True, "run": run}).encode()
    return answer(200, body, "content-type: application/json")


def is_replay(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


# -- bytes after an answer's end ------------------------------------------------------


@pytest.mark.parametrize("packets", ["one packet", "a later packet"])
async def test_a_response_after_a_204_is_never_the_next_answer(
    serve: Callable[[Handler], RawServer],
    gateway_on: Callable[..., Awaitable[GatewayClient]],
    packets: str,
) -> None:
    """The upstream answers 204 with Content-Length: 5 and a whole forged response,
    in the same packet or a little later; a second keyed request waits for the pool's
    one connection. It gets the upstream's real answer, and so does its repeat: the
    forged response is never stored or replayed."""
    runs = 0

    async def handler(peer: Peer) -> None:
        nonlocal runs
        while (request := await peer.request()) is not None:
            if b"/jobs/first" in request[0]:
                stray = b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n"
                if packets == "one packet":
                    await peer.send(stray + FORGED)
                else:
                    await peer.send(stray)
                    await asyncio.sleep(0.2)  # the next request is on its way by now
                    await peer.send(FORGED)
            else:
                runs += 1
                await peer.send(real_answer(runs))

    server = serve(handler)
    gw = await gateway_on(server)
    key = unique("second")
    first = asyncio.create_task(gw.post("/jobs/first", headers={"Idempotency-Key": unique()}))
    await asyncio.sleep(0.05)  # the first has the connection; the second waits for it
    second = await gw.post("/jobs/second", headers={"Idempotency-Key": key})
    repeat = await gw.post("/jobs/second", headers={"Idempotency-Key": key})
    assert (await first).status_code == 204
    assert second.status_code == 200, second.text
    assert second.json() == {"real": True, "run": 1} and not is_replay(second)
    assert repeat.json() == {"real": True, "run": 1} and is_replay(repeat)
    assert b"forged" not in second.content + repeat.content
    assert server.connections == 2  # the 204's connection was never reused


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n", id="204+length"),
        pytest.param(
            b"HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\n\r\n", id="304+chunked"
        ),
        pytest.param(answer(200, b"ok") + FORGED, id="200+second-response"),
        pytest.param(answer(200, b"ok") + b"HTTP/1.1 200", id="200+start-of-one"),
    ],
)
async def test_answer_out_of_step_with_its_framing_is_not_reused(
    serve: Callable[[Handler], RawServer], client: Upstream, first: bytes
) -> None:
    """What may be reused (Exchange.reusable): not a connection whose answer was
    followed by anything in the same read, nor a 204/304 that announces a body."""

    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            await peer.send(first if b"/first" in request[0] else answer(200, b"real"))

    server = serve(handler)
    await post(client, server.url + "/first")
    assert (await post(client, server.url + "/next")).body == b"real"
    assert server.connections == 2


@pytest.mark.parametrize("status", [103, 150])
async def test_interim_answer_announcing_a_body_is_an_unknown_outcome(
    serve: Callable[[Handler], RawServer], client: Upstream, status: int
) -> None:
    """llhttp reads a body after some 1xx codes (150) and not others (103); h11 and
    RFC 9110 never do. Where the answer starts is not known: outcome unknown."""

    async def handler(peer: Peer) -> None:
        await peer.request()
        interim = f"HTTP/1.1 {status} Wait\r\ncontent-length: 5\r\n\r\n".encode()
        await peer.send(interim + b"hello" + answer(200, b"real"))
        await asyncio.sleep(5)

    server = serve(handler)
    with pytest.raises(OutcomeLost, match=f"interim {status} answer announces a body"):
        await post(client, server.url + "/")


@pytest.mark.parametrize(
    "line",
    [b"HTTP/1.1 600 X", b"HTTP/1.1 999 X", b"HTTP/1.1 600", b"HTTP/1.1 000 X", b"HTTP/1.1 099 X"],
    ids=["600", "999", "600-no-reason", "000", "099"],
)
async def test_a_status_outside_100_to_599_is_an_unknown_outcome(
    serve: Callable[[Handler], RawServer], client: Upstream, line: bytes
) -> None:
    """llhttp reads any three digits as a status. Outside 100 to 599 (RFC 9110 15) it
    is no answer: not a final one to store or release on (600), nor an interim one to
    wait past (000, 099). Sent, and not understood: the outcome is unknown, at once."""

    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(line + b"\r\ncontent-length: 2\r\n\r\nok" + answer(200, b"real"))
        await asyncio.sleep(5)

    server = serve(handler)
    status = line.split(b" ")[1].decode()
    with pytest.raises(OutcomeLost, match=f"answered {status}, which is no HTTP status") as lost:
        await post(client, server.url + "/", deadline=2)
    assert lost.value.status is None


@pytest.mark.parametrize(
    "coding",
    [b"gzip, chunked", b"chunked, chunked", b"chunked\r\nTransfer-Encoding: chunked"],
)
async def test_transfer_codings_other_than_chunked_alone_are_an_unknown_outcome(
    serve: Callable[[Handler], RawServer], client: Upstream, coding: bytes
) -> None:
    """Found by the h11 oracle: under gzip the chunk-decoded body was returned still
    gzip-coded with nothing saying so (Transfer-Encoding is hop-by-hop), and chunked
    twice was read once. Neither is the body the upstream meant."""

    async def handler(peer: Peer) -> None:
        await peer.request()
        body = b"3\r\nabc\r\n0\r\n\r\n"
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + coding + b"\r\n\r\n" + body)
        await asyncio.sleep(5)

    server = serve(handler)
    with pytest.raises(OutcomeLost, match="Transfer-Encoding"):
        await post(client, server.url + "/")


async def test_trailing_whitespace_of_a_header_value_is_not_part_of_it(
    serve: Callable[[Handler], RawServer], client: Upstream
) -> None:
    """RFC 9110 5.5: whitespace around a field value is not part of it; llhttp strips
    the leading, not the trailing, so the client strips the trailing itself."""

    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(
            b"HTTP/1.1 200 OK\r\nCache-Control:  no-store \t\r\nContent-Length: 2\r\n\r\nok"
        )

    server = serve(handler)
    response = await post(client, server.url + "/")
    assert dict(response.headers)["cache-control"] == "no-store"


# -- a connection closed as it is handed on ------------------------------------------


def closing_after_each_answer(runs: list[bytes]) -> Handler:
    """An upstream that answers keep-alive (no Connection: close) and closes at once:
    the answer and the FIN leave in one step, before the client reads either."""

    async def handler(peer: Peer) -> None:
        request = await peer.request()
        if request is None:
            return
        runs.append(request[0].split(b" ")[1])
        peer.send_now(real_answer(len(runs)))
        peer.sock.close()

    return handler


async def test_connection_closed_after_its_answer_is_never_written_to(
    serve: Callable[[Handler], RawServer], client: Upstream
) -> None:
    """The FIN is in the socket, not yet read by the loop, when the next request
    comes: the pool sees it (a poll before the write) and opens a new connection."""
    runs: list[bytes] = []
    server = serve(closing_after_each_answer(runs))
    for n in range(3):
        assert (await post(client, server.url + f"/{n}")).status == 200
    assert runs == [b"/0", b"/1", b"/2"]
    assert server.connections == 3


async def test_two_keyed_requests_on_a_pool_of_one_both_complete(
    serve: Callable[[Handler], RawServer],
    gateway_on: Callable[..., Awaitable[GatewayClient]],
) -> None:
    """Pool limit 1, an upstream that closes right after each keep-alive answer, two
    concurrent keyed requests: the second is handed the first's connection as the
    upstream's FIN arrives. It was never sent, so it must not be parked: both
    complete, no 504."""
    runs: list[bytes] = []
    server = serve(closing_after_each_answer(runs))
    gw = await gateway_on(server)
    keys = [unique("a"), unique("b")]
    answers = await asyncio.gather(
        *(gw.post(f"/jobs/{n}", headers={"Idempotency-Key": key}) for n, key in enumerate(keys))
    )
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    repeats = [
        await gw.post(f"/jobs/{n}", headers={"Idempotency-Key": key}) for n, key in enumerate(keys)
    ]
    assert [is_replay(r) for r in repeats] == [True, True]
    assert sorted(runs) == [b"/jobs/0", b"/jobs/1"]


async def test_a_closed_connection_handed_on_keeps_the_pool_limit(
    serve: Callable[[Handler], RawServer],
) -> None:
    """The waiter a closed connection was handed to connects in its slot; no other
    waiter is woken for it, so a pool of one never has two connections open."""
    open_now = most = 0

    async def handler(peer: Peer) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            request = await peer.request()
            if request is not None:
                await asyncio.sleep(0.02)  # the other requests queue for the connection
                peer.send_now(answer(200, b"ok"))
        finally:
            open_now -= 1

    server = serve(handler)
    upstream = Upstream(connections=1)
    await upstream.start()
    try:
        answers = await asyncio.gather(*(post(upstream, server.url + "/") for _ in range(4)))
    finally:
        await upstream.close()
    assert [a.body for a in answers] == [b"ok"] * 4
    assert (server.connections, most) == (4, 1)


async def test_a_pooled_connection_is_checked_just_before_the_write(
    serve: Callable[[Handler], RawServer],
) -> None:
    """ready(): a kept-alive connection whose FIN the loop has not read yet is not
    ready; one the upstream keeps open is."""
    closing = asyncio.Event()

    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            peer.send_now(answer(200, b"ok"))
            if closing.is_set():
                peer.sock.close()
                return

    server = serve(handler)
    upstream = Upstream(connections=1)
    await upstream.start()
    try:
        await post(upstream, server.url + "/")
        (pool,) = (origin.pool for origin in upstream._origins.values())
        (connection,) = pool.idle
        assert connection.ready()
        closing.set()
        await post(upstream, server.url + "/")
        # asyncio has not read the FIN yet (uvloop reads it with the answer, and the
        # connection has left the pool already)
        assert not any(connection.ready() for connection in pool.idle)
    finally:
        await upstream.close()


async def test_no_connection_in_time_after_a_closed_one_is_not_sent(
    serve: Callable[[Handler], RawServer],
) -> None:
    """A write that never happened is NotSent: the pooled connection was closed and
    no other could be opened within the deadline."""
    runs: list[bytes] = []
    server = serve(closing_after_each_answer(runs))
    upstream = Upstream(connections=1)
    await upstream.start()
    try:
        await post(upstream, server.url + "/0")
        await server.stop_listening()
        with pytest.raises(NotSent, match="could not connect"):
            await post(upstream, server.url + "/1", deadline=1)
    finally:
        await upstream.close()
    assert runs == [b"/0"]


# -- the upstream's keep-alive ----------------------------------------------------------


def racing_keep_alive(seconds: float, runs: list[float]) -> Handler:
    """An upstream with a `seconds` keep-alive that loses the race deterministically:
    a request arriving on a connection idle that long is dropped unread, as when its
    timer fires the moment the request arrives (gunicorn, node and uvicorn close then;
    the request was written, so the client cannot know it was not read)."""

    async def handler(peer: Peer) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while await peer.request() is not None:
            if loop.time() - last >= seconds:
                return  # closed with the request unread
            runs.append(loop.time())
            await peer.send(real_answer(len(runs)))
            last = loop.time()

    return handler


@pytest.mark.slow
async def test_connections_are_retired_before_the_upstream_keep_alive(
    serve: Callable[[Handler], RawServer],
    gateway_on: Callable[..., Awaitable[GatewayClient]],
) -> None:
    """server.upstream_keep_alive (1 s by default) is below the upstream's 1.5 s: keyed
    requests spaced 1.2 s and 1.7 s apart go out on a new connection, never on one the
    upstream is closing. (With a keep-alive of 2 s, the one after 1.7 s is lost.)"""
    runs: list[float] = []
    server = serve(racing_keep_alive(1.5, runs))
    gw = await gateway_on(server, own_upstream=True)  # server.upstream_keep_alive: 1 s
    answers = []
    for pause in (0, 1.2, 1.7):
        await asyncio.sleep(pause)
        answers.append(await gw.post("/jobs/x", headers={"Idempotency-Key": unique()}))
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert len(runs) == 3 and server.connections == 3


async def test_upstream_keep_alive_setting_reaches_the_client(
    serve: Callable[[Handler], RawServer],
    gateway_on: Callable[..., Awaitable[GatewayClient]],
) -> None:
    """server.upstream_keep_alive is the gateway's upstream client's idle limit."""

    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(real_answer(1))

    server = serve(handler)
    config = config_for(server.url, keyed_routes(), server={"upstream_keep_alive": "100ms"})
    assert config.server.upstream_keep_alive == 0.1
    gateway = Gateway(config, store=MemoryStore(), sweep=False)
    await gateway.start()
    gw = GatewayClient(gateway)
    try:
        await gw.post("/jobs/x", headers={"Idempotency-Key": unique()})
        await gw.post("/jobs/x", headers={"Idempotency-Key": unique()})  # reused
        await asyncio.sleep(0.3)
        await gw.post("/jobs/x", headers={"Idempotency-Key": unique()})  # retired: a new one
    finally:
        await gw.http.aclose()
        await gateway.close()
    assert server.connections == 2


def test_upstream_keep_alive_parses_and_defaults_below_common_upstreams() -> None:
    routes = [{"name": "r", "match": {"path": "/x"}, "upstream": "http://127.0.0.1:9"}]
    assert parse_config({"routes": routes}, "t").server.upstream_keep_alive == 1.0
    parsed = parse_config({"server": {"upstream_keep_alive": "1500ms"}, "routes": routes}, "t")
    assert parsed.server.upstream_keep_alive == 1.5
    with pytest.raises(ConfigError, match="upstream_keep_alive"):
        parse_config({"server": {"upstream_keep_alive": "soon"}, "routes": routes}, "t")
    assert ServerConfig().upstream_keep_alive < 2.0  # gunicorn's default keep-alive


# -- trailers, Connection-named headers, the head's size ----------------------------------


async def test_trailers_and_connection_named_headers_never_reach_the_caller(
    serve: Callable[[Handler], RawServer],
    gateway_on: Callable[..., Awaitable[GatewayClient]],
) -> None:
    """A trailer is not a header (`location: evil` after the last chunk), and a header
    the response's Connection names is for this hop only: neither is forwarded,
    stored or replayed."""

    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            if b"/jobs/trailer" in request[0]:
                await peer.send(
                    b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n"
                    b"trailer: location\r\n\r\n"
                    b"2\r\nok\r\n0\r\nlocation: evil\r\nx-trailer: 1\r\n\r\n"
                )
            else:
                await peer.send(
                    answer(
                        200,
                        b"ok",
                        "Connection: keep-alive, X-Internal-Token",
                        "x-internal-token: s3cret",
                        "x-public: 1",
                    )
                )

    server = serve(handler)
    gw = await gateway_on(server)
    for path in ("/jobs/trailer", "/jobs/connection"):
        key = unique()
        first = await gw.post(path, headers={"Idempotency-Key": key})
        repeat = await gw.post(path, headers={"Idempotency-Key": key})
        assert first.content == repeat.content == b"ok" and is_replay(repeat)
        for response in (first, repeat):
            assert "location" not in response.headers and "x-trailer" not in response.headers
            assert "x-internal-token" not in response.headers
            assert "s3cret" not in str(response.headers.raw)
    assert repeat.headers["x-public"] == "1"  # the others are kept


def head_with(fields: int) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"x-field-%06d: value\r\n" % n for n in range(fields))
        + b"content-length: 2\r\n\r\nok"
    )


async def test_header_fields_are_capped(
    serve: Callable[[Handler], RawServer], client: Upstream
) -> None:
    async def handler(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            fields = int(request[0].split(b" ")[1].strip(b"/"))
            await peer.send(head_with(fields))

    server = serve(handler)
    response = await post(client, server.url + f"/{MAX_RESPONSE_FIELDS - 1}")
    assert len(response.headers) == MAX_RESPONSE_FIELDS - 1  # content-length is the last
    with pytest.raises(OutcomeLost) as caught:
        await post(client, server.url + f"/{MAX_RESPONSE_FIELDS}")
    assert caught.value.reason == (
        f"the upstream's response head has more than {MAX_RESPONSE_FIELDS} header fields; "
        "the request was sent, its outcome is unknown"
    )
    assert caught.value.status == 200


async def test_a_200000_line_head_is_cut_early_with_bounded_memory(
    serve: Callable[[Handler], RawServer], client: Upstream
) -> None:
    """200,000 header lines (4.6 MB) sent as fast as the client reads: reading stops
    at the field cap, and the client's memory stays near one read, not the head."""
    head = head_with(200_000)
    sent = 0

    async def handler(peer: Peer) -> None:
        nonlocal sent
        await peer.request()
        view = memoryview(head)
        while sent < len(head):
            await peer.send(view[sent : sent + 65536])
            sent += 65536

    server = serve(handler)
    tracemalloc.start()
    try:
        with pytest.raises(OutcomeLost, match="more than 256 header fields"):
            await post(client, server.url + "/")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"200,000-line head ({len(head):,} bytes): peak {peak:,} bytes traced, {sent:,} sent")
    assert peak < 2 * 1024 * 1024, peak


@pytest.mark.parametrize("where", ["head", "trailers"])
async def test_an_endless_field_line_is_cut_as_it_streams(
    serve: Callable[[Handler], RawServer], client: Upstream, where: str
) -> None:
    """One header (or trailer) line that never ends, 16 KiB at a time: httptools
    buffers a field line whole, so the bytes are counted per read and the answer is
    cut just past MAX_RESPONSE_HEAD, not at the deadline."""
    sent = 0
    stopped = asyncio.Event()

    async def handler(peer: Peer) -> None:
        nonlocal sent
        await peer.request()
        if where == "head":
            await peer.send(b"HTTP/1.1 200 OK\r\nx-endless: ")
        else:
            await peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\nx: ")
        try:
            while sent < 64 * MAX_RESPONSE_HEAD:
                await peer.send(b"v" * 16384)
                sent += 16384
                await asyncio.sleep(0.001)
        finally:
            stopped.set()

    server = serve(handler)
    part = "head" if where == "head" else "trailer section"
    with pytest.raises(OutcomeLost, match=f"response {part} is over {MAX_RESPONSE_HEAD} bytes"):
        await post(client, server.url + "/", deadline=30)
    await asyncio.wait_for(stopped.wait(), 10)
    print(f"endless {where} line: cut after {sent:,} bytes were sent")
    assert sent < 16 * MAX_RESPONSE_HEAD, sent  # the client hung up: the sender stopped


async def test_a_large_body_in_small_chunks_is_not_a_large_head(
    serve: Callable[[Handler], RawServer], client: Upstream
) -> None:
    """Chunk framing is not head: 40,000 one-byte chunks (200 KB of framing) pass."""
    body = b"".join(b"1\r\n%c\r\n" % (97 + n % 26) for n in range(40_000))

    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body)
        await peer.send(b"0\r\n\r\n")

    server = serve(handler)
    response = await post(client, server.url + "/")
    assert len(response.body) == 40_000


# -- a TLS body cut without close_notify -----------------------------------------------


@pytest.mark.parametrize("close_notify", [True, False], ids=["close_notify", "tcp-fin-only"])
async def test_tls_body_until_close_needs_close_notify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, close_notify: bool
) -> None:
    """A body delimited by the connection's end (no Content-Length, not chunked) over
    TLS: whole after the upstream's close_notify; cut (outcome unknown) when the TCP
    connection ends under the TLS session, as an attacker on the path or a crashed
    TLS terminator ends it. asyncio reports both as eof_received; uvloop the second as
    connection_lost(None) alone."""
    cert, key = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]
    served = threading.Event()

    def serve_one() -> None:
        raw, _ = listener.accept()
        raw.settimeout(10)
        with context.wrap_socket(raw, server_side=True) as tls:
            data = b""
            while b"\r\n\r\n" not in data:
                data += tls.recv(65536)
            tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of the body")
            if close_notify:
                tls.unwrap().close()
            else:
                # SSLSocket.shutdown ends the TCP connection alone: no close_notify
                tls.shutdown(socket.SHUT_RDWR)
        served.set()

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    upstream = Upstream()
    await upstream.start()
    try:
        call = upstream.forward("POST", f"https://localhost:{port}/", [], b"", 10, 1000)
        if close_notify:
            response = await call
            assert (response.status, response.body) == (200, b"all of the body")
        else:
            with pytest.raises(OutcomeLost) as caught:
                await call
            assert caught.value.status == 200
            assert caught.value.reason == (
                "the body was cut off after it answered 200: "
                "the connection ended without TLS close_notify"
            )
    finally:
        await upstream.close()
        thread.join(10)
        listener.close()
    assert served.is_set()
