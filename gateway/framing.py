"""The proxy listener's HTTP/1.1 parser: uvicorn's httptools protocol, with the
gateway's answers for requests it cannot even parse.

Stock uvicorn answers an unparseable request (Content-Length with Transfer-Encoding,
two Content-Lengths, a bad chunk size, a bare LF, ...) with a text/plain 400, and
buffers a request head of any size: a header never finishes until the parser sees
its line end, so a 100 MB header line sits in memory before any check can run.
`GatewayHttpProtocol` changes two things:

- every refusal is problem+json (400, 414 or 431) and closes the connection, so
  nothing after a request the parser gave up on is read as another request;
- the head is bounded while it streams in: the request target over
  `server.max_header_bytes` gets 414, header names and values over it 431, and
  a head that is still incomplete after that many bytes (plus one read's slack,
  for the end of a previous request's body in the same read) gets 431 too.

The app checks the header total again (gateway/app.py), so in-process use without
this protocol answers the same.

On the response side it enforces `server.write_timeout`: a caller whose connection
stays over the transport's high-water mark that long without taking a byte is given
up on (the connection is reset, its buffered bytes freed); the app learns it from the
transport it finds in the scope under CALLER_TRANSPORT, which it also uses to cut off
a streamed response whose upstream body broke.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import HeadersTooLarge, MalformedRequest, ProblemError, UriTooLong

#: Bytes a single read may add beyond the limit before the head is known to be over it.
READ_SLACK = 256 * 1024

#: The scope key under which the app finds the response's transport.
CALLER_TRANSPORT = "gateway.transport"

#: A body write at least this large goes out as it is, after the held head, rather
#: than copied onto it.
COALESCE_BELOW = 64 * 1024


class GatewayHttpProtocol(HttpToolsProtocol):
    #: The head limit in bytes; read per request, so a config reload applies.
    head_limit: Callable[[], int] = staticmethod(lambda: 16 * 1024)
    #: server.write_timeout in seconds; read when a write stalls.
    write_timeout: Callable[[], float] = staticmethod(lambda: 30.0)

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limit = self.head_limit()
        self._in_head = True  # no request yet: the first bytes are a head
        self._head_bytes = 0  # bytes read while a head was incomplete
        self._url_bytes = 0
        self._header_bytes = 0
        self._refusal: ProblemError | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes buffered for the caller when the stall timer was set

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        super().data_received(data)
        if self._in_head and self._refusal is None and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self._limit + READ_SLACK:
                self._refuse(
                    HeadersTooLarge(
                        f"The request head is over {self._head_bytes} bytes and not finished; "
                        f"the limit is {self._limit}."
                    )
                )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._limit = self.head_limit()
        self._in_head = True
        self._url_bytes = self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self._limit:
            # Raising stops the parser; uvicorn then calls send_400_response.
            self._refusal = UriTooLong(
                f"The request target is over {self._limit} bytes, the gateway's limit."
            )
            raise self._refusal
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self._limit:
            self._refusal = HeadersTooLarge(
                f"The request headers are over {self._header_bytes} bytes; "
                f"the limit is {self._limit}."
            )
            raise self._refusal
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            transport: Any = self.transport
            if self.scope["method"] != "HEAD":
                # Its app task has not run yet: every write of this response goes through.
                transport = cycle.transport = _HeadHolder(self.transport)  # type: ignore[assignment]
            self.scope[CALLER_TRANSPORT] = transport  # type: ignore[literal-required]

    # -- server.write_timeout: the transport calls these at its high/low-water marks ----

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._unsent = self.transport.get_write_buffer_size()
            self._stall = self.loop.call_later(self.write_timeout(), self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().connection_lost(exc)

    def _write_stalled(self) -> None:
        self._stall = None
        unsent = self.transport.get_write_buffer_size()
        if unsent < self._unsent:  # it reads, if slowly: it gets another period
            self._unsent = unsent
            self._stall = self.loop.call_later(self.write_timeout(), self._write_stalled)
            return
        self.logger.warning(
            "a caller took nothing of its response for %gs (server.write_timeout): "
            "connection closed, %d unsent bytes dropped",
            self.write_timeout(),
            unsent,
        )
        reset(self.transport)

    def send_400_response(self, msg: str) -> None:
        refusal = self._refusal or MalformedRequest(
            "The request is not valid HTTP/1.1 (for example: Content-Length together with "
            "Transfer-Encoding, two Content-Lengths, a bad chunk, or a malformed line), so "
            "the gateway cannot tell where it ends. It was not forwarded."
        )
        self._refuse(refusal)

    def _refuse(self, refusal: ProblemError) -> None:
        self._refusal = refusal
        self.logger.warning("refused a request: %s", refusal.detail)
        status, headers, payload = refusal.render()
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
        headers = [*self.server_state.default_headers, *headers]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        lines.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(lines) + payload)
        self.transport.close()


def reset(transport: Any) -> None:
    """Close a caller's connection at once with a reset, its unsent bytes dropped: for a
    caller that stopped reading, a plain close would leave them (and the socket's
    buffers, megabytes) waiting in the kernel for a reader that never comes."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _HeadHolder:
    """The response's transport: holds the status line and headers until the first
    body write, so a response sent whole leaves in one write (one syscall where
    uvicorn makes two; most of the gateway's answers are whole). A large first body
    write goes after the head instead of being copied onto it. Not used for HEAD,
    whose answer has no body write to wait for."""

    __slots__ = ("_head", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head: bytes | None = None  # None: nothing held yet; b"": passed

    def write(self, data: bytes) -> None:
        head = self._head
        if head is None and not data.startswith(b"HTTP/1.1 100 "):  # 100 Continue: now
            self._head = data
            return
        if head:
            self._head = b""
            if len(data) >= COALESCE_BELOW:
                self._transport.write(head)  # one write more, not a copy of the body
            else:
                data = head + data
        self._transport.write(data)

    def close(self) -> None:
        if self._head:  # the app never sent its body: uvicorn closes, as it would
            self._transport.write(self._head)
            self._head = b""
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_for(
    head_limit: Callable[[], int], write_timeout: Callable[[], float] | None = None
) -> type[GatewayHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, reading `head_limit`
    (and `write_timeout`)."""
    settings: dict[str, Any] = {"head_limit": staticmethod(head_limit)}
    if write_timeout is not None:
        settings["write_timeout"] = staticmethod(write_timeout)
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,), settings)
