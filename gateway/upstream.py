"""The upstream HTTP client: forwarding, header hygiene, one deadline, outcome classes.

A small HTTP/1.1 client of the gateway's own: a keep-alive pool per origin on asyncio
protocols, with httptools (llhttp, the parser uvicorn uses) reading the answers. It
replaced aiohttp by measurement (README, design; docs/performance.md): forwarding is
what the gateway does on every first request, and aiohttp's general-purpose client
(cookies, redirects, auth, proxies, retries, tracing) cost more CPU per request than
the whole idempotency layer. The gateway needs one thing: send these bytes, read one
whole answer, and know exactly how far it got when something breaks.

How a failure is classified is decided here and only here:
- NotSent: connection refused, DNS failure, connect timeout, no pooled connection in
  time, a header that cannot be written. Not one byte of the request left, so the key
  may be released and the work run again. A kept-alive connection is looked at just
  before the request is written to it (see _Pool._fit): one the upstream has closed,
  or that holds bytes nobody asked for, is retired and another taken, so a request is
  never written where it cannot arrive.
- OutcomeLost: the deadline passed, or the connection broke or spoke nonsense, after
  the request may have been sent. The upstream may have done the work: never resend.
  That includes an answer cut off after its status line (a streaming endpoint sends
  "200" before its work is done), a body that never ends or outgrows
  `max_response_body`, a response head over MAX_RESPONSE_HEAD bytes or
  MAX_RESPONSE_FIELDS fields, and a body delimited by the connection's end whose TLS
  connection ended without close_notify: the status received is kept on the error,
  for the record. Once the request's bytes were handed to the transport, an end of
  the connection without an answer is OutcomeLost, whatever it looks like: the
  upstream may have read the request before it closed.

What may be reused (_Exchange.reusable): a connection whose answer ended exactly
where its framing said, with nothing after it, from an upstream that did not ask to
close it. Bytes after an answer are never read as the next request's answer.

The client never resends anything: a request goes out on one connection, once. (A
general-purpose client retries an idempotent method once when a kept-alive connection
breaks before the answer's headers; for the gateway that would be a blind resend.)

Bodies too large to hold: with a `ResponseBudget`, `forward` reads a body whole only up
to `whole_up_to` bytes (the route's max_stored_body). A longer one, or one the
process's budget has no room for, is handed on as soon as that is known, as a
`BodyStream` the caller reads part by part as the upstream sends it; while the reader
is behind, the upstream connection stops reading, so the gateway holds about one read
of it, never the body. How it ends (whole, cut off, over `max_response_body`, late) is
classified exactly as for a body read whole.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import ipaddress
import re
import select
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

from gateway.config.http import IPNetwork
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
        "expect",  # the gateway holds the whole body and answers 100-continue itself
    }
)


#: The most a response's head may hold: its status line and header fields, interim
#: (1xx) answers' included, and its trailer section (dropped, but read). A head is
#: metadata: nginx refuses an upstream head over its proxy_buffer_size (4 or 8 KiB)
#: and node over 16 KiB, httpx (h11) buffers at most 16 KiB; 64 KiB leaves room for
#: large cookies and link headers while one answer's head costs kilobytes, not the
#: megabytes an upstream could send. Counted as the bytes arrive, so a head that
#: never ends is cut after this much plus one read.
MAX_RESPONSE_HEAD = 64 * 1024
#: The most header fields (and trailer fields) a response may carry: Apache allows
#: 100 per request (LimitRequestFields); 256 leaves room for many Set-Cookie lines.
#: Each field costs Python objects, so this bounds a head of many short lines that
#: fits in MAX_RESPONSE_HEAD.
MAX_RESPONSE_FIELDS = 256
#: What a chunk's size line and the CRLF after its data may take without counting
#: toward MAX_RESPONSE_HEAD: 16 hex digits, CRLF, CRLF and room for a short
#: extension. (Chunk extensions are hardly ever sent; long ones count as head.)
CHUNK_FRAMING = 64
#: A stream stops reading from the upstream once this much waits for its reader.
STREAM_HIGH = 64 * 1024
#: Parts of a stream smaller than this that wait together reach the reader as one.
JOIN_BELOW = 64 * 1024
#: The share of the deadline a key's reader may hold the upstream read back for; after
#: it, a reader that still does is given up on, so the body is read to its end in time.
READER_SHARE = 0.75


# Not frozen: a frozen dataclass sets each field through object.__setattr__, about
# 0.1 us a field, and one of these is made on every request.
@dataclass(slots=True)
class UpstreamResponse:
    status: int
    #: hop-by-hop headers removed; the body is the raw bytes, still content-encoded
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: the body, when it was too large to hold: `body` is then empty
    rest: BodyStream | None = None
    #: bytes of `body` counted in the budget; whoever writes them releases them
    held: int = 0


class ResponseBudget:
    """Response bytes the process holds at once, over all requests
    (`server.max_buffered_responses`): bodies being read whole, and streamed parts not
    yet written to their callers.

    At the limit nothing waits for a body being read whole (those could wait for each
    other forever): that response is streamed instead, so it is not stored whole.
    Streams stop reading from their upstreams until bytes are freed, which happens as
    callers take their parts (or are given up on after server.write_timeout)."""

    __slots__ = ("_waiting", "held", "limit", "on_full")

    def __init__(self, limit: int, on_full: Callable[[str], None] | None = None) -> None:
        self.held = 0
        self.limit = limit
        #: called with "streamed" or "paused" when the limit causes either
        self.on_full = on_full
        self._waiting: dict[BodyStream, None] = {}  # in the order they began to wait

    def release(self, size: int) -> None:
        self.held -= size
        if self._waiting and self.held <= self.limit:
            waiting, self._waiting = self._waiting, {}
            for stream in waiting:
                stream._budget_freed()

    def _wait(self, stream: BodyStream) -> None:
        """`stream`'s read stays paused until bytes are freed."""
        if stream not in self._waiting:
            self._waiting[stream] = None
            self._full("paused")

    def _full(self, action: str) -> None:
        if self.on_full is not None:
            self.on_full(action)


#: Headers that tell the upstream who the caller is. From a caller that is not a trusted
#: proxy they are the caller's own say-so: dropped, and the gateway's view put in place
#: of X-Forwarded-For/-Proto/-Host, Forwarded and X-Real-IP. Every `x-forwarded-*`
#: counts too (-Port, -Prefix, -Ssl move the URLs frameworks build).
CLIENT_CLAIMS = frozenset(
    {
        "forwarded",
        "x-real-ip",
        "true-client-ip",
        "x-client-ip",
        "cf-connecting-ip",
        "fastly-client-ip",
        "x-cluster-client-ip",
    }
)

#: RFC 9110 7.2: uri-host [":" port] (RFC 3986 3.2.2), an IP literal or a reg-name of
#: unreserved, pct-encoded and sub-delims characters; but not the comma, which no
#: registered name has and which would make X-Forwarded-Host read as a list.
_HOST = re.compile(
    r"(?:\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[A-Za-z0-9._~!$&'()*+;=:-]+)\]"
    r"|(?:[A-Za-z0-9._~!$&'()*+;=-]|%[0-9A-Fa-f]{2})*)"
    r"(?::[0-9]*)?"
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: Peers whose trust is remembered; past it the memory starts over (a caller with many
#: addresses costs an address parse per request, never memory).
_TRUST_MEMORY = 4096


def valid_host(value: str) -> bool:
    """Whether `value` is a valid Host field value (empty is: RFC 9112 3.2). Asked on
    every request, of a handful of distinct values: each is matched once."""
    known = _VALID_HOSTS.get(value)
    if known is None:
        known = _HOST.fullmatch(value) is not None
        if len(_VALID_HOSTS) >= _TRUST_MEMORY:
            _VALID_HOSTS.clear()
        _VALID_HOSTS[value] = known
    return known


_VALID_HOSTS: dict[str, bool] = {}


class TrustedProxies:
    """`server.trusted_proxies`: whether a peer address is one whose forwarding headers
    are believed. Asked on every forward, so each address string is parsed once."""

    __slots__ = ("_known", "networks")

    def __init__(self, networks: Iterable[IPNetwork] = ()) -> None:
        self.networks = tuple(networks)
        self._known: dict[str, bool] = {}

    def __contains__(self, address: object) -> bool:
        if not self.networks or not isinstance(address, str):
            return False
        known = self._known.get(address)
        if known is None:
            known = self._check(address)
            if len(self._known) >= _TRUST_MEMORY:
                self._known.clear()
            self._known[address] = known
        return known

    def _check(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.strip())
        except ValueError:
            return False  # "unknown", a port, junk: not an address of ours
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # a dual-stack listener reports IPv4 callers this way
        return any(ip in network for network in self.networks)

    def client_of(self, chain: str) -> str:
        """The caller's address from an X-Forwarded-For chain that ends at a trusted
        peer: the nearest hop that is not itself a trusted proxy (or the farthest)."""
        hops = [hop.strip() for hop in chain.split(",")]
        for hop in reversed(hops):
            if hop and hop not in self:
                return hop
        return next((hop for hop in hops if hop), "")


#: No proxy is trusted: the default, and what in-process callers get.
NO_PROXIES = TrustedProxies()


def forwarded_headers(
    headers: list[tuple[str, str]],
    client: str | None,
    scheme: str,
    proxies: TrustedProxies = NO_PROXIES,
) -> list[tuple[str, str]]:
    """The caller's headers as the upstream should see them: hop-by-hop ones (and any
    the Connection header names) removed, and what the gateway knows of the caller.

    `client` is the immediate peer's address. Unless it is in `proxies`, whatever the
    caller said about itself (CLIENT_CLAIMS, X-Forwarded-*) is dropped and replaced by
    what the gateway saw: X-Forwarded-For the peer, -Proto the scheme, -Host the Host,
    X-Real-IP the peer, and one Forwarded element. From a trusted proxy the
    X-Forwarded-For chain (every line, in order) is extended with the peer, and
    Forwarded with the gateway's element; X-Forwarded-Proto/-Host keep the proxy's
    last value (if valid), X-Real-IP the proxy's (else the chain's nearest untrusted
    hop); other claims pass as sent. Each goes upstream as exactly one line.
    """
    trusted = client in proxies
    named = {
        token.strip().lower()
        for name, value in headers
        if name == "connection"
        for token in value.split(",")
    }
    out: list[tuple[str, str]] = []
    host = ""
    chain: list[str] = []
    forwarded: list[str] = []
    proto = forwarded_host = real_ip = ""
    for name, value in headers:
        if name in HOP_BY_HOP or name in named:
            if name == "host":
                host = value
        elif name in CLIENT_CLAIMS or name.startswith("x-forwarded-"):
            if not trusted:
                continue
            if name == "x-forwarded-for":
                if value.strip():
                    chain.append(value.strip())
            elif name == "x-forwarded-proto":
                proto = value
            elif name == "x-forwarded-host":
                forwarded_host = value
            elif name == "forwarded":
                if value.strip():
                    forwarded.append(value.strip())
            elif name == "x-real-ip":
                real_ip = value.strip()
            else:
                out.append((name, value))
        else:
            out.append((name, value))
    if not trusted:
        # What the gateway saw replaces every claim: the same few lines for each
        # (peer, scheme, Host), built once.
        key = (client, scheme, host)
        tail = _UNTRUSTED_TAILS.get(key)
        if tail is None:
            tail = _untrusted_tail(client, scheme, host)
            if len(_UNTRUSTED_TAILS) >= _TRUST_MEMORY:
                _UNTRUSTED_TAILS.clear()
            _UNTRUSTED_TAILS[key] = tail
        out += tail
        return out
    assert client is not None
    chain.append(client)
    proto = _last(proto)
    if _SCHEME.fullmatch(proto) is None:
        proto = scheme
    forwarded_host = _last(forwarded_host)
    if not forwarded_host or not valid_host(forwarded_host):
        forwarded_host = host
    real_ip = real_ip or proxies.client_of(", ".join(chain))
    return out + _tail(chain, proto, forwarded_host, forwarded, real_ip, client, scheme, host)


_UNTRUSTED_TAILS: dict[tuple[str | None, str, str], list[tuple[str, str]]] = {}


def _untrusted_tail(client: str | None, scheme: str, host: str) -> list[tuple[str, str]]:
    chain = [client] if client else []
    return _tail(chain, scheme, host, [], client or "", client, scheme, host)


def _tail(
    chain: list[str],
    proto: str,
    forwarded_host: str,
    forwarded: list[str],
    real_ip: str,
    client: str | None,
    scheme: str,
    host: str,
) -> list[tuple[str, str]]:
    """The lines that say who the caller is, the gateway's own Forwarded element last."""
    out: list[tuple[str, str]] = []
    element = f"for={_node(client)};proto={_forwarded_value(scheme)}"
    if host:
        element += f";host={_forwarded_value(host)}"
    forwarded = [*forwarded, element]
    if chain:
        out.append(("x-forwarded-for", ", ".join(chain)))
    out.append(("x-forwarded-proto", proto.lower()))
    if forwarded_host:
        out.append(("x-forwarded-host", forwarded_host))
    out.append(("forwarded", ", ".join(forwarded)))
    if real_ip:
        out.append(("x-real-ip", real_ip))
    return out


def _last(value: str) -> str:
    """The last element of a comma-separated value: the one the nearest hop wrote."""
    return value.rpartition(",")[2].strip()


def _node(client: str | None) -> str:
    """A Forwarded `for=` node (RFC 7239 6): an IPv6 address in brackets, quoted."""
    if not client:
        return "unknown"
    if ":" in client:
        return _forwarded_value(f"[{client}]")
    return _forwarded_value(client)


def _forwarded_value(text: str) -> str:
    """A token as is, anything else as a quoted-string (RFC 7239 4)."""
    if _TOKEN.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: Connection values that name no header: the usual ones, skipped without a split.
_PLAIN_CONNECTION = frozenset({"keep-alive", "close", "upgrade"})


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    """The upstream's header fields as the caller (and the store) should see them:
    hop-by-hop ones removed, and any the response's Connection header names (they were
    meant for this hop only: an upstream's `Connection: x-internal-token` says that
    header is not for the caller)."""
    # llhttp strips a value's leading whitespace, not its trailing (RFC 9110 5.5: neither
    # is part of the value). One pass; a second only when a Connection header names more.
    out: list[tuple[str, str]] = []
    named: set[str] | None = None
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        if name not in HOP_BY_HOP:
            out.append((name, raw_value.decode("latin-1").rstrip(" \t")))
        elif name == "connection":
            value = raw_value.decode("latin-1").lower()
            if value not in _PLAIN_CONNECTION:
                named = named or set()
                named.update(token.strip() for token in value.split(","))
    if named:
        return tuple((name, value) for name, value in out if name not in named)
    return tuple(out)


def _framing(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool, list[bytes]]:
    """What a head says about its body: the Content-Length (None without one), whether
    the body is chunked, and the transfer codings, over every Transfer-Encoding line
    (empty: none was sent)."""
    length: int | None = None
    codings: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            length = int(value)  # llhttp has checked it is a number
        elif lowered == b"transfer-encoding":
            codings += [token.strip().lower() for token in value.split(b",")]
    return length, b"chunked" in codings, codings


def _closed_cleanly(transport: asyncio.BaseTransport) -> bool:
    """Whether the upstream's end of the stream is one a body may end on: a FIN on
    plain TCP; on TLS only a close_notify, since an attacker (or a crash) can end the
    TCP connection under the TLS session and a body that ends at the connection's end
    would look whole. asyncio's SSL transport reports a FIN without close_notify as
    eof_received, as it does a clean close (uvloop's reports it as connection_lost(None)
    without eof_received), so the TLS session is asked: after the peer's close_notify a
    read returns b"" (SSL_ERROR_ZERO_RETURN); without one it raises. Everything sent
    was read before eof_received, so the read takes nothing from the answer."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return True
    try:
        return cast(bytes, ssl_object.read(1)) == b""
    except (ssl.SSLError, OSError, ValueError):
        return False


def _poller(fd: int | None) -> select.poll:
    """A poll(2) set of one socket, made once per connection: asking it (`_readable`)
    costs one system call, about 0.3 us. Without a socket (fd None) it is empty, and
    never readable."""
    poller = select.poll()
    if fd is not None:
        poller.register(fd, select.POLLIN)
    return poller


def _readable(poller: select.poll) -> bool:
    """Whether the socket holds something the event loop has not read yet: bytes, a
    FIN, or an error (poll reports those whatever was asked)."""
    return bool(poller.poll(0))


class _Broken(Exception):
    """How an exchange ended without a whole answer; becomes OutcomeLost."""

    def __init__(self, reason: str, status: int | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class _Stop(Exception):
    """Raised in a parser callback to stop the parser (httptools wraps it)."""


class _Exchange:
    """One request's answer as httptools parses it; its callbacks are the parser's."""

    __slots__ = (
        "budget",
        "chunk_events",
        "chunks",
        "complete",
        "connection",
        "credit",
        "error",
        "fields",
        "framing",
        "future",
        "head",
        "headers",
        "hold",
        "in_body",
        "keep_alive",
        "limit",
        "out_of_step",
        "parser",
        "read_to_end",
        "size",
        "status",
        "stream",
        "until_close",
    )

    def __init__(self, future: asyncio.Future[UpstreamResponse], head: bool, limit: int) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.future = future
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.head = head
        self.until_close = False  # no Content-Length, not chunked: the body ends at EOF
        self.in_body = False  # the head is read; what is cut off now is the body
        self.complete = False
        self.keep_alive = False
        #: something followed the answer, or its framing disagreed with its status:
        #: the connection's next bytes cannot be trusted to answer the next request
        self.out_of_step = False
        self.fields = 0  # header and trailer fields, interim answers' included
        self.framing = 0  # bytes read that were not body (head, trailers); see measure
        self.chunk_events = 0  # chunk size lines and chunk ends parsed
        self.credit = 0  # framing allowance left from the last read (see measure)
        self.error: _Broken | None = None
        # Set by forward when the body may be streamed (see BodyStream).
        self.connection: _Connection | None = None
        self.budget: ResponseBudget | None = None
        self.hold = limit
        self.read_to_end = False
        self.stream: BodyStream | None = None

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        # llhttp goes on parsing after a message's end within one feed_data: a second
        # response in the same read would run its callbacks into this exchange.
        if self.complete:
            self.out_of_step = True
            raise _Stop

    def on_status(self, reason: bytes) -> None:
        # The status line is in, the headers may never be: it already says the
        # request arrived, and it goes on the record.
        status = self.parser.get_status_code()
        if status >= 200:
            self.status = status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields += 1
        if self.fields > MAX_RESPONSE_FIELDS:
            self.error = self._over_head(f"has more than {MAX_RESPONSE_FIELDS} header fields")
            raise _Stop
        if not self.in_body:
            self.headers.append((name, value))
        # else a trailer field (after the last chunk): it was never part of the head
        # the upstream's framing and the caller's checks were about; dropped

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        length, chunked, coded = _framing(self.headers)
        if status < 200:
            if length or coded:
                # llhttp reads a body for some 1xx codes and not others; h11 and RFC
                # 9110 never do: where the answer starts cannot be known.
                self.error = _Broken(
                    f"the upstream's interim {status} answer announces a body, which a "
                    "1xx answer cannot have; the request was sent, its outcome is unknown",
                    self.status,
                )
                raise _Stop
            self.headers = []  # 100 Continue, 103 Early Hints: the answer follows
            return
        self.status = status
        self.in_body = True
        if coded and coded != [b"chunked"]:
            # gzip under chunked would be stored decoded once and labelled as nothing
            # (its Transfer-Encoding is hop-by-hop); chunked twice is read once by
            # llhttp: either way the body is not what the upstream meant.
            self.error = _Broken(
                f"the upstream's answer uses Transfer-Encoding {b', '.join(coded).decode()!r}; "
                "the gateway reads chunked alone; the request was sent, its outcome is unknown",
                self.status,
            )
            raise _Stop
        if self.head:
            self._finish(keep_alive=False)  # no body follows; the connection is not reused
            raise _Stop
        if status in (204, 304) and (length or coded):
            # Taken without a body, as RFC 9110 says; but an upstream that sent one
            # would have its next bytes read as the next request's answer.
            self.out_of_step = True
        if length is not None and length > self.limit:
            self._fail_too_large()
        self.until_close = length is None and not chunked and status not in (204, 304)

    def on_chunk_header(self) -> None:
        self.chunk_events += 1

    def on_chunk_complete(self) -> None:
        self.chunk_events += 1

    def on_body(self, body: bytes) -> None:
        size = self.size = self.size + len(body)
        if size > self.limit:
            self._fail_too_large()
        if self.stream is not None:
            self.stream._push(body)
            return
        budget = self.budget
        if budget is not None:
            if size > self.hold or budget.held + len(body) > budget.limit:
                self._start_stream(body)
                return
            budget.held += len(body)
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.status is None:
            return  # the end of a 1xx answer
        self._finish(keep_alive=self.parser.should_keep_alive())

    # -- decisions ----------------------------------------------------------------------

    def measure(self, read: int, size_before: int, events_before: int) -> None:
        """Count what one read added to the head (and trailers): its bytes that were
        not body, less an allowance of CHUNK_FRAMING for each chunk's size line and
        for its end; what a read leaves of the allowance, at most one CHUNK_FRAMING,
        covers a size line or CRLF split across reads. Per read, not per byte: llhttp
        has no limit of its own and httptools buffers a header line whole, so this
        is what bounds a head (or trailer section) that never ends."""
        allowance = self.credit + CHUNK_FRAMING * (self.chunk_events - events_before)
        excess = read - (self.size - size_before) - allowance
        if excess <= 0:
            self.credit = min(CHUNK_FRAMING, -excess)
            return
        self.credit = 0
        self.framing += excess
        if self.framing > MAX_RESPONSE_HEAD and not self.complete and self.error is None:
            self.error = self._over_head(f"is over {MAX_RESPONSE_HEAD} bytes")

    def reusable(self) -> bool:
        """Whether the connection may carry another request after this answer: only
        if the upstream did not ask to close it, the answer ended where its framing
        said and nothing followed it."""
        return self.complete and self.keep_alive and not self.out_of_step and self.error is None

    # -- outcomes -----------------------------------------------------------------------

    def _over_head(self, what: str) -> _Broken:
        part = "trailer section" if self.in_body else "head"
        return _Broken(
            f"the upstream's response {part} {what}; the request was sent, its outcome is unknown",
            self.status,
        )

    def _fail_too_large(self) -> None:
        self.error = _Broken(
            f"the upstream answered {self.status} with a body larger than "
            f"max_response_body ({self.limit} bytes); reading stopped",
            self.status,
        )
        raise _Stop

    def _finish(self, *, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive
        if self.stream is not None:
            self.stream._end()
        elif not self.future.done():
            assert self.status is not None
            body = b"".join(self.chunks)  # one chunk: that very object, not a copy
            held = len(body) if self.budget is not None else 0
            self.future.set_result(
                UpstreamResponse(self.status, response_headers(self.headers), body, None, held)
            )

    def _start_stream(self, body: bytes) -> None:
        """The body outgrew what is read whole, or the budget has no room for it: hand
        the response on now, its body to follow as it arrives."""
        budget, status = self.budget, self.status
        assert budget is not None and status is not None and self.connection is not None
        if self.future.done():
            return  # forward gave up (its deadline): the connection is being closed
        if self.size <= self.hold:
            budget._full("streamed")  # the budget, not the size, made it a stream
        chunks, self.chunks = self.chunks, []
        chunks.append(body)
        budget.held += len(body)
        stream = self.stream = BodyStream(self, chunks, self.size, status, budget)
        self.future.set_result(
            UpstreamResponse(status, response_headers(self.headers), b"", stream)
        )
        stream._check_pause()

    def fail(self, error: _Broken) -> None:
        if self.stream is not None:
            self.stream._fail(error)
        elif not self.future.done():
            self.future.set_exception(error)

    def end_of_stream(self) -> None:
        """The upstream ended the stream cleanly (see _closed_cleanly): the end of a
        body delimited by the connection's end."""
        if self.until_close and not self.complete and self.error is None:
            self._finish(keep_alive=False)

    def let_go(self) -> None:
        """forward gives up on this exchange (failed, past its deadline, or cancelled
        before its caller got the answer): free what it holds."""
        budget = self.budget
        future = self.future
        if future.done() and not future.cancelled() and future.exception() is None:
            response = future.result()  # an answer nobody will write
            if response.held and budget is not None:
                budget.release(response.held)
            if response.rest is not None:
                response.rest.close()
        elif budget is not None and self.chunks:
            budget.release(sum(map(len, self.chunks)))  # a body that never came whole
            self.chunks = []
        if not self.complete and self.connection is not None:
            self.connection.detach()
            self.connection.close()  # an exchange cut short leaves the connection unusable

    def connection_lost(self, exc: Exception | None) -> None:
        if self.complete:
            return
        after = _after(self.status)
        if self.error is not None:
            self.fail(self.error)
        elif self.in_body:
            detail = "" if exc is None else f": {type(exc).__name__}: {exc}"
            if exc is None and self.until_close:
                # A clean end would have ended it (end_of_stream): this is a TLS
                # connection closed under its session, without close_notify.
                detail = ": the connection ended without TLS close_notify"
            self.fail(_Broken(f"the body was cut off{after}{detail}", self.status))
        elif exc is not None:
            self.fail(_Broken(f"connection broke{after}: {type(exc).__name__}: {exc}", self.status))
        else:
            self.fail(_Broken(f"the upstream closed the connection{after}", self.status))


class BodyStream:
    """The body of an answer too large to hold, read part by part as it arrives.

    Parts wait here for the reader (`read`); once STREAM_HIGH bytes wait, or the
    process's ResponseBudget is used up, the upstream connection stops reading until
    the reader catches up, so the gateway holds about one read of the body (the
    socket buffers hold the rest, and the upstream waits). How it ends is decided as
    for a body read whole: complete, or OutcomeLost (cut off, over max_response_body,
    past the deadline).

    The deadline: for a key's answer (`read_to_end`) it is the whole call's, as for a
    body read whole, so the key settles within its lease; its reader may hold the read
    back for the first READER_SHARE of it, and is given up on (its `read` raises) if it
    still does after that, the rest then read at the upstream's pace. For any other
    answer, time the read is paused for its reader does not count.

    `abandon`: the reader is gone. A key's answer is then read to its end anyway,
    parts dropped as they come, so the key is decided as if it had been read; any
    other answer's connection is closed."""

    __slots__ = (
        "_budget",
        "_connection",
        "_deadline",
        "_discarding",
        "_dropped",
        "_ended",
        "_error",
        "_give_up",
        "_late",
        "_left",
        "_on_drop",
        "_out",
        "_paused",
        "_queue",
        "_queued",
        "_read_to_end",
        "_status",
        "_timer",
        "_waiter",
        "length",
    )

    def __init__(
        self,
        exchange: _Exchange,
        chunks: list[bytes],
        queued: int,
        status: int,
        budget: ResponseBudget,
    ) -> None:
        #: the whole body's declared length (Content-Length), if it has one
        self.length = _declared_length(exchange.headers)
        self._connection: _Connection | None = exchange.connection
        self._status = status
        self._budget = budget
        self._read_to_end = exchange.read_to_end
        self._queue = collections.deque(chunks)
        self._queued = queued  # bytes in _queue, all of them counted in the budget
        self._out = 0  # bytes the reader has now, counted until it asks for more
        self._paused = False
        self._discarding = False  # nobody reads: parts are dropped as they come
        self._dropped = False  # the reader was given up on
        self._late = False  # past the reader's share of the deadline
        self._on_drop: Callable[[str], None] | None = None
        self._error: _Broken | None = None
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._give_up = 0.0  # loop time; 0: forward has not handed it on yet
        self._left = 0.0  # seconds of deadline left while paused (not read_to_end)
        self._deadline = 0.0

    # -- the reader's side -----------------------------------------------------------------

    async def read(self) -> bytes:
        """The next part of the body, b"" at its end. OutcomeLost if the body was cut
        off (the parts that came before it are read first) or the reader was given up
        on: the response this is written to must then stay visibly incomplete."""
        if self._out:
            self._budget.release(self._out)
            self._out = 0
        queue = self._queue
        while not queue:
            if self._dropped:
                raise OutcomeLost(self._drop_reason(), self._status)
            if self._error is not None:
                raise OutcomeLost(self._error.reason, self._error.status)
            if self._ended.done():
                return b""
            self._check_resume()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunk = queue.popleft()
        if queue and len(chunk) < JOIN_BELOW and len(queue[0]) < JOIN_BELOW:
            parts, size = [chunk], len(chunk)
            while queue and size < JOIN_BELOW and len(queue[0]) < JOIN_BELOW:
                part = queue.popleft()
                parts.append(part)
                size += len(part)
            chunk = b"".join(parts)
        self._out = len(chunk)
        self._queued -= len(chunk)
        self._check_resume()
        return chunk

    def abandon(self) -> None:
        """The reader is gone (or done): see the class docstring. Safe to repeat."""
        self._drop_parts()
        if self._ended.done():
            return
        if self._read_to_end:
            self._discarding = True
            self._check_resume()
        else:
            self.close()

    async def finished(self) -> None:
        """Until the body ends; OutcomeLost if it did not arrive whole."""
        await asyncio.shield(self._ended)  # a waiter cancelled is no end of the body
        if self._error is not None:
            raise OutcomeLost(self._error.reason, self._error.status)

    def close(self) -> None:
        """Stop reading: the connection is closed and the body counts as cut off."""
        self._drop_parts()
        connection = self._connection
        if not self._ended.done():
            self._fail(_Broken(f"the gateway stopped reading the body{_after(self._status)}", None))
        if connection is not None:
            connection.detach()
            connection.close()

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the body has ended, however it ended."""
        self._ended.add_done_callback(lambda _: callback())

    def when_dropped(self, callback: Callable[[str], None]) -> None:
        """Call `callback` with the reason if the reader is given up on (see the class
        docstring): at once, while the reader may still be waiting for its caller."""
        self._on_drop = callback

    # -- the exchange's side ---------------------------------------------------------------

    def _start(self, give_up: float, deadline: float) -> None:
        """forward hands the answer on: the deadline starts to apply here."""
        self._give_up, self._deadline = give_up, deadline
        if self._ended.done():
            return
        loop = asyncio.get_running_loop()
        if self._read_to_end:
            share = give_up - deadline * (1 - READER_SHARE)
            self._timer = loop.call_at(share, self._reader_late)
        elif self._paused:
            self._left = give_up - loop.time()
        else:
            self._timer = loop.call_at(give_up, self._expire)

    def _push(self, chunk: bytes) -> None:
        if self._discarding:
            return
        self._queue.append(chunk)
        self._queued += len(chunk)
        self._budget.held += len(chunk)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._check_pause()

    def _end(self) -> None:
        connection = self._connection
        if self._paused and connection is not None and connection.transport is not None:
            self._paused = False
            if not connection.transport.is_closing():
                connection.transport.resume_reading()  # it goes back to the pool reading
        self._settled()

    def _fail(self, error: _Broken) -> None:
        if not self._ended.done():
            self._error = error
            self._settled()

    def _settled(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._connection = None  # it may carry another request now
        if not self._ended.done():
            self._ended.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._discarding:
            self._drop_parts()

    # -- flow ------------------------------------------------------------------------------

    def _check_pause(self) -> None:
        if self._paused or self._connection is None:
            return
        budget = self._budget
        if self._queued < STREAM_HIGH and budget.held <= budget.limit:
            return
        if self._late:
            self._drop_reader()  # too slow for the key's deadline: no more waiting for it
            return
        if self._queued < STREAM_HIGH:
            budget._wait(self)  # its reader is not behind: the process's memory is full
        transport = self._connection.transport
        if transport is None:
            return
        transport.pause_reading()
        self._paused = True
        if not self._read_to_end and self._timer is not None:
            self._timer.cancel()  # the reader's time is not the upstream's
            self._timer = None
            self._left = self._give_up - asyncio.get_running_loop().time()

    def _check_resume(self) -> None:
        if not self._paused or self._connection is None:
            return
        budget = self._budget
        if not self._discarding:
            if self._queued >= STREAM_HIGH:
                return
            if budget.held > budget.limit:
                budget._wait(self)
                return
        self._resume()

    def _resume(self) -> None:
        connection = self._connection
        assert connection is not None and connection.transport is not None
        self._paused = False
        if connection.transport.is_closing():
            return
        connection.transport.resume_reading()
        if not self._read_to_end and self._give_up and self._timer is None:
            loop = asyncio.get_running_loop()
            self._give_up = loop.time() + self._left
            self._timer = loop.call_at(self._give_up, self._expire)

    def _budget_freed(self) -> None:
        self._check_resume()

    def _drop_parts(self) -> None:
        dropped = self._queued + self._out
        self._queue.clear()
        self._queued = self._out = 0
        if dropped:
            self._budget.release(dropped)

    # -- time ------------------------------------------------------------------------------

    def _reader_late(self) -> None:
        loop = asyncio.get_running_loop()
        self._late = True
        self._timer = loop.call_at(self._give_up, self._expire)
        if self._paused:
            self._drop_reader()

    def _drop_reader(self) -> None:
        self._dropped = True
        self._discarding = True
        self._drop_parts()
        if self._paused:
            self._resume()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._on_drop is not None:
            self._on_drop(self._drop_reason())

    def _drop_reason(self) -> str:
        return (
            f"the caller read the body too slowly to take it within {READER_SHARE:.0%} "
            f"of the {self._deadline:g}s deadline; it was cut off and the rest is read "
            "for the key"
        )

    def _expire(self) -> None:
        self._timer = None
        connection = self._connection
        self._fail(
            _Broken(
                f"no complete answer within {self._deadline:g}s{_after(self._status)}",
                self._status,
            )
        )
        if connection is not None:
            connection.detach()
            connection.close()


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    chunked = False
    length: int | None = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            length = int(value)
        elif lowered == b"transfer-encoding":
            chunked = True
    return None if chunked else length


class _Connection(asyncio.Protocol):
    """One kept-alive connection to an origin; carries one exchange at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self.poller = _poller(None)
        #: given to a waiter that has not looked at it yet: its slot is that waiter's
        self.handed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")  # the TCP socket, under TLS too
        if sock is not None:
            self.poller = _poller(sock.fileno())

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted
            return
        size, events = exchange.size, exchange.chunk_events
        try:
            exchange.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # _Stop from a callback: the exchange says why
        except httptools.HttpParserUpgrade:
            exchange.error = _Broken("the upstream switched protocols", exchange.status)
        except httptools.HttpParserError as exc:
            reason = f"the upstream's answer is not valid HTTP{_after(exchange.status)}: {exc}"
            exchange.error = _Broken(reason, exchange.status)
        exchange.measure(len(data), size, events)
        if exchange.complete:
            self.detach()
            # Bytes after the answer, HTTP or not: the connection is out of step.
            self.pool.release(self, reusable=exchange.reusable())
        elif exchange.error is not None:
            exchange.fail(exchange.error)
            self.close()

    def eof_received(self) -> bool:
        # The upstream closed its side; connection_lost follows, one callback later.
        # Out of the pool now: a request written here in between would be lost.
        self.closed = True
        exchange = self.exchange
        if exchange is not None and exchange.until_close and self.transport is not None:
            if _closed_cleanly(self.transport):
                exchange.end_of_stream()
                if exchange.complete:
                    self.detach()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        exchange = self.detach()
        if exchange is not None:
            exchange.connection_lost(exc)
        self.pool.lost(self)

    def ready(self) -> bool:
        """Whether a request written now would go out on an open connection as the
        first thing since its last answer: not closed (by us, or by the upstream as
        far as the loop has seen), and nothing waiting in the socket that the loop
        has not read yet: a FIN (the upstream closed it: the request would never be
        read) or bytes nobody asked for (they would be read as its answer)."""
        transport = self.transport
        return (
            not self.closed
            and transport is not None
            and not transport.is_closing()
            and not _readable(self.poller)
        )

    def detach(self) -> _Exchange | None:
        """The connection is done with its exchange (answered, failed or abandoned):
        let go of it, once. The exchange's parser holds the exchange's bound methods
        and the exchange holds the parser, a reference cycle that only the garbage
        collector would free, the response and its future with it; breaking it here
        frees each request's objects as it ends (the collector's passes over them
        cost about 8% of the gateway's CPU)."""
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            del exchange.parser
        return exchange

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class _Pool:
    """Kept-alive connections to one origin, at most `limit` open at once."""

    def __init__(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        limit: int,
        keepalive: float,
    ) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl_context
        self.limit = limit
        self.keepalive = keepalive
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self.waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self.connecting = 0

    async def acquire(self, timeout: float) -> _Connection:
        """A connection ready for a request, or NotSent. A kept-alive one is taken
        only if it is fit to be written to now (_fit); one that is not is retired and
        its slot serves a new connection, within the same timeout."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.idle:
            connection = self.idle.pop()
            if self._fit(connection, now):
                return connection
            self._retire(connection)
        if len(self.open) + self.connecting >= self.limit:
            handed = await self._wait(timeout)
            if handed is not None:
                handed.handed = False
                if self._fit(handed, loop.time()):
                    return handed
                self._retire(handed)  # its slot is this request's now
            timeout = max(0.0, timeout - (loop.time() - now))
        return await self._connect(timeout)

    def _fit(self, connection: _Connection, now: float) -> bool:
        """Whether a kept-alive connection may be written to now: idle for less than
        the keep-alive (the upstream closes idle connections after its own, and a
        request written as it does is lost: the gateway lets go first), and ready."""
        return now - connection.idle_since < self.keepalive and connection.ready()

    def _retire(self, connection: _Connection) -> None:
        """Close a connection (out of the idle list) that will not carry a request;
        its slot is free at once, for the caller: no waiter is woken for it."""
        connection.close()
        self.open.discard(connection)

    async def _wait(self, timeout: float) -> _Connection | None:
        """Wait for a released connection (or None: a free slot to connect in)."""
        waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._hand_back(waiter.result())  # it came as we gave up: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise NotSent(
                    f"no upstream connection came free within {timeout:g}s ({self.limit} are open)"
                ) from None
            raise

    async def _connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(self)
        self.connecting += 1
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(
                    lambda: connection,
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                )
        except BaseException as exc:
            self.connecting -= 1
            connection.close()
            self._wake()  # the slot it would have taken is free again
            if isinstance(exc, TimeoutError):
                raise NotSent(
                    f"connect to {self.host}:{self.port} timed out after {timeout:g}s"
                ) from None
            if isinstance(exc, OSError):
                raise NotSent(f"could not connect to {self.host}:{self.port}: {exc}") from exc
            raise
        self.connecting -= 1
        if connection.closed:  # the upstream hung up at once
            self._wake()
            raise NotSent(f"{self.host}:{self.port} closed the connection as it opened")
        self.open.add(connection)
        return connection

    def release(self, connection: _Connection, *, reusable: bool) -> None:
        """An answer is complete: keep its connection for the next request (a waiter
        first), or close it."""
        if not reusable or connection.closed:
            connection.close()
            return  # connection_lost takes it out and wakes a waiter
        connection.idle_since = asyncio.get_running_loop().time()
        self._offer(connection)

    def _offer(self, connection: _Connection) -> None:
        # A waiter looks at it (_fit) when it wakes: the loop may read the
        # upstream's FIN before then.
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                connection.handed = True
                waiter.set_result(connection)
                return
        connection.handed = False
        self.idle.append(connection)

    def _hand_back(self, connection: _Connection | None) -> None:
        if connection is None:
            self._wake()
        else:
            self._offer(connection)

    def lost(self, connection: _Connection) -> None:
        if connection in self.open:
            self.open.discard(connection)
            with contextlib.suppress(ValueError):
                self.idle.remove(connection)
            if not connection.handed:  # else the waiter it went to connects in its slot
                self._wake()

    def _wake(self) -> None:
        """A connection slot came free: let one waiter open a connection of its own."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for connection in list(self.open):
            connection.close()
        self.idle.clear()


@dataclass(frozen=True, slots=True)
class _Origin:
    pool: _Pool
    host_header: str
    authorization: str | None  # from user:password@ in the upstream URL


class Upstream:
    """The process's client: one pool per origin; started and closed by the app's
    lifespan."""

    def __init__(self, *, connections: int = 256, keepalive: float = 1.0) -> None:
        # `keepalive` is server.upstream_keep_alive (the default is the same):
        # idle connections are retired before common servers' keep-alive timeouts
        # (gunicorn: 2 s; uvicorn, node: 5 s), since a request written as the server
        # closes its end is lost after it may have been read, and parks the key.
        self._connections = connections
        self._keepalive = keepalive
        self._origins: dict[str, _Origin] = {}
        self._ssl: ssl.SSLContext | None = None
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        self._started = False
        for origin in self._origins.values():
            origin.pool.close()
        self._origins.clear()

    def _origin(self, authority: str, tls: bool) -> _Origin:
        key = ("https://" if tls else "http://") + authority
        origin = self._origins.get(key)
        if origin is None:
            parts = urlsplit(key)
            host = parts.hostname or ""
            port = parts.port or (443 if tls else 80)
            if tls and self._ssl is None:
                self._ssl = ssl.create_default_context()
            hostport = authority.rpartition("@")[2]
            authorization = None
            if parts.username is not None:
                secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
                authorization = "Basic " + base64.b64encode(secret.encode()).decode("ascii")
            pool = _Pool(host, port, self._ssl if tls else None, self._connections, self._keepalive)
            origin = self._origins[key] = _Origin(pool, hostport, authorization)
        return origin

    async def forward(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        deadline: float,
        max_body: int,
        budget: ResponseBudget | None = None,
        whole_up_to: int = 0,
        read_to_end: bool = False,
    ) -> UpstreamResponse:
        """Send one request and read the whole response, at most `max_body` bytes of
        body, within `deadline` seconds.

        With `budget`: a body longer than `whole_up_to` bytes (or one the budget has
        no room for) comes back as soon as that is known, as `rest` (a BodyStream);
        `read_to_end` for a key's answer, whose end decides the key (see BodyStream).
        A body read whole is counted in the budget as `held` until its writer
        releases it.

        Raises NotSent or OutcomeLost (see the module docstring); never anything else
        for a network or protocol failure.
        """
        if not self._started:
            raise RuntimeError("Upstream.forward before start()")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline
        tls = url.startswith("https://")
        rest = url[8:] if tls else url[7:]
        slash = rest.find("/")
        authority, target = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
        origin = self._origin(authority, tls)
        request = _request_bytes(method, target, origin, headers, body)
        # Connecting (pool wait included) gets part of the deadline and its own error,
        # so a slow connect is known to be "never sent" rather than "unknown".
        connection = await origin.pool.acquire(deadline * 0.9)
        future: asyncio.Future[UpstreamResponse] = loop.create_future()
        exchange = _Exchange(future, method == "HEAD", max_body)
        exchange.connection = connection
        if budget is not None:
            exchange.budget = budget
            exchange.hold = whole_up_to
            exchange.read_to_end = read_to_end
        connection.exchange = exchange
        assert connection.transport is not None
        connection.transport.write(request)
        timer = loop.call_at(give_up, _expire, future)
        handed = False
        try:
            response = await future
            if response.rest is not None:
                response.rest._start(give_up, deadline)
            handed = True
            return response
        except TimeoutError:
            raise OutcomeLost(
                f"no complete answer within {deadline:g}s{_after(exchange.status)}",
                exchange.status,
            ) from None
        except _Broken as exc:
            raise OutcomeLost(exc.reason, exc.status) from None
        finally:
            timer.cancel()
            if not handed:
                exchange.let_go()


def _expire(future: asyncio.Future[UpstreamResponse]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _request_bytes(
    method: str, target: str, origin: _Origin, headers: list[tuple[str, str]], body: bytes
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {origin.host_header}\r\n"]
    authorization = origin.authorization
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
        if name == "authorization":
            authorization = None  # the caller's own credentials win
    if authorization is not None:
        lines.append(f"authorization: {authorization}\r\n")
    if body or method in _BODY_METHODS:
        lines.append(f"content-length: {len(body)}\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    # One line per header: a CR or LF inside a value or the target would start a
    # header (or a request) of its own on the upstream.
    breaks = len(lines) + 1  # the first holds the request line and host
    if text.count("\n") != breaks or text.count("\r") != breaks:
        raise NotSent("a header or the path holds a line break; the request was not sent")
    try:
        head = text.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise NotSent(f"a header holds a character HTTP cannot carry: {exc}") from None
    return head + body


#: Methods whose requests carry Content-Length even when the body is empty (RFC 9110 8.6).
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _after(status: int | None) -> str:
    return f" after it answered {status}" if status is not None else ""
