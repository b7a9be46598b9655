"""What a key's stored response keeps of the upstream's answer, and what its replays carry.

The engine decides when a response is stored and when one is replayed; these are the
rules for the headers and body that go into the record, and for the headers a replay
takes from it (and adds) whoever wrote it.
"""

from __future__ import annotations

from gateway.config import Route
from gateway.config.http import HOP_BY_HOP
from gateway.records import StoredResponse
from gateway.upstream import UpstreamResponse

#: Headers a stored response never keeps: per-caller state must not be replayed.
NEVER_STORED = frozenset({"set-cookie", "set-cookie2"})

#: Headers the gateway adds to a replay itself.
REPLAY_HEADERS = frozenset(
    {"idempotent-replayed", "idempotent-body-omitted", "idempotent-resolved-by"}
)

#: What a replay never takes from a stored response, whoever wrote it (an older
#: version, an operator, someone with write access to the store): framing and
#: hop-by-hop headers (the replay is framed by this hop, for this caller), per-caller
#: state, and the headers a replay gets from the gateway.
_NOT_REPLAYED = HOP_BY_HOP | NEVER_STORED | REPLAY_HEADERS


def to_store(route: Route, response: UpstreamResponse) -> StoredResponse:
    """The record's copy of a response whose status the route caches: without
    per-caller and stripped headers, and headers only (body_omitted) for a body that
    was streamed or is over max_stored_body."""
    headers = tuple(
        (n, v)
        for n, v in response.headers
        if n not in NEVER_STORED and n not in route.strip_headers
    )
    if response.rest is not None or len(response.body) > route.max_stored_body:
        return StoredResponse(response.status, headers, b"", body_omitted=True)
    return StoredResponse(response.status, headers, response.body)


def replay_headers(stored: StoredResponse) -> tuple[tuple[str, str], ...]:
    """The headers of a replay of `stored`: its replayable ones, then the gateway's."""
    headers = _replayable(stored.headers)
    headers.append(("idempotent-replayed", "true"))
    if stored.body_omitted:
        headers.append(("idempotent-body-omitted", "true"))
        headers = [(n, v) for n, v in headers if n.lower() != "content-encoding"]
    if stored.origin != "upstream":
        headers.append(("idempotent-resolved-by", stored.origin))
    return tuple(headers)


def _replayable(stored: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """The stored headers a replay carries. One pass over a handful of headers; the
    second only for a stored Connection header, which names more of them."""
    named: set[str] = set()
    headers = []
    for name, value in stored:
        lowered = name.lower()
        if lowered not in _NOT_REPLAYED:
            headers.append((name, value))
        elif lowered == "connection":
            named.update(token.strip().lower() for token in value.split(","))
    if named:
        headers = [(n, v) for n, v in headers if n.lower() not in named]
    return headers
