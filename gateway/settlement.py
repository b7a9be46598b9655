"""How a forward's outcome settles its key, once the engine's classifier has said what
the outcome is: the one place that classifies (`Engine._forward_and_settle`) calls a
`Settlement`, and the settlement makes the store move that fits the path.

    classifier sees                 SyncSettlement         DeliverySettlement
    a status in cache_statuses      complete               complete (its last attempt)
    another status, or NotSent      release (retry runs)   retry_later per plan(), or park
    OutcomeLost, cut off, shutdown  engine._unknown        engine._unknown (never retried)

Beside them: the `Reply` a caller gets; one delivery attempt (`attempt`, which is
`Engine.deliver`); what an async route stores (`stored_request`) and answers (the 202,
`accepted_reply`).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import os
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_text
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config import Route
from gateway.delivery import Delivery, parse_retry_after, plan
from gateway.errors import ProblemError, StoreError
from gateway.forwarding import forwarded_headers
from gateway.keys import RequestParts
from gateway.outbound import Origin, Outbound, with_key
from gateway.records import KeyRef, StoredRequest, StoredResponse
from gateway.response import BodyStream, UpstreamResponse
from gateway.status import status_url

if TYPE_CHECKING:
    from gateway.engine import Engine

log = logging.getLogger("gateway.engine")


@dataclass(slots=True)  # not frozen, for the same reason as UpstreamResponse
class Reply:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: bytes of `body` counted in the engine's response budget until they are written
    held: int = 0
    #: the body as it arrives, when it was too large to hold (`body` is then empty)
    rest: BodyStream | None = None
    #: for a key's streamed body: the task that settles the key once the body ends
    settling: asyncio.Task[None] | None = None


class Settlement(Protocol):
    route: Route
    ref: KeyRef

    async def complete(self, stored: StoredResponse, response: UpstreamResponse) -> None:
        """The answer is whole and its status is cached: the key is done."""

    async def retry(self, reason: str, response: UpstreamResponse | None = None) -> None:
        """Never sent, or answered a status not cached: the job may run again."""

    async def lost(self, reason: str) -> None:
        """It may have run: the key stays open per the route's policy."""


async def settle_change(change: Awaitable[bool], ref: KeyRef, what: str) -> bool:
    """Record the outcome. If the store fails now, the record stays in flight and
    its lease turns it unresolved later: a conservative state, never a lost one."""
    try:
        ok = await change
    except StoreError as exc:
        log.error("could not %s key %r (%s); its lease will expire into review", what, ref.key, exc)
        return False
    if not ok:
        log.warning("could not %s key %r: another run or an operator holds it", what, ref.key)
    return ok


class SyncSettlement:
    """A caller is waiting: the key is completed, released for its retry, or left open."""

    __slots__ = ("engine", "ref", "route", "run_id")

    def __init__(self, engine: Engine, route: Route, ref: KeyRef, run_id: str) -> None:
        self.engine, self.route, self.ref, self.run_id = engine, route, ref, run_id

    async def complete(self, stored: StoredResponse, response: UpstreamResponse) -> None:
        route = self.route
        change = self.engine.store.complete(self.ref, self.run_id, stored, route.response_ttl)
        await settle_change(change, self.ref, "complete")
        self.engine.count(route, "forwarded")

    async def retry(self, reason: str, response: UpstreamResponse | None = None) -> None:
        await self.engine.release(self.route, self.ref, self.run_id, reason)
        self.engine.count(self.route, "upstream_error")

    async def lost(self, reason: str) -> None:
        await self.engine.unknown(self.route, self.ref, self.run_id, reason)


class DeliverySettlement:
    """Nobody waits (the caller got 202): a delivery is completed, scheduled again per
    the route's retry (Retry-After wins, up to max_backoff), parked when no attempt is
    left, or left open when its outcome is unknown. `result` says which."""

    __slots__ = ("attempts", "engine", "ref", "replica", "result", "route", "run_id")

    def __init__(
        self, engine: Engine, route: Route, ref: KeyRef, run_id: str, attempts: int, replica: str
    ) -> None:
        self.engine, self.route, self.ref, self.run_id = engine, route, ref, run_id
        self.attempts, self.replica = attempts, replica
        self.result = ""

    async def complete(self, stored: StoredResponse, response: UpstreamResponse) -> None:
        attempt = {"result": "completed", "status": response.status}
        change = self.engine.store.complete(
            self.ref, self.run_id, stored, self.route.response_ttl, attempt
        )
        await settle_change(change, self.ref, "complete")
        self.result = "completed"

    async def retry(self, reason: str, response: UpstreamResponse | None = None) -> None:
        retry_after = None
        if response is not None:
            value = next((v for n, v in response.headers if n.lower() == "retry-after"), None)
            retry_after = parse_retry_after(value, time.time())
        delay = plan(self.route, self.attempts, retry_after)
        attempt: dict[str, Any] = {
            "result": "retry_scheduled" if delay is not None else "exhausted",
            "status": response.status if response is not None else None,
            "error": reason,
            "retry_after": retry_after,
        }
        if delay is None:
            attempt["reason"] = f"attempts exhausted ({self.attempts}); last: {reason}"
        change = self.engine.store.retry_later(
            self.ref, self.run_id, delay, attempt, origin=self.replica
        )
        await settle_change(change, self.ref, "schedule a retry of")
        log.info(
            "delivery %s key %r attempt %d: %s -> %s",
            self.route.name,
            self.ref.key,
            self.attempts,
            reason,
            f"again in {delay:.3g}s" if delay is not None else "parked, no attempt left",
        )
        self.result = str(attempt["result"])

    async def lost(self, reason: str) -> None:
        await self.engine.unknown(self.route, self.ref, self.run_id, reason)
        self.result = "unknown_outcome"

    async def unreadable(self, error: str) -> None:
        """The stored request cannot be opened: it is never sent; a person decides."""
        attempt = {"result": "exhausted", "reason": f"stored request unreadable: {error}"}
        log.error("delivery %s record %s: %s", self.route.name, self.ref.digest, attempt["reason"])
        change = self.engine.store.retry_later(self.ref, self.run_id, None, attempt)
        await settle_change(change, self.ref, "park")
        self.result = "exhausted"


async def attempt(engine: Engine, route: Route, hint: KeyRef, replica: str) -> Delivery:
    """`Engine.deliver`: pick `hint` (or, where the store can, the route's earliest due
    delivery) for a new run id, send its stored request through the engine's one
    classifier, and say what happened. An unreadable request is never sent: parked."""
    run_id = secrets.token_hex(8)
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
    settle = DeliverySettlement(engine, route, ref, run_id, record.attempts, replica)
    try:
        request = engine.store.codec.decode_request(ref.digest, picked.request)
    except (ValueError, TypeError) as exc:  # Unreadable is one: never sent, parked
        await settle.unreadable(str(exc))
        return Delivery(settle.result, "", picked.next, 0, picked.now_ms)
    out = delivery_outbound(route, request, ref.key)
    done: asyncio.Future[StoredResponse | None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(engine._forward_and_settle(route, ref, out, done, settle))
    engine.tasks.add(task)
    task.add_done_callback(engine.tasks.discard)
    try:
        reply = await asyncio.shield(task)
    except ProblemError:
        pass  # the settlement recorded what happened
    else:
        engine._unsent(task)  # nobody writes it: its budget back, a stream read to its end
        if reply.settling is not None:
            await asyncio.shield(reply.settling)
    return Delivery(settle.result, "", picked.next, 0, picked.now_ms)


def stored_request(route: Route, parts: RequestParts, origin: Origin) -> StoredRequest:
    """The request as the upstream will get it at each attempt, minus what is never
    stored: delivery.drop_headers and the key header (added again from the key)."""
    drop = never_stored(route.delivery.drop_headers, route.forward_key_header)
    headers = forwarded_headers(parts.headers, origin.client, origin.scheme, origin.proxies)
    # The names are lower-case already (RequestParts' and forwarded_headers' own lines).
    kept = tuple([(n, v) for n, v in headers if n not in drop])
    target = parts.path + ("?" + parts.query if parts.query else "")
    return StoredRequest(parts.method, target, kept, parts.body)


@functools.lru_cache(maxsize=256)
def never_stored(drop_headers: frozenset[str], key_header: str | None) -> frozenset[str]:
    """The lower-case names an async route never stores, built once per route setting
    (drop_headers are lower-case from the config; the key header may be any case)."""
    return (drop_headers | {key_header.lower()}) if key_header else drop_headers


def delivery_outbound(route: Route, request: StoredRequest, key: str) -> Outbound:
    url = route.upstream + request.target
    return Outbound(request.method, url, with_key(route, list(request.headers), key), request.body)


def delivery_ids() -> tuple[str, str]:
    """An accept's run id (64 bits in hex, as `secrets.token_hex(8)` gives a sync run)
    and its status token (128 bits, spelled as `secrets.token_urlsafe(16)`), from one
    read of the system's CSPRNG instead of two."""
    drawn = os.urandom(24)
    return drawn[:8].hex(), base64.urlsafe_b64encode(drawn[8:]).rstrip(b"=").decode()


def accepted_reply(
    prefix: str, route: Route, ref: KeyRef, state: str, token: str, *, replayed: bool
) -> Reply:
    """202 with the small body a client polls by: its status URL, also in Location."""
    url = status_url(prefix, route.name, ref.digest, token)
    # json.dumps({"route": ..., "key": ..., "state": ..., "status_url": ...}), spelled
    # out: each value through json's own string encoder, without building a dict and
    # an encoder per 202 (test_status_url checks the two agree).
    body = (
        f'{{"route": {_json_text(route.name)}, "key": {_json_text(ref.key)}, '
        f'"state": {_json_text(state)}, "status_url": {_json_text(url)}}}'
    )
    headers = [
        ("content-type", "application/json"),
        ("location", url),
        ("cache-control", "no-store"),
    ]
    if replayed:
        headers.append(("idempotent-replayed", "true"))
    return Reply(202, tuple(headers), body.encode())
