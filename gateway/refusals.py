"""The problems a keyed request gets instead of a response, in the words that explain them.

The engine decides when a request is refused (and counts it); these build what the
caller is told: which problem, its detail, and when to retry.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.config import Route
from gateway.errors import (
    FingerprintMismatch,
    KeyConflict,
    OutcomeLost,
    OutcomePending,
    ProblemError,
    QueueFull,
    ResponseUnreadable,
)
from gateway.records import KeyRef, Record, State

log = logging.getLogger("gateway.engine")


def missing_key_detail(route: Route) -> str:
    assert route.key is not None
    names = ", ".join(
        f"{s.kind} {s.name}".strip() if s.kind != "hash" else "hash" for s in route.key.sources
    )
    return f"Route {route.name!r} reads its idempotency key from: {names}."


def fingerprint_mismatch(route: Route, ref: KeyRef) -> ProblemError:
    return FingerprintMismatch(
        "The first request with this key had a different method, path, query or "
        "body. Use a new key for a different request.",
        route=route.name,
        key=ref.key,
    )


def in_flight_conflict(route: Route, ref: KeyRef, state: str, *, waited: bool) -> ProblemError:
    detail = (
        f"Waited {route.wait_timeout:g}s for the first request with this key to finish."
        if waited
        else "The first request with this key is still being processed."
    )
    return KeyConflict(
        detail + " Retry later to get its response.",
        route=route.name,
        key=ref.key,
        state=state,
        headers={"Retry-After": str(max(1, round(min(route.upstream_timeout, 30))))},
    )


def open_conflict(route: Route, ref: KeyRef, record: Record) -> ProblemError:
    """For a record whose outcome is open: unresolved, parked or claimed."""
    what = {
        State.UNRESOLVED: "The outcome of the first request with this key is unknown; "
        "the gateway will not resend it until it is checked.",
        State.PARKED: "The outcome of the first request with this key is unknown and "
        "waits for an operator.",
        State.CLAIMED: f"An operator ({record.holder}) is reviewing the first request "
        "with this key.",
    }[record.state]
    return OutcomePending(
        what,
        route=route.name,
        key=ref.key,
        state=str(record.state),
        headers={"Retry-After": "60"},
    )


def unreadable(route: Route, ref: KeyRef, record: Record) -> ProblemError:
    """The work ran and its response is stored, but this gateway cannot read it:
    neither replay something else nor run it again; leave the record as it is."""
    log.error(
        "stored response of route %s record %s cannot be decrypted: %s. Not replayed, "
        "not run again; the record is kept",
        route.name,
        ref.digest,
        record.unreadable,
    )
    return ResponseUnreadable(
        f"The request with this key ran and its response is stored, but {record.unreadable}. "
        "It was not run again and the record is kept. If its key was rotated out too "
        "early, add the key back to store.previous_encryption_keys and restart the "
        "gateway; otherwise repeats get this answer until the record expires (the "
        "route's response_ttl).",
        route=route.name,
        key=ref.key,
    )


def upstream_status(exc: OutcomeLost) -> dict[str, Any]:
    """The status the upstream sent before its answer was lost, for the problem body."""
    return {} if exc.status is None else {"upstream_status": exc.status}


def queue_full(route: Route, ref: KeyRef) -> ProblemError:
    return QueueFull(
        f"Route {route.name!r} has {route.delivery.max_queued} deliveries waiting, its "
        "delivery.max_queued; this one was not accepted. Retry later.",
        route=route.name,
        key=ref.key,
        headers={"Retry-After": "30"},
    )
