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

Operator surfaces read pages (`list_records`, from a cursor) and counts the store
keeps as records change (`stats`, `queue_stats`): neither grows with the records.
`accept` decides an async route's bound against the store's own count, in its step.

A copy to another store (store/copy.py, with the gateway stopped) reads every record
with `export_records` and writes it with `import_records`, as it is: no move is made.

The store also keeps the operator roster (store/operator_roster.py) and the async
routes' pauses (store/route_pauses.py), whose contracts Store takes on.

Every implementation passes the contract suite in tests/test_store_contract.py.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import random
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from gateway.encryption import PLAIN, ResponseCodec, Unreadable
from gateway.records import (
    KeyRef,
    QueueStat,
    Record,
    State,
    StateCount,
    StoredRequest,
    StoredResponse,
    StoreInfo,
)
from gateway.store.notices import Due, DueFeed, Notifier, Watch
from gateway.store.operator_roster import OperatorRoster, RosterEntry
from gateway.store.pages import ANY, MAX_PAGE_SIZE, PAGE_SIZE, Match, Page
from gateway.store.route_pauses import PauseMove, PauseState, RoutePauses, Verdict
from gateway.store.transfer import EXPORT_PAGE, ExportedRecord, ExportPage

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


def duration_ms(seconds: float) -> int:
    """A lease, ttl or lock in the stores' milliseconds: never 0, which Redis and the
    SQL read as "no expiry"."""
    return max(1, int(seconds * 1000))


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


class NewDelivery(NamedTuple):
    """What `accept` queues: `request` under `ref` for `run_id`, with its status `token`.
    `limit` bounds the route's queued and retrying deliveries (None: no bound), `origin`
    names the announcing process, `expired` is what an expired lease found there becomes,
    `delay_ms` how long after the store's now the first attempt is due (0: at once)."""

    ref: KeyRef
    run_id: str
    fingerprint: str
    request: StoredRequest
    token: str
    limit: int | None = None
    origin: str = ""
    expired: ExpiredPolicy = "unresolved"
    delay_ms: int = 0


class CheckResult(NamedTuple):
    """What `end_check` records: the check of `run_id`'s unresolved record `ref` said
    `result` ("done", "not_done" or "inconclusive") with `answer` (the history's) and,
    when done, `response`. `ttl` is a settled record's, `park_after` how long it may stay
    unresolved, `retry_in` a delivery's next attempt (None: no attempt left)."""

    ref: KeyRef
    run_id: str
    result: str
    answer: dict[str, Any]
    response: StoredResponse | None
    ttl: float
    park_after: float
    retry_in: float | None = None


@dataclass(frozen=True, slots=True)
class Accepted:
    """What `accept` did: "queued" (the key is now queued for the caller's run),
    "exists" (`record` is what was there) or "full" (not admitted: nothing stored)."""

    outcome: Literal["queued", "exists", "full"]
    now_ms: int
    record: Record | None = None
    #: False: the caller's delivery is stored and queued, but the replicas
    #: `wait_for_replicas` asks for did not confirm it in time (a failover before they
    #: have it would lose it). Always True where the store does not replicate.
    confirmed: bool = True


@dataclass(frozen=True, slots=True)
class PickResult:
    #: the record, in_flight for the caller's run id, or None if nothing was picked
    record: Record | None
    #: its stored request, sealed by the codec (the engine opens it); b"" if none
    request: bytes = b""
    #: "" picked, "gone" (not queued or retrying), "not_due", "exhausted" (parked),
    #: "unconfirmed" (picked, but the replicas did not confirm it: put back unsent)
    why: str = ""
    #: when "not_due" or "unconfirmed": when it is due
    due_ms: int = 0
    #: the next due delivery of the route the store saw, if any
    next: Due | None = None
    now_ms: int = 0


@dataclass(frozen=True, slots=True)
class Counts:
    """The store's kept counts, read together for scrapes and overviews."""

    stats: list[StateCount]
    queues: list[QueueStat]
    #: route -> seconds since its last success, by the store
    successes: dict[str, float]
    #: route -> its pause row (store/route_pauses.py), for routes any move wrote
    pauses: dict[str, PauseState] = dataclasses.field(default_factory=dict)


#: The dummy token `Opener.no_token` opens: no record's (a digest is 32 hex digits).
_NO_DIGEST = "no record"
_NO_TOKEN = "-" * 22


class Opener:
    """What a store's parts read records with: its codec, opening a stored response or
    status token, or saying why it cannot."""

    def __init__(self, codec: ResponseCodec = PLAIN) -> None:
        self.codec = codec
        #: a token sealed as a stored one is, by the codec it was sealed with
        self._dummy_token: tuple[ResponseCodec, bytes] | None = None

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

    def no_token(self) -> str:
        """ "" for a status URL whose record has no token, after opening a fixed one as
        `read_token` opens a stored one (with `store.encryption_key`, a decryption):
        a guessed URL with a wrong token costs the same whether or not its key exists."""
        dummy = self._dummy_token
        if dummy is None or dummy[0] is not self.codec:
            dummy = self._dummy_token = (self.codec, self.codec.encode_token(_NO_DIGEST, _NO_TOKEN))
        self.read_token(_NO_DIGEST, dummy[1])
        return ""


class Store(OperatorRoster, RoutePauses):
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
        self.opener = Opener(codec)

    def read_response(self, digest: str, data: bytes) -> tuple[StoredResponse | None, str]:
        """The response stored as `data` in record `digest`, or None and why not."""
        return self.opener.read_response(digest, data)

    def read_token(self, digest: str, data: bytes) -> str:
        """The status token stored as `data`, or "" if it cannot be opened."""
        return self.opener.read_token(digest, data)

    def no_token(self) -> str:
        """ "" for a status URL whose record has no token, at the cost of opening one
        (`Opener.no_token`)."""
        return self.opener.no_token()

    async def start(self) -> None:
        """Connect (and subscribe to change notifications). Called once."""

    async def close(self) -> None:
        """Release connections. Records stay where the store keeps them."""

    async def ping(self) -> None:
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

        With wait_for_replicas, the caller's claim (made now, or found by its
        retried command) that the replicas did not confirm in time is released and
        raises StoreError: nothing was forwarded on it, so a refusal is the truth.
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
        completion whose status is a success (records.is_success: 2xx, 3xx, 4xx but
        408 and 429) is the route's last success (see `last_successes`), written in
        the same step.

        It happens whole or not at all: a `ttl` the store cannot keep (longer than
        config.units.MAX_DURATION, which config refuses) may be refused with
        StoreError, and then the record is exactly as it was (in flight, its lease
        running). On Redis each script checks its durations before its first write,
        since Redis does not undo a script's earlier commands when a later one fails.
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
    async def delivery_token(self, ref: KeyRef) -> str:
        """The status token of the delivery `ref` names (by digest), opened; "" when
        there is none: no such record, one past its expiry, not a delivery, or a token
        that does not open. Reads the token alone, never the response or the request,
        so a status URL with a wrong token costs what one for a missing record does,
        however large the record."""

    @abc.abstractmethod
    async def accept(self, delivery: NewDelivery) -> Accepted:
        """Queue `delivery.request` under `delivery.ref`, or read what is there, in one
        atomic step (the claim of a delivery: the caller answers 202 on "queued"). The
        names below are `delivery`'s fields.

        "queued": the key was free (or `released`): it is now `queued` for `run_id`,
        a delivery record with no attempt yet, due `delay_ms` after the store's now
        (`Accepted.now_ms`; no pick takes it before, in any process or after a
        restart: the due time is the record's own, in the due index), its request
        and `token` stored sealed with `codec` (a released record's history carried
        on), and `due.announce`d to every process with `origin`. Accepted again by
        the same run id (a retried command), it returns "exists" with the record it
        made (same run id, state queued unless an attempt already took it).
        "full": the key was free and `limit` (None: no bound) deliveries of the route
        are queued or retrying, counted by the store in the same step for every
        replica at once (a Cluster: redis/admission.py): nothing is stored. A repeat
        of a queued key is "exists" whatever the count.
        "exists": anything else, with the record (never its request): a queued
        record keeps the due time its first accept gave it. An expired
        in_flight lease first becomes what `expired` says, as in `claim`. Queued
        records never expire. With wait_for_replicas, the caller's queued record
        (queued now, or found queued by its retried command) that the replicas did
        not confirm in time stays queued and is returned with `confirmed` False:
        never dropped and never a StoreError, since the work it stands for will run
        (a repeat finds it)."""

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
        one that is not due. The same pick repeated (a retried command, or the worker
        retrying a pick that failed) finds the hint in flight for `run_id`: it is that
        pick, returned with its request again, nothing changed.

        With wait_for_replicas a pick is confirmed as a claim is, since it lets an
        attempt reach the upstream: one the replicas did not confirm in time (made
        now, or found by its repeat) is put back unsent, why "unconfirmed" with
        `due_ms` when it is due again (soon): queued again if no attempt was made
        before, else retrying, its attempts as they were, the pick's `attempt` event
        replaced by a `put_back` event that says why (unconfirmed picks in a row are
        one event, its `times` counted), and announced. Never left in flight, never
        an unknown outcome: nothing was sent. Only Redis has replicas to wait for:
        memory has none, and a PostgreSQL commit itself waits for the standbys
        `synchronous_standby_names` names."""

    @abc.abstractmethod
    async def retry_later(
        self,
        ref: KeyRef,
        run_id: str,
        delay: float | None,
        attempt: dict[str, Any],
        origin: str = "",
        *,
        uncounted: bool = False,
    ) -> bool:
        """The attempt of `run_id` did not complete and may be repeated (it was never
        sent, or its status is not cached): record `attempt` (result, status, error,
        retry_after: JSON values) as the last attempt and in the history. With
        `delay`, the record becomes `retrying`, due `delay` seconds from the store's
        now, announced with `origin`; with None (no attempt left) it is parked, its
        reason `attempt["reason"]` or "attempts exhausted". With `uncounted` (a
        paused route's probe that was refused or never sent) the attempt is not one
        of the delivery's: its attempts go back down by the one its pick counted
        (never below 0), so a later pick is not parked for it; the rest is as
        without. Only from `in_flight` owned by `run_id` on a delivery record; the
        same call repeated after it took effect returns True (attempts changed
        once); False, changing nothing, otherwise."""

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
        counts the store keeps and the due indexes' heads: O(routes) (Redis: x
        buckets), never O(records)."""

    @abc.abstractmethod
    async def take_token(self, name: str, per_second: float, burst: int) -> float:
        """Take a token from the rate limit `name` (store/rate.py): `per_second`
        tokens a second, at most `burst` at once after a quiet spell. One atomic step
        on the store's clock, shared by every process on the store (Redis: a script;
        PostgreSQL: one function call; SQLite: one operation; memory: this process).
        Returns 0.0 if a token was taken, else the seconds until one will be there
        (nothing taken, nothing changed). Over any span t, at most per_second x t +
        burst takes succeed, whoever asks. Every caller of one name gives the same
        rate and burst. Raises StoreError if the store does not answer."""

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
    async def end_check(self, check: CheckResult) -> str:
        """Record a check's `answer` in the history and act on `result` (the names here
        are `check`'s fields): "done"
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
    async def list_records(
        self,
        states: frozenset[State],
        *,
        route: str | None = None,
        older_than: float = 0.0,
        cursor: str = "",
        limit: int = PAGE_SIZE,
        match: Match = ANY,
    ) -> Page:
        """One page (1 to MAX_PAGE_SIZE records, else ValueError) of the records in
        `states`, of `route` if given, whose place is at least `older_than` seconds old
        (an in-flight record: its state's age) and that `match` keeps (its time range
        over the places, from the indexes; its key prefix, taken literally, and its
        upstream status, dropped after reading like the rest), from `cursor` ("" or a
        page's `next` or `prev`; InvalidCursor for any other text). Completed records
        are a route's completed deliveries (ValueError without `route`), listed by
        when each completed while their records are kept (its response_ttl; Redis
        drops an entry from its index at a later completion in its bucket past that
        ttl), never a sync route's keys. In the order and with the promise of
        store/pages.py: a record in a listed state throughout a walk is listed exactly
        once. `next` is "" only where nothing more matches; a page
        may be short, even empty, with `next` set, where the filters dropped what the
        store read within its bound (pages.READ_ROUNDS), so a caller walks on while
        `next` is set. Read from the state indexes, never the keyspace: O(limit)
        records (Redis: x buckets entries), READ_ROUNDS times at most."""

    async def open_records(self, states: frozenset[State]) -> list[Record]:
        """Every record in these states, a page at a time: O(records), never what an
        operator's request reads (one page)."""
        records: list[Record] = []
        cursor = ""
        while True:
            page = await self.list_records(states, cursor=cursor, limit=MAX_PAGE_SIZE)
            records += page.records
            if not page.next:
                return records
            cursor = page.next

    @abc.abstractmethod
    async def stats(self) -> list[StateCount]:
        """Count and oldest age per route of unresolved, parked and claimed records, from
        kept counts and the indexes' heads: O(routes x states) (Redis: x buckets)."""

    async def repair_counts(self, routes: Collection[str]) -> int:
        """Mend the kept counts (and the admission marks of `routes`) where a failure
        between two writes left them apart from the records; how many were wrong. Safe
        in every replica at once; a store that counts in the records' own transaction
        has nothing to mend."""
        return 0

    @abc.abstractmethod
    async def last_successes(self) -> dict[str, float]:
        """Per route, seconds since its last success by the store's clock: the last
        `complete` of a success (records.is_success; the upstream's answer to a forward or a
        delivery: a check's or an operator's "done" is none), by any replica. A
        route without one is absent. Reads only. PostgreSQL keeps it to the second (a
        route's row is written at most once a second, so completions do not queue on
        its lock); the other stores to the millisecond."""

    # -- copying to another store ------------------------------------------------------

    @abc.abstractmethod
    async def export_records(self, cursor: str = "", limit: int = EXPORT_PAGE) -> ExportPage:
        """A page of about `limit` records from `cursor` ("" to start, then a page's
        `next`, until it is ""): every record the store holds, in any state, but one past
        its expiry, each with its stored response, token and request as stored (sealed
        or not) and the time a settled one has left (transfer.py). Reads only, and a page
        at a time: never every record at once. Made for a store no gateway writes to: a
        record that moves during the walk may be read before or after the move, or on
        Redis (a SCAN) twice."""

    @abc.abstractmethod
    async def import_records(self, items: Sequence[ExportedRecord]) -> list[str]:
        """Write each item as it is (its state, times, history, attempts and stored
        bytes; a settled one expiring after its `ttl_ms` from the store's now), with
        everything the store keeps beside it (indexes, kept counts, admission marks), so
        listings, `stats`, `queue_stats` and the workers find it as if it had been made
        here. No move is made and nobody is notified. An item whose digest the store
        already holds a live record under is skipped, changing nothing. Each item is one
        atomic step (the SQL stores: the page in one transaction). Returns the digests
        it skipped."""

    @abc.abstractmethod
    async def holds_keys(self) -> bool:
        """Whether the store holds any live record (of its prefix, where it has one)."""

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


class DeliveryPart(Protocol):
    """The deliveries a store holds as a part: the interface's delivery calls."""

    async def accept(self, delivery: NewDelivery) -> Accepted: ...

    async def pick(
        self,
        route: str,
        hint: KeyRef,
        run_id: str,
        lease: float,
        max_attempts: int,
        replica: str,
        park_reason: str = ...,
    ) -> PickResult: ...

    async def retry_later(
        self,
        ref: KeyRef,
        run_id: str,
        delay: float | None,
        attempt: dict[str, Any],
        origin: str = ...,
        *,
        uncounted: bool = ...,
    ) -> bool: ...

    async def get_request(self, ref: KeyRef) -> StoredRequest | None: ...

    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]: ...


class ListingPart(Protocol):
    """The listing a store holds as a part: pages and the kept counts."""

    async def stats(self) -> list[StateCount]: ...

    async def list_records(
        self,
        states: frozenset[State],
        *,
        route: str | None = ...,
        older_than: float = ...,
        cursor: str = ...,
        limit: int = ...,
        match: Match = ...,
    ) -> Page: ...


class PartsStore(Store):
    """A store that holds its deliveries, its listing and its operator roster as parts
    (the Redis, PostgreSQL and SQLite stores): the interface's calls for each go to
    the part, here once rather than in every store."""

    deliveries: DeliveryPart
    listing: ListingPart
    operators: OperatorRoster
    pauses: RoutePauses

    def accept(self, delivery: NewDelivery) -> Coroutine[Any, Any, Accepted]:
        # The part's own coroutine, not one more awaiting it: every 202's path.
        return self.deliveries.accept(delivery)

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
        return await self.deliveries.pick(
            route, hint, run_id, lease, max_attempts, replica, park_reason
        )

    async def retry_later(
        self,
        ref: KeyRef,
        run_id: str,
        delay: float | None,
        attempt: dict[str, Any],
        origin: str = "",
        *,
        uncounted: bool = False,
    ) -> bool:
        return await self.deliveries.retry_later(
            ref, run_id, delay, attempt, origin, uncounted=uncounted
        )

    async def get_request(self, ref: KeyRef) -> StoredRequest | None:
        return await self.deliveries.get_request(ref)

    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]:
        return await self.deliveries.due_candidates(route, limit)

    async def stats(self) -> list[StateCount]:
        return await self.listing.stats()

    async def list_records(
        self,
        states: frozenset[State],
        *,
        route: str | None = None,
        older_than: float = 0.0,
        cursor: str = "",
        limit: int = PAGE_SIZE,
        match: Match = ANY,
    ) -> Page:
        return await self.listing.list_records(
            states, route=route, older_than=older_than, cursor=cursor, limit=limit, match=match
        )

    async def record_roster(self, marks: Mapping[str, str]) -> dict[str, RosterEntry]:
        return await self.operators.record_roster(marks)

    async def roster(self) -> dict[str, RosterEntry]:
        return await self.operators.roster()

    async def route_pause(self, route: str) -> PauseState:
        return await self.pauses.route_pause(route)

    async def route_pauses(self) -> dict[str, PauseState]:
        return await self.pauses.route_pauses()

    async def change_pause(self, route: str, move: PauseMove) -> tuple[PauseState, Verdict]:
        return await self.pauses.change_pause(route, move)
