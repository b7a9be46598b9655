"""The upstream HTTP client: forwarding, header hygiene, one deadline, outcome classes.

aiohttp, chosen by measurement (README, design): on this kind of machine it forwards
about 7x faster than httpx's stock pool. All of it stays behind `Upstream.forward`,
so another client can replace it without touching the engine.

How a failure is classified is decided here and only here:
- NotSent: connection refused, DNS failure, connect timeout, no pooled connection in
  time. The request never left, so the key may be released and the work run again.
- OutcomeLost: the deadline passed, or the connection broke or spoke nonsense, after
  the request may have been sent. The upstream may have done the work: never resend.
  That includes an answer cut off after its status line (a streaming endpoint sends
  "200" before its work is done), and a body that never ends or outgrows
  `max_response_body`: the status received is kept on the error, for the record.

The client itself never resends either: aiohttp retries a GET, PUT or DELETE once when
the connection breaks before the answer's headers, which for the gateway would be a
blind resend of a request the upstream may have run. That retry is switched off.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from yarl import URL

from gateway.errors import NotSent, OutcomeLost

#: RFC 9110 7.6.1, plus headers that describe the framing of one hop's message.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    status: int
    #: hop-by-hop headers removed; the body is the raw bytes, still content-encoded
    headers: tuple[tuple[str, str], ...]
    body: bytes


def forwarded_headers(
    headers: list[tuple[str, str]], client: str | None, scheme: str
) -> list[tuple[str, str]]:
    """The caller's headers as the upstream should see them: hop-by-hop ones (and any
    the Connection header names) removed, X-Forwarded-For/-Proto/-Host added."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name == "connection"
        for token in value.split(",")
    }
    out: list[tuple[str, str]] = []
    host = ""
    prior_for = ""
    for name, value in headers:
        if name == "host":
            host = value
        elif name == "x-forwarded-for":
            prior_for = value
        elif name in ("x-forwarded-proto", "x-forwarded-host"):
            continue
        elif name not in HOP_BY_HOP and name not in named:
            out.append((name, value))
    if client:
        out.append(("x-forwarded-for", f"{prior_for}, {client}" if prior_for else client))
    out.append(("x-forwarded-proto", scheme))
    if host:
        out.append(("x-forwarded-host", host))
    return out


def response_headers(raw: tuple[tuple[bytes, bytes], ...]) -> tuple[tuple[str, str], ...]:
    return tuple(
        (name.decode("latin-1").lower(), value.decode("latin-1"))
        for name, value in raw
        if name.decode("latin-1").lower() not in HOP_BY_HOP
    )


class Upstream:
    """One pooled client for the process; created and closed by the app's lifespan."""

    def __init__(self, *, connections: int = 256, keepalive: float = 2.0) -> None:
        # Idle connections are dropped well before common servers' keep-alive
        # timeouts (uvicorn: 5 s): a POST on a connection the server just closed
        # would fail after it may have been sent, and park the key for nothing.
        self._connections = connections
        self._keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}  # one per route deadline

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._connections, keepalive_timeout=self._keepalive, ttl_dns_cache=60
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # Raw bytes in, raw bytes out: a stored body keeps its Content-Encoding.
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        # aiohttp's only switch for its resend-once of idempotent methods (RFC 9112
        # 9.3.1) is this attribute; its own test client sets it the same way.
        if not hasattr(self._session, "_retry_connection"):
            raise RuntimeError(
                f"aiohttp {aiohttp.__version__} cannot turn off its request retry; "
                "the gateway needs aiohttp >= 3.11"
            )
        self._session._retry_connection = False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def forward(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        deadline: float,
        max_body: int,
    ) -> UpstreamResponse:
        """Send one request and read the whole response, at most `max_body` bytes of
        body, within `deadline` seconds.

        Raises NotSent or OutcomeLost (see the module docstring); never anything else
        for a network or protocol failure.
        """
        if self._session is None:
            raise RuntimeError("Upstream.forward before start()")
        # Connecting (pool wait included) gets part of the deadline and its own error,
        # so a slow connect is known to be "never sent" rather than "unknown".
        timeout = self._timeouts.get(deadline)
        if timeout is None:
            timeout = self._timeouts[deadline] = aiohttp.ClientTimeout(
                total=None, connect=deadline * 0.9
            )
        status: int | None = None  # once the status line is in, the work ran or runs
        try:
            async with asyncio.timeout(deadline):
                async with self._session.request(
                    method,
                    URL(url, encoded=True),
                    headers=headers,
                    data=body if body else None,
                    timeout=timeout,
                    allow_redirects=False,
                ) as resp:
                    status = resp.status
                    payload = await _read_body(resp, max_body)
                    return UpstreamResponse(
                        resp.status, response_headers(resp.raw_headers), payload
                    )
        except aiohttp.ConnectionTimeoutError as exc:
            raise NotSent(f"connect timed out: {exc}") from exc
        except aiohttp.ClientConnectorError as exc:
            raise NotSent(f"could not connect: {exc.os_error}") from exc
        except TimeoutError as exc:
            raise OutcomeLost(
                f"no complete answer within {deadline:g}s{_after(status)}", status
            ) from exc
        except aiohttp.ServerDisconnectedError as exc:
            # Its message is the half-read response head, if one arrived.
            status = status or getattr(exc.message, "code", None)
            reason = f"the upstream closed the connection{_after(status)}"
            raise OutcomeLost(reason, status) from exc
        except BodyTooLarge as exc:
            reason = f"the upstream answered {status} with a body {exc}; reading stopped"
            raise OutcomeLost(reason, status) from exc
        except aiohttp.ClientPayloadError as exc:
            raise OutcomeLost(f"the body was cut off{_after(status)}: {exc}", status) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise OutcomeLost(
                f"connection broke{_after(status)}: {type(exc).__name__}: {exc}", status
            ) from exc


class BodyTooLarge(Exception):
    """The body passed the route's `max_response_body`: the gateway stopped reading."""


async def _read_body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    length = resp.content_length
    if length is not None and length <= limit:
        return await resp.read()
    # Chunked, until-close, or announced too large: read no more than the limit, so a
    # body that never ends costs a deadline, not the process's memory.
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            resp.close()  # drop the connection: the rest is never read
            raise BodyTooLarge(f"larger than max_response_body ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _after(status: int | None) -> str:
    return f" after it answered {status}" if status is not None else ""
