"""The response an operator gives when resolving a key `done`: checked, then stored.

Repeats of the key get exactly that response for as long as the record lives, so
anything the gateway could not replay as given (a framing or hop-by-hop header, a
header value with CR or LF, a body over the route's `max_stored_body`) is refused up
front with `BadResponse`, naming the field, before anything changes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.config.http import HOP_BY_HOP
from gateway.config.types import HTTP_TOKEN
from gateway.engine.replay import NEVER_STORED, REPLAY_HEADERS
from gateway.errors import BadResponse
from gateway.operators.text import check_body
from gateway.records import Record, StoredResponse

#: RFC 9110 5.6.2: a header name is a token.
#: A header value an operator may give: visible ASCII, space and tab. RFC 9110 5.5
#: also allows obs-text (bytes 0x80-0xFF), but clients disagree on what it means.
_VALUE = re.compile(r"[\t\x20-\x7e]*")
_RESPONSE_FIELDS = ("status", "headers", "body")
MAX_HEADERS = 100


def _bad(message: str, field: str, hint: str = "") -> BadResponse:
    return BadResponse(f"{message}. {hint}" if hint else f"{message}.", field=field)


def check_response(given: Any, max_body: int, route: str) -> None:
    """Refuse an operator's response that the gateway could not replay as given."""
    shape = 'Give {"status": 200, "headers": {"Name": "value"}, "body": ...}.'
    if not isinstance(given, dict):
        raise _bad("response must be a JSON object", "response", shape)
    unknown = sorted(set(given) - set(_RESPONSE_FIELDS))
    if unknown:
        raise _bad(f"response has an unknown field: {unknown[0]}", "response", shape)
    status = given.get("status", 200)
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise _bad(
            "response.status must be a whole number from 200 to 599",
            "response.status",
            "A replay is a final response: 1xx ones are interim and never end an exchange.",
        )
    headers = given.get("headers", {})
    if headers is None:
        headers = {}
    if not isinstance(headers, dict):
        raise _bad("response.headers must be a JSON object of names and values", "response.headers")
    if len(headers) > MAX_HEADERS:
        raise _bad(f"response.headers has over {MAX_HEADERS} headers", "response.headers")
    for name, value in headers.items():
        _check_header(name, value)
    body = given.get("body", "")
    if isinstance(body, str):
        check_body(body)  # text no UTF-8 can write: InvalidText, before it is encoded
    raw = body_bytes(body)
    if len(raw) > max_body:
        raise _bad(
            f"response.body is over {max_body} bytes",
            "response.body",
            f"Route {route} stores and replays bodies up to {max_body} bytes "
            "(its max_stored_body).",
        )
    if raw and status in (204, 304):
        raise _bad(f"response.body must be empty for status {status}", "response.body")


def _check_header(name: str, value: Any) -> None:
    field = f"response.headers.{name}"
    if not HTTP_TOKEN.fullmatch(name):
        raise _bad(
            f"response.headers: {name!r} is not a header name",
            field,
            "A header name is letters, digits and !#$%&'*+-.^_`|~ (an RFC 9110 token).",
        )
    lowered = name.lower()
    refusal = ""
    if lowered == "content-length":
        refusal = "the gateway sets Content-Length itself"
    elif lowered == "transfer-encoding":
        refusal = "the gateway frames the replay itself: no Transfer-Encoding"
    elif lowered in HOP_BY_HOP:
        refusal = f"{name} is a hop-by-hop header, not part of a stored response"
    elif lowered in NEVER_STORED:
        refusal = f"a stored response never carries {name}: every repeat would get it"
    elif lowered in REPLAY_HEADERS:
        refusal = f"the gateway sets {name} itself on replays"
    if refusal:
        raise _bad(f"response.headers: {refusal}", field)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _bad(f"response.headers: the value of {name} must be text", field)
    if not _VALUE.fullmatch(str(value)):
        raise _bad(
            f"response.headers: the value of {name} has a character a header cannot carry",
            field,
            "Header values are printable ASCII, spaces and tabs: no CR, LF, NUL or other "
            "control characters.",
        )


def body_bytes(body: Any) -> bytes:
    """A response body as given: text as is, anything else as its JSON."""
    return body.encode() if isinstance(body, str) else json.dumps(body).encode()


def operator_response(given: Any, record: Record, operator: str) -> StoredResponse:
    """What repeats of the key get once an operator said it is done: the response
    they gave (checked by check_response), or a 2xx that says an operator resolved it."""
    if isinstance(given, dict):
        body = given.get("body", "")
        headers = tuple(
            (name.lower(), str(value).strip(" \t"))
            for name, value in (given.get("headers") or {}).items()
        )
        if not any(name == "content-type" for name, _ in headers) and not isinstance(body, str):
            headers = (*headers, ("content-type", "application/json"))
        status = given.get("status", 200)
        return StoredResponse(status, headers, body_bytes(body), origin="operator")
    doc = {
        "status": "completed",
        "resolved_by": operator,
        "key": record.key,
        "detail": "The first request's outcome was unknown; an operator checked and marked "
        "it done. It was not run again.",
    }
    return StoredResponse(
        200, (("content-type", "application/json"),), json.dumps(doc).encode(), origin="operator"
    )
