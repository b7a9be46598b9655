"""A parser oracle: the listener and the upstream client held against h11.

h11 is a strict, well-kept RFC 9112 parser in pure Python, with no code in common with
llhttp (which both the listener and the client use). Hypothesis builds byte streams;
h11 and the gateway read the same bytes; they must agree.

- The listener (`test_listener_agrees_with_h11`): request byte streams (valid and
  subtly invalid request lines, header fields, framings, a pipelined second request
  or stray bytes; one write or two, split anywhere) go over a raw socket to a real
  `python -m gateway run` in front of an echo upstream that records exactly what
  reached it. What h11 accepts, the upstream receives with the same method, target,
  body and end-to-end headers (once the fields the gateway documents it changes are
  set aside), and its answer is that request's own. What h11 refuses never reaches
  the upstream, nor anything after it, and gets a 4xx or a close.
- The client (`test_client_agrees_with_h11`): upstream responses (status lines,
  header fields, Content-Length, chunked and close-delimited bodies, trailers, 1xx
  interim answers, 204/304 that announce a body, stray bytes after the end) are
  served by a raw asyncio server and fetched with `Upstream().forward`. What h11
  parses as a complete response, forward() returns with the same status, body and
  end-to-end headers (trailers never among them); what h11 refuses, forward() raises
  as OutcomeLost. A second request on the same pool then gets its own answer (or
  NotSent), never bytes left over from the first, and a connection with bytes left
  over, or whose 1xx/204/304 announced a body, is not reused.
  Run on uvloop and on asyncio.

Where the gateway is deliberately stricter than h11 (it refuses what h11 accepts), the
exception is named in LISTENER_STRICTER / CLIENT_STRICTER with its reason; a generated
input carries the names of the quirks it was built with, and only those excuse a
refusal. The strategies do not build inputs on which h11 is stricter than RFC 9112
(HTTP/1.0 keep-alive, which h11 does not implement; chunk sizes of more than 20
digits; a response whose transfer codings do not end in chunked), so h11's refusals
count. One such refusal is kept on purpose: a response with `Transfer-Encoding: gzip,
chunked` is valid HTTP that h11 refuses, and the gateway, which drops Transfer-Encoding
on its hop, must refuse it too rather than pass on a body still gzip-coded with nothing
saying so. h11 buffers at most 16 KiB of an unfinished head; the strategies make heads
of under 4 KiB, or of 200 KiB and more, so the gateway's own cap
may lie anywhere in between.

Examples: ORACLE_EXAMPLES for the listener (default 500) and ORACLE_CLIENT_EXAMPLES
per event loop for the client (default 800): about 40 s on an idle 2-core machine.
Seeded (the same examples every run, nothing written to disk, as
tests/test_properties.py's are); ORACLE_SEED=<n> explores other ones.
Every example runs, and a failure lists each kind of disagreement with the shortest
input that showed it (fixes for several kinds land in parallel: one run shows what is
left of each); ORACLE_SHRINK=1 stops at the first disagreement instead and lets
hypothesis shrink each kind it finds to a minimal input. Counts go to the reliability
ledger (area `oracle`): inputs tried (`requests`), inputs h11 refused (`bad_inputs`),
requests forwarded twice (`upstream_duplicates`), and the disagreements, by kind, in
the detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import select
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import h11
import pytest
import uvloop
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from gateway.errors import NotSent, OutcomeLost
from gateway.upstream import Upstream
from tests.support.ledger import Ledger
from tests.support.servers import Process, free_port, gateway_process

LISTENER_EXAMPLES = int(os.environ.get("ORACLE_EXAMPLES", "500"))
CLIENT_EXAMPLES = int(os.environ.get("ORACLE_CLIENT_EXAMPLES", "800"))


def oracle_settings(examples: int, salt: int) -> Callable[[Any], Any]:
    """Reproducible: a fixed seed per test (`salt`, so the two event loops of the client
    test get examples of their own), nothing written to disk."""
    chosen = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )
    base = int(os.environ.get("ORACLE_SEED", "12"))
    return lambda test: seed(base * 1000 + salt)(chosen(test))


# --- what the gateway documents it changes -------------------------------------------

#: RFC 9110 7.6.1's hop-by-hop fields, Proxy-* (meant for the proxy), the framing of
#: one hop's message (Content-Length is recomputed, Transfer-Encoding removed), Host
#: (the upstream's own; the caller's goes in X-Forwarded-Host), Expect (the gateway
#: holds the whole body before it forwards, and answers the expectation itself), and
#: the client-address fields, which the gateway sets itself.
DROPPED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"host",
        b"expect",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"forwarded",
        b"x-real-ip",
    }
)
#: What the gateway adds on its own hop: set aside on the upstream's side. The
#: Idempotency-Key field is how the test tells requests apart (the keyed route forwards
#: the key in it); its value is checked by finding the request at all.
ADDED = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"te",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"forwarded",
        b"x-real-ip",
        b"idempotency-key",
    }
)
#: Response fields that describe one hop (RFC 9110 7.6.1) or the framing: never
#: returned by forward().
RESPONSE_DROPPED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
    }
)


def connection_named(headers: tuple[tuple[bytes, bytes], ...]) -> set[bytes]:
    return {
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    }


# --- the named exceptions: where the gateway is deliberately stricter than h11 --------

#: Quirks an input may carry that let the listener refuse what h11 accepts.
LISTENER_STRICTER = {
    "obs-fold": "RFC 9112 5.2 lets a server refuse obsolete line folding with 400 "
    "instead of unfolding it; the gateway refuses (docs/reliability.md, hostile input)",
    "bare-lf": "RFC 9112 2.2 lets a recipient accept a bare LF as a line end; the gateway "
    "refuses it (docs/reliability.md, hostile input)",
    "repeated-content-length": "two equal Content-Length lines, or a list of equal values: "
    "RFC 9112 6.3 lets a recipient take them as one, h11 does; the gateway refuses "
    "(docs/reliability.md, hostile input: two or listed Content-Lengths)",
    "content-length-with-transfer-encoding": "RFC 9112 6.1 lets a server refuse a request "
    "with both; the gateway does (docs/reliability.md, hostile input)",
    "transfer-encoding-in-http10": "RFC 9112 6.1: an HTTP/1.0 message with "
    "Transfer-Encoding must be treated as faulty framing; h11 reads it chunked",
    "control-in-value": "RFC 9110 5.5: control characters in a field value are invalid; "
    "h11 keeps those other than NUL, CR and LF, the gateway refuses them "
    "(gateway/proxy/app.py, _headers)",
    "unregistered-method": "llhttp parses the methods it knows (the IANA registry's, in "
    "upper case) and refuses other tokens; h11 takes any token",
    "chunk-size-whitespace": "whitespace after a chunk size with no extension: not in RFC "
    "9112 7.1's grammar; h11 tolerates it, llhttp refuses",
    "loose-chunk-extension": "a chunk extension that is not token[=token/quoted-string] "
    "(RFC 9112 7.1.1); h11 skips whatever follows ';', llhttp checks it",
    "other-http-version": "HTTP/1.2 (RFC 9110 2.5: SHOULD be read as 1.1) and HTTP/2.0: "
    "llhttp refuses both, h11 takes any digit.digit",
    "non-utf8-path": "percent-escapes that are not UTF-8 once decoded are refused so two "
    "paths cannot match as one (gateway/proxy/app.py, _check_path)",
    "asterisk-form": "`*` is no path: no route matches it (404, nothing forwarded)",
    "fragment-in-target": "RFC 9112 3.2: a request target has no fragment ('#'); h11 takes "
    "any visible character, a refusal is right (forwarding it without the fragment is not)",
    "dot-segments": "a path with dot-segments or an encoded slash may be "
    "refused on a keyed route (on any route it may be normalised, RFC 3986 5.2.4, before "
    "it is matched and forwarded: see compare())",
    "invalid-host": "RFC 9112 3.2: a Host field with an invalid value gets 400; h11 does "
    "not check the value",
    "framing-field-in-trailer": "RFC 9110 6.5.1: framing fields (Content-Length) must not "
    "be sent as trailers; llhttp refuses a chunked request with one",
    "trailer-fields": "a chunked request's trailer fields are dropped, or the request is refused",
    "absolute-form-without-path": "`http://host` with no path: RFC 9110 4.2.3 reads it as "
    "`/`; the gateway refuses it with 400 malformed-request (test_listener.py)",
    "upgrade": "Connection: upgrade: llhttp stops reading HTTP after an upgrade request (its "
    "body and what follows would be lost), and the gateway speaks HTTP/1.1 only: refused "
    "with 400 upgrade-refused (RFC 9110 7.8 lets a server ignore Upgrade; it cannot here)",
}

#: Where the gateway is more lenient than h11, and why that is harmless: it forwards a
#: request line of its own making, so the upstream never sees the leniency.
LISTENER_LENIENT = {
    "request-line-spaces": "llhttp accepts two spaces between the parts of a request "
    "line (not RFC 9112 3's grammar; h11 refuses); the upstream gets a single-spaced line",
}

#: Quirks that let forward() give up (OutcomeLost) on a response h11 reads.
CLIENT_STRICTER = {
    "obs-fold": "RFC 9112 5.2 lets a proxy discard a response with obsolete line folding "
    "(and answer 502) instead of unfolding it",
    "bare-lf": "RFC 9112 2.2 lets a recipient accept a bare LF; llhttp refuses it",
    "repeated-content-length": "RFC 9112 6.3: a recipient may take equal Content-Lengths as "
    "one, and may refuse them; llhttp refuses",
    "content-length-with-transfer-encoding": "RFC 9112 6.1: a response with both ought to "
    "be handled as an error (smuggling, splitting)",
    "control-in-value": "RFC 9110 5.5: control characters in a field value are invalid",
    "chunk-size-whitespace": "not in RFC 9112 7.1's grammar; llhttp refuses",
    "loose-chunk-extension": "not RFC 9112 7.1.1's grammar; llhttp checks it",
    "other-http-version": "a version other than HTTP/1.0 or 1.1 on this connection",
    "status-without-reason-space": "RFC 9112 4: the SP after the status code is required "
    "even with an empty reason; h11 accepts its absence",
    "framing-field-in-trailer": "RFC 9110 6.5.1: framing fields (Content-Length) must not "
    "be sent as trailers; llhttp refuses a chunked response with one",
    "transfer-encoding-in-http10": "RFC 9112 6.1: an HTTP/1.0 message with "
    "Transfer-Encoding must be treated as faulty framing",
    "content-length-overflow": "a Content-Length beyond 2**64, refused even where the "
    "status says no body follows (RFC 9110 8.6 asks recipients to guard against the "
    "overflow)",
}


# --- h11's reading ---------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """A request as one side parsed it."""

    method: bytes
    target: bytes
    version: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    trailers: tuple[tuple[bytes, bytes], ...]

    def values(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n == name]

    @property
    def tag(self) -> str | None:
        keys = self.values(b"idempotency-key")
        return keys[0].decode("latin-1") if len(keys) == 1 else None


@dataclass
class Reading:
    """h11's reading of a request stream: the requests it parsed whole, in order (None
    for one it refused whose framing was sound, see `read_stream`), and how the stream
    ends after them."""

    slots: list[Message | None]
    end: str  # "clean" (nothing left over), "refused", "incomplete"
    reason: str = ""
    refusals: dict[int, str] = field(default_factory=dict)  # slot -> why h11 refused it

    @property
    def messages(self) -> list[Message]:
        return [m for m in self.slots if m is not None]

    def why(self, index: int) -> str:
        """Why h11 refused request `index` of the stream (or what follows the last)."""
        return self.refusals.get(index) or self.reason.split(":")[0] or self.end


#: h11 gives up on a connection at these, though the request's framing is sound: a
#: server may answer 400 and read on.
SOUND_FRAMING_REFUSALS = ("Missing mandatory Host", "Found multiple Host")


def read_stream(stream: Stream, number: bytes) -> Reading:
    """h11's reading of a generated stream. Where h11 refuses a request for its Host
    field alone, the requests after it are read on their own: the gateway may refuse
    that one request and carry on with the next."""
    reading = h11_requests(stream.data.replace(SEQ, number))
    while reading.end == "refused" and reading.reason.startswith(SOUND_FRAMING_REFUSALS):
        j = len(reading.slots)
        tags = [m.tag for m in reading.slots if m is not None]
        if j + 1 >= len(stream.requests) or tags != [f"o{number.decode()}r{i}" for i in range(j)]:
            break
        rest = b"".join(r.data for r in stream.requests[j + 1 :]) + stream.tail
        after = h11_requests(rest.replace(SEQ, number))
        reading = Reading(
            [*reading.slots, None, *after.slots],
            after.end,
            after.reason,
            {**reading.refusals, j: reading.reason.split(":")[0]},
        )
    return reading


def h11_requests(data: bytes) -> Reading:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    messages: list[Message | None] = []
    start: h11.Request | None = None
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return Reading(messages, "refused", str(exc))
        if isinstance(event, h11.Request):
            start, body = event, bytearray()
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert start is not None
            messages.append(
                Message(
                    start.method,
                    start.target,
                    start.http_version,
                    tuple(start.headers),
                    bytes(body),
                    tuple(event.headers),
                )
            )
            start = None
        elif event is h11.PAUSED:
            # h11 reads the next request once this one is answered.
            conn.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                pending, _ = conn.trailing_data
                if pending:
                    return Reading(messages, "refused", "data after the connection's last request")
                return Reading(messages, "clean")
            conn.start_next_cycle()
        elif event is h11.NEED_DATA:
            pending, _ = conn.trailing_data
            return Reading(messages, "incomplete" if start is not None or pending else "clean")
        else:
            return Reading(messages, "clean")


# --- the echo upstream -----------------------------------------------------------------


class EchoUpstream:
    """Records each request exactly as it arrived (parsed by h11, so a request the
    gateway forwards malformed shows up in `broken`) and answers 200 with the request's
    tag in `x-oracle-tag`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrivals: dict[str, list[Message]] = {}
        self.untagged: list[Message] = []
        self.broken: list[str] = []
        echo = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                echo.serve(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self, sock: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER)
        start: h11.Request | None = None
        body = bytearray()
        received = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                with self.lock:
                    self.broken.append(f"{exc}: {bytes(received[-2000:])!r}")
                return
            if event is h11.NEED_DATA:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                received += data
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                start, body = event, bytearray()
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert start is not None
                message = Message(
                    start.method,
                    start.target,
                    start.http_version,
                    tuple(start.headers),
                    bytes(body),
                    tuple(event.headers),
                )
                tag = message.tag
                with self.lock:
                    if tag is None:
                        self.untagged.append(message)
                    else:
                        self.arrivals.setdefault(tag, []).append(message)
                answer = b"echo " + (tag or "-").encode()
                headers = [
                    (b"content-type", b"text/plain"),
                    (b"x-oracle-tag", (tag or "-").encode()),
                    (b"content-length", str(len(answer)).encode()),
                ]
                out = conn.send(h11.Response(status_code=200, headers=headers)) or b""
                if start.method != b"HEAD":
                    out += conn.send(h11.Data(data=answer)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                try:
                    sock.sendall(out)
                except OSError:
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
                start = None
            else:
                return

    def take(self, prefix: str) -> tuple[dict[str, list[Message]], list[Message], list[str]]:
        """The arrivals whose tag starts with `prefix`, and every untagged or broken one
        since the last call; each is handed out once."""
        with self.lock:
            mine = {t: m for t, m in self.arrivals.items() if t.startswith(prefix)}
            for tag in mine:
                del self.arrivals[tag]
            untagged, self.untagged = self.untagged, []
            broken, self.broken = self.broken, []
        return mine, untagged, broken


@dataclass
class Listener:
    process: Process
    port: int
    echo: EchoUpstream


@pytest.fixture(scope="module")
def listener(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Listener]:
    echo = EchoUpstream()
    echo.thread.start()
    port, admin_port = free_port(), free_port()
    common = {"upstream": echo.url, "upstream_timeout": "10s"}
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "keyed",
                "match": {"path": "/k/{rest:path}"},
                "key": {"header": "Idempotency-Key"},
                **common,
            },
            {"name": "passthrough", "match": {"path": "/{rest:path}"}, **common},
        ],
    }
    path = tmp_path_factory.mktemp("oracle") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port).start()
    try:
        yield Listener(process, port, echo)
    finally:
        status = process.stop()
        echo.server.shutdown()
        echo.server.server_close()
        assert status == 0, process.output()[-3000:]


# --- request strategies ----------------------------------------------------------------
#
# A request is ordinary everywhere but (in one example of four) at one site, where it is
# odd: invalid, or valid in a way the gateway may be stricter about (its quirk is
# named). One odd site at a time keeps every disagreement attributable to one cause.

#: A generated piece of an input and the quirks it was built with.
Part = tuple[bytes, frozenset[str]]
NONE: frozenset[str] = frozenset()


def plain(value: bytes) -> Part:
    return value, NONE


def quirky(*items: tuple[bytes, str | None]) -> st.SearchStrategy[Part]:
    return st.sampled_from([(v, frozenset([q]) if q else NONE) for v, q in items])


def weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each as often as its weight; the first is what shrinking
    goes to, so it is the ordinary case."""
    return st.one_of(*[s for weight, s in options for _ in range(weight)])


#: Stands for the example's number in every request's tag (Idempotency-Key), filled in
#: when the example runs; no strategy ever makes an "@".
SEQ = b"@@@@@@"
SITES = ("method", "target", "version", "gaps", "host", "header", "framing", "line-ends")

WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~", min_size=1, max_size=8).map(
    str.encode
)
METHODS = st.sampled_from(
    [b"POST", b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"PROPFIND"]
).map(plain)
ODD_METHODS = quirky(
    (b"get", "unregistered-method"),
    (b"FOO", "unregistered-method"),
    (b"G(T", None),
    (b"GE\x00T", None),
    (b"", None),
)
PIECES = weighted(
    (4, WORD),
    (1, st.sampled_from([b"%41", b"%C3%A9", b"%25", b"%20", b"%00", b"!$&'()*+,;=:", b"%zz"])),
)
QUERY_PIECES = weighted(
    (4, WORD), (1, st.sampled_from([b"/", b"?", b"%3F", b"=", b"&", b"a=b", b"%FF"]))
)
ODD_PIECES = quirky(
    (b"%2F", "dot-segments-forwarded"),
    (b"%2f", "dot-segments-forwarded"),
    (b".", "dot-segments-forwarded"),
    (b"..", "dot-segments-forwarded"),
    (b"%FF", "non-utf8-path"),
    (b"%C3", "non-utf8-path"),
    (b"\x7f", None),
    (b"\xff", None),
    (b"a b", None),
)


@st.composite
def targets(draw: st.DrawFn, route: bytes, odd: bool) -> Part:
    pieces = draw(st.lists(PIECES, max_size=3))
    quirks = NONE
    form = "origin"
    if odd:
        form = draw(
            st.sampled_from(["piece", "piece", "absolute", "absolute-root", "asterisk", "fragment"])
        )
    if form == "piece":
        piece, quirks = draw(ODD_PIECES)
        if quirks and route == b"/k/":  # a keyed route may refuse dot-segments
            quirks |= {"dot-segments"}
        pieces.insert(draw(st.integers(0, len(pieces))), piece)
    query = b""
    if draw(st.booleans()):
        query = b"?" + b"".join(draw(st.lists(QUERY_PIECES, max_size=4)))
    path = route + b"/".join(pieces) + query
    if form == "absolute":
        return b"http://oracle.test" + path, quirks
    if form == "absolute-root":  # no path at all: RFC 9110 4.2.3 reads it as "/"
        return b"http://oracle.test" + query, quirks | {"absolute-form-without-path"}
    if form == "asterisk":
        return b"*", frozenset(["asterisk-form"])
    if form == "fragment":
        return path + b"#" + draw(WORD), quirks | {"fragment-in-target"}
    return path, quirks


VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]).map(plain)
ODD_VERSIONS = quirky(
    (b"HTTP/1.2", "other-http-version"),
    (b"HTTP/2.0", "other-http-version"),
    (b"HTTP/1.", None),
    (b"http/1.1", None),
    (b"HTTP/11", None),
    (b"HTTP/1.1 ", None),
)
NAMES = st.sampled_from(
    [
        b"Content-Type",
        b"Accept",
        b"User-Agent",
        b"X-A",
        b"X-B",
        b"Cookie",
        b"Authorization",
        b"Cache-Control",
        b"x_under",
        b"Accept-Encoding",
        b"Content-Encoding",
        b"Via",
        b"X-Forwarded-For",
        b"X-Forwarded-Proto",
        b"X-Forwarded-Host",
        b"Forwarded",
        b"X-Real-IP",
        b"X-Hop",
        b"!#$%&'*+.^`|~",
    ]
)
VALUES = weighted(
    (4, st.lists(WORD, min_size=1, max_size=3).map(b" ".join)),
    (
        1,
        st.sampled_from(
            [
                b"",
                b'"a quoted, value"',
                b"a=b; c=d",
                b"a, b,c",
                b"\xe9t\xe9",
                b"\xff",
                b"a\tb",
                b" padded  ",
                b"\ttabbed\t",
                b"1.2.3.4, 5.6.7.8",
                b"for=6.6.6.6;proto=https",
            ]
        ),
    ),
)
SEPARATORS = st.sampled_from([b": ", b": ", b":", b":\t", b":  "])
#: Fields the gateway changes on its hop (see DROPPED), the way callers send them.
HOP_FIELDS = st.sampled_from(
    [
        (b"Connection: close",),
        (b"Connection: keep-alive",),
        (b"Connection: X-Hop", b"X-Hop: hidden"),
        (b"Connection: x-hop, close", b"X-Hop: hidden"),
        (b"Connection: TE", b"TE: trailers"),
        (b"Keep-Alive: timeout=5",),
        (b"Expect: 100-continue",),
        (b"Trailer: X-T",),
        (b"Proxy-Authorization: Basic eDp5",),
        (b"Proxy-Connection: keep-alive",),
        (b"Connection: Upgrade", b"Upgrade: h2c"),
    ]
)


@dataclass(frozen=True)
class Unit:
    """Header lines that stay together (a field and its folded continuation, a
    Connection field and the field it names)."""

    lines: tuple[bytes, ...]
    quirks: frozenset[str] = NONE


@st.composite
def header_units(draw: st.DrawFn) -> Unit:
    if draw(weighted((3, st.just(False)), (1, st.just(True)))):
        lines = draw(HOP_FIELDS)
        return Unit(lines, frozenset({"upgrade"}) if b"Connection: Upgrade" in lines else NONE)
    return Unit((draw(NAMES) + draw(SEPARATORS) + draw(VALUES),))


@st.composite
def odd_header_units(draw: st.DrawFn) -> Unit:
    name, value = draw(NAMES), draw(VALUES)
    odd = draw(st.sampled_from(["name", "value", "fold", "fold"]))
    if odd == "name":
        bad = draw(st.sampled_from([b"X-A ", b"X A", b"X(A)", b"", b"X\x00", "ключ".encode()]))
        return Unit((bad + b": " + value,))
    if odd == "value":
        bad, quirks = draw(
            quirky(
                (b"a\x01b", "control-in-value"),
                (b"\x7f", "control-in-value"),
                (b"a\x1fb", "control-in-value"),
                (b"a\rb", None),
                (b"a\x00b", None),
                (b"a\x0bb", None),
            )
        )
        return Unit((name + b": " + bad,), quirks)
    fold = draw(st.sampled_from([b" ", b"\t", b"  "]))
    return Unit((name + b": " + value, fold + draw(WORD)), frozenset(["obs-fold"]))


HOSTS = weighted(
    (4, st.just(Unit((b"Host: oracle.test",)))),
    (
        1,
        st.sampled_from(
            [
                Unit((b"Host: oracle.test:8080",)),
                Unit((b"host: Oracle.Test",)),
                Unit((b"Host: 127.0.0.1",)),
                Unit((b"Host: [::1]:80",)),
            ]
        ),
    ),
)
ODD_HOSTS = st.sampled_from(
    [
        Unit(()),
        Unit((b"Host: oracle.test", b"Host: oracle.test")),
        Unit((b"Host: a.test", b"Host: b.test")),
        Unit((b"Host:",)),
        Unit((b"Host: a b",), frozenset(["invalid-host"])),
        Unit((b"Host: a/b",), frozenset(["invalid-host"])),
    ]
)
BODIES = weighted(
    (4, st.binary(min_size=1, max_size=24)),
    (
        1,
        st.sampled_from(
            [b'{"job": 1}', b"a=1&b=2", b"0\r\n\r\nGET /p/hidden HTTP/1.1\r\nHost: x\r\n\r\n"]
        ),
    ),
)
CHUNK_EXTENSIONS = weighted(
    (4, st.just(b"")),
    (1, st.sampled_from([b";a=b", b';name="x y"', b";a", b";a=b;c=d"])),
)
ODD_CHUNK_EXTENSIONS = quirky(
    (b";a b", "loose-chunk-extension"),
    (b";\x01", "loose-chunk-extension"),
    (b";", "loose-chunk-extension"),
    (b";=x", "loose-chunk-extension"),
)
TRAILERS = st.sampled_from(
    [
        plain(b"X-T: 1"),
        plain(b"X-User: admin"),
        plain(b"X-Forwarded-For: 6.6.6.6"),
        plain(b"Host: evil.example"),
        plain(b"Location: /evil"),
        (b"Content-Length: 5", frozenset(["framing-field-in-trailer"])),
    ]
)


@dataclass(frozen=True)
class Framing:
    unit: Unit  # the framing header lines
    body: bytes  # what follows the head, as sent
    chunked: bool


@st.composite
def chunked_body(draw: st.DrawFn, odd: str = "") -> tuple[bytes, frozenset[str]]:
    chunks = draw(st.lists(st.binary(min_size=1, max_size=16), max_size=3))
    if odd and not chunks:
        chunks = [b"x"]
    style = draw(st.sampled_from([b"%x", b"%X", b"000%x"]))
    quirks: set[str] = set()
    out = b""
    for i, data in enumerate(chunks):
        size = style % len(data)
        ext = draw(CHUNK_EXTENSIONS)
        eol = b"\r\n"
        if i == 0 and odd:  # the odd thing happens in the first chunk
            if odd == "size-space":
                size += b" "
                quirks.add("chunk-size-whitespace")
            elif odd == "extension":
                ext, q = draw(ODD_CHUNK_EXTENSIONS)
                quirks |= q
            elif odd == "hex-prefix":
                size = b"0x" + size
            elif odd == "long-size":
                size = b"1" + b"0" * 16  # 2**64: more than any length can be
            elif odd == "long-data":
                data += b"!"
            elif odd == "lf":
                eol = b"\n"
        out += size + ext + eol + data + eol
    out += b"0" + draw(CHUNK_EXTENSIONS) + b"\r\n"
    for line, q in draw(st.lists(TRAILERS, max_size=2)):
        out += line + b"\r\n"
        quirks |= q | {"trailer-fields"}
    if odd == "trailer-fold":
        out += b"X-T: a\r\n folded\r\n"
        quirks |= {"obs-fold", "trailer-fields"}
    if odd != "no-end":
        out += b"\r\n"
    return out, frozenset(quirks)


@st.composite
def framings(draw: st.DrawFn, odd: bool, response: bool = False) -> Framing:
    kind = draw(st.sampled_from(["length", "chunked", "none"]))
    if kind == "none" and not odd:
        return Framing(Unit(()), b"", False)
    if kind != "chunked":
        body = draw(BODIES)
        n = len(body)
        if not odd:
            value = draw(st.sampled_from([b"%d", b"%d", b"0%d", b" %d "])) % n
            return Framing(Unit((b"Content-Length: " + value,)), body, False)
        length = b"Content-Length: %d" % n
        lines, quirks = draw(
            st.sampled_from(
                [
                    ((length, length), {"repeated-content-length"}),
                    ((b"Content-Length: %d, %d" % (n, n),), {"repeated-content-length"}),
                    ((length, b"Content-Length: %d" % (n + 1)), set()),
                    ((b"Content-Length: +%d" % n,), set()),
                    ((b"Content-Length: -1",), set()),
                    ((b"Content-Length: 0x%x" % n,), set()),
                    ((b"Content-Length:",), set()),
                    ((b"Content-Length: %d" % (n + 3),), set()),  # the body is short
                    ((b"Content-Length: %d" % (n - 1),), set()),  # a byte left over
                    ((b"Content-Length: 99999999999999999999",), {"content-length-overflow"}),
                ]
            )
        )
        return Framing(Unit(lines, frozenset(quirks)), body, False)
    coding = b"Transfer-Encoding: chunked"
    if not odd:
        body, quirks = draw(chunked_body())
        value = draw(st.sampled_from([b"chunked", b"chunked", b"Chunked", b"CHUNKED", b"chunked "]))
        return Framing(Unit((b"Transfer-Encoding: " + value,), quirks), body, True)
    wheres = [
        "size-space",
        "extension",
        "hex-prefix",
        "long-size",
        "long-data",
        "lf",
        "no-end",
        "trailer-fold",
        "with-length",
        "twice",
        "listed",
        "gzip",
    ]
    # A response whose codings do not end in chunked is delimited by the close (RFC
    # 9112 6.3), which h11 does not implement; a request's is refused by both.
    where = draw(st.sampled_from(wheres if response else [*wheres, "identity"]))
    body, quirks = draw(chunked_body(where))
    lines = {
        "with-length": (coding, b"Content-Length: %d" % len(body)),
        "twice": (coding, coding),
        "listed": (b"Transfer-Encoding: chunked, chunked",),
        "gzip": (b"Transfer-Encoding: gzip, chunked",),
        "identity": (b"Transfer-Encoding: identity",),
    }.get(where, (coding,))
    if where == "with-length":
        quirks |= {"content-length-with-transfer-encoding"}
    return Framing(Unit(lines, quirks), body, True)


@dataclass(frozen=True)
class Req:
    """One generated request: its bytes (with SEQ in its tag) and its quirks."""

    data: bytes
    quirks: frozenset[str]
    method: bytes
    version: bytes
    head_end: int  # where its head ends in `data`
    odd: str | None  # the site where it is odd


@st.composite
def requests(draw: st.DrawFn, index: int) -> Req:
    odd = draw(weighted((3, st.none()), (1, st.sampled_from(SITES))))
    method, quirks = draw(ODD_METHODS if odd == "method" else METHODS)
    route = draw(st.sampled_from([b"/k/", b"/p/"]))
    target, q = draw(targets(route, odd == "target"))
    version, qv = draw(ODD_VERSIONS if odd == "version" else VERSIONS)
    quirks |= q | qv
    gaps = (b" ", b" ")
    if odd == "gaps":
        gaps = draw(st.sampled_from([(b"  ", b" "), (b" ", b"  "), (b"\t", b" "), (b" ", b"\t")]))
        if b"  " in gaps:
            quirks |= {"request-line-spaces"}
    framing = draw(framings(odd == "framing"))
    units = [draw(ODD_HOSTS if odd == "host" else HOSTS), framing.unit]
    units += draw(st.lists(header_units(), max_size=3))
    if odd == "header":
        units.append(draw(odd_header_units()))
    units = draw(st.permutations(units))
    for unit in units:
        quirks |= unit.quirks
    if framing.chunked and version == b"HTTP/1.0":
        quirks |= {"transfer-encoding-in-http10"}
    lines = [
        method + gaps[0] + target + gaps[1] + version,
        b"Idempotency-Key: o" + SEQ + b"r%d" % index,
        *(line for unit in units for line in unit.lines),
        b"",
    ]
    ends = [b"\r\n"] * len(lines)
    if odd == "line-ends":
        if draw(st.booleans()):
            ends = [b"\n"] * len(lines)
        else:
            ends[draw(st.integers(0, len(lines) - 1))] = b"\n"
        quirks |= {"bare-lf"}
    head = b"".join(line + end for line, end in zip(lines, ends, strict=True))
    return Req(head + framing.body, frozenset(quirks), method, version, len(head), odd)


GARBAGE = st.sampled_from(
    [
        b"\r\n",
        b"x",
        b"\x00\x01\x02",
        b"0\r\n\r\n",
        b"GET /p/ HTTP/1.1\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
        b"\r\n\r\n",
    ]
)


@dataclass(frozen=True)
class Stream:
    requests: tuple[Req, ...]
    tail: bytes  # stray bytes after the last request
    split: int | None  # sent in two writes, split here

    @property
    def data(self) -> bytes:
        return b"".join(r.data for r in self.requests) + self.tail


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    first = draw(requests(0))
    reqs = [first]
    tail = b""
    # h11 implements no HTTP/1.0 keep-alive (RFC 9112 9.3 allows it): nothing is
    # pipelined after an HTTP/1.0 request but bytes that are no request.
    after = draw(
        weighted((6, st.just("nothing")), (2, st.just("request")), (1, st.just("garbage")))
    )
    if after == "request" and first.version == b"HTTP/1.1":
        reqs.append(draw(requests(1)))
    elif after != "nothing":
        tail = draw(GARBAGE)
    size = sum(len(r.data) for r in reqs) + len(tail)
    split = draw(
        weighted(
            (3, st.none()),
            (1, st.just(first.head_end)),
            (1, st.just(len(first.data))),
            (2, st.integers(1, max(1, size - 1))),
        )
    )
    if split is not None and not 0 < split < size:
        split = None
    return Stream(tuple(reqs), tail, split)


# --- the listener's side of an example -------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    @property
    def tag(self) -> str | None:
        tags = [v for n, v in self.headers if n == b"x-oracle-tag"]
        return tags[0].decode("latin-1") if tags else None


class Answers:
    """The gateway's answers on one connection, read by h11 as a client that sent the
    requests in order (HEAD ones as HEAD: their answers have no body)."""

    def __init__(self, methods: list[bytes]) -> None:
        self.conn = h11.Connection(h11.CLIENT)
        self.methods = methods
        self.got: list[Answer] = []
        self.broken = ""  # what h11 found wrong with the gateway's answers
        self.ended = False  # the gateway said it closes, or did
        self._response: h11.Response | None = None
        self._body = bytearray()
        self._ask()

    def settled(self, count: int) -> bool:
        """`count` answers are in, or no more can come."""
        return len(self.got) >= count or bool(self.broken) or self.ended

    def after_head(self) -> bool:
        """The last answer was to a HEAD request (bytes after it are its body)."""
        i = len(self.got) - 1
        return 0 <= i < len(self.methods) and self.methods[i] == b"HEAD"

    def _ask(self) -> None:
        i = len(self.got)
        head = i < len(self.methods) and self.methods[i] == b"HEAD"
        self.conn.send(
            h11.Request(method=b"HEAD" if head else b"GET", target=b"/", headers=[(b"host", b"x")])
        )
        self.conn.send(h11.EndOfMessage())

    def feed(self, data: bytes) -> None:
        if self.broken or self.ended:
            if data:
                self.broken = self.broken or f"bytes after the last answer: {data[:80]!r}"
            return
        if not data and self._response is None and self.conn.their_state is h11.SEND_RESPONSE:
            self.ended = True  # closed with no answer begun: a close, not a broken answer
            return
        self.conn.receive_data(data)
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                self.broken = f"{exc}"
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.ConnectionClosed):
                self.ended = True
                return
            if isinstance(event, h11.Response):
                self._response, self._body = event, bytearray()
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert self._response is not None
                self.got.append(
                    Answer(
                        self._response.status_code, tuple(self._response.headers), bytes(self._body)
                    )
                )
                self._response = None
                if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                    self.conn.start_next_cycle()
                    self._ask()
                else:
                    self.ended = True
                    pending, _ = self.conn.trailing_data
                    if pending:
                        self.broken = f"bytes after an answer that closes: {bytes(pending[:80])!r}"
                    return


def _read(sock: socket.socket, answers: Answers, until: Callable[[], bool], timeout: float) -> bool:
    """Read answers until `until()` or the gateway closes (True) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not until():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            return False
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        answers.feed(data)
        if not data:
            return True
    return False


class Disagreement(AssertionError):
    """The gateway and h11 read an input differently. One subclass per kind, so
    hypothesis shrinks and reports each kind on its own."""

    kinds: dict[str, type[Disagreement]] = {}  # noqa: RUF012

    @classmethod
    def of(cls, kind: str) -> type[Disagreement]:
        if kind not in cls.kinds:
            cls.kinds[kind] = type(f"Disagreement[{kind}]", (cls,), {})
        return cls.kinds[kind]


#: ORACLE_SHRINK=1: stop at the first disagreement and shrink it (see the docstring).
SHRINK = os.environ.get("ORACLE_SHRINK") == "1"


@dataclass
class Tally:
    """What the oracle tried, for the ledger."""

    tried: int = 0
    refused_by_h11: int = 0
    split: int = 0
    disagreements: Counter[str] = field(default_factory=Counter)
    shortest: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # kind -> input, text
    excused: Counter[str] = field(default_factory=Counter)  # refusals a named quirk excused
    outcomes: Counter[str] = field(default_factory=Counter)

    def note(self, found: list[tuple[str, str]], data: bytes, how: str = "") -> None:
        """Count each disagreement; keep the shortest input for each kind and way the
        input was built (`how`), so a survey shows every cause of a kind."""
        for kind in {k for k, _ in found}:
            self.disagreements[kind] += 1
        for kind, text in found:
            key = f"{kind} [{how}]"
            if key not in self.shortest or len(data) < len(self.shortest[key][0]):
                self.shortest[key] = (data, text)

    def survey(self, per_kind: int = 3) -> str:
        """Each kind with its count and, for up to `per_kind` ways of building an input,
        the shortest input that showed it."""
        lines = []
        for kind, count in sorted(self.disagreements.items()):
            lines.append(f"{kind}: {count} input(s)")
            seen = sorted(
                (len(data), key, data, text)
                for key, (data, text) in self.shortest.items()
                if key.rpartition(" [")[0] == kind
            )
            for _, key, data, text in seen[:per_kind]:
                how = key.rpartition(" [")[2].rstrip("]")
                lines.append(f"  [{how}] {text[:300]}\n    input: {data[:600]!r}")
        return "\n".join(lines)

    def detail(self) -> str:
        return (
            f"disagreements: {sum(self.disagreements.values())} {dict(self.disagreements)}; "
            f"h11 refused {self.refused_by_h11} of {self.tried}; split writes {self.split}; "
            f"stricter than h11, by name: {dict(sorted(self.excused.items()))}; "
            f"outcomes: {dict(sorted(self.outcomes.items()))}"
        )


def origin_form(target: bytes) -> bytes:
    """What a proxy forwards for an absolute-form target (RFC 9112 3.2.2)."""
    if target.startswith((b"http://", b"https://")):
        rest = target.split(b"//", 1)[1]
        slash = rest.find(b"/")
        query = rest.find(b"?")
        if slash < 0 or 0 <= query < slash:
            return b"/" + (rest[query:] if query >= 0 else b"")
        return rest[slash:]
    return target


def remove_dot_segments(target: bytes) -> bytes:
    """RFC 3986 5.2.4 on the path, the query kept."""
    path, sep, query = target.partition(b"?")
    out: list[bytes] = []
    segments = path.split(b"/")
    for i, segment in enumerate(segments[1:], 1):
        last = i == len(segments) - 1
        if segment == b"..":
            if len(out) > 0:
                out.pop()
            if last:
                out.append(b"")
        elif segment == b".":
            if last:
                out.append(b"")
        else:
            out.append(segment)
    return b"/" + b"/".join(out) + sep + query


def expected_headers(message: Message) -> list[tuple[bytes, bytes]]:
    drop = DROPPED | connection_named(message.headers) | {b"idempotency-key"}
    return [(n, v) for n, v in message.headers if n not in drop]


def received_headers(arrival: Message) -> list[tuple[bytes, bytes]]:
    return [(n, v) for n, v in arrival.headers if n not in ADDED]


def compare(sent: Message, arrival: Message, quirks: frozenset[str]) -> list[tuple[str, str]]:
    """How what reached the upstream differs from what h11 read the caller sending."""
    found: list[tuple[str, str]] = []
    if arrival.method != sent.method:
        found.append(("forwarded-method", f"{sent.method!r} arrived as {arrival.method!r}"))
    target = origin_form(sent.target)
    # Dot-segments are removed (RFC 3986 5.2.4) on every route, also those the
    # strategies did not put there on purpose ("." and ".." are path pieces). An empty
    # query is forwarded as none: ASGI's query_string is b"" for both, and the gateway
    # documents it (docs/concepts.md, "What the upstream sees").
    allowed = {t.removesuffix(b"?") for t in (target, remove_dot_segments(target))}
    allowed |= {target, remove_dot_segments(target)}
    if arrival.target not in allowed:
        kind = "forwarded-target"
        bare = target.partition(b"#")[0]
        if b"#" in target and arrival.target in (bare, bare.removesuffix(b"?")):
            kind += " (fragment dropped)"
        elif arrival.target + b"?" == target:
            kind += " (empty query dropped)"
        found.append((kind, f"{sent.target!r} arrived as {arrival.target!r}"))
    if arrival.body != sent.body:
        found.append(("forwarded-body", f"{sent.body!r} arrived as {arrival.body!r}"))
    want, got = expected_headers(sent), received_headers(arrival)
    if want != got:
        extra = {n for n, _ in got} - {n for n, _ in want}
        trailers = {n for n, _ in sent.trailers}
        if extra & trailers:
            kind = "trailer-became-a-header"
        elif b"expect" in extra:
            kind = "expect-forwarded"
        elif extra & connection_named(sent.headers):
            kind = "connection-named-forwarded"
        elif extra & DROPPED:
            kind = "hop-by-hop-forwarded"
        else:
            kind = "forwarded-headers"
        found.append((kind, f"expected {want!r}, the upstream got {got!r}"))
    hosts = sent.values(b"host")
    forwarded_host = arrival.values(b"x-forwarded-host")
    if forwarded_host and (len(forwarded_host) > 1 or [forwarded_host[0]] != hosts):
        found.append(("x-forwarded-host", f"Host {hosts!r}, X-Forwarded-Host {forwarded_host!r}"))
    return found


#: What llhttp's pause at an Upgrade request does (the body and what follows unread).
UPGRADE_KINDS = (
    "forwarded-body",
    "refused-what-h11-accepts",
    "forwarded-but-unanswered",
    "forwarded-what-h11-refuses (incomplete)",
)


class ListenerOracle:
    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.seq = itertools.count(1)
        self.tally = Tally()
        self.must_not_arrive: dict[str, bytes] = {}  # tag -> the input, for late arrivals

    def run(self, stream: Stream) -> list[tuple[str, str]]:
        number = f"{next(self.seq):06d}"
        data = stream.data.replace(SEQ, number.encode())
        prefix = f"o{number}r"
        reading = read_stream(stream, number.encode())
        self.tally.tried += 1
        self.tally.refused_by_h11 += reading.end != "clean"
        self.tally.split += stream.split is not None
        # Each answer is read with the method of the request in its place on the wire:
        # h11's reading where it has one (a generated request may have become another's
        # body), else the generated request's.
        methods = [r.method for r in stream.requests]
        for i, parsed in enumerate(reading.slots):
            if parsed is None:
                continue
            if i < len(methods):
                methods[i] = parsed.method
            else:
                methods.append(parsed.method)
        answers = Answers(methods)
        with socket.create_connection(("127.0.0.1", self.listener.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                if stream.split is None:
                    sock.sendall(data)
                else:
                    sock.sendall(data[: stream.split])
                    time.sleep(0.02)  # the gateway reads the first part on its own
                    sock.sendall(data[stream.split :])
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before it was all sent: the answer is still there
            want = len(reading.slots)
            closed = _read(sock, answers, lambda: answers.settled(want), 10)
            if not closed and reading.end != "clean":
                # h11 refused what follows: the gateway's answer to it (a refusal, or an
                # answer from the upstream it should not have) comes now, or a close.
                closed = _read(sock, answers, lambda: answers.settled(want + 1), 0.5)
            by_gateway = closed or answers.ended
            if not closed:
                # Nothing more is coming from us: a gateway still waiting sees the end.
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                closed = _read(sock, answers, lambda: False, 10)
        arrived, untagged, broken = self.listener.echo.take(prefix)
        found = self.judge(stream, reading, answers, arrived, untagged, broken, prefix)
        self.tally.outcomes[
            f"h11 {reading.end}, {len(arrived)} forwarded, "
            f"{'closed' if by_gateway else 'closed at our EOF' if closed else 'left open'}"
        ] += 1
        for tag in (f"{prefix}{i}" for i in range(len(stream.requests))):
            if tag not in arrived and not any(m.tag == tag for m in reading.messages):
                if not lenient_stream(stream):
                    self.must_not_arrive[tag] = data
        return found

    def judge(
        self,
        stream: Stream,
        reading: Reading,
        answers: Answers,
        arrived: dict[str, list[Message]],
        untagged: list[Message],
        broken: list[str],
        prefix: str,
    ) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        quirks = {f"{prefix}{i}": r.quirks for i, r in enumerate(stream.requests)}
        for text in broken:
            found.append(("upstream-got-malformed-request", text))
        for message in untagged:
            found.append(("forwarded-untagged", f"{message}"))
        parsed = {m.tag for m in reading.messages}
        for tag, messages in arrived.items():
            if len(messages) > 1:
                found.append(("forwarded-twice", f"{tag} arrived {len(messages)} times"))
            if tag not in parsed:
                if lenient_stream(stream):
                    # h11 stopped at a request the gateway reads leniently: what follows
                    # it is the gateway's to read too.
                    self.tally.excused["after-a-lenient-request"] += 1
                    continue
                why = reading.why(int(tag.rsplit("r", 1)[1]))
                found.append(
                    (
                        f"forwarded-what-h11-refuses ({why})",
                        f"h11 refused it ({why}); the upstream got {messages[0]}",
                    )
                )
        excuses = [
            sorted(quirks.get(m.tag or "", NONE) & LISTENER_STRICTER.keys()) if m else []
            for m in reading.slots
        ]
        stopped = False  # an earlier request was not forwarded: the connection may end there
        for i, message in enumerate(reading.slots):
            if message is None:  # refused by h11, framing sound: checked with the answers
                stopped = True
                continue
            tag = message.tag
            if tag in arrived:
                found += compare(message, arrived[tag][0], quirks.get(tag or "", NONE))
                continue
            if stopped:
                continue
            stopped = True
            if excuses[i]:
                self.tally.excused[excuses[i][0]] += 1
                continue
            answer = answers.got[i] if i < len(answers.got) else None
            # Before a request it refuses, the gateway may close the
            # connection without forwarding or answering the requests it holds; what it
            # must not do is answer one of those with the refusal.
            later_refused = (
                reading.end != "clean" or any(excuses[i + 1 :]) or None in reading.slots[i + 1 :]
            )
            if later_refused and answer is None:
                self.tally.excused["closed-before-a-later-refusal"] += 1
                continue
            found.append(
                (
                    "refusal-answers-an-earlier-request"
                    if later_refused
                    else "refused-what-h11-accepts",
                    f"request {i} ({message.method!r} {message.target!r}) was not forwarded; "
                    f"the gateway answered {answer.status if answer else 'nothing'}"
                    f"{' ' + repr(answer.body[:200]) if answer else ''}",
                )
            )
        for i, answer in enumerate(answers.got):
            message = reading.slots[i] if i < len(reading.slots) else None
            forwarded = message is not None and message.tag in arrived
            if answer.tag is not None:
                if message is None and answer.tag not in parsed:
                    continue  # forwarded what h11 refuses: reported above
                if message is None or answer.tag != message.tag or not forwarded:
                    found.append(
                        (
                            "answer-out-of-order",
                            f"answer {i} is the upstream's answer to {answer.tag}, "
                            f"request {i} is {message.tag if message else 'not a request to h11'}",
                        )
                    )
            elif forwarded:
                found.append(
                    (
                        "answer-out-of-order",
                        f"request {i} ({message.tag if message else ''}) was forwarded, its "
                        f"answer is the gateway's {answer.status} {answer.body[:200]!r}",
                    )
                )
            elif not 400 <= answer.status < 500:
                found.append(
                    ("refusal-not-4xx", f"answer {i}: {answer.status} {answer.body[:200]!r}")
                )
        # Answers are read with the method of the request in their place as generated;
        # once h11 refuses the stream, which bytes the gateway refused (a HEAD, or
        # garbage after a HEAD's body) is not known, so neither is whether its refusal
        # has a body: the gateway's choice is not judged there.
        first_unparsed = next(
            (i for i, m in enumerate(reading.slots) if m is None), len(reading.slots)
        )
        unsure = reading.end != "clean" and b"HEAD" in answers.methods[first_unparsed:]
        if (
            answers.broken
            and unsure
            and ("bytes after" in answers.broken or "complete message body" in answers.broken)
        ):
            self.tally.excused["method-of-a-refused-request"] += 1
        elif answers.broken:
            if not answers.after_head():
                found.append(("gateway-answer-malformed", answers.broken))
            elif not any(
                k.startswith(("refusal-answers", "answer-out-of-order")) for k, _ in found
            ):
                found.append(("head-refusal-with-a-body", answers.broken))
        if reading.end == "clean" and not any(excuses) and None not in reading.slots:
            if not found and len(answers.got) < len(reading.slots):
                found.append(
                    (
                        "forwarded-but-unanswered",
                        f"{len(reading.messages)} requests forwarded, {len(answers.got)} answered",
                    )
                )
        if b"\nUpgrade: h2c" in stream.data:
            found = [
                (
                    f"after an Upgrade request: {kind}" if kind.startswith(UPGRADE_KINDS) else kind,
                    text,
                )
                for kind, text in found
            ]
        return found


@pytest.fixture(scope="module")
def listener_oracle(listener: Listener) -> ListenerOracle:
    return ListenerOracle(listener)


def _raise_first(found: list[tuple[str, str]], data: bytes, how: str) -> None:
    if found:
        kind, text = found[0]
        others = "; ".join(sorted({k for k, _ in found[1:]} - {kind}))
        raise Disagreement.of(kind)(
            f"{kind}: {text}\ninput ({how}): {data!r}" + (f"\nalso: {others}" if others else "")
        )


@pytest.mark.process
@pytest.mark.timeout(600)
def test_listener_agrees_with_h11(listener_oracle: ListenerOracle, ledger: Ledger) -> None:
    oracle = listener_oracle
    tally = oracle.tally

    @oracle_settings(LISTENER_EXAMPLES, 0)
    @given(stream=streams())
    def run(stream: Stream) -> None:
        found = oracle.run(stream)
        odd = {r.odd for r in stream.requests if r.odd} | {
            q for r in stream.requests for q in r.quirks
        }
        tally.note(found, stream.data, ",".join(sorted(odd)) + (" +tail" if stream.tail else ""))
        if SHRINK:
            _raise_first(found, stream.data, f"split at {stream.split}")

    try:
        run()
    finally:
        time.sleep(0.5)  # a forward still under way for a request that was refused
        late, untagged, broken = oracle.listener.echo.take("o")
        for tag in late:
            if tag in oracle.must_not_arrive:
                tally.note([("forwarded-late", tag)], oracle.must_not_arrive[tag])
        for message in untagged:
            tally.note([("forwarded-untagged", f"{message}")], b"")
        for text in broken:
            tally.note([("upstream-got-malformed-request", text)], b"")
        ledger.record(
            "oracle",
            "listener vs h11: raw request streams through a real gateway",
            requests=tally.tried,
            bad_inputs=tally.refused_by_h11,
            upstream_duplicates=tally.disagreements["forwarded-twice"],
            detail=tally.detail(),
        )
    assert not tally.disagreements, tally.survey() + "\n" + tally.detail()
    assert oracle.listener.process.proc is not None
    assert oracle.listener.process.proc.poll() is None


# --- response strategies ---------------------------------------------------------------

REPLY_SITES = ("status-line", "header", "framing", "line-ends", "interim", "tail")
STATUSES = st.sampled_from(
    [200, 200, 201, 202, 203, 206, 299, 301, 302, 400, 404, 409, 500, 503, 599, 204, 304]
)
REASONS = st.sampled_from([b"OK", b"Fine", b"", b"Some Reason", b"\xe9t\xe9", b"a\tb"])
RESPONSE_NAMES = st.sampled_from(
    [
        b"Content-Type",
        b"Location",
        b"Set-Cookie",
        b"Cache-Control",
        b"ETag",
        b"X-A",
        b"Vary",
        b"Server",
        b"Content-Encoding",
        b"Link",
        b"x_under",
        b"X-Internal-Token",
    ]
)
RESPONSE_HOP_FIELDS = st.sampled_from(
    [
        (b"Connection: close",),
        (b"Connection: keep-alive",),
        (b"Connection: X-Internal-Token", b"X-Internal-Token: secret"),
        (b"Connection: x-a, keep-alive", b"X-A: internal"),
        (b"Keep-Alive: timeout=5, max=100",),
        (b"Trailer: X-T",),
        (b"Proxy-Authenticate: Basic",),
        (b"Upgrade: h2c",),
    ]
)
RESPONSE_TRAILERS = st.sampled_from(
    [
        plain(b"X-T: 1"),
        plain(b"Location: /evil"),
        plain(b"Set-Cookie: evil=1"),
        plain(b"X-Internal-Token: secret"),
        (b"Content-Length: 5", frozenset(["framing-field-in-trailer"])),
    ]
)
INTERIM = st.sampled_from(
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 102 Processing\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
    ]
)
STRAY = st.sampled_from(
    [
        b"hello",
        b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged",
        b"\r\n",
        b"\x00",
    ]
)


@st.composite
def response_header_units(draw: st.DrawFn) -> Unit:
    if draw(weighted((3, st.just(False)), (1, st.just(True)))):
        return Unit(draw(RESPONSE_HOP_FIELDS))
    return Unit((draw(RESPONSE_NAMES) + draw(SEPARATORS) + draw(VALUES),))


@dataclass(frozen=True)
class Reply:
    """A generated upstream response to one request."""

    data: bytes
    quirks: frozenset[str]
    method: str  # the request forward() sends
    close: bool  # the upstream closes the connection after it
    split: int | None  # written in two parts, split here
    odd: str | None


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    odd = draw(weighted((3, st.none()), (1, st.sampled_from(REPLY_SITES))))
    method = draw(st.sampled_from(["GET", "GET", "POST", "HEAD"]))
    status = draw(STATUSES)
    quirks: set[str] = set()
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]))
    line = b"%s %d %s" % (version, status, draw(REASONS))
    if odd == "status-line":
        line, q = draw(
            quirky(
                (b"HTTP/1.1 %d" % status, "status-without-reason-space"),
                (b"HTTP/1.2 %d OK" % status, "other-http-version"),
                (b"HTTP/2 200 OK", None),
                (b"http/1.1 200 OK", None),
                (b"HTTP/1.1 2000 OK", None),
                (b"HTTP/1.1 20 OK", None),
                (b"HTTP/1.1  200 OK", None),
                (b"HTTP/1.1 abc OK", None),
                (b"HTTP/1.1 099 OK", None),
                (b"HTTP/1.1 200 O\rK", None),
            )
        )
        quirks |= q
        version = line.split(b" ")[0]
    units = draw(st.lists(response_header_units(), max_size=3))
    if odd == "header":
        kind = draw(st.sampled_from(["odd", "odd", "odd", "many-lines", "long-line"]))
        if kind == "odd":
            units.append(draw(odd_header_units()))
        elif kind == "many-lines":  # far over any sensible head cap
            units.append(Unit(tuple(b"X-N%d: v" % i for i in range(20_000))))
        else:
            units.append(Unit((b"X-Long: " + b"v" * 300_000,)))
    framing_kind = draw(st.sampled_from(["length", "chunked", "close", "none"]))
    close = False
    if odd == "framing":
        framing = draw(framings(True, response=True))
    elif framing_kind == "length":
        framing = draw(framings(False).filter(lambda f: not f.chunked))
    elif framing_kind == "chunked":
        chunked, q = draw(chunked_body())
        if draw(st.booleans()):  # trailers the response announces or not
            for line_, qt in draw(st.lists(RESPONSE_TRAILERS, min_size=1, max_size=2)):
                chunked = chunked[:-2] + line_ + b"\r\n\r\n"
                q |= qt
        value = draw(st.sampled_from([b"chunked", b"Chunked", b"chunked "]))
        framing = Framing(Unit((b"Transfer-Encoding: " + value,), q), chunked, True)
    elif framing_kind == "close":  # no Content-Length, not chunked: the body ends at EOF
        framing = Framing(Unit(()), draw(BODIES), False)
        close = True
    else:
        framing = Framing(Unit(()), b"", False)
    if framing.chunked and version == b"HTTP/1.0":
        quirks.add("transfer-encoding-in-http10")
    units.append(framing.unit)
    units = draw(st.permutations(units)) if len(units) < 10 else units
    for unit in units:
        quirks |= unit.quirks
    lines = [line, *(header for unit in units for header in unit.lines), b""]
    ends = [b"\r\n"] * len(lines)
    if odd == "line-ends":
        if draw(st.booleans()):
            ends = [b"\n"] * len(lines)
        else:
            ends[draw(st.integers(0, len(lines) - 1))] = b"\n"
        quirks.add("bare-lf")
    head = b"".join(text + end for text, end in zip(lines, ends, strict=True))
    interim = b""
    if odd == "interim":
        interim = b"".join(draw(st.lists(INTERIM, min_size=1, max_size=2)))
    data = interim + head + framing.body
    # Where the response ends: a HEAD's answer, a 204 and a 304 end with the head. (A
    # 204 that announces a body counts it in: a client must not reuse the connection
    # after it, so the body may come late.)
    announced = status == 204 and any(
        line.lower().startswith((b"content-length", b"transfer-encoding"))
        for line in framing.unit.lines
    )
    end = len(data)
    if method == "HEAD" or (status in (204, 304) and not announced):
        end = len(interim + head)
    if odd == "tail":
        data += draw(STRAY)
    close = close or draw(st.booleans())
    # Split inside the response, never right at its end: bytes that come after an
    # answer, in a write of their own, can look like the next request's answer to any
    # client (no fix could tell); stray bytes in the answer's own write must not.
    split = draw(
        weighted(
            (3, st.none()),
            (1, st.just(len(interim) + len(head))),
            (1, st.integers(1, max(1, end - 1))),
        )
    )
    if split is not None and not 0 < split < end:
        split = None
    return Reply(data, frozenset(quirks), method, close, split, odd)


# --- the client's side of an example ---------------------------------------------------


@dataclass
class Expected:
    """h11's reading of a response: complete (with what is left over after it),
    refused, or still incomplete."""

    end: str
    status: int = 0
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    trailers: tuple[tuple[bytes, bytes], ...] = ()
    reason: str = ""
    leftover: bytes = b""  # what follows the end of the response

    @property
    def announces_a_body(self) -> bool:
        """A 1xx or 204 whose head frames a body it cannot have. (A 304 may carry the
        Content-Length or Transfer-Encoding a 200 would have had, RFC 9110 8.6 and RFC
        9112 6.1: that is no body, though the gateway may close after it all the same.)"""
        if self.status >= 200 and self.status != 204:
            return False
        lengths = [v for n, v in self.headers if n == b"content-length"]
        codings = [v for n, v in self.headers if n == b"transfer-encoding"]
        return bool(codings) or any(v.strip() not in (b"0", b"") for v in lengths)


def h11_response(method: str, data: bytes, eof: bool) -> Expected:
    conn = h11.Connection(h11.CLIENT)
    headers = [(b"host", b"upstream.test")]
    if method == "POST":
        headers.append((b"content-length", b"0"))
    conn.send(h11.Request(method=method.encode(), target=b"/first", headers=headers))
    conn.send(h11.EndOfMessage())
    # In pieces, as a network delivers it: h11 bounds what it buffers for an event it
    # cannot finish (16 KiB), and that bound only bites on a head still incomplete.
    pieces = [data[i : i + 8192] for i in range(0, len(data), 8192)]
    if eof:
        pieces.append(b"")
    start: h11.Response | None = None
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
            if event is h11.NEED_DATA and pieces:
                conn.receive_data(pieces.pop(0))
                continue
        except h11.RemoteProtocolError as exc:
            return Expected("refused", reason=str(exc))
        if isinstance(event, h11.Response):
            start = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert start is not None
            left = bytes(conn.trailing_data[0]) + b"".join(pieces)
            return Expected(
                "complete",
                start.status_code,
                tuple(start.headers),
                bytes(body),
                tuple(event.headers),
                leftover=left,
            )
        elif event is h11.NEED_DATA:
            return Expected("incomplete")
        elif isinstance(event, h11.ConnectionClosed):
            return Expected("refused", reason="closed before the response")
        # InformationalResponse: interim, the answer follows


SECOND = b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\nx-answer: second\r\n\r\nsecond answer"


class ScriptedUpstream:
    """A raw asyncio server: the reply under test to /first, SECOND to /second, on any
    connection and as often as asked."""

    def __init__(self) -> None:
        self.reply: Reply | None = None
        self.port = 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.reused = False  # /second came on a connection that served /first

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for writer in list(self.writers):
            writer.close()
        while self.writers:
            await asyncio.sleep(0.01)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        served_first = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                if head.split(b" ", 2)[1] == b"/second":
                    self.reused = self.reused or served_first
                    writer.write(SECOND)
                    await writer.drain()
                    continue
                reply = self.reply
                assert reply is not None
                served_first = True
                if reply.split is None:
                    writer.write(reply.data)
                else:
                    writer.write(reply.data[: reply.split])
                    await writer.drain()
                    await asyncio.sleep(0.01)
                    writer.write(reply.data[reply.split :])
                await writer.drain()
                if reply.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self.writers.discard(writer)


def lenient_stream(stream: Stream) -> bool:
    """Whether a request of the stream has a quirk the gateway reads and h11 refuses
    (LISTENER_LENIENT): h11's reading stops there, the gateway's goes on."""
    return any(r.quirks & LISTENER_LENIENT.keys() for r in stream.requests)


def late_leftover(reply: Reply, expected: Expected) -> bool:
    """Whether bytes after the first answer came in a later write than its end: the
    client may have written the next request before they arrived."""
    if reply.split is None or not expected.leftover.strip(b"\r\n"):
        return False
    return reply.split >= len(reply.data) - len(expected.leftover)


def _head_fields(data: bytes) -> list[tuple[bytes, bytes]]:
    """The header fields of the final response's head (for naming a disagreement)."""
    while data.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in data:
        data = data.split(b"\r\n\r\n", 1)[1]
    lines = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
    return [(n.strip().lower(), v.strip()) for n, _, v in (line.partition(b":") for line in lines)]


def response_expected_headers(expected: Expected) -> list[tuple[str, str]]:
    drop = RESPONSE_DROPPED | connection_named(expected.headers)
    return [
        (n.decode("latin-1"), v.decode("latin-1")) for n, v in expected.headers if n not in drop
    ]


class ClientOracle:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.server = ScriptedUpstream()
        self.tally = Tally()
        loop.run_until_complete(self.server.start())

    def close(self) -> None:
        self.loop.run_until_complete(self.server.stop())
        self.loop.close()

    def run(self, reply: Reply) -> list[tuple[str, str]]:
        expected = h11_response(reply.method, reply.data, eof=reply.close)
        if expected.end != "complete" and not reply.close:
            # What h11 cannot finish without the end of the connection gets it, so
            # neither side waits for a deadline.
            reply = Reply(reply.data, reply.quirks, reply.method, True, reply.split, reply.odd)
            expected = h11_response(reply.method, reply.data, eof=True)
        self.tally.tried += 1
        self.tally.refused_by_h11 += expected.end != "complete"
        self.tally.split += reply.split is not None
        self.server.reply = reply
        self.server.reused = False
        return self.loop.run_until_complete(self._exchange(reply, expected))

    async def _exchange(self, reply: Reply, expected: Expected) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        url = f"http://127.0.0.1:{self.server.port}"
        upstream = Upstream(connections=1, keepalive=30)
        await upstream.start()
        try:
            try:
                got = await upstream.forward(reply.method, url + "/first", [], b"", 3.0, 1 << 20)
            except OutcomeLost as exc:
                outcome: Any = exc
            except NotSent as exc:
                outcome = exc
            else:
                outcome = got
            found += self.judge(reply, expected, outcome)
            try:
                second = await upstream.forward("GET", url + "/second", [], b"", 3.0, 1 << 20)
            except NotSent:
                self.tally.outcomes["second request: NotSent"] += 1
            except OutcomeLost as exc:
                if late_leftover(reply, expected):
                    # Bytes that arrive after the first answer was whole and after the
                    # second request was written cannot be told from its answer (HTTP/1.1
                    # has no request ids); the safe reading is "unknown", never a
                    # response made of them, which the branch below would catch.
                    self.tally.outcomes["second request: OutcomeLost (late stray bytes)"] += 1
                    return found
                # Bytes left after the first answer read as the second's, or the
                # second written to a connection the upstream had closed.
                kind = "second-request-read-leftover-bytes"
                if "closed the connection" in exc.reason or "broke" in exc.reason:
                    kind = "second-request-on-a-closed-connection"
                found.append((kind, f"{exc.reason}"))
            else:
                if (second.status, second.body) != (200, b"second answer") or (
                    "x-answer",
                    "second",
                ) not in second.headers:
                    found.append(
                        (
                            "second-request-read-leftover-bytes",
                            f"{second.status} {second.headers} {second.body[:200]!r}",
                        )
                    )
        finally:
            await upstream.close()
        if self.server.reused and expected.end == "complete":
            # Never reuse a connection with bytes left after the
            # answer, or one whose 1xx/204 announced a body. (Line ends alone are
            # let through: llhttp skips them before a status line, so they cannot
            # become an answer, and a client cannot see them without counting bytes.)
            if expected.leftover.strip(b"\r\n"):
                found.append(("reused-a-connection-with-bytes-left", f"{expected.leftover[:80]!r}"))
            elif expected.announces_a_body:
                found.append(("reused-after-a-1xx-or-204-announced-a-body", f"{expected.status}"))
        return found

    def judge(self, reply: Reply, expected: Expected, outcome: Any) -> list[tuple[str, str]]:
        self.tally.outcomes[f"h11 {expected.end}, forward: {type(outcome).__name__}"] += 1
        if isinstance(outcome, NotSent):
            return [("not-sent-after-the-request-went-out", outcome.reason)]
        if expected.end != "complete":
            if isinstance(outcome, OutcomeLost):
                return []
            why = expected.reason.split(":")[0] or expected.end
            if "Transfer-Encoding" in why:
                codings = [v for n, v in _head_fields(reply.data) if n == b"transfer-encoding"]
                why = f"Transfer-Encoding {b' + '.join(codings).decode('latin-1')}"
            return [
                (
                    f"returned-what-h11-refuses ({why})",
                    f"h11: {expected.reason}; forward() returned {outcome.status} "
                    f"{outcome.headers[:10]} {outcome.body[:200]!r}",
                )
            ]
        if isinstance(outcome, OutcomeLost):
            excuse = sorted(reply.quirks & CLIENT_STRICTER.keys())
            if excuse:
                self.tally.excused[excuse[0]] += 1
                return []
            return [
                ("lost-what-h11-reads", f"h11 read {expected.status}; forward(): {outcome.reason}")
            ]
        found: list[tuple[str, str]] = []
        if outcome.status != expected.status:
            found.append(("returned-status", f"h11 {expected.status}, forward() {outcome.status}"))
        if outcome.body != expected.body:
            found.append(("returned-body", f"h11 {expected.body!r}, forward() {outcome.body!r}"))
        want = response_expected_headers(expected)
        got = list(outcome.headers)
        if got != want:
            extra = {n for n, _ in got} - {n for n, _ in want}
            surplus = set((Counter(got) - Counter(want)).keys())
            trailers = {(n.decode("latin-1"), v.decode("latin-1")) for n, v in expected.trailers}
            named = {n.decode("latin-1") for n in connection_named(expected.headers)}
            if surplus & trailers:
                kind = "trailer-merged-into-headers"
            elif extra & named:
                kind = "connection-named-header-returned"
            elif [(n, v.strip(" \t")) for n, v in got] == want:
                kind = "header-value-whitespace-kept"
            else:
                kind = "returned-headers"
            found.append((kind, f"expected {want[:20]}, forward() returned {got[:20]}"))
        return found


@pytest.fixture(params=["uvloop", "asyncio"])
def client_oracle(request: pytest.FixtureRequest) -> Iterator[ClientOracle]:
    loop = uvloop.new_event_loop() if request.param == "uvloop" else asyncio.new_event_loop()
    oracle = ClientOracle(loop)
    yield oracle
    oracle.close()


@pytest.mark.timeout(600)
def test_client_agrees_with_h11(
    client_oracle: ClientOracle, ledger: Ledger, request: pytest.FixtureRequest
) -> None:
    oracle = client_oracle
    tally = oracle.tally

    @oracle_settings(CLIENT_EXAMPLES, 1 if request.node.callspec.id == "uvloop" else 2)
    @given(reply=replies())
    def run(reply: Reply) -> None:
        found = oracle.run(reply)
        how = ",".join(sorted({reply.odd or "", *reply.quirks} - {""}))
        tally.note(found, reply.data[:2000], how)
        if SHRINK:
            closed = "closed" if reply.close else "kept open"
            _raise_first(
                found, reply.data[:2000], f"{reply.method}, split at {reply.split}, {closed}"
            )

    try:
        run()
    finally:
        ledger.record(
            "oracle",
            f"client vs h11: generated upstream responses ({request.node.callspec.id})",
            requests=tally.tried,
            bad_inputs=tally.refused_by_h11,
            detail=tally.detail(),
        )
    assert not tally.disagreements, tally.survey() + "\n" + tally.detail()
