"""Raw HTTP/1.1 over a socket, for tests where the framing itself is the input.

`exchange` sends bytes exactly as given and reads one response (or notes that none
came), so a test can send what no HTTP client library would.
"""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawResponse:
    status: int | None  # None: no response line arrived before the deadline or close
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names, last wins
    body: bytes = b""
    closed: bool = False  # the server closed the connection after the response
    raw: bytes = b""

    def problem(self) -> dict[str, Any]:
        """The problem+json document; fails the test when it is anything else."""
        assert self.headers.get("content-type") == "application/problem+json", self
        doc: dict[str, Any] = json.loads(self.body)
        assert doc["status"] == self.status and doc["title"] and doc["type"], doc
        return doc


def parse(raw: bytes) -> RawResponse | None:
    """The first complete final response in `raw` (interim 1xx ones, such as
    100 Continue, are skipped), or None if it is not complete yet."""
    while raw.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in raw:
        raw = raw.partition(b"\r\n\r\n")[2]
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    length = int(headers.get("content-length", "0"))
    if len(rest) < length:
        return None
    return RawResponse(int(parts[1]), headers, rest[:length], raw=raw)


def read_response(sock: socket.socket, timeout: float) -> RawResponse:
    deadline = time.monotonic() + timeout
    raw = b""
    closed = False
    while True:
        done = parse(raw)
        if done is not None or closed:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not chunk:
            closed = True
        raw += chunk
    response = parse(raw) or RawResponse(None, raw=raw)
    # A refusal says `connection: close`: give the close a moment to arrive.
    wait = 0.5 if response.headers.get("connection") == "close" else 0.01
    response.closed = closed or _closed_soon(sock, wait)
    return response


def _closed_soon(sock: socket.socket, wait: float = 0.5) -> bool:
    """Whether the server closes the connection within `wait` seconds, sending nothing."""
    try:
        readable, _, _ = select.select([sock], [], [], wait)
        if not readable:
            return False
        return sock.recv(1) == b""
    except OSError:
        return True


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def exchange(port: int, data: bytes, *, timeout: float = 10.0) -> RawResponse:
    """Send `data` on a fresh connection and read one response."""
    with connect(port) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may refuse before reading it all; its answer is still there
        return read_response(sock, timeout)


def request(
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
) -> bytes:
    """A well-formed request with Content-Length, for the normal cases."""
    lines = [f"{method} {target} HTTP/1.1", "Host: gateway.test"]
    lines += [f"{name}: {value}" for name, value in headers or []]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
