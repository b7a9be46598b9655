"""The store interface: one async method per operation on a key's record.

Every method is atomic on one record: it reads and changes the record in one step
(a Lua script on Redis, a critical section with no await in memory). Times come
from the store's clock, never the caller's, so replicas with skewed clocks agree on
leases and ages. Every state change is conditional on the run id (or operator)
that is allowed to make it, and is safe to repeat: a retried command that already
took effect reports success again instead of doing it twice.

Deliveries (routes with delivery: async) add a queue on the same records: `accept`
stores a request and queues it, `pick` claims a due one for an attempt, and
`retry_later` schedules the next; the engine settles an attempt as it settles a sync
forward. Workers are woken by `due` notices (at-most-once, like `notifier`) and their
own timers; `due_candidates` is the rescan for notices that were lost, and reads the
due indexes only.

Both implementations pass the contract suite in tests/test_store_contract.py.
"""

from __future__ import annotations

import abc
import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from gateway.encryption import PLAIN, ResponseCodec, Unreadable
from gateway.records import OPEN_STATES, KeyRef, Record, State, StoredRequest, StoredResponse
from gateway.store.notices import Due, DueFeed, Notifier, Watch

if TYPE_CHECKING:
    from gateway.config import StoreConfig

#: What an in_flight record whose lease ran out becomes, per route policy (a
#: delivery's, under "release", becomes unresolved: it is never dropped or resent blind).
ExpiredPolicy = Literal["unresolved", "parked", "release"]

#: The ExpiredPolicy for each `on_unknown_outcome` setting of a route.
EXPIRED_POLICY: dict[str, ExpiredPolicy] = {
    "park": "parked",
    "release": "release",
    "reconcile": "unresolved",
}


def codec_for(config: StoreConfig) -> ResponseCodec:
    """How the configured store writes responses: sealed when a key is set; and reads
    them: plain ones only without a key, or with store.read_unencrypted."""
    if not config.encryption_key and not config.previous_encryption_keys:
        return PLAIN
    return ResponseCodec(
        config.encryption_key or None,
        config.previous_encryption_keys,
        read_plain=config.read_unencrypted,
    )


#: How much harm each maxmemory-policy can do to records, least first: noeviction
#: refuses writes when memory is full; volatile-* evict keys with a ttl (completed
#: and released records: their keys run again); allkeys-* evict any record.
_EVICTION_HARM = {"noeviction": 0, "volatile": 1, "allkeys": 2}
_AOF_HARM = {"yes": 0, "n/a": 0, "unknown": 1, "no": 2}


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """How the store keeps records, as it reports it (Redis: INFO, which managed
    services allow where CONFIG is disabled)."""

    #: Redis maxmemory-policy: anything but "noeviction" may drop records, and a
    #: dropped record is a key that runs again. "unknown" if INFO would not say.
    maxmemory_policy: str
    #: "yes": every write also goes to an append-only file; "no": a restart loses
    #: what the last snapshot (if any) did not hold; "n/a": nothing to persist.
    aof: str
    #: where it was read, for messages: an address, or the cluster master it came from
    source: str = ""
    #: why INFO could not be read (an ACL without +info), if it could not
    error: str = ""

    @property
    def evicts(self) -> bool:
        return self.maxmemory_policy != "noeviction"

    def worse(self, other: StoreInfo) -> StoreInfo:
        """Of two servers' answers, the policy more likely to lose records and the
        persistence more likely to lose them: what holds for all of them."""

        def harm(info: StoreInfo) -> int:
            return _EVICTION_HARM.get(info.maxmemory_policy.partition("-")[0], 3)

        policy = self if harm(self) >= harm(other) else other
        aof = max(self.aof, other.aof, key=lambda aof: _AOF_HARM.get(aof, 1))
        return replace(policy, aof=aof)

    def refusal(self, allow_eviction: bool) -> str:
        """Why a gateway on this store is not ready, or "" if it is."""
        if not self.evicts or allow_eviction:
            return ""
        where = f"Redis at {self.source}" if self.source else "Redis"
        if self.error:
            found = f"{where} did not say its maxmemory-policy ({self.error})"
            fix = "allow the gateway's Redis user to run INFO (+info)"
        else:
            found = f"{where} has maxmemory-policy {self.maxmemory_policy}"
            fix = "set maxmemory-policy noeviction"
        return (
            f"{found}: it may evict records, and a key whose record is evicted runs "
            f"again. {fix[0].upper()}{fix[1:]}, or store.allow_eviction: true if a key "
            "may run again when Redis evicts its record"
        )


@dataclass(frozen=True, slots=True)
class StateCount:
    route: str
    state: State
    count: int
    oldest_seconds: float


@dataclass(frozen=True, slots=True)
class OperatorResult:
    ok: bool
    #: the record's state: after the change when ok, as found when refused
    state: str = ""
    #: why it was refused: "held" (another operator holds it), "holder" (only the
    #: holder may resolve), "state" (not a legal move from `state`), "missing"
    refused: str = ""
    holder: str = ""
    holder_since_ms: int = 0


@dataclass(frozen=True, slots=True)
class Accepted:
    """What `accept` did: "queued" (the key is now queued for the caller's run),
    "exists" (`record` is what was there) or "full" (not admitted: nothing stored)."""

    outcome: Literal["queued", "exists", "full"]
    now_ms: int
    record: Record | None = None


@dataclass(frozen=True, slots=True)
class PickResult:
    #: the record, in_flight for the caller's run id, or None if nothing was picked
    record: Record | None
    #: its stored request, sealed by the codec (the engine opens it); b"" if none
    request: bytes = b""
    #: "" picked, "gone" (not queued or retrying), "not_due", "exhausted" (parked)
    why: str = ""
    #: when "not_due": when it is due
    due_ms: int = 0
    #: the next due delivery of the route the store saw, if any
    next: Due | None = None
    now_ms: int = 0


@dataclass(frozen=True, slots=True)
class QueueStat:
    route: str
    queued: int
    retrying: int
    #: the longest a due delivery has waited: queued since accepted, retrying since due
    oldest_wait_seconds: float


class Store(abc.ABC):
    """Records of idempotency keys. See the module docstring for the guarantees.

    Stored responses go through `codec` (plain, or sealed with the configured
    keys). A record whose response cannot be read is returned with `response`
    None and `unreadable` saying why; it is never changed or deleted for it."""

    #: Seconds (low, high) a waiter sleeps before it re-reads without a notification.
    fallback_wait = (0.5, 1.0)

    def __init__(self, codec: ResponseCodec = PLAIN) -> None:
        self.notifier = Notifier()
        self.due = DueFeed()
        self.codec = codec

    def read_response(self, digest: str, data: bytes) -> tuple[StoredResponse | None, str]:
        """The response stored as `data` in record `digest`, or None and why not."""
        try:
            return self.codec.decode(digest, data), ""
        except Unreadable as exc:
            return None, str(exc)

    def read_token(self, digest: str, data: bytes) -> str:
        """The status token stored as `data`, or "" if it cannot be opened (a status
        request then finds nothing: the record itself is kept as it is)."""
        try:
            return self.codec.decode_token(digest, data)
        except Unreadable:
            return ""

    async def start(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Connect (and subscribe to change notifications). Called once."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Records stay where the store keeps them."""

    async def ping(self) -> None:  # noqa: B027 - an in-process store always answers
        """Raise StoreError unless the store answers."""

    @abc.abstractmethod
    async def info(self) -> StoreInfo:
        """How the store keeps records: its eviction policy and whether it writes an
        append-only file, read from the store each call (a policy can be changed at
        run time). Several servers (a cluster's masters) answer with the worst of
        them (`StoreInfo.worse`). Raises StoreError if the store does not answer; a
        store that answers but will not say (INFO refused) reports policy "unknown".
        A store that can lose records this way logs what it found whenever that
        differs from the last call's (so at start, and after a change), naming the fix."""

    async def check_reset(self) -> int:
        """How many parts of the store lost every record since the last call (a
        restart without persistence, a flush, an eviction), or 0. The first call
        leaves a marker in each part, so only a loss seen by a running gateway is
        reported: a gateway started after it cannot tell. Raises StoreError if the
        store does not answer. An in-process store cannot lose records behind the
        gateway's back."""
        return 0

    # -- the request path -------------------------------------------------------

    @abc.abstractmethod
    async def claim(
        self,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        lease: float,
        expired: ExpiredPolicy = "unresolved",
    ) -> Record | None:
        """Claim `ref` for `run_id`, or read what is there, in one atomic step.

        Returns None when the key was free (or `released`): it is now `in_flight`,
        owned by `run_id`, with a lease of `lease` seconds from the store's clock; a
        released record's history is carried on. A claim repeated by the same run id
        (a retried command) returns the record it already created, which the caller
        recognises by its run id.

        Otherwise returns the record. An `in_flight` record whose lease has run out
        (the gateway holding it died) first becomes what `expired` says, reason
        "lease_expired": never released blind unless the route says so.
        """

    @abc.abstractmethod
    async def complete(
        self,
        ref: KeyRef,
        run_id: str,
        response: StoredResponse,
        ttl: float,
        attempt: dict[str, Any] | None = None,
    ) -> bool:
        """Store the response and make the record `completed`, expiring after `ttl`.

        Only the run that claimed the key may complete it, and only from `in_flight`
        or `unresolved` (a late answer is still the answer). Returns False, changing
        nothing, for any other run or state: a stale worker never overwrites a newer
        run, nor a record a person holds. Waiters are notified. A delivery's stored
        request is deleted in the same step; `attempt` becomes its last attempt. A
        completion with a status below 500 is the route's last success (see
        `last_successes`), written in the same step.
        """

    @abc.abstractmethod
    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        """Free the key so the next request runs, if `run_id` owns it in flight.
        A record with a history becomes a `released` tombstone (expiring after `ttl`)
        so the story survives; others are deleted. False if someone else owns it.
        A delivery's stored request is deleted in the same step (no delivery path
        releases: an attempt that may be repeated goes through `retry_later`)."""

    @abc.abstractmethod
    async def mark_unresolved(
        self, ref: KeyRef, run_id: str, reason: str, *, park: bool = False
    ) -> bool:
        """Turn `run_id`'s `in_flight` record `unresolved` (or straight to `parked`)
        with `reason`; it no longer expires. False, changing nothing, if `run_id`
        does not own it in flight. Waiters are notified."""

    @abc.abstractmethod
    async def get(self, ref: KeyRef) -> Record | None:
        """The record, or None. Reads only (ref.digest is all it needs)."""

    # -- deliveries --------------------------------------------------------------

    @abc.abstractmethod
    async def accept(
        self,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        request: StoredRequest,
        token: str,
        *,
        admit: bool = True,
        origin: str = "",
        expired: ExpiredPolicy = "unresolved",
    ) -> Accepted:
        """Queue `request` for delivery under `ref`, or read what is there, in one
        atomic step (the claim of a delivery: the caller answers 202 on "queued").

        "queued": the key was free (or `released`): it is now `queued` for `run_id`,
        a delivery record with no attempt yet, due at the store's now, its request
        and `token` stored sealed with `codec` (a released record's history carried
        on), and `due.announce`d to every process with `origin`. Accepted again by
        the same run id (a retried command), it returns "exists" with the record it
        made (same run id, state queued unless an attempt already took it).
        "full": the key was free and `admit` was False; nothing is stored.
        "exists": anything else, with the record (never its request). An expired
        in_flight lease first becomes what `expired` says, as in `claim`. Queued
        records never expire. With wait_for_replicas, a queued record the replicas
        did not confirm raises StoreError and stays queued (a repeat finds it)."""

    @abc.abstractmethod
    async def pick(
        self,
        route: str,
        hint: KeyRef,
        run_id: str,
        lease: float,
        max_attempts: int,
        replica: str,
        park_reason: str = "attempts exhausted",
    ) -> PickResult:
        """Claim one due delivery of `route` for an attempt by `run_id`, atomically.

        Claims `hint` if it is queued or retrying and due: it becomes `in_flight`
        for `run_id` with a lease of `lease` seconds from the store's clock, its
        attempts counted up, an `attempt` event naming `replica` and the run id, and
        every process told `due.taken`. Returns it with its sealed request. A record
        with `max_attempts` or more attempts is parked with `park_reason` instead
        (why "exhausted"): no attempt over the limit ever starts. A store that can
        search in the same step (memory) claims the earliest due delivery of `route`
        when the hint is gone or not due; Redis cannot (a script touches only the
        keys it is given: the hint's bucket) and returns "gone" or "not_due" (with
        `due_ms`). `next` names the next due delivery of `route` the store saw (the
        hint's bucket, on Redis). Never claims one record for two runs; never claims
        one that is not due."""

    @abc.abstractmethod
    async def retry_later(
        self,
        ref: KeyRef,
        run_id: str,
        delay: float | None,
        attempt: dict[str, Any],
        origin: str = "",
    ) -> bool:
        """The attempt of `run_id` did not complete and may be repeated (it was never
        sent, or its status is not cached): record `attempt` (result, status, error,
        retry_after: JSON values) as the last attempt and in the history. With
        `delay`, the record becomes `retrying`, due `delay` seconds from the store's
        now, announced with `origin`; with None (no attempt left) it is parked, its
        reason `attempt["reason"]` or "attempts exhausted". Only from `in_flight`
        owned by `run_id` on a delivery record; the same call repeated after it took
        effect returns True; False, changing nothing, otherwise."""

    @abc.abstractmethod
    async def get_request(self, ref: KeyRef) -> StoredRequest | None:
        """A delivery's stored request, opened (Unreadable if it cannot be); None
        once its key settled (completed or released), or for any other record."""

    @abc.abstractmethod
    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]:
        """Up to `limit` queued and retrying deliveries of `route` per part of the
        store (memory: one; Redis: each bucket), earliest due first, and the store's
        now: the rescan for notices that may have been lost. Reads only, and only
        the due indexes, never the keyspace."""

    @abc.abstractmethod
    async def queue_stats(self) -> list[QueueStat]:
        """Per route with pending deliveries (routes no longer configured too):
        queued and retrying counts and the oldest wait, by route name. Reads the
        due indexes and per-bucket counts only: O(buckets x routes), never
        O(records) (memory: in-process, O(pending))."""

    # -- the sweep and the reconciler -----------------------------------------------

    @abc.abstractmethod
    async def expire_leases(
        self, policy: Callable[[str], ExpiredPolicy], limit: int = 1000
    ) -> list[tuple[KeyRef, str]]:
        """Turn in-flight records whose lease ran out into what `policy(route)` says.
        Returns what changed (at most `limit`); safe to run in every replica at once."""

    @abc.abstractmethod
    async def begin_check(self, ref: KeyRef, run_id: str, lock: float, min_interval: float) -> bool:
        """Take the right to check an `unresolved` record with the upstream: True
        for one caller across all replicas while `lock` lasts, and at most once per
        `min_interval`. False if the record is not unresolved for `run_id`."""

    @abc.abstractmethod
    async def end_check(
        self,
        ref: KeyRef,
        run_id: str,
        result: str,
        answer: dict[str, Any],
        response: StoredResponse | None,
        ttl: float,
        park_after: float,
        retry_in: float | None = None,
    ) -> str:
        """Record a check's `answer` in the history and act on `result`: "done"
        completes with `response`, "not_done" releases, "inconclusive" keeps it
        unresolved, or parks it once it has been unresolved for `park_after`.
        Returns the state after, or "" if the record was no longer unresolved for
        `run_id` (someone else settled it; nothing changed).

        On a delivery record, "not_done" makes it `retrying`, due `retry_in`
        seconds from the store's now (announced), or `parked` when `retry_in` is
        None (no attempt left); "done" deletes its request with the completion."""

    @abc.abstractmethod
    async def park(self, ref: KeyRef, reason: str) -> bool:
        """Hand an `unresolved` record to a person. False from any other state."""

    # -- operators ---------------------------------------------------------------

    @abc.abstractmethod
    async def operator_claim(self, ref: KeyRef, operator: str, force: bool) -> OperatorResult:
        """Take an unresolved, parked or claimed record for `operator`, recording who
        and when. Another operator's claim is refused (with holder and since) unless
        `force`, which is recorded as a takeover. Claiming again as the holder is ok."""

    @abc.abstractmethod
    async def operator_resolve(
        self,
        ref: KeyRef,
        operator: str,
        outcome: str,
        note: str,
        response: StoredResponse | None,
        ttl: float,
    ) -> OperatorResult:
        """Only the holder of a `claimed` record may resolve it: "done" completes it
        with `response` (replayed to repeats), "retry" releases it. Recorded with
        the note. On a delivery record, "retry" queues it again (attempts from 0,
        due now, announced; state "queued") and "done" deletes its request."""

    @abc.abstractmethod
    async def open_records(self, states: frozenset[State]) -> list[Record]:
        """Every record in these states (in_flight, unresolved, parked, claimed,
        queued, retrying), read from the indexes (deliveries: the due indexes), never
        by scanning the keyspace."""

    @abc.abstractmethod
    async def last_successes(self) -> dict[str, float]:
        """Per route, seconds since its last success by the store's clock: the last
        `complete` of a response below 500 (the upstream's answer to a forward or a
        delivery: a check's or an operator's "done" is none), by any replica. A
        route without one is absent. Reads only. PostgreSQL keeps it to the second (a
        route's row is written at most once a second, so completions do not queue on
        its lock); the other stores to the millisecond."""

    async def stats(self) -> list[StateCount]:
        """Count and oldest age per route of unresolved, parked and claimed records."""
        groups: dict[tuple[str, State], list[float]] = {}
        for record in await self.open_records(OPEN_STATES):
            groups.setdefault((record.route, record.state), []).append(record.state_age)
        return [
            StateCount(route, state, len(ages), max(ages))
            for (route, state), ages in sorted(groups.items())
        ]

    async def wait(self, ref: KeyRef, watch: Watch, timeout: float) -> None:
        """Wait until `watch` (from `notifier.watch`) fires or a jittered fallback
        delay passes, whichever is first, never longer than `timeout`.

        Notifications are at-most-once (a reconnect drops them), so callers re-read
        after this returns; the fallback delay keeps that from becoming a tight loop.
        """
        fallback = min(timeout, random.uniform(*self.fallback_wait))
        try:
            async with asyncio.timeout(fallback):
                await watch.wait()
        except TimeoutError:
            pass
