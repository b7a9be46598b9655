"""The problems a keyed request gets instead of a response, in the words that explain them.

The engine decides when a request is refused (and counts it); these build what the
caller is told: which problem, its detail, and when to retry.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.config import Route
from gateway.errors import (
    AcceptedUnconfirmed,
    FingerprintMismatch,
    KeyConflict,
    OutcomeLost,
    OutcomePending,
    ProblemError,
    QueueFull,
    ResponseUnreadable,
    StoreUnavailable,
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


def token_unreadable(route: Route, ref: KeyRef, record: Record) -> ProblemError:
    """A repeat of a delivery whose status URL's token this gateway cannot read: it
    cannot give the status URL; the delivery is kept as it is, never accepted again."""
    why = record.unreadable or "its status URL's token cannot be decrypted"
    log.error(
        "status token of route %s record %s cannot be decrypted: %s. Not accepted "
        "again; the record is kept",
        route.name,
        ref.digest,
        why,
    )
    return ResponseUnreadable(
        f"The delivery with this key is kept ({record.state}), but {why}, so the "
        "gateway cannot give its status URL. It was not accepted or run again. If its "
        "key was rotated out too early, add the key back to "
        "store.previous_encryption_keys and restart the gateway; an operator can see "
        "and resolve the key meanwhile.",
        route=route.name,
        key=ref.key,
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
        f"Route {route.name!r} has as many deliveries waiting as its delivery.max_queued "
        f"({route.delivery.max_queued}). This request was not queued and nothing was kept "
        "for its key: send it again later (after Retry-After).",
        route=route.name,
        key=ref.key,
        headers={"Retry-After": "30"},
    )


def store_unavailable(route: Route, key: str) -> ProblemError:
    """The store failed on a key's claim or accept, on a route that fails closed. A
    claim that failed sends nothing. An accept may have been written before the store
    failed (its answer lost): then it is queued and will be delivered, so the answer
    must not say it was refused."""
    if route.delivery.mode == "async":
        detail = (
            "The store failed while the gateway was queueing this request, so it may be "
            "queued or not: the gateway could not confirm either. Send it again with the "
            "same key once the store is back: a repeat never queues it twice, and "
            "answers with its state."
        )
    else:
        detail = (
            "The gateway cannot record this key right now, so it did not forward the "
            "request. Retry later."
        )
    return StoreUnavailable(detail, route=route.name, key=key, headers={"Retry-After": "1"})


def accepted_unconfirmed(route: Route, ref: KeyRef, url: str, due: str = "") -> ProblemError:
    """An accept the store's replicas did not confirm in time: it is queued and will
    be delivered (from `due`, if given), unless the store fails over before a replica
    holds it."""
    log.warning(
        "route %s record %s: delivery accepted and queued, but the store's replicas did "
        "not confirm it in time (store.wait_for_replicas); answered accepted-unconfirmed",
        route.name,
        ref.digest,
    )
    return AcceptedUnconfirmed(
        "The gateway stored this request and queued it for delivery, but the store's "
        "replica did not confirm the write in time (store.wait_for_replicas), so a "
        "failover in the next moments could still lose it. Unless that happens it will "
        "be delivered. Send it again with the same key to see its state (or read its "
        "status_url): a repeat never queues it twice.",
        route=route.name,
        key=ref.key,
        state="queued",
        status_url=url,
        headers={"Location": url, "Cache-Control": "no-store"},
        **({"due": due} if due else {}),
    )
