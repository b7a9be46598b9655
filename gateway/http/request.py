"""What the proxy reads of a caller's request before it is routed: its headers (their
size, control characters, exactly one valid Host), its path (as forwarded and as
matched: dot-segments removed, escapes that must be UTF-8, separators that split
differently from server to server) and its body (one framing, within the route's
limit, never a body cut short).

Each check raises the request's problem (gateway.errors) before anything is claimed or
forwarded: a request refused here has cost no key.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote, unquote_to_bytes

from starlette.types import Message, Receive, Scope

from gateway.digits import whole_number
from gateway.errors import BadHost, HeadersTooLarge, MalformedRequest, PayloadTooLarge
from gateway.headers import valid_host
from gateway.routes import remove_dot_segments

#: C0 controls but HTAB, and DEL: not allowed in a field value (RFC 9110 5.5).
_FORBIDDEN_IN_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def read_headers(scope: Scope, limit: int) -> list[tuple[str, str]]:
    raw: list[tuple[bytes, bytes]] = scope["headers"]
    size = 0
    out: list[tuple[str, str]] = []
    bad = ""
    hosts = 0
    host = ""
    for name, value in raw:
        size += len(name) + len(value)
        header, text = name.decode("latin-1").lower(), value.decode("latin-1")
        # httptools refuses these already; another ASGI server might not, and the
        # upstream client would fail on them after the key was claimed.
        if not bad and _FORBIDDEN_IN_HEADER.search(text):
            bad = header
        if header == "host":
            hosts += 1
            host = text
        out.append((header, text))
    if size > limit:
        raise HeadersTooLarge(f"The request headers are {size} bytes; the limit is {limit}.")
    if bad:
        raise MalformedRequest(f"The {bad} header contains control characters.")
    if hosts != 1 or not valid_host(host):
        check_host(hosts, host, scope.get("http_version", "1.1"))
    return out


def check_host(hosts: int, host: str, version: str) -> None:
    """RFC 9112 3.2: 400 for an HTTP/1.1 request without Host, and for any with more
    than one Host line or an invalid one. Which Host the gateway reports upstream
    (X-Forwarded-Host, Forwarded) must never be a choice between two. An HTTP/1.0
    request may lack it (its clients predate the header): it is forwarded without."""
    if hosts > 1:
        raise BadHost(f"The request has {hosts} Host header lines; HTTP allows exactly one.")
    if hosts == 0:
        if version == "1.0":
            return
        raise BadHost("The request has no Host header; HTTP/1.1 requires one.")
    shown = host if len(host) <= 64 else host[:64] + "..."
    raise BadHost(f"The Host header {shown!r} is not a host name or address with an optional port.")


def request_paths(scope: Scope) -> tuple[str, str]:
    """The request's path twice: as forwarded, and as matched (the same, decoded).

    The forwarded one is the path as the caller sent it, still percent-encoded, with
    its dot-segments removed (routes.remove_dot_segments): what is matched is what
    keys, fingerprints and the upstream see. Decoding it would turn %3F into a query,
    %0D%0A into a line break in the upstream request, and %2F into a path separator.

    A path whose percent-escapes are not UTF-8 is refused: decoded with U+FFFD for
    each bad byte, /jobs/%FF and /jobs/%FE would match as one path and give a
    `{path.<param>}` key the same value."""
    raw_bytes: bytes | None = scope.get("raw_path")
    path: str = scope["path"]
    if raw_bytes is None:
        raw = quote(path, safe="/%:@!$&'()*+,;=~")
    else:
        raw = raw_bytes.decode("latin-1")
    normal = remove_dot_segments(raw)
    if normal is not raw:
        raw, path = normal, unquote(normal)
    if "\ufffd" in path:
        try:
            unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedRequest("The path is not valid UTF-8 once percent-decoded.") from None
    return raw, path


def splits_differently(raw: str) -> bool:
    """%2F and %5C (and a backslash) are one segment to some servers, a separator to
    others (and to their path normalisation); a segment such as `..;x` is a name to
    some and `..` to others (Tomcat and Jetty drop `;params` before they resolve dots),
    and `;x` an empty segment to them.
    Refused on keyed routes."""
    if "\\" in raw:
        return True
    if "%" not in raw and ";" not in raw:
        return False
    lowered = raw.lower()
    if "%2f" in lowered or "%5c" in lowered:
        return True
    if ";" not in lowered and "%3b" not in lowered:
        return False
    for segment in lowered.replace("%3b", ";").split("/"):
        head, semicolon, _ = segment.partition(";")
        if semicolon and unquote(head) in ("", ".", ".."):
            return True
    return False


async def read_body(receive: Receive, headers: list[tuple[str, str]], limit: int) -> bytes:
    codings = [
        token.strip().lower()
        for name, value in headers
        if name == "transfer-encoding"
        for token in value.split(",")
    ]
    if codings and codings != ["chunked"]:
        # The body would reach the upstream still coded, its coding header dropped.
        raise MalformedRequest(
            "The gateway accepts Transfer-Encoding: chunked only, once; "
            f"this request has {', '.join(codings)}."
        )
    declared = [v for n, v in headers if n == "content-length"]
    if declared:
        length = whole_number(declared[0].strip(" \t"))
        if len(set(declared)) > 1 or length is None:
            raise MalformedRequest("The Content-Length header is not a single whole number.")
        if codings:
            raise MalformedRequest(
                "Content-Length and Transfer-Encoding must not be sent together."
            )
        if length > limit:
            raise PayloadTooLarge(f"The body is {length} bytes; this route accepts {limit}.")
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            # A body cut short is not the request the caller meant: never forward it.
            raise MalformedRequest(
                "The client disconnected before the body was complete; nothing was forwarded."
            )
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The body is over {limit} bytes, the limit of this route.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
