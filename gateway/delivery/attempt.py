"""One delivery attempt, top to bottom: the worker (gateway/delivery/worker.py) calls
`attempt`, which picks a due delivery from the store, rebuilds its request, and hands
it to the engine's one classifier (`Engine.forward_unattended`), which sends it
upstream and settles the key through a `DeliverySettlement`: completed, scheduled
again per the route's retry (gateway/delivery/retry.py), parked when no attempt is
left, or left open when its outcome is unknown.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from gateway.config import Route
from gateway.delivery.retry import parse_retry_after, plan
from gateway.engine.core import Engine
from gateway.engine.outbound import Outbound, with_key
from gateway.engine.settlement import FAULT, guarded, settle_change
from gateway.records import KeyRef, StoredRequest, StoredResponse
from gateway.store.notices import Due
from gateway.upstream import UpstreamResponse

log = logging.getLogger("gateway.engine")


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one `attempt` did: `result` "completed", "retry_scheduled",
    "unknown_outcome", "exhausted", or "" when nothing was picked (`why` says why);
    `next` and, for "not_due" and "unconfirmed", `due_ms` (store clock, said at
    `now_ms`) are hints. `upstream` is what the attempt says of the upstream, for the
    route's pause (store/route_pauses.py): "refused" (never sent, a 5xx or a 429, with
    `error`), "answered" (any other status), or "" (an unknown outcome, or nothing
    sent: no pick, an unreadable request)."""

    result: str
    why: str = ""
    next: Due | None = None
    due_ms: int = 0
    now_ms: int = 0
    upstream: str = ""
    error: str = ""


def refused(response: UpstreamResponse | None) -> bool:
    """Whether an attempt that is repeated was refused: never sent (no response), or
    answered 5xx or 429; any other status is an answer."""
    return response is None or response.status >= 500 or response.status == 429


class DeliverySettlement:
    """Nobody waits (the caller got 202): a delivery is completed, scheduled again per
    the route's retry (Retry-After wins, up to max_backoff), parked when no attempt is
    left, or left open when its outcome is unknown. `result` says which."""

    __slots__ = (
        "attempts",
        "engine",
        "error",
        "probe",
        "ref",
        "replica",
        "result",
        "route",
        "run_id",
        "upstream",
    )

    def __init__(
        self,
        engine: Engine,
        route: Route,
        ref: KeyRef,
        run_id: str,
        attempts: int,
        replica: str,
        probe: bool = False,
    ) -> None:
        self.engine, self.route, self.ref, self.run_id = engine, route, ref, run_id
        self.attempts, self.replica, self.probe = attempts, replica, probe
        self.result = ""
        self.upstream = self.error = ""

    async def complete(self, stored: StoredResponse, response: UpstreamResponse) -> None:
        attempt = {"result": "completed", "status": response.status}
        change = self.engine.store.complete(
            self.ref, self.run_id, stored, self.route.response_ttl, attempt
        )
        await settle_change(change, self.ref, "complete")
        self.result = "completed"
        self.upstream = "answered"

    async def retry(self, reason: str, response: UpstreamResponse | None = None) -> None:
        retry_after = None
        if response is not None:
            value = next((v for n, v in response.headers if n.lower() == "retry-after"), None)
            retry_after = parse_retry_after(value, time.time())
        # A paused route's probe that was refused or never sent is not an attempt of
        # the delivery it took: an outage longer than its attempts parks nothing.
        uncounted = self.probe and refused(response)
        if uncounted:
            delay: float | None = self.route.delivery.probe_every
            result = "probe_refused"
        else:
            delay = plan(self.route, self.attempts, retry_after)
            result = "retry_scheduled" if delay is not None else "exhausted"
        attempt: dict[str, Any] = {
            "result": result,
            "status": response.status if response is not None else None,
            "error": reason,
            "retry_after": retry_after,
        }
        if delay is None:
            attempt["reason"] = f"attempts exhausted ({self.attempts}); last: {reason}"
        change = self.engine.store.retry_later(
            self.ref, self.run_id, delay, attempt, origin=self.replica, uncounted=uncounted
        )
        await settle_change(change, self.ref, "schedule a retry of")
        log.info(
            "delivery %s key %r %s %d: %s -> %s",
            self.route.name,
            self.ref.key,
            "probe, not counted, of attempt" if uncounted else "attempt",
            self.attempts,
            reason,
            f"again in {delay:.3g}s" if delay is not None else "parked, no attempt left",
        )
        self.result = "retry_scheduled" if uncounted else result
        self.upstream = "refused" if refused(response) else "answered"
        self.error = reason

    async def lost(self, reason: str) -> None:
        await self.engine.unknown(self.route, self.ref, self.run_id, reason)
        self.result = "unknown_outcome"
        self.upstream = ""  # sent, maybe taken: no word on whether it refuses

    async def unreadable(self, error: str) -> None:
        """The stored request cannot be opened: it is never sent; a person decides."""
        attempt = {"result": "exhausted", "reason": f"stored request unreadable: {error}"}
        log.error("delivery %s record %s: %s", self.route.name, self.ref.digest, attempt["reason"])
        change = self.engine.store.retry_later(self.ref, self.run_id, None, attempt)
        await settle_change(change, self.ref, "park")
        self.result = "exhausted"


async def attempt(
    engine: Engine, route: Route, hint: KeyRef, replica: str, run_id: str, probe: bool = False
) -> Delivery:
    """One delivery attempt by `run_id`: pick `hint` (or, where the store can, the
    route's earliest due delivery), send its stored request through the engine's one
    classifier, and say what happened. A `probe` (of a paused route) that is refused
    or never sent is not counted as one of the delivery's attempts. A pick that failed
    is repeated with the same run id, so it finds what its first try took. An
    unreadable request is never sent: parked. A pick the store's replicas did not
    confirm is never sent either: the store put it back (why "unconfirmed")."""
    picked = await engine.store.pick(
        route.name, hint, run_id, engine.lease_for(route), route.retry.attempts, replica
    )
    record = picked.record
    if record is None:
        result = "exhausted" if picked.why == "exhausted" else ""
        return Delivery(result, picked.why, picked.next, picked.due_ms, picked.now_ms)
    ref = KeyRef(record.digest, record.route, record.key)
    if record.attempts == 1 and not record.last_attempt:  # not one an operator requeued
        engine.metrics.first_attempt(route.name, picked.now_ms - record.created_ms)
    settle = DeliverySettlement(engine, route, ref, run_id, record.attempts, replica, probe)
    try:
        request = engine.store.codec.decode_request(ref.digest, picked.request)
    except (ValueError, TypeError) as exc:  # Unreadable is one: never sent, parked
        await settle.unreadable(str(exc))
        return Delivery(settle.result, "", picked.next, 0, picked.now_ms)
    try:
        out = delivery_outbound(route, request, ref.key)
    except Exception as exc:  # a fault of the gateway's own, before anything was sent
        log.exception("delivery %s key %r: the request could not be built", route.name, ref.key)
        await guarded(settle.retry(f"not sent: {FAULT}: {type(exc).__name__}"), settle)
        return Delivery(settle.result, "", picked.next, 0, picked.now_ms, settle.upstream)
    await engine.forward_unattended(route, ref, out, settle)
    return Delivery(settle.result, "", picked.next, 0, picked.now_ms, settle.upstream, settle.error)


def delivery_outbound(route: Route, request: StoredRequest, key: str) -> Outbound:
    url = route.upstream + request.target
    return Outbound(request.method, url, with_key(route, list(request.headers), key), request.body)
