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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import HeadersTooLarge, MalformedRequest, ProblemError, UriTooLong

#: Bytes a single read may add beyond the limit before the head is known to be over it.
READ_SLACK = 256 * 1024


class GatewayHttpProtocol(HttpToolsProtocol):
    #: The head limit in bytes; read per request, so a config reload applies.
    head_limit: Callable[[], int] = staticmethod(lambda: 16 * 1024)

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
        if cycle is not None and cycle is not before and self.scope["method"] != "HEAD":
            # Its app task has not run yet: every write of this response goes through.
            cycle.transport = _HeadHolder(self.transport)  # type: ignore[assignment]

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


class _HeadHolder:
    """The response's transport: holds the status line and headers until the first
    body write, so a response sent whole leaves in one write (one syscall where
    uvicorn makes two; the gateway's answers are always whole). Not used for HEAD,
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


def protocol_for(head_limit: Callable[[], int]) -> type[GatewayHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, reading `head_limit`."""
    return type(
        "GatewayHttpProtocol",
        (GatewayHttpProtocol,),
        {"head_limit": staticmethod(head_limit)},
    )
