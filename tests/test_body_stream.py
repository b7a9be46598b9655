"""The upstream client's streamed bodies (gateway/upstream/response.py, BodyStream) on both event
loops, against a socket server on loopback that writes a body with its own transport's
back-pressure (each part once the one before was taken) and counts what the client
took: read whole up to `whole_up_to`, streamed past it, the upstream read paused while
the reader is behind, the ResponseBudget's count back to 0 however a body ends, a key's
body read to its end when its reader goes, and the deadline rules. What a caller sees
through a real gateway is tests/test_streaming.py's part."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from gateway.errors import OutcomeLost
from gateway.upstream.client import Upstream
from gateway.upstream.response import STREAM_HIGH, BodyStream, ResponseBudget
from tests.support.loops import anyio_backend  # noqa: F401  (uvloop and asyncio)

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
PART = 64 * 1024


def body_of(size: int) -> bytes:
    return random.Random(size).randbytes(size)


@dataclass
class Writer:
    """Answers `/N` with an N-byte body (`?chunked`, `?cut=M`: only M bytes, then FIN);
    `sent` counts the body bytes its transport took, `closed` the connections the
    client closed before an answer was whole."""

    port: int = 0
    sent: int = 0
    closed: int = 0
    complete: int = 0
    connections: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ")[1].decode()
                path, _, query = target.partition("?")
                size = int(path.strip("/"))
                cut = size
                chunked = "chunked" in query
                for item in query.split("&"):
                    if item.startswith("cut="):
                        cut = int(item[4:])
                framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % size
                writer.write(b"HTTP/1.1 200 OK\r\n%s\r\n\r\n" % framing)
                data = body_of(size)
                for start in range(0, min(size, cut), PART):
                    part = data[start : min(start + PART, cut)]
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                    await writer.drain()
                    self.sent += len(part)
                if cut < size:
                    return
                if chunked:
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
                self.complete += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed += 1
        finally:
            writer.close()

    def url(self, size: int, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{size}" + (f"?{query}" if query else "")


@pytest.fixture
async def writer() -> AsyncIterator[Writer]:
    state = Writer()
    listener = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.port = listener.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        listener.close()


@pytest.fixture
async def client() -> AsyncIterator[Upstream]:
    upstream = Upstream(connections=1)
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.close()


async def read_all(rest: BodyStream) -> bytes:
    parts = []
    while part := await rest.read():
        parts.append(part)
    rest.abandon()
    return b"".join(parts)


async def until(condition: object, what: str) -> None:
    for _ in range(400):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never: {what}")


async def test_a_body_within_whole_up_to_is_read_whole(writer: Writer, client: Upstream) -> None:
    budget = ResponseBudget(64 * MiB)
    response = await client.forward(
        "GET", writer.url(300_000), [], b"", 5, 8 * MiB, budget, 300_000
    )
    assert response.rest is None and response.body == body_of(300_000)
    assert response.held == budget.held == 300_000  # counted until its writer lets go
    budget.release(response.held)
    assert budget.held == 0


@pytest.mark.parametrize("query", ["", "chunked"])
async def test_a_longer_body_streams_byte_exact(
    writer: Writer, client: Upstream, query: str
) -> None:
    budget = ResponseBudget(64 * MiB)
    size = 5 * MiB + 7
    response = await client.forward(
        "GET", writer.url(size, query), [], b"", 5, 8 * MiB, budget, MiB
    )
    assert response.rest is not None and response.body == b""
    assert response.rest.length == (None if query else size)
    assert await read_all(response.rest) == body_of(size)
    await response.rest.finished()
    assert budget.held == 0
    # The connection went back to the pool reading, and serves the next request.
    again = await client.forward("GET", writer.url(10), [], b"", 5, 8 * MiB, budget, MiB)
    assert again.body == body_of(10) and writer.connections == 1


async def test_a_reader_that_is_behind_pauses_the_upstream_read(
    writer: Writer, client: Upstream
) -> None:
    """While nobody reads, the client holds about one read beyond STREAM_HIGH, not the
    body: the rest waits in the socket buffers and in the upstream, which is held back."""
    budget = ResponseBudget(64 * MiB)
    size = 48 * MiB
    response = await client.forward("GET", writer.url(size), [], b"", 30, 64 * MiB, budget, PART)
    assert response.rest is not None
    first = await response.rest.read()
    await asyncio.sleep(0.5)  # the socket buffers fill and the upstream stops
    held = budget.held
    sent_while_stalled = writer.sent
    assert held <= STREAM_HIGH + 512 * 1024, f"{held} bytes held for a stalled reader"
    assert sent_while_stalled < size
    rest = await read_all(response.rest)
    assert first + rest == body_of(size)
    assert budget.held == 0 and writer.complete == 1


async def test_a_keys_body_is_read_to_its_end_when_its_reader_goes(
    writer: Writer, client: Upstream
) -> None:
    budget = ResponseBudget(64 * MiB)
    size = 16 * MiB
    response = await client.forward(
        "GET", writer.url(size), [], b"", 30, 64 * MiB, budget, PART, True
    )
    assert response.rest is not None
    await response.rest.read()
    response.rest.abandon()
    await response.rest.finished()  # whole: the key can be completed
    assert writer.sent == size and writer.complete == 1
    assert budget.held == 0


async def test_any_other_body_is_closed_when_its_reader_goes(
    writer: Writer, client: Upstream
) -> None:
    budget = ResponseBudget(64 * MiB)
    response = await client.forward(
        "GET", writer.url(32 * MiB), [], b"", 30, 64 * MiB, budget, PART
    )
    assert response.rest is not None
    await response.rest.read()
    response.rest.abandon()
    with pytest.raises(OutcomeLost, match="stopped reading"):
        await response.rest.finished()
    await until(lambda: writer.closed == 1, "the upstream saw the connection closed")
    assert writer.complete == 0 and budget.held == 0


@pytest.mark.parametrize("query", ["cut=3000000", "chunked&cut=3000000"])
async def test_a_body_cut_off_while_streaming(writer: Writer, client: Upstream, query: str) -> None:
    """What came before the cut is read first; then the reader and the key's waiter
    both learn it is cut off."""
    budget = ResponseBudget(64 * MiB)
    response = await client.forward(
        "GET", writer.url(4 * MiB, query), [], b"", 30, 64 * MiB, budget, MiB, True
    )
    assert response.rest is not None
    parts = []
    with pytest.raises(OutcomeLost, match="the body was cut off after it answered 200"):
        while part := await response.rest.read():
            parts.append(part)
    response.rest.abandon()
    with pytest.raises(OutcomeLost, match="cut off"):
        await response.rest.finished()
    assert b"".join(parts) == body_of(4 * MiB)[:3_000_000]
    assert budget.held == 0


async def test_a_stream_over_max_response_body(writer: Writer, client: Upstream) -> None:
    budget = ResponseBudget(64 * MiB)
    response = await client.forward(
        "GET", writer.url(8 * MiB, "chunked"), [], b"", 30, 2 * MiB, budget, MiB, True
    )
    assert response.rest is not None
    with pytest.raises(OutcomeLost, match="larger than max_response_body"):
        await read_all(response.rest)
    response.rest.abandon()
    with pytest.raises(OutcomeLost, match="larger than max_response_body"):
        await response.rest.finished()
    assert budget.held == 0


async def test_the_budget_streams_a_body_it_has_no_room_for(
    writer: Writer, client: Upstream
) -> None:
    events: list[str] = []
    budget = ResponseBudget(200 * 1024, events.append)
    response = await client.forward(
        "GET", writer.url(600 * 1024), [], b"", 5, 8 * MiB, budget, MiB, True
    )
    assert response.rest is not None  # under whole_up_to, but over the budget
    assert "streamed" in events
    assert await read_all(response.rest) == body_of(600 * 1024)
    assert budget.held == 0


async def test_the_budget_pauses_streams_until_bytes_are_freed(writer: Writer) -> None:
    """Two streams, one budget of 512 KiB: the first one's parts wait for a reader
    that does not come yet, so the second's read pauses; once the first is read the
    second goes on. Nothing waits on a body read whole, so nothing waits forever."""
    events: list[str] = []
    budget = ResponseBudget(512 * 1024, events.append)
    upstream = Upstream(connections=2)
    await upstream.start()
    try:
        first = await upstream.forward(
            "GET", writer.url(8 * MiB), [], b"", 30, 64 * MiB, budget, 400 * 1024
        )
        second = await upstream.forward(
            "GET", writer.url(8 * MiB + 1), [], b"", 30, 64 * MiB, budget, 64 * 1024
        )
        assert first.rest is not None and second.rest is not None
        reading = asyncio.create_task(read_all(second.rest))
        await until(lambda: "paused" in events, "the second stream paused for the budget")
        assert not reading.done()
        assert await read_all(first.rest) == body_of(8 * MiB)
        assert await reading == body_of(8 * MiB + 1)
    finally:
        await upstream.close()
    assert budget.held == 0


async def test_time_paused_for_a_reader_is_not_the_upstreams(
    writer: Writer, client: Upstream
) -> None:
    """Without a key, a reader that takes longer than the deadline is not a late
    upstream: the deadline counts only the time the read was not paused for it."""
    budget = ResponseBudget(64 * MiB)
    response = await client.forward(
        "GET", writer.url(24 * MiB), [], b"", 1.0, 64 * MiB, budget, PART
    )
    assert response.rest is not None
    first = await response.rest.read()
    await asyncio.sleep(1.5)  # paused all along: the socket buffers are full
    assert first + await read_all(response.rest) == body_of(24 * MiB)


async def test_a_keys_reader_too_slow_for_the_deadline_is_given_up_on(
    writer: Writer, client: Upstream
) -> None:
    """A key's body must end within the deadline (the record's lease counts on it):
    a reader that still holds the read back after READER_SHARE of it is dropped, and
    the rest is read at the upstream's pace, so the key can be completed."""
    budget = ResponseBudget(64 * MiB)
    dropped: list[str] = []
    response = await client.forward(
        "GET", writer.url(24 * MiB), [], b"", 4.0, 64 * MiB, budget, PART, True
    )
    assert response.rest is not None
    response.rest.when_dropped(dropped.append)
    await response.rest.read()
    await until(lambda: dropped, "the reader was given up on")
    with pytest.raises(OutcomeLost, match="too slowly"):
        await response.rest.read()
    response.rest.abandon()
    await response.rest.finished()  # whole
    assert writer.complete == 1 and budget.held == 0
