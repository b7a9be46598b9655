"""The admin listener's HTTP protocol: the proxy listener's (gateway/http/protocol.py,
gateway/http/connection.py, gateway/http/cycle.py), with the admin listener's words.

The admin listener faces operators, probes and scrapers, and whoever else reaches its
port: it is held to the same guards as the proxy's, by the same code, with the same
`server.*` settings, counted apart (its own connections under
`server.max_connections`, its own idle ones closed first): a request head bounded by
`server.max_header_bytes` while it streams in (414 for the target, 431 for the
headers), `server.header_timeout` for a head and `server.body_timeout` for a body's
silences (408), the connection cap (503 with Retry-After), `server.keep_alive`,
`server.write_timeout`, and a lingering close. Every refusal is problem+json, drawn by
the renderer every other answer of the listener uses (gateway/errors.py); a request
the parser cannot read is 400 `not-http`. A body is bounded by the call that reads it
(gateway/admin/api.py, the console's forms: 413 from its Content-Length, before a byte
is read); the listener reads a body nobody asked for no faster than the app takes it.

What the app answers is the app's: every path and failure of the operator API and the
console is drawn there (gateway/admin/api.py, gateway/console/site.py). Unlike the proxy,
which passes on the Date an upstream gave, the listener adds uvicorn's Date to every
answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from gateway.config import ServerConfig
from gateway.errors import NotHttp, ProblemError
from gateway.http.protocol import GatewayHttpProtocol, protocol_for


class AdminHttpProtocol(GatewayHttpProtocol):
    unserved: ClassVar[str] = "nothing was done with it"

    def malformed(self, detail: str) -> ProblemError:
        return NotHttp(detail)


def admin_protocol(settings: Callable[[], ServerConfig]) -> type[GatewayHttpProtocol]:
    """The admin listener's protocol class, reading `settings` (the running config's
    `server`) per connection and per request."""
    return protocol_for(settings, AdminHttpProtocol)
