"""The gateway's errors.

    GatewayError
    ├── ConfigError            a config file is wrong; never reaches a request
    ├── StoreError             the store could not be reached or answered badly
    ├── CopyRefused            `store copy`: the destination holds keys, or the copy's
    │                          counts do not match the source's
    ├── UpstreamError          how a forward failed, classified once (upstream.py)
    │   ├── NotSent            the request never left: safe to run again
    │   └── OutcomeLost        it was sent and the answer was lost: never resend blind
    └── ProblemError           answered to a caller as RFC 9457 problem+json
        ├── AcceptedUnconfirmed 202: queued for delivery, but the store's replicas did not
        │                          confirm it in time: it will run unless a failover loses it
        ├── BadRequest         400: the request cannot be keyed (malformed body, bad key)
        │   ├── MalformedRequest 400: not valid HTTP/1.1 or its framing is ambiguous
        │   │   ├── BadHost      400: no Host (HTTP/1.1), more than one, or an invalid one
        │   │   └── UpgradeRefused 400: Connection: upgrade; the gateway does not switch
        │   ├── AmbiguousPath  400: an encoded slash, a backslash or ..;x on a keyed route
        │   └── BadDeliveryTime 400: an async route's delay or not-before header cannot
        │                          be read, or asks for more than delivery.max_delay
        ├── MissingKey         400: the route needs a key and the request has none
        ├── NoRoute            404: no route matches
        ├── UnknownStatus      404: a status URL that names no delivery (whatever is wrong)
        ├── MethodNotAllowed   405: the gateway's own paths take GET and HEAD only
        ├── RequestTimeout     408: the head or body did not arrive in time (the listener)
        ├── PayloadTooLarge    413
        ├── UriTooLong         414: the request target is over server.max_header_bytes
        ├── HeadersTooLarge    431
        ├── KeyConflict        409: the first request with the key is in flight
        │   └── OutcomePending 409: its outcome is unknown (unresolved, parked, claimed)
        ├── FingerprintMismatch 422: same key, different request
        ├── ResponseUnreadable 500: the stored response cannot be decrypted; kept as is
        ├── InternalError      500: an unexpected error on the request's path; its cause
        │                          and traceback are logged, never answered
        ├── UpstreamFailed     502: the upstream could not be reached (never sent)
        ├── StoreUnavailable   503: the store is down and the route fails closed
        ├── QueueFull          503: an async route has delivery.max_queued waiting
        ├── TooManyConnections 503: over server.max_connections; nothing was read
        ├── OutcomeUnknown     504: the request was sent and its answer lost (timeout,
        │                          reset, cut off): the work may have run
        └── OperatorRefusal    the operator API (admin.py) refused a call; nothing changed
            ├── Unauthorized          401: no token that matches (named or shared), and no
            │                             identity header from a trusted proxy naming an operator
            ├── Forbidden             403: authenticated, and not allowed this
            │   ├── ViewerCannotAct   a viewer's claim or resolve
            │   └── NotYourName       an "operator" field that differs from the authenticated name
            ├── OperatorApiDisabled   404: no admin.token and no admin.operators
            ├── UnknownKey            404: no record for this route and key
            ├── UnknownRoute          404: no delivery: async route by this name (pause, resume)
            ├── UnknownPath           404: nothing on the admin listener has this path
            ├── WrongMethod           405: the path does not take this method
            ├── OperatorCallFailed    500: an unexpected error; the log says which
            ├── HeldByAnother         409: another operator holds the key (claim without force)
            ├── NotTheHolder          409: only the operator holding the key may resolve it
            ├── InvalidTransition     409: not a legal move from the key's state
            ├── OperatorBodyTooLarge  413: larger than the call can need
            ├── InvalidText           422: a name, note or body holds text the gateway
            │                             cannot keep (gateway/operators/text.py)
            └── BadOperatorRequest    400: the call cannot be acted on as sent
                ├── BadFilter         a listing's state or older_than is not valid
                ├── NotJsonObject     the body is not a JSON object
                ├── OperatorRequired  the body does not name the operator
                ├── BadOutcome        outcome is neither "done" nor "retry"
                ├── DigestRequired    a scoped route's record needs ?digest=
                ├── BadResponse       the response given could not be replayed as given
                └── NotHttp           not valid HTTP/1.1 (the admin listener's parser)

Each ProblemError knows its `type`, `title` and status, and renders itself. A title is
the same for every occurrence of its type (RFC 9457 3.1.3); what this occurrence got
wrong is its `detail`, and extra members (`field`, `holder`, `state`) say it to programs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

PROBLEM_BASE = "https://idempotency-gateway.dev/problems/"


class GatewayError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    path: str  # YAML path, e.g. routes[2].key.body ("" for the whole file)
    message: str  # what is wrong and how to fix it
    #: where in the file, from 1 (0: not known, e.g. data that did not come from a file)
    line: int = 0
    column: int = 0

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(GatewayError):
    """`config.yaml:14:7: routes[2].key.body: what is wrong; what to write`, one a line."""

    def __init__(self, source: str, issues: list[ConfigIssue]) -> None:
        self.source = source
        self.issues = issues
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(
            f"{self.source}:{issue.line}:{issue.column}: {issue}"
            if issue.line
            else f"{self.source}: {issue}"
            for issue in self.issues
        )


class StoreError(GatewayError):
    """A store operation failed; the driver's exception is the __cause__. Its message
    (for the log, never the caller) names what failed and why: `because` builds it
    from a driver's exception."""

    @classmethod
    def because(cls, what: str, exc: BaseException) -> StoreError:
        """`what` failed: `exc`'s first line, or its kind where it has no words (a
        driver's pool-exhausted and timeout errors often have none)."""
        words = str(exc).strip().splitlines()
        return cls(f"{what}: {words[0] if words else type(exc).__name__}")


class CopyRefused(GatewayError):
    """`store copy` stopped: its message says why (a destination that already holds
    records, counts that differ after the copy) and what to do."""


class UpstreamError(GatewayError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotSent(UpstreamError):
    """Connect refused or timed out, or no pooled connection in time."""


class OutcomeLost(UpstreamError):
    """Timed out, reset or broken after the request was (maybe) sent."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        #: the upstream's status, if its status line arrived before the failure
        self.status = status


class ProblemError(GatewayError):
    status: ClassVar[int] = 500
    slug: ClassVar[str] = "internal"
    title: ClassVar[str] = "The gateway failed"

    def __init__(
        self,
        detail: str = "",
        *,
        route: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or self.title)
        self.detail = detail
        self.route = route
        self.key = key
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "type": PROBLEM_BASE + self.slug,
            "title": self.title,
            "status": self.status,
        }
        if self.detail:
            doc["detail"] = self.detail
        if self.route is not None:
            doc["route"] = self.route
        if self.key is not None:
            doc["key"] = self.key
        doc.update(self.extra)
        return doc

    def render(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        body = self.body()
        try:
            payload = json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            # A member that repeats what the caller sent (a header name, a field) may
            # hold a lone surrogate, which UTF-8 cannot write: JSON's escape can.
            payload = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        headers.extend((k.lower().encode(), v.encode()) for k, v in self.headers.items())
        return self.status, headers, payload


class AcceptedUnconfirmed(ProblemError):
    """Not a refusal: the request is stored and queued, and it is answered 202 (RFC 9110's
    "might or might not eventually be acted upon") with its status URL. A 503 would
    say it was refused, and a caller that gives up on it believes a job did not run
    that runs; a plain 202 would hide that a failover could still lose it."""

    status = 202
    slug = "accepted-unconfirmed"
    title = "The request is stored and will most likely run; a replica has not confirmed it yet"


class BadRequest(ProblemError):
    status = 400
    slug = "bad-request"
    title = "The request cannot be keyed"


class MalformedRequest(BadRequest):
    slug = "malformed-request"
    title = "The request is not valid HTTP; it was not forwarded"


class BadHost(MalformedRequest):
    slug = "bad-host"
    title = "The request needs exactly one valid Host header; it was not forwarded"


class UpgradeRefused(MalformedRequest):
    slug = "upgrade-refused"
    title = (
        "The gateway does not switch protocols; send the request without "
        "Connection: upgrade. It was not forwarded"
    )


class AmbiguousPath(BadRequest):
    slug = "ambiguous-path"
    title = (
        "The path has an encoded slash or a backslash, which servers split differently; "
        "it was not forwarded"
    )


class BadDeliveryTime(BadRequest):
    slug = "bad-delivery-time"
    title = (
        "The delivery time the request asks for cannot be read or is later than the "
        "route allows; nothing was queued"
    )


class MissingKey(ProblemError):
    status = 400
    slug = "missing-key"
    title = "The request has no idempotency key"


class NoRoute(ProblemError):
    status = 404
    slug = "no-route"
    title = "No route matches this request"


class UnknownStatus(ProblemError):
    status = 404
    slug = "unknown-status"
    title = "No delivery has this status URL"


class MethodNotAllowed(ProblemError):
    status = 405
    slug = "method-not-allowed"
    title = "The gateway's status URLs take GET and HEAD only"


class RequestTimeout(ProblemError):
    status = 408
    slug = "request-timeout"
    title = "The request did not arrive in time; nothing was done with it"


class PayloadTooLarge(ProblemError):
    status = 413
    slug = "payload-too-large"
    title = "The request body is larger than this route accepts"


class UriTooLong(ProblemError):
    status = 414
    slug = "uri-too-long"
    title = "The request target is longer than the gateway accepts"


class HeadersTooLarge(ProblemError):
    status = 431
    slug = "headers-too-large"
    title = "The request headers are larger than the gateway accepts"


class KeyConflict(ProblemError):
    status = 409
    slug = "conflict"
    title = "A request with this key is already being processed"


class OutcomePending(KeyConflict):
    slug = "outcome-pending"
    title = "The outcome of the first request with this key is unknown"


class FingerprintMismatch(ProblemError):
    status = 422
    slug = "fingerprint-mismatch"
    title = "This key was already used for a different request"


class ResponseUnreadable(ProblemError):
    status = 500
    slug = "stored-response-unreadable"
    title = "Stored response cannot be decrypted"


class InternalError(ProblemError):
    status = 500
    slug = "internal-error"
    title = "The gateway failed on this request; the cause is in its log"


class UpstreamFailed(ProblemError):
    status = 502
    slug = "upstream-unreachable"
    title = "The upstream could not be reached; the request was not sent"


class StoreUnavailable(ProblemError):
    status = 503
    slug = "store-unavailable"
    title = "The idempotency store is unavailable; retry later"


class QueueFull(ProblemError):
    status = 503
    slug = "queue-full"
    title = "The route's delivery queue is full; retry later"


class TooManyConnections(ProblemError):
    status = 503
    slug = "too-many-connections"
    title = "The gateway has too many connections open; retry later"


class OutcomeUnknown(ProblemError):
    status = 504
    slug = "outcome-unknown"
    title = "The upstream's answer was lost; the outcome is unknown"


class OperatorRefusal(ProblemError):
    """The operator API said no, before or instead of changing the record."""


class Unauthorized(OperatorRefusal):
    status = 401
    slug = "unauthorized"
    title = "A valid operator token is required"


class Forbidden(OperatorRefusal):
    status = 403
    slug = "forbidden"
    title = "This operator may not do that"


class ViewerCannotAct(Forbidden):
    slug = "viewer-cannot-act"
    title = "A viewer reads keys; claiming and resolving need the operator role"


class NotYourName(Forbidden):
    slug = "not-your-name"
    title = "The operator named is not the one authenticated"


class OperatorApiDisabled(OperatorRefusal):
    status = 404
    slug = "operator-api-disabled"
    title = "The operator API is disabled"


class UnknownKey(OperatorRefusal):
    status = 404
    slug = "unknown-key"
    title = "No record for this route and key"


class UnknownRoute(OperatorRefusal):
    status = 404
    slug = "unknown-route"
    title = "No delivery: async route by this name"


class UnknownPath(OperatorRefusal):
    status = 404
    slug = "unknown-path"
    title = "The admin listener has nothing at this path"


class WrongMethod(OperatorRefusal):
    status = 405
    slug = "wrong-method"
    title = "This path does not take this method"


class OperatorCallFailed(OperatorRefusal):
    status = 500
    slug = "operator-call-failed"
    title = "The admin listener failed to answer this request"


class HeldByAnother(OperatorRefusal):
    status = 409
    slug = "held-by-another-operator"
    title = "Another operator holds this key"


class NotTheHolder(OperatorRefusal):
    status = 409
    slug = "not-the-holder"
    title = "Only the operator holding this key may resolve it"


class InvalidTransition(OperatorRefusal):
    status = 409
    slug = "invalid-transition"
    title = "That is not a legal move for this key now"


class OperatorBodyTooLarge(OperatorRefusal):
    status = 413
    slug = "request-too-large"
    title = "The request body is larger than the operator API accepts"


class InvalidText(OperatorRefusal):
    status = 422
    slug = "invalid-text"
    title = "A field holds text the gateway cannot keep"


class BadOperatorRequest(OperatorRefusal):
    status = 400
    slug = "bad-request"
    title = "The operator API cannot act on this request"


class BadFilter(BadOperatorRequest):
    slug = "bad-filter"
    title = "A listing filter is not valid"


class NotJsonObject(BadOperatorRequest):
    slug = "not-a-json-object"
    title = "The request body must be a JSON object"


class OperatorRequired(BadOperatorRequest):
    slug = "operator-required"
    title = "The request body must name the operator"


class BadOutcome(BadOperatorRequest):
    slug = "bad-outcome"
    title = 'The outcome must be "done" or "retry"'


class DigestRequired(BadOperatorRequest):
    slug = "digest-required"
    title = "This route's keys are scoped per client"


class BadResponse(BadOperatorRequest):
    slug = "bad-response"
    title = "The gateway could not replay the response given as it is"


class NotHttp(BadOperatorRequest):
    slug = "not-http"
    title = "The request is not valid HTTP/1.1"
