"""HTTP values in settings: methods, header names, request parts (what a hash key, a
fingerprint or a scope is made of), status sets and IP networks."""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Iterable
from typing import Annotated

from gateway.config import units
from gateway.config.issues import raise_at
from gateway.config.text import show
from gateway.config.types import Check, is_token, items, list_schema
from gateway.records import SUCCESS_STATUSES

#: RFC 9110 7.6.1, plus headers that describe the framing of one hop's message: never
#: forwarded, so never a setting's header to read a request's meaning from.
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

#: Request parts a `hash` key or a `fingerprint` may be computed from.
#: `header.<Name>` is accepted too.
REQUEST_PARTS = ("method", "path", "query", "body")


#: The answers that mean the upstream handled the request (records.is_success).
DEFAULT_CACHE_STATUSES = SUCCESS_STATUSES


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def request_parts(
    values: Iterable[object], plain: tuple[str, ...], prefixes: tuple[str, ...]
) -> tuple[str, ...]:
    found: list[str] = []
    hint = ", ".join((*plain, *(f"{p}<Name>" for p in prefixes)))
    for i, item in enumerate(values):
        prefix = next((p for p in prefixes if isinstance(item, str) and item.startswith(p)), "")
        if isinstance(item, str) and (item in plain or (prefix and is_token(item[len(prefix) :]))):
            if item in found:
                raise_at((i,), f"{show(item)} is listed twice")
            found.append(item)
            continue
        message = f"{show(item)} is not a request part; write {hint}"
        close = difflib.get_close_matches(str(item), plain, n=1) if isinstance(item, str) else []
        raise_at((i,), message + (f'; did you mean "{close[0]}"?' if close else ""))
    return tuple(found)


def _fingerprint(value: object) -> tuple[str, ...]:
    if value == "none":
        return ()
    return request_parts(items(value, "[method, path, body], or none"), REQUEST_PARTS, ("header.",))


def _hash_parts(value: object) -> tuple[str, ...]:
    found = items(value, "[method, path, body]")
    if not found:
        raise ValueError("list at least one request part, e.g. [method, path, body]")
    return request_parts(found, REQUEST_PARTS, ("header.",))


def _scope(value: object) -> tuple[str, ...]:
    found = items(value, "[header.Authorization]")
    return request_parts(found, (), ("header.", "query.")) if found else ()


def _cache_statuses(value: object) -> frozenset[int]:
    found = items(value, '["2xx", "3xx", "4xx", "!408", "!429"]')
    return units.parse_status_set(found, DEFAULT_CACHE_STATUSES)


def _statuses(value: object) -> frozenset[int]:
    codes = units.parse_status_set(items(value, "[200]"), frozenset())
    if not codes:
        raise ValueError("list at least one status, e.g. [200]")
    return codes


def _methods(value: object) -> frozenset[str] | None:
    if value is None:
        return None
    found = items(value, "[POST]")
    if not found:
        raise ValueError("an empty list matches nothing; list methods, or remove methods: for any")
    for i, item in enumerate(found):
        if not (isinstance(item, str) and is_token(item)):
            raise_at((i,), f"{show(item)} is not an HTTP method; write e.g. POST")
    return frozenset(str(item).upper() for item in found)


def _method(value: object) -> str:
    if isinstance(value, str) and is_token(value):
        return value.upper()
    raise ValueError(f"{show(value)} is not an HTTP method; write GET")


def _header_names(value: object) -> frozenset[str]:
    found = items(value, "[Set-Cookie, X-Secret]")
    for i, item in enumerate(found):
        if not (isinstance(item, str) and is_token(item)):
            raise_at((i,), f"{show(item)} is not a header name; write e.g. X-Secret")
    return frozenset(str(item).lower() for item in found)


def _query_names(value: object) -> frozenset[str]:
    found = items(value, "[page, region]")
    for i, item in enumerate(found):
        if not isinstance(item, str) or not item or not item.isprintable():
            raise_at(
                (i,),
                f"{show(item)} is not a query parameter's name; write it as it reads "
                "decoded, e.g. page",
            )
    return frozenset(str(item) for item in found)


def _forward_header(value: object) -> str | None:
    if value is None or value is False or value == "":
        return None
    if isinstance(value, str) and is_token(value):
        return value
    raise ValueError(
        f"{show(value)} is not a header name; write e.g. Idempotency-Key, or false to "
        "not forward the key"
    )


def _header_or_off(value: object) -> str | None:
    if value is None or value is False or value == "":
        return None
    if isinstance(value, str) and is_token(value):
        return value
    raise ValueError(
        f"{show(value)} is not a header name; write e.g. Delivery-Delay, or false to read "
        "no such header"
    )


def _networks(value: object) -> tuple[IPNetwork, ...]:
    """Addresses or CIDR blocks: `127.0.0.1`, `10.0.0.0/8`, `::1`."""
    out: list[IPNetwork] = []
    for i, item in enumerate(items([] if value is None else value, '["127.0.0.1", "10.0.0.0/8"]')):
        try:
            out.append(ipaddress.ip_network(str(item).strip(), strict=False))
        except ValueError:
            raise_at(
                (i,),
                f"{show(item)} is not an IP address or CIDR block; write e.g. "
                '"127.0.0.1", "10.0.0.0/8" or "::1"',
            )
    return tuple(out)


_TOKEN = {"type": "string", "pattern": "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"}
_PART = {
    "type": "string",
    "pattern": "^(method|path|query|body|header\\.[!#$%&'*+.^_`|~0-9A-Za-z-]+)$",
}
_SCOPE = {"type": "string", "pattern": "^(header|query)\\.[!#$%&'*+.^_`|~0-9A-Za-z-]+$"}
_STATUS = {"anyOf": [{"type": "integer", "minimum": 100, "maximum": 599},
                     {"type": "string", "pattern": f"^{units.STATUS_RE.pattern}$"}]}  # fmt: skip
Methods = Annotated[
    frozenset[str] | None,
    Check(
        _methods,
        {"anyOf": [list_schema(_TOKEN, minItems=1), {"type": "null"}]},
        written="list of methods",
    ),
]
Method = Annotated[str, Check(_method, _TOKEN, written="method")]
HeaderNames = Annotated[
    frozenset[str], Check(_header_names, list_schema(_TOKEN), written="list of header names")
]
QueryNames = Annotated[
    frozenset[str],
    Check(
        _query_names,
        list_schema({"type": "string", "minLength": 1}),
        written="list of query parameter names",
    ),
]
ForwardHeader = Annotated[
    str | None,
    Check(
        _forward_header,
        {"anyOf": [_TOKEN, {"enum": [False, None, ""]}]},
        written="header name, or `false`",
    ),
]
#: A request header the gateway reads, or None: `false`, `null` or `""`.
HeaderOrOff = Annotated[
    str | None,
    Check(
        _header_or_off,
        {"anyOf": [_TOKEN, {"enum": [False, None, ""]}]},
        written="header name, or `false`",
    ),
]
Networks = Annotated[
    tuple[IPNetwork, ...],
    Check(
        _networks,
        {"anyOf": [list_schema({"type": "string"}), {"type": "null"}]},
        written="list of addresses or CIDR blocks",
    ),
]
Fingerprint = Annotated[
    tuple[str, ...],
    Check(
        _fingerprint,
        {"anyOf": [list_schema(_PART, uniqueItems=True), {"const": "none"}]},
        written="list of request parts, or `none`",
    ),
]
HashParts = Annotated[
    tuple[str, ...],
    Check(
        _hash_parts,
        list_schema(_PART, minItems=1, uniqueItems=True),
        written="list of request parts",
    ),
]
ScopeParts = Annotated[
    tuple[str, ...],
    Check(_scope, list_schema(_SCOPE, uniqueItems=True), written="list of request parts"),
]
CacheStatuses = Annotated[
    frozenset[int],
    Check(
        _cache_statuses,
        list_schema(_STATUS),
        written="list of statuses",
        show=units.write_statuses,
    ),
]
Statuses = Annotated[
    frozenset[int],
    Check(
        _statuses,
        list_schema(_STATUS, minItems=1),
        written="list of statuses",
        show=units.write_statuses,
    ),
]
