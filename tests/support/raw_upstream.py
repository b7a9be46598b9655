"""A raw-socket upstream for fault tests: plain asyncio streams and no HTTP framework,
so it can break an answer anywhere. It runs in a process of its own:

    python tests/support/raw_upstream.py PORT

Each request to any path but the control ones below is one execution of the key in its
`Idempotency-Key` header, counted as soon as the request has been read (so the work
"happened"). The query says how the answer goes wrong:

    ?sleep=S                 work S seconds first (the answer follows unless a fault says)
    ?fault=reset             RST right after reading the request: not one response byte
    ?fault=half_headers      "HTTP/1.1 200 OK" and one header, then FIN: no blank line
    ?fault=reset_mid_body    a 200 with Content-Length 4000, 1000 bytes of it, then RST
    ?fault=close_mid_body    the same, then FIN
    ?fault=endless           a chunked 200 whose body never ends: ?rate=trickle (a small
                             chunk every 50 ms), or ?rate=flood (as fast as the reader
                             takes it, up to FLOOD bytes, then a trickle)
    ?fault=stray_after_204   a 204 that announces Content-Length: 5 and sends no body;
                             the next request on the same connection is answered with
                             a forged 200 ({"forged": true}) first, then its own answer:
                             what reaches a client that reuses the connection
    ?status=503&fail=2       the key's first 2 executions answer 503, later ones 200
    ?size=N                  a 200 with an N-byte body

Control paths (not counted):

    GET /_count?key=K   {"count", "max_concurrent", "sent", "peer_closed"} for key K
    GET /_status/K      200 once an execution of K finished its work, 202 while one
                        runs, 404 if none ran: a reconcile endpoint like a real one
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
from collections import Counter
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote, urlsplit

if TYPE_CHECKING:
    from tests.support.servers import Process

#: How much an `endless` flood sends before it slows to a trickle: bounded, so a
#: gateway that never stops reading costs the machine this much, not all its memory.
FLOOD = 64 * 1024 * 1024
#: An endless body stops by itself after this long, whatever the reader does.
ENDLESS_LIMIT = 120.0

counts: Counter[str] = Counter()
running: Counter[str] = Counter()
max_running: Counter[str] = Counter()
finished: Counter[str] = Counter()
sent: Counter[str] = Counter()
peer_closed: Counter[str] = Counter()


def _answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}.get(status, "Status")
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _json(status: int, doc: object) -> bytes:
    return _answer(status, json.dumps(doc).encode())


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN: SO_LINGER on, timeout zero."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, target, headers, body


async def _endless(writer: asyncio.StreamWriter, key: str, flood: bool) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    loop = asyncio.get_running_loop()
    stop = loop.time() + ENDLESS_LIMIT
    big = b"x" * 65536
    try:
        while loop.time() < stop:
            fast = flood and sent[key] < FLOOD
            chunk = big if fast else b"y" * 16
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            sent[key] += len(chunk)
            if not fast:
                await asyncio.sleep(0.05)
    except (ConnectionError, OSError):
        peer_closed[key] += 1  # the reader hung up: what the gateway should do
    writer.transport.abort()


async def _job(writer: asyncio.StreamWriter, key: str, query: dict[str, str]) -> bool:
    """Run one execution; False when the connection was broken on purpose."""
    counts[key] += 1
    run = counts[key]
    running[key] += 1
    max_running[key] = max(max_running[key], running[key])
    try:
        if "sleep" in query:
            await asyncio.sleep(float(query["sleep"]))
        finished[key] += 1  # the work is done, whatever happens to the answer
        fault = query.get("fault", "")
        if fault == "reset":
            _reset(writer)
            return False
        if fault == "half_headers":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            await writer.drain()
            writer.close()
            return False
        if fault in ("reset_mid_body", "close_mid_body"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4000\r\n\r\n" + b"z" * 1000)
            await writer.drain()
            await asyncio.sleep(0.05)  # the partial body reaches the reader first
            if fault == "reset_mid_body":
                _reset(writer)
            else:
                writer.close()
            return False
        if fault == "endless":
            await _endless(writer, key, query.get("rate") == "flood")
            return False
        status = 200
        if run <= int(query.get("fail", "0")):
            status = int(query.get("status", "503"))
        if "size" in query:
            writer.write(_answer(status, b"s" * int(query["size"]), "text/plain"))
        else:
            writer.write(_json(status, {"key": key, "run": run, "status": status}))
        await writer.drain()
        return True
    finally:
        running[key] -= 1


async def _control(path: str, query: dict[str, str]) -> bytes:
    if path == "/_count":
        key = query["key"]
        return _json(
            200,
            {
                "count": counts[key],
                "max_concurrent": max_running[key],
                "sent": sent[key],
                "peer_closed": peer_closed[key],
            },
        )
    key = unquote(path.removeprefix("/_status/"))
    if finished[key]:
        return _json(200, {"key": key, "done": True})
    return _json(202 if counts[key] else 404, {"key": key, "done": False})


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    forge = False  # the connection's next request gets a forged answer first
    try:
        while True:
            request = await _read_request(reader)
            if request is None:
                break
            _, target, headers, _ = request
            parts = urlsplit(target)
            query = dict(parse_qsl(parts.query))
            if forge:
                writer.write(_json(200, {"forged": True}))
                forge = False
            if query.get("fault") == "stray_after_204":
                key = headers.get("idempotency-key", "")
                counts[key] += 1
                finished[key] += 1
                writer.write(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n")
                await writer.drain()
                forge = True
                continue
            if parts.path == "/_count" or parts.path.startswith("/_status/"):
                writer.write(await _control(parts.path, query))
                await writer.drain()
                continue
            if not await _job(writer, headers.get("idempotency-key", ""), query):
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


def raw_upstream_server(port: int | None = None) -> Process:
    """This script as a child process of the tests (not started yet)."""
    from tests.support.servers import Process, free_port

    port = port or free_port()
    return Process([sys.executable, __file__, str(port)], port, "raw-upstream")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
