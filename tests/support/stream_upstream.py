"""An upstream for the streaming tests: large bodies of known bytes, sent with the
writer's back-pressure (each part waits until the reader took the one before), and cut
off on demand. Plain asyncio streams, in a process of its own:

    python tests/support/stream_upstream.py PORT

Each request to any path but /_count is one execution of the key in its
`Idempotency-Key` header, counted as soon as the request has been read. The query says
what the answer is:

    ?size=N        a 200 with N bytes of body(N), Content-Length framed
    &chunked=1     the same body chunked, in parts of 64 KiB
    &cut=M         only the first M bytes of it, then FIN (no last chunk)
    &status=S      that status instead of 200

GET /_count?key=K   {"count", "sent", "complete", "peer_closed"} for key K: executions,
                    body bytes the reader took (accepted by the socket), answers sent
                    whole, and answers the reader hung up on
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections import Counter
from functools import cache
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

if TYPE_CHECKING:
    from tests.support.servers import Process

PART = 64 * 1024

counts: Counter[str] = Counter()
sent: Counter[str] = Counter()
complete: Counter[str] = Counter()
peer_closed: Counter[str] = Counter()


@cache
def body(size: int) -> bytes:
    """The body of a `size`-byte answer: bytes no two offsets of which are likely to
    repeat, so a part lost, doubled or reordered shows in a hash."""
    return random.Random(size).randbytes(size)


async def _answer(writer: asyncio.StreamWriter, key: str, query: dict[str, str]) -> bool:
    size = int(query.get("size", "0"))
    data = body(size)
    cut = int(query.get("cut", size))
    chunked = query.get("chunked") == "1"
    status = int(query.get("status", "200"))
    framing = "transfer-encoding: chunked" if chunked else f"content-length: {size}"
    writer.write(
        f"HTTP/1.1 {status} Status\r\ncontent-type: application/octet-stream\r\n"
        f"x-body-size: {size}\r\n{framing}\r\n\r\n".encode()
    )
    try:
        for start in range(0, min(cut, size), PART):
            part = data[start : min(start + PART, cut)]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            await writer.drain()
            sent[key] += len(part)
        if cut < size:
            writer.close()
            return False
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
    except (ConnectionError, OSError):
        peer_closed[key] += 1
        return False
    complete[key] += 1
    return True


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    target = lines[0].split(" ")[1]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return target, headers


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while (request := await _read_request(reader)) is not None:
            target, headers = request
            parts = urlsplit(target)
            query = dict(parse_qsl(parts.query))
            if parts.path == "/_count":
                key = query["key"]
                doc = json.dumps(
                    {
                        "count": counts[key],
                        "sent": sent[key],
                        "complete": complete[key],
                        "peer_closed": peer_closed[key],
                    }
                ).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(doc), doc))
                await writer.drain()
                continue
            key = headers.get("idempotency-key", "")
            counts[key] += 1
            if not await _answer(writer, key, query):
                return
    except (ConnectionError, OSError):
        pass
    finally:
        if not writer.transport.is_closing():
            writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port, backlog=512)
    async with server:
        await server.serve_forever()


def stream_upstream_server(port: int | None = None) -> Process:
    """This script as a child process of the tests (not started yet)."""
    from tests.support.servers import Process, free_port

    port = port or free_port()
    return Process([sys.executable, __file__, str(port)], port, "stream-upstream")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
