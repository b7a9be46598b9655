"""The proxy listener: uvicorn's httptools protocol, with the gateway's answers for
requests it cannot parse, deadlines for callers that are slow on purpose, and a close
that does not lose bytes in flight.

Stock uvicorn answers an unparseable request (Content-Length with Transfer-Encoding,
two Content-Lengths, a bad chunk size, a bare LF, ...) with a text/plain 400, buffers
a request head of any size, waits forever for a head or a body that never ends, and
closes a kept-alive connection after 5 s whatever is arriving on it.
`GatewayHttpProtocol` changes that, in three modules:

- here, the parsing: the head is bounded while it streams in: the request target over
  `server.max_header_bytes` gets 414, header names and values over it 431, and a head
  that is still incomplete after that many bytes (plus `READ_SLACK`) gets 431 too. A
  chunked body's trailer fields are never headers: they are dropped, and their bytes
  count against the same limit. A request target with a fragment, and any upgrade
  request, are refused;
- gateway/connection.py, the connection: refusals in order, the head and body
  deadlines, the connection cap, the keep-alive, the write timeout, the lingering
  close;
- gateway/cycle.py, each request's ASGI receive and send: a response's head held
  until its body, so a whole answer leaves in one write, and an answer before the
  body that ends the connection.

`date_header` is off in uvicorn: a forwarded or replayed response keeps the Date it
has, and the gateway adds one (`http_date`) only to answers that have none.

The parser callbacks do uvicorn's work themselves rather than through super(): they run
for every request (on_header for every field), and each frame less is a measurable part
of a request's CPU (docs/performance.md, session 7). The app checks the header total
again (gateway/app.py), so in-process use without this protocol answers the same.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable

from gateway.config import ServerConfig
from gateway.connection import Connection
from gateway.cycle import CALLER_TRANSPORT, Cycle
from gateway.errors import HeadersTooLarge, MalformedRequest, UpgradeRefused, UriTooLong

#: Bytes the parser is fed at a time: a read brings up to about 256 KiB (asyncio's and
#: uvloop's read size), fed in pieces of this size, so an unfinished head or trailer
#: section is cut at most this far past the limit (and counting a piece that ends one
#: message and starts the next as head bytes cannot refuse a head under the limit).
READ_SLACK = 8 * 1024


class GatewayHttpProtocol(Connection):
    def data_received(self, data: bytes) -> None:
        now = self._last_read = self.loop.time()
        if self._stopped:
            return  # refused or lingering: what comes now is read and dropped
        if self.timeout_keep_alive_task is not None:
            self._unset_keepalive_if_required()
        if self._in_head and self._head_since is None:
            self._head_since = now  # a later request's first byte: its deadline starts
        if len(data) <= READ_SLACK:
            self._feed(data)
        else:
            view = memoryview(data)
            for start in range(0, len(data), READ_SLACK):
                self._feed(view[start : start + READ_SLACK])  # type: ignore[arg-type]
                if self._stopped or self.parser is None or self.parser.should_upgrade():
                    break
        if self._stopped or self._timer is not None:
            return
        # Armed only for what did not finish within this read: a request that arrives
        # whole costs no timer.
        if not self._in_head:
            self._timer = self.loop.call_later(self._server.body_timeout, self._body_idle)
        elif self._head_since is not None:
            self._timer = self.loop.call_at(
                self._head_since + self._server.header_timeout, self._head_deadline
            )

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            # on_headers_complete refuses every upgrade, so llhttp never gets here with
            # one; stock uvicorn would only log it too.
            self.logger.warning("Unsupported upgrade request.")
        if (self._in_head or self._trailing) and not self._stopped:
            self._head_bytes += len(data)
            if self._head_bytes > self._limit + READ_SLACK:
                what = "head" if self._in_head else "trailer section"
                self._refuse(
                    HeadersTooLarge(
                        f"The request {what} is over {self._head_bytes} bytes and not "
                        f"finished; the limit is {self._limit}."
                    )
                )

    # --- parser callbacks ----------------------------------------------------------
    # What they leave out of uvicorn's: the websocket upgrade (the gateway refuses
    # upgrades, in on_headers_complete, so no body or message of one is ever parsed).

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        server = self._server = self.settings()
        self._limit = server.max_header_bytes
        self.timeout_keep_alive = server.keep_alive  # type: ignore[assignment]
        self._in_head = True
        if self._head_since is None:
            self._head_since = self._last_read
        self._url_bytes = self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self._limit:
            # Raising stops the parser; uvicorn then calls send_400_response.
            self._refusal = UriTooLong(
                f"The request target is over {self._limit} bytes, the gateway's limit."
            )
            raise self._refusal
        if b"#" in url:
            # RFC 9112 3.2: a request target has no fragment. Dropping it (what the URL
            # parser would do) forwards a request the caller did not write.
            self._refusal = MalformedRequest(
                "The request target has a fragment (#...), which HTTP requests do not "
                "carry; it was not forwarded."
            )
            raise self._refusal
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self._limit:
            self._refusal = HeadersTooLarge(
                f"The request headers are over {self._header_bytes} bytes; "
                f"the limit is {self._limit}."
            )
            raise self._refusal
        # After the head, a field is a trailer: uvicorn would append it to the
        # request's headers (the scope's list) whenever it arrives in the same read as
        # the head. The gateway forwards no trailers, so it drops them.
        if self._in_head:
            name = name.lower()
            if name == b"expect" and value.lower() == b"100-continue":
                self.expect_100_continue = True
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        if parser.should_upgrade():
            # llhttp reads nothing after an upgrade request as HTTP any more (its body
            # and any pipelined request would be lost or misread), and the gateway
            # speaks HTTP/1.1 only: refused. Raising stops the parser (see on_url).
            self._refusal = UpgradeRefused(
                "The request asks to switch protocols (Connection: upgrade); the gateway "
                "forwards HTTP/1.1 requests only."
            )
            raise self._refusal
        # The target is read while the head still counts as unfinished, so a refusal of
        # it is answered like any head's (after the requests pipelined before it).
        try:
            parsed_url = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            parsed_url = None
        if parsed_url is None or parsed_url.path is None:
            # `http://host` or `http://host?q` (absolute-form without a path): llhttp
            # passes it, and no path means nothing a route could match.
            self._refusal = MalformedRequest(
                "The request target has no path (for example `http://host` without `/`); "
                "it was not forwarded."
            )
            raise self._refusal
        self._in_head = False
        self._head_since = None
        self._head_bytes = 0
        if self._timer is not None:
            self._cancel_timer()
        scope = self.scope
        http_version = parser.get_http_version()
        method = scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        raw_path = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed_url.query or b""
        app = self.app
        if self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency
            or len(self.tasks) >= self.limit_concurrency
        ):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        existing = self.cycle
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        # A HEAD answer has no body write for its head to wait for (gateway/cycle.py).
        hold = method != "HEAD"
        cycle = self.cycle = Cycle(self, scope, keep_alive, self.expect_100_continue, hold)
        scope[CALLER_TRANSPORT] = self.transport  # type: ignore[literal-required]
        if existing is None or existing.response_complete:
            cycle.start(app)
        else:
            # Pipelined: it waits for the responses before it (on_response_complete).
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))

    def on_chunk_header(self) -> None:
        # The last chunk's header is followed by the trailer section, any other by
        # data: until data comes, what arrives counts as trailer bytes.
        self._trailing = True
        self._head_bytes = self._header_bytes

    def on_chunk_complete(self) -> None:
        self._trailing = False

    def on_body(self, body: bytes) -> None:
        self._trailing = False
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if not cycle.response_complete:
            cycle.more_body = False
            cycle.wake()
        self._url_bytes = 0
        self._in_head = True
        self._trailing = False
        self._head_bytes = 0
        if self._timer is not None:
            self._cancel_timer()


def protocol_for(settings: Callable[[], ServerConfig]) -> type[GatewayHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, reading `settings`."""
    return type(
        "GatewayHttpProtocol",
        (GatewayHttpProtocol,),
        {"settings": staticmethod(settings), "idle": {}, "capped": [0, 0.0]},
    )
