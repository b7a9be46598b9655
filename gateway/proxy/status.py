"""The status URL of an accepted (202) request: `{prefix}/status/{route}/{digest}/{token}`.

Whoever holds a 202's `Location` may read that delivery's state from any replica; the
token, made at acceptance and stored sealed in the record, is what makes the URL
unguessable. Whatever is wrong with a status URL (its shape, an unknown route or
digest, another route's record, a token that does not match or does not open, other
scope headers), the answer is one and the same 404: nothing tells a guesser which part
it got right.

On a route whose `key.scope` names headers only, the URL alone is not enough: the
record's digest is made again from this request's scope headers and must be the URL's,
so a URL leaked into a log does not show one tenant's delivery to another. Other
scopes (method, path, query, body) cannot be recomputed from a GET: the token decides.

The body says what a caller may know: the record's own state names, attempts, when the
last one ended and how (its result class and status, never the gateway's error texts,
which name upstream addresses), when the next is due, and once completed the stored
response with the headers a replay would send; while it waits on a paused route
(store/route_pauses.py), since when and when the next probe goes out. Never the
history, operators' notes, or who paused the route and why: the operator API has those.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from gateway.config import Route
from gateway.engine.accept import rfc3339, status_url
from gateway.engine.replay import REPLAY_HEADERS, replay_headers
from gateway.errors import (
    MethodNotAllowed,
    ProblemError,
    StoreError,
    StoreUnavailable,
    UnknownStatus,
)
from gateway.http.request import read_headers
from gateway.keying import RequestParts, record_digest, scope_value
from gateway.logs import Trace
from gateway.records import DIGEST, QUEUE_STATES, KeyRef, Record, State, StoredResponse
from gateway.store.route_pauses import PauseState

if TYPE_CHECKING:
    from starlette.types import Scope

    from gateway.assembly import Gateway

log = logging.getLogger("gateway")

#: secrets.token_urlsafe(16): 128 bits, 22 characters of the URL-safe alphabet
_TOKEN = re.compile(r"[A-Za-z0-9_-]{22}")
_NO_STORE = (b"cache-control", b"no-store")

#: What a caller is told of an attempt: its result class and the upstream's status.
_ATTEMPT_FIELDS = ("result", "status")


#: An answer as ProblemError.render gives it: status, headers (Content-Length among
#: them), body. HEAD gets GET's; the server sends no body for it.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


async def status_reply(gateway: Gateway, scope: Scope, raw_path: str, trace: Trace) -> Answer:
    """The answer to a request under `{server.status_prefix}/`, `raw_path` as forwarded
    would be (dot-segments removed, still percent-encoded)."""
    method = scope["method"]
    if method not in ("GET", "HEAD"):
        trace.outcome = "method_not_allowed"
        return _problem(MethodNotAllowed(headers={"Allow": "GET, HEAD"}))
    headers = read_headers(scope, gateway.config.server.max_header_bytes)
    prefix = gateway.config.server.status_prefix
    try:
        found = await _find(gateway, prefix, raw_path, headers)
    except StoreError as exc:
        log.error("store failed on a status request: %s", exc)
        trace.outcome = "store_error"
        problem = StoreUnavailable(
            "The gateway cannot read the store right now. Retry later.",
            headers={"Retry-After": "1"},
        )
        return _problem(problem)
    if found is None:
        trace.outcome = "status_not_found"
        gateway.metrics.count("", "status_not_found")  # the URL's route name is untrusted
        return _problem(UnknownStatus())
    route, record = found
    trace.route, trace.key, trace.sensitive = record.route, record.key, route.sensitive_keys
    trace.outcome = "status"
    gateway.metrics.count(record.route, "status")
    url = status_url(prefix, record.route, record.digest, record.token)
    pause = None
    if record.state in QUEUE_STATES:
        try:
            pause = await gateway.store.route_pause(record.route)
        except StoreError as exc:  # the record is read: its state is worth the answer
            log.warning("store failed reading the pause of %s: %s", record.route, exc)
    body = json.dumps(status_body(record, url, pause), ensure_ascii=False).encode()
    length = (b"content-length", b"%d" % len(body))
    return 200, [(b"content-type", b"application/json"), length, _NO_STORE], body


async def _find(
    gateway: Gateway, prefix: str, raw_path: str, headers: list[tuple[str, str]]
) -> tuple[Route, Record] | None:
    """The route and the delivery record this status URL names, or None: every way of
    not naming one ends here alike."""
    segments = raw_path[1:].split("/")
    own = prefix[1:].split("/")
    if len(segments) != len(own) + 4:
        return None
    if [unquote(s) for s in segments[: len(own) + 1]] != [*own, "status"]:
        return None
    name, digest, given = unquote(segments[-3]), segments[-2], segments[-1]
    route = gateway.config.route(name)
    if route is None or not DIGEST.fullmatch(digest) or not _TOKEN.fullmatch(given):
        return None
    ref = KeyRef(digest, name, "")
    # The token alone first: a wrong one is found without reading the record, whose
    # stored response may be a megabyte, so it costs what a missing record costs.
    token = await gateway.store.delivery_token(ref)
    if not hmac.compare_digest(token.encode(), given.encode()):
        return None
    record = await gateway.store.get(ref)
    if record is None or record.route != name or not record.delivery or not record.token:
        return None
    if not hmac.compare_digest(record.token.encode(), given.encode()):
        return None
    if not _scope_matches(route, record, headers):
        return None
    return route, record


def _scope_matches(route: Route, record: Record, headers: list[tuple[str, str]]) -> bool:
    """On a route scoped by headers only: this request's scope headers make the URL's
    digest. A route that no longer has a key or a scope cannot say: the token decides."""
    spec = route.key
    if spec is None or not spec.scope or not all(p.startswith("header.") for p in spec.scope):
        return True
    parts = RequestParts(method="GET", path="", query="", headers=headers, body=b"")
    digest = record_digest(route.name, scope_value(spec, parts), record.key)
    return hmac.compare_digest(digest.encode(), record.digest.encode())


def status_body(record: Record, url: str, pause: PauseState | None = None) -> dict[str, Any]:
    """What the holder of a delivery's status URL is told about it; `pause` is its
    route's while it is queued or retrying."""
    doc: dict[str, Any] = {
        "route": record.route,
        "key": record.key,
        "state": str(record.state),
        "status_url": url,
        "accepted_at": _time(record.created_ms),
        "attempts": record.attempts,
        "last_attempt": _last_attempt(record),
        "next_attempt_at": _time(record.due_ms) if record.state in QUEUE_STATES else None,
        "paused": None,
    }
    if pause is not None and pause.paused and record.state in QUEUE_STATES:
        doc["paused"] = {
            "since": _time(pause.since_ms),
            "next_probe_at": _time(pause.probe_ms) if pause.probe_ms else None,
        }
    if record.state is State.COMPLETED:
        if record.response is not None:
            doc["response"] = _response(record.response)
        elif record.unreadable:
            doc["response"] = {"unreadable": True}  # why (a key id, a cipher error) is not theirs
    return doc


def _last_attempt(record: Record) -> dict[str, Any] | None:
    """The last attempt that ended: when, and how. One under way is the state
    (in_flight); one whose answer was lost leaves the state unresolved or parked."""
    response = record.response
    if record.state is State.COMPLETED and response is not None and response.origin == "upstream":
        return {"at": _time(record.since_ms), "result": "completed", "status": response.status}
    attempt = record.last_attempt
    if not attempt:
        return None
    shown: dict[str, Any] = {"at": _time(_ended_ms(record))}
    for name in _ATTEMPT_FIELDS:
        if name in attempt:
            shown[name] = attempt[name]
    return shown


def _ended_ms(record: Record) -> int:
    """When the last attempt was recorded: the event that carries it."""
    at = record.last_attempt.get("at_ms")
    if isinstance(at, int):
        return at
    for event in reversed(record.history):
        if event.get("attempt") == record.last_attempt and isinstance(event.get("at_ms"), int):
            return int(event["at_ms"])
    return 0


def _response(stored: StoredResponse) -> dict[str, Any]:
    headers = [[n, v] for n, v in replay_headers(stored) if n not in REPLAY_HEADERS]
    doc: dict[str, Any] = {"status": stored.status, "headers": headers}
    if stored.body_omitted:
        doc["body_omitted"] = True
    else:
        try:
            doc["body"] = stored.body.decode("utf-8")
        except UnicodeDecodeError:
            doc["body_base64"] = base64.b64encode(stored.body).decode("ascii")
    doc["origin"] = stored.origin
    return doc


def _time(ms: int) -> str | None:
    """RFC 3339, UTC, to the millisecond; None for a time the store never set."""
    return rfc3339(ms) if ms > 0 else None


def _problem(problem: ProblemError) -> Answer:
    status, headers, body = problem.render()
    return status, [*headers, _NO_STORE], body
