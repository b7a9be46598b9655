"""How a forward's outcome settles its key, once the engine's classifier has said what
the outcome is: the one place that classifies (`Engine._forward_and_settle`) calls a
`Settlement`, and the settlement makes the store move that fits the path.

    classifier sees                 SyncSettlement         DeliverySettlement
    a status in cache_statuses      complete               complete (its last attempt)
    another status, or NotSent      release (retry runs)   retry_later per plan(), or park
    OutcomeLost, cut off, shutdown  engine.unknown         engine.unknown (never retried)
    a fault while settling          engine.unknown         engine.unknown (`guarded`)

`cache_statuses` defaults to records.is_success (2xx, 3xx, 4xx but 408 and 429): the
rule that decides what the upstream handled is one, for both paths. `SyncSettlement`
is here; `DeliverySettlement` is a delivery attempt's (gateway/delivery/attempt.py).

Beside them: the `Reply` a caller gets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

from gateway.config import Route
from gateway.errors import StoreError
from gateway.records import KeyRef, StoredResponse
from gateway.store.base import Store
from gateway.upstream import BodyStream, UpstreamResponse

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


#: How a record's reason begins when a fault of the gateway's own decided it.
FAULT = "the gateway failed (see its log)"


async def guarded(
    step: Awaitable[StoredResponse | None], settle: Settlement
) -> StoredResponse | None:
    """One settlement step (complete, retry, lost, or the classifier's choice of them).
    A store that fails raises StoreError, which `settle_change` handles; any other
    exception is a fault of the gateway's own, and must not leave the key in flight
    until its lease runs out (then parked as if nobody had answered). The request was
    sent, or whether it was is what could not be recorded: the key is left open as an
    unknown outcome at once, per the route's policy, and the fault is logged with its
    traceback. If even that fails, the lease is what remains."""
    try:
        return await step
    except Exception as exc:
        log.exception("settling %s key %r failed", settle.route.name, settle.ref.key)
        reason = f"{FAULT}: {type(exc).__name__} while recording the outcome"
    try:
        await settle.lost(reason)
    except Exception:
        log.exception(
            "%s key %r could not be left unresolved either; its lease will expire into review",
            settle.route.name,
            settle.ref.key,
        )
    return None


class KeyMoves(Protocol):
    """What a settlement asks of the engine: the store, the count, and the two moves
    that leave a key for another run (release) or for a check (unknown)."""

    store: Store

    def count(self, route: Route, outcome: str) -> None: ...

    async def release(self, route: Route, ref: KeyRef, run_id: str, reason: str) -> None: ...

    async def unknown(self, route: Route, ref: KeyRef, run_id: str, reason: str) -> None: ...


class SyncSettlement:
    """A caller is waiting: the key is completed, released for its retry, or left open."""

    __slots__ = ("engine", "ref", "route", "run_id")

    def __init__(self, engine: KeyMoves, route: Route, ref: KeyRef, run_id: str) -> None:
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
