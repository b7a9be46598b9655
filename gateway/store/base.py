"""The store interface: one async method per operation on a key's record.

Every method is atomic on one record: it reads and changes the record in one step
(a Lua script on Redis, a critical section with no await in memory). Times come
from the store's clock, never the caller's, so replicas with skewed clocks agree on
leases and ages. Every state change is conditional on the run id (or operator)
that is allowed to make it, and is safe to repeat: a retried command that already
took effect reports success again instead of doing it twice.

Both implementations pass the contract suite in tests/test_store_contract.py.
"""

from __future__ import annotations

import abc
import asyncio
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from gateway.encryption import PLAIN, ResponseCodec, Unreadable
from gateway.records import OPEN_STATES, KeyRef, Record, State, StoredResponse

if TYPE_CHECKING:
    from gateway.config import StoreConfig

#: What an in_flight record whose lease ran out becomes, per route policy.
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


class Store(abc.ABC):
    """Records of idempotency keys. See the module docstring for the guarantees.

    Stored responses go through `codec` (plain, or sealed with the configured
    keys). A record whose response cannot be read is returned with `response`
    None and `unreadable` saying why; it is never changed or deleted for it."""

    #: Seconds (low, high) a waiter sleeps before it re-reads without a notification.
    fallback_wait = (0.5, 1.0)

    def __init__(self, codec: ResponseCodec = PLAIN) -> None:
        self.notifier = Notifier()
        self.codec = codec

    def read_response(self, digest: str, data: bytes) -> tuple[StoredResponse | None, str]:
        """The response stored as `data` in record `digest`, or None and why not."""
        try:
            return self.codec.decode(digest, data), ""
        except Unreadable as exc:
            return None, str(exc)

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
        self, ref: KeyRef, run_id: str, response: StoredResponse, ttl: float
    ) -> bool:
        """Store the response and make the record `completed`, expiring after `ttl`.

        Only the run that claimed the key may complete it, and only from `in_flight`
        or `unresolved` (a late answer is still the answer). Returns False, changing
        nothing, for any other run or state: a stale worker never overwrites a newer
        run, nor a record a person holds. Waiters are notified.
        """

    @abc.abstractmethod
    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        """Free the key so the next request runs, if `run_id` owns it in flight.
        A record with a history becomes a `released` tombstone (expiring after `ttl`)
        so the story survives; others are deleted. False if someone else owns it."""

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
    ) -> str:
        """Record a check's `answer` in the history and act on `result`: "done"
        completes with `response`, "not_done" releases, "inconclusive" keeps it
        unresolved, or parks it once it has been unresolved for `park_after`.
        Returns the state after, or "" if the record was no longer unresolved for
        `run_id` (someone else settled it; nothing changed)."""

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
        the note."""

    @abc.abstractmethod
    async def open_records(self, states: frozenset[State]) -> list[Record]:
        """Every record in these states (in_flight, unresolved, parked, claimed),
        read from the indexes, never by scanning the keyspace."""

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


class Watch(asyncio.Event):
    """Set when the watched key changed. `completed` holds the fingerprint and
    response of a completion that came with its notice, else None: read the record."""

    def __init__(self) -> None:
        super().__init__()
        self.completed: tuple[str, StoredResponse] | None = None


class Notifier:
    """Per-process fan-out of "this key changed" to local waiters.

    A change is announced to every caller whose `claim` found the record in flight
    (the Redis store publishes only then: most keys never have a waiter).

    A waiter registers *before* it reads the record, so a change that lands between
    the read and the wait is not missed.
    """

    def __init__(self) -> None:
        self._watchers: dict[str, set[Watch]] = {}

    @contextmanager
    def watch(self, digest: str) -> Iterator[Watch]:
        event = Watch()
        watchers = self._watchers.setdefault(digest, set())
        watchers.add(event)
        try:
            yield event
        finally:
            watchers.discard(event)
            if not watchers:
                self._watchers.pop(digest, None)

    def watching(self, digest: str) -> bool:
        return digest in self._watchers

    def notify(self, digest: str, completed: tuple[str, StoredResponse] | None = None) -> None:
        """Wake the key's watchers; `completed` (fingerprint, response) when the
        change was a completion whose response came with the notice."""
        for event in self._watchers.get(digest, ()):
            if completed is not None:
                event.completed = completed
            event.set()

    def notify_all(self) -> None:
        """After a reconnect, when notifications may have been lost."""
        for watchers in self._watchers.values():
            for event in watchers:
                event.set()
