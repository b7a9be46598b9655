"""The gateway's upstream client (gateway/upstream/client.py) against a real socket server on
loopback that answers each request with the raw bytes a test chose: framing (length,
chunked, until-close, HEAD, 1xx), the keep-alive pool (reuse, limit, idle expiry, a
closed connection never reused), and what is refused before a byte leaves. How broken
answers are classified (sent or not) is tests/test_upstream_faults.py's part."""

from __future__ import annotations

import asyncio
import base64
import datetime
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.errors import NotSent, OutcomeLost
from gateway.upstream import Upstream
from tests.support.loops import anyio_backend  # noqa: F401  (uvloop and asyncio)

pytestmark = pytest.mark.anyio

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@dataclass
class Server:
    """Answers every request with `answer(head)`'s bytes; records what arrived."""

    answer: Callable[[bytes], bytes | None] = lambda head: OK
    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    hold: asyncio.Event = field(default_factory=asyncio.Event)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                answer = self.answer(head)
                if answer is None:  # hang: the test's deadline ends it
                    await self.hold.wait()
                    return
                writer.write(answer)
                await writer.drain()
                if b"connection: close" in answer.lower() or b"content-length" not in (
                    answer.split(b"\r\n\r\n")[0].lower()
                ):
                    if b"chunked" not in answer and b" 204 " not in answer:
                        break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server()
    listener = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.port = listener.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        state.hold.set()
        listener.close()


@pytest.fixture
async def client() -> AsyncIterator[Upstream]:
    upstream = Upstream(connections=4)
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.close()


async def test_request_bytes(server: Server, client: Upstream) -> None:
    await client.forward("POST", server.url + "/a/b%2Fc?x=1", [("x-a", "1")], b"", 5, 100)
    await client.forward("GET", server.url + "/", [], b"", 5, 100)
    await client.forward("PUT", server.url + "/p", [], b"{}", 5, 100)
    post, get, put = server.heads
    assert post == (
        b"POST /a/b%%2Fc?x=1 HTTP/1.1\r\nhost: 127.0.0.1:%d\r\nx-a: 1\r\n"
        b"content-length: 0\r\n\r\n" % server.port
    )
    assert b"content-length" not in get  # a GET without a body says nothing
    assert b"content-length: 2\r\n" in put and server.bodies[2] == b"{}"
    assert server.connections == 1  # kept alive and reused


async def test_chunked_and_hop_by_hop(server: Server, client: Upstream) -> None:
    server.answer = lambda head: (
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\n"
        b"X-Run: 7\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    response = await client.forward("POST", server.url + "/", [], b"x", 5, 100)
    assert (response.status, response.body) == (201, b"abcde")
    assert response.headers == (("x-run", "7"),)


async def test_body_until_close_is_read_to_the_end_and_not_reused(
    server: Server, client: Upstream
) -> None:
    server.answer = lambda head: b"HTTP/1.1 200 OK\r\nx-a: 1\r\n\r\nall of it"
    first = await client.forward("POST", server.url + "/", [], b"", 5, 100)
    second = await client.forward("POST", server.url + "/", [], b"", 5, 100)
    assert first.body == second.body == b"all of it"
    assert server.connections == 2


async def test_connection_close_is_not_reused(server: Server, client: Upstream) -> None:
    server.answer = lambda head: (
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    )
    for _ in range(2):
        assert (await client.forward("POST", server.url + "/", [], b"", 5, 100)).body == b"ok"
    assert server.connections == 2


async def test_head_answer_has_no_body(server: Server, client: Upstream) -> None:
    server.answer = lambda head: b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n"
    response = await client.forward("HEAD", server.url + "/", [], b"", 2, 100)
    assert (response.status, response.body) == (200, b"")
    assert ("content-length", "1234") not in response.headers  # framing is not passed on


async def test_interim_answers_are_skipped(server: Server, client: Upstream) -> None:
    server.answer = lambda head: (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + OK
    )
    response = await client.forward("POST", server.url + "/", [], b"x", 5, 100)
    assert (response.status, response.body, response.headers) == (200, b"ok", ())


async def test_pool_limit_queues_and_reuses(server: Server) -> None:
    upstream = Upstream(connections=1)
    await upstream.start()
    try:
        results = await asyncio.gather(
            *(upstream.forward("POST", server.url + "/", [], b"", 5, 100) for _ in range(5))
        )
    finally:
        await upstream.close()
    assert [r.body for r in results] == [b"ok"] * 5
    assert server.connections == 1  # the other four waited for it


async def test_no_connection_free_in_time_is_not_sent(server: Server) -> None:
    server.answer = lambda head: None if b"/hang" in head else OK
    upstream = Upstream(connections=1)
    await upstream.start()
    try:
        hung = asyncio.create_task(upstream.forward("POST", server.url + "/hang", [], b"", 3, 100))
        await asyncio.sleep(0.1)
        with pytest.raises(NotSent, match="no upstream connection came free"):
            await upstream.forward("POST", server.url + "/next", [], b"", 0.3, 100)
        with pytest.raises(OutcomeLost, match="no complete answer within 3s"):
            await hung
        # The hung exchange's connection was dropped; its slot serves the next request.
        assert (await upstream.forward("POST", server.url + "/", [], b"", 3, 100)).body == b"ok"
    finally:
        await upstream.close()
    assert [h.split(b" ")[1] for h in server.heads] == [b"/hang", b"/"]


async def test_idle_connection_past_keepalive_is_not_reused(server: Server) -> None:
    upstream = Upstream(connections=4, keepalive=0.1)
    await upstream.start()
    try:
        await upstream.forward("POST", server.url + "/", [], b"", 5, 100)
        await asyncio.sleep(0.25)
        await upstream.forward("POST", server.url + "/", [], b"", 5, 100)
    finally:
        await upstream.close()
    assert server.connections == 2


@pytest.mark.parametrize(
    ("headers", "target", "reason"),
    [
        ([("x-a", "1\r\nx-injected: 1")], "/", "line break"),
        ([("x-a", "1\rx")], "/", "line break"),
        ([], "/a\nb", "line break"),
        ([("x-a", "\u2713")], "/", "cannot carry"),
    ],
)
async def test_unsendable_request_is_not_sent(
    server: Server, client: Upstream, headers: list[tuple[str, str]], target: str, reason: str
) -> None:
    with pytest.raises(NotSent, match=reason):
        await client.forward("POST", server.url + target, headers, b"", 5, 100)
    assert server.connections == 0


async def test_credentials_in_the_upstream_url(server: Server, client: Upstream) -> None:
    url = f"http://us%40er:p%3Ass@127.0.0.1:{server.port}/"
    await client.forward("GET", url, [], b"", 5, 100)
    await client.forward("GET", url, [("authorization", "Bearer mine")], b"", 5, 100)
    basic = base64.b64encode(b"us@er:p:ss")
    assert b"authorization: Basic " + basic + b"\r\n" in server.heads[0]
    assert b"host: 127.0.0.1:%d\r\n" % server.port in server.heads[0]
    assert b"Basic" not in server.heads[1] and b"authorization: Bearer mine" in server.heads[1]


async def test_answer_that_is_not_http_is_lost_not_retried(
    server: Server, client: Upstream
) -> None:
    server.answer = lambda head: b"SSH-2.0-OpenSSH_9.6\r\n\r\n"
    with pytest.raises(OutcomeLost, match="not valid HTTP"):
        await client.forward("PUT", server.url + "/", [], b"", 5, 100)
    assert len(server.heads) == 1


async def test_refused_is_not_sent(client: Upstream, server: Server) -> None:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    with pytest.raises(NotSent, match="could not connect"):
        await client.forward("POST", f"http://127.0.0.1:{port}/", [], b"", 5, 100)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for "localhost" that is its own CA, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_https_upstream_is_verified(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https upstream: the certificate is checked against the trusted CAs
    (SSL_CERT_FILE here), and one it does not trust is never sent the request."""
    cert, key = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=context)
    port = listener.sockets[0].getsockname()[1]
    try:
        untrusting = Upstream()
        await untrusting.start()
        with pytest.raises(NotSent, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusting.forward("POST", f"https://localhost:{port}/", [], b"x", 5, 100)
        await untrusting.close()
        assert server.heads == []
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        trusting = Upstream()
        await trusting.start()
        try:
            for _ in range(2):
                response = await trusting.forward(
                    "POST", f"https://localhost:{port}/a", [], b"x", 5, 100
                )
                assert (response.status, response.body) == (200, b"ok")
        finally:
            await trusting.close()
    finally:
        listener.close()
    assert server.heads[0].startswith(b"POST /a HTTP/1.1\r\nhost: localhost:%d\r\n" % port)
    assert server.connections == 1  # kept alive over TLS too


async def test_bytes_after_the_answer_drop_the_connection(server: Server, client: Upstream) -> None:
    """Junk after a complete answer is not read as the next request's answer."""
    server.answer = lambda head: OK + b"junk that is not HTTP\r\n\r\n" if b"/junk" in head else OK
    assert (await client.forward("POST", server.url + "/junk", [], b"", 5, 100)).body == b"ok"
    assert (await client.forward("POST", server.url + "/next", [], b"", 5, 100)).body == b"ok"
    assert server.connections == 2


async def test_connection_the_upstream_closed_while_idle_is_not_used(
    server: Server, client: Upstream
) -> None:
    """A kept-alive connection the upstream closes while it sits in the pool (its own
    keep-alive timeout) is dropped, not sent the next request: that request would be
    lost and its key parked for nothing."""
    first = await client.forward("POST", server.url + "/first", [], b"", 5, 100)
    assert first.body == b"ok"
    for writer in server.writers:
        writer.close()
    await asyncio.sleep(0.1)  # the upstream closes it; the FIN arrives
    second = await client.forward("POST", server.url + "/second", [], b"", 5, 100)
    assert second.body == b"ok"
    assert server.connections == 2
