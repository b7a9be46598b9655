"""What an operator sees of a delivery's stored request, and of a stored response.

A delivery keeps the caller's request to send it at each attempt, credentials and
all: an upstream that authenticates by `X-Api-Key`, `X-Auth-Token`, a signature
header or an `?api_key=` in the query needs them, so `delivery.drop_headers` cannot
drop them, and `store.encryption_key` protects them at rest, not from a viewer. An
operator needs to know what will be sent, not the secrets in it. So a header's value
is shown only when its name is one of a short list of harmless ones (SHOWN_HEADERS,
the route's key header, `admin.show_headers`), and a query parameter's only when its
name is the route's key parameter or in `admin.show_query`; every other value is
shown hidden, with its length (an empty value and a 300-character one tell different
stories), names and order kept. The same for every role and every surface: the
console's key page, `GET /admin/keys/{route}/{key}` and, through it, `keys show` all
draw `shown_request`, or `UnreadableRequest` (why) for a request that cannot be opened.

A stored response is the upstream's answer to the caller, replayed to the caller's
repeats, and may carry what was meant for the caller alone (a token the job minted, a
signed URL): the key page shows its headers by the same rule (`shown_response`:
SHOWN_RESPONSE_HEADERS and `admin.show_headers`). The operator API gives a stored
response's status alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

from gateway.config import CREDENTIAL_HEADERS, AdminConfig
from gateway.config import Route as RouteConfig
from gateway.records import StoredRequest

#: Request headers whose values are shown on every route.
SHOWN_HEADERS = frozenset({"content-type", "content-length", "user-agent"})
#: Response headers whose values are shown on every route: what says how the body is
#: written and how long the answer holds, nothing an upstream hands to its caller.
SHOWN_RESPONSE_HEADERS = frozenset(
    {"content-type", "content-length", "content-encoding", "content-language", "date",
     "etag", "last-modified", "cache-control", "expires", "retry-after", "vary"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ShownValue:
    """A header or a query parameter, as an operator sees it."""

    name: str
    #: None: hidden
    value: str | None
    #: the value's length in characters, shown or not
    length: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "hidden": self.value is None,
            "length": self.length,
        }


@dataclass(frozen=True, slots=True)
class ShownRequest:
    method: str
    #: the path as forwarded (percent-encoded), without the query
    path: str
    #: the query's parameters in order, names and values percent-decoded
    query: tuple[ShownValue, ...]
    headers: tuple[ShownValue, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "query": [parameter.to_json() for parameter in self.query],
            "headers": [header.to_json() for header in self.headers],
        }


@dataclass(frozen=True, slots=True)
class UnreadableRequest:
    """A stored request that cannot be opened (store.encryption_key turned on over
    requests stored plain, a key no longer configured, bytes changed in the store):
    why, in the gateway's words (gateway/encryption.py's Unreadable). It is never
    sent; the record is shown, and a person resolves it."""

    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"unreadable": self.reason}


def shown_names(route: RouteConfig | None, admin: AdminConfig) -> frozenset[str]:
    """The lower-case names whose values are shown for `route` (None: a route a reload
    removed): SHOWN_HEADERS, the route's key headers (the key is on the page anyway)
    and admin.show_headers; never Authorization, Proxy-Authorization or Cookie, even
    as a route's key header."""
    names = SHOWN_HEADERS | admin.show_headers
    if route is not None and route.key is not None:
        names |= {s.name.lower() for s in route.key.sources if s.kind == "header"}
    return names - CREDENTIAL_HEADERS


def shown_parameters(route: RouteConfig | None, admin: AdminConfig) -> frozenset[str]:
    """The query parameters whose values are shown for `route` (None: a route a reload
    removed), by their decoded names as written (names are case-sensitive): the
    route's key parameters and admin.show_query."""
    names = admin.show_query
    if route is not None and route.key is not None:
        names |= {s.name for s in route.key.sources if s.kind == "query"}
    return names


def shown_request(
    request: StoredRequest, names: frozenset[str], parameters: frozenset[str] = frozenset()
) -> ShownRequest:
    """`request` as an operator sees it: the values of the headers `names`
    (lower-case) and of the query `parameters`, and the length alone of every other."""
    headers = tuple(
        ShownValue(name, value if name.lower() in names else None, len(value))
        for name, value in request.headers
    )
    path, _, query = request.target.partition("?")
    return ShownRequest(request.method, path, shown_query(query, parameters), headers)


def shown_query(query: str, parameters: frozenset[str]) -> tuple[ShownValue, ...]:
    """Each parameter of a raw query (`a=1&b=2`), read as the key's templates read it
    (split on `&`, then at the first `=`; `+` a space; bytes that are no UTF-8 shown
    as U+FFFD), its value shown when its name is one of `parameters`."""
    shown = []
    for piece in query.split("&"):
        if not piece:
            continue
        raw_name, _, raw_value = piece.partition("=")
        name = unquote_plus(raw_name, errors="replace")
        value = unquote_plus(raw_value, errors="replace")
        shown.append(ShownValue(name, value if name in parameters else None, len(value)))
    return tuple(shown)


def query_line(query: Iterable[ShownValue]) -> str:
    """A shown query written out for a person (`keys show`): `name=value`, a hidden
    value as `(hidden, N characters)`, joined by `&`. Not a URL: nothing is encoded."""
    return "&".join(
        f"{p.name}={p.value}"
        if p.value is not None
        else f"{p.name}=(hidden, {p.length} characters)"
        for p in query
    )


def shown_response(
    headers: tuple[tuple[str, str], ...], admin: AdminConfig
) -> tuple[ShownValue, ...]:
    """A stored response's headers as an operator sees them: the values of
    SHOWN_RESPONSE_HEADERS and admin.show_headers, the length alone of every other."""
    shown = SHOWN_RESPONSE_HEADERS | (admin.show_headers - CREDENTIAL_HEADERS)
    return tuple(
        ShownValue(name, value if name.lower() in shown else None, len(value))
        for name, value in headers
    )
