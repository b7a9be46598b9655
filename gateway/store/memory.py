"""The in-memory store: one process, nothing survives a restart.

For the demo, tests and a single instance. It keeps the same contract as the Redis
store, move for move (each method is one critical section: no await inside), but
its records live in this process only: a restart forgets every completed key (so
repeats run again) and every unresolved one (so nothing is left to reconcile), and
two processes never see each other's keys. `run` refuses several workers on it.

One class keeps the records and everything kept beside them: the deliveries' stored
requests and tokens (sealed as Redis keeps them) and per route the queued and retrying
digests by due time; and per (state, route) the records' (place, digest) sorted, which
a listing walks from its cursor and the counts read (a count is a list's length, the
oldest its head). The operator roster is a part of its own (MemoryRoster).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from gateway.encryption import PLAIN, ResponseCodec
from gateway.records import (
    OPEN_STATES,
    QUEUE_STATES,
    KeyRef,
    QueueStat,
    Record,
    State,
    StateCount,
    StoredRequest,
    StoredResponse,
    StoreInfo,
    history_event,
    is_success,
)
from gateway.store import rate
from gateway.store.base import (
    Accepted,
    CheckResult,
    ExpiredPolicy,
    NewDelivery,
    OperatorResult,
    PickResult,
    Store,
)
from gateway.store.notices import Due
from gateway.store.operator_roster import OperatorRoster, RosterEntry
from gateway.store.pages import (
    ANY,
    COUNTED_STATES,
    PAGE_SIZE,
    READ_ROUNDS,
    Cursor,
    Match,
    Page,
    Position,
    check_limit,
    check_states,
    listed_completed,
    page_of,
    place_of,
)
from gateway.store.route_pauses import PauseMove, PauseState, Verdict, apply_move
from gateway.store.transfer import EXPORT_PAGE, ExportedRecord, ExportPage

QUEUE_STATES_ORDER = (State.QUEUED, State.RETRYING)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


#: The states kept in order for listings: the counted ones and in_flight.
_LISTED = COUNTED_STATES | {State.IN_FLIGHT}
_TOMBSTONE_TTL = 86400.0


class MemoryStore(Store):
    def __init__(self, codec: ResponseCodec = PLAIN) -> None:
        super().__init__(codec)
        self._roster = MemoryRoster()
        self._pauses: dict[str, PauseState] = {}
        self._rates: dict[str, float] = {}  # name -> its bucket's tat (store/rate.py)
        self._records: dict[str, Record] = {}
        self._requests: dict[str, bytes] = {}
        self._tokens: dict[str, bytes] = {}
        # route -> digest -> due, for queued and retrying records; and per route a
        # heap of (due, digest) whose entries that no longer match are stale.
        self._queued: dict[str, dict[str, int]] = {}
        self._due_heaps: dict[str, list[tuple[int, str]]] = {}
        # With an encryption key, completed records hold no response: it is kept
        # here sealed, as the Redis store keeps it, and opened on every read.
        self._sealed: dict[str, bytes] = {}
        # Per (state, route): the records' (place, digest), sorted (place_of); and where
        # each record is filed. A listing walks these from a cursor, the counts are their
        # lengths, the oldest their heads.
        self._order: dict[tuple[State, str], list[tuple[int, str]]] = {}
        self._filed: dict[str, tuple[State, str, int]] = {}
        self._expires: dict[str, int] = {}  # digest -> ms, for completed and released
        self._expiry_heap: list[tuple[int, str]] = []  # may hold stale entries
        self._successes: dict[str, int] = {}  # route -> ms of its last success

    # -- helpers: the Lua library's equivalents ------------------------------------

    def _purge(self, now: int) -> None:
        # Amortised O(log n) a write: memory stays bounded by live records.
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, digest = heapq.heappop(heap)
            expires = self._expires.get(digest)
            if expires is not None and expires <= now:
                self._drop(digest)

    def _drop(self, digest: str) -> None:
        record = self._records.pop(digest, None)
        self._expires.pop(digest, None)
        self._sealed.pop(digest, None)
        self._requests.pop(digest, None)
        self._tokens.pop(digest, None)
        self._unfile(digest)
        if record is not None:
            self._queued.get(record.route, {}).pop(digest, None)

    def _unfile(self, digest: str) -> None:
        filed = self._filed.pop(digest, None)
        if filed is None:
            return
        state, route, place = filed
        order = self._order[(state, route)]
        at = bisect.bisect_left(order, (place, digest))
        del order[at]
        if not order:
            del self._order[(state, route)]

    def _file(self, record: Record) -> None:
        """Keep `record` at its place in its state's order (and nowhere else)."""
        place = place_of(record)
        if self._filed.get(record.digest) == (record.state, record.route, place):
            return
        self._unfile(record.digest)
        if record.state in _LISTED or listed_completed(record):
            order = self._order.setdefault((record.state, record.route), [])
            bisect.insort(order, (place, record.digest))
            self._filed[record.digest] = (record.state, record.route, place)

    def _read(self, digest: str, now: int) -> Record | None:
        expires = self._expires.get(digest)
        if expires is not None and expires <= now:
            self._drop(digest)
        return self._records.get(digest)

    def _put(self, record: Record, *, ttl: float | None = None, notify: bool = True) -> None:
        old = self._records.get(record.digest)
        self._file(record)
        if old is not None and old.state in QUEUE_STATES:
            self._queued[old.route].pop(record.digest, None)
        if record.state in QUEUE_STATES:
            self._queued.setdefault(record.route, {})[record.digest] = record.due_ms
            heapq.heappush(
                self._due_heaps.setdefault(record.route, []), (record.due_ms, record.digest)
            )
        elif record.state in (State.COMPLETED, State.RELEASED):
            self._requests.pop(record.digest, None)  # a settled delivery's request goes
        self._records[record.digest] = record
        if ttl is None:
            self._expires.pop(record.digest, None)
        else:
            expires = record.now_ms + int(ttl * 1000)
            self._expires[record.digest] = expires
            heapq.heappush(self._expiry_heap, (expires, record.digest))
        if notify:
            completed = None
            if record.state is State.COMPLETED and record.response is not None:
                completed = (record.fingerprint, record.response)
            self.notifier.notify(record.digest, completed)

    def _keep(self, digest: str, response: StoredResponse | None) -> StoredResponse | None:
        """What a completed record holds: the response, or None when it is sealed."""
        if response is None or not self.codec.encrypting:
            return response
        self._sealed[digest] = self.codec.encode(digest, response)
        return None

    def _out(self, record: Record, now: int) -> Record:
        """A snapshot for the caller, with a sealed response and token opened."""
        token = self._tokens.get(record.digest)
        if token is not None:
            record = replace(record, token=self.read_token(record.digest, token))
        sealed = self._sealed.get(record.digest)
        if sealed is None:
            return replace(record, now_ms=now)
        response, unreadable = self.read_response(record.digest, sealed)
        return replace(record, now_ms=now, response=response, unreadable=unreadable)

    def _move(
        self, record: Record, state: State, now: int, *events: dict[str, Any], **changes: Any
    ) -> Record:
        return replace(
            record,
            state=state,
            since_ms=now,
            now_ms=now,
            history=(*record.history, *events),
            **changes,
        )

    def _settle(
        self,
        record: Record,
        state: State,
        now: int,
        ttl: float,
        *events: dict[str, Any],
        **changes: Any,
    ) -> None:
        moved = self._move(
            record,
            state,
            now,
            *events,
            lease_until_ms=0,
            check_lock_ms=0,
            holder="",
            holder_since_ms=0,
            **changes,
        )
        self._put(moved, ttl=ttl)

    def _unknown(self, record: Record, target: State, now: int, reason: str) -> Record:
        events = [history_event(now, "unknown", reason=reason)]
        if target is State.PARKED:
            events.append(history_event(now, "parked", reason="route policy: park"))
        moved = self._move(record, target, now, *events, reason=reason, lease_until_ms=0)
        self._put(moved)
        return moved

    def _expire_lease(self, record: Record, now: int, policy: ExpiredPolicy) -> Record:
        if policy == "release" and not record.delivery:
            event = history_event(now, "released", reason="lease expired; route policy: release")
            self._settle(record, State.RELEASED, now, _TOMBSTONE_TTL, event)
            return self._records[record.digest]
        target = State.UNRESOLVED if policy == "release" else State(policy)
        return self._unknown(record, target, now, "lease_expired")

    async def info(self) -> StoreInfo:
        # Nothing evicts a record here, and nothing survives a restart to persist.
        return StoreInfo("noeviction", "n/a", source="memory")

    # -- the request path -------------------------------------------------------

    async def claim(
        self,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        lease: float,
        expired: ExpiredPolicy = "unresolved",
    ) -> Record | None:
        now = now_ms()
        self._purge(now)
        record = self._read(ref.digest, now)
        if record is not None and record.state is State.IN_FLIGHT and record.lease_until_ms <= now:
            record = self._expire_lease(record, now, expired)
        if record is None or record.state is State.RELEASED:
            fresh = Record.claimed(ref, run_id, fingerprint, now, now + int(lease * 1000), record)
            self._put(fresh, notify=False)
            return None
        return self._out(record, now)

    async def complete(
        self,
        ref: KeyRef,
        run_id: str,
        response: StoredResponse,
        ttl: float,
        attempt: dict[str, Any] | None = None,
    ) -> bool:
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.run_id != run_id:
            return False
        if record.state is State.COMPLETED:
            return True  # a repeated completion of our own run
        if record.state not in (State.IN_FLIGHT, State.UNRESOLVED):
            return False
        events = []
        if record.state is State.UNRESOLVED or record.history:
            events.append(history_event(now, "completed", origin=response.origin))
        kept = self._keep(ref.digest, response)
        if record.delivery and attempt is not None:
            record = replace(record, last_attempt=attempt)
        self._settle(record, State.COMPLETED, now, ttl, *events, response=kept, reason="")
        if is_success(response.status):
            self._successes[record.route] = max(now, self._successes.get(record.route, 0))
        return True

    async def last_successes(self) -> dict[str, float]:
        now = now_ms()
        return {route: max(0, now - at) / 1000 for route, at in self._successes.items()}

    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None:
            return True
        if record.run_id != run_id or record.state is not State.IN_FLIGHT:
            return False
        if record.history:
            self._settle(
                record, State.RELEASED, now, ttl, history_event(now, "released", reason=reason)
            )
            return True
        self._drop(ref.digest)
        self.notifier.notify(ref.digest)
        return True

    async def mark_unresolved(
        self, ref: KeyRef, run_id: str, reason: str, *, park: bool = False
    ) -> bool:
        now = now_ms()
        record = self._read(ref.digest, now)
        target = State.PARKED if park else State.UNRESOLVED
        if record is None or record.run_id != run_id:
            return False
        if record.state is target and record.reason == reason:
            return True
        if record.state is not State.IN_FLIGHT:
            return False
        self._unknown(record, target, now, reason)
        return True

    async def get(self, ref: KeyRef) -> Record | None:
        now = now_ms()
        record = self._read(ref.digest, now)
        return None if record is None else self._out(record, now)

    # -- the sweep and the reconciler -----------------------------------------------

    async def expire_leases(
        self, policy: Callable[[str], ExpiredPolicy], limit: int = 1000
    ) -> list[tuple[KeyRef, str]]:
        now = now_ms()
        changed: list[tuple[KeyRef, str]] = []
        dead = [
            digest
            for (state, _), order in list(self._order.items())
            if state is State.IN_FLIGHT
            for digest in until(order, now)  # by lease: the dead ones come first
        ]
        for digest in dead[:limit]:
            record = self._records[digest]
            after = self._expire_lease(record, now, policy(record.route))
            changed.append((KeyRef(digest, record.route, record.key), str(after.state)))
        return changed

    async def begin_check(self, ref: KeyRef, run_id: str, lock: float, min_interval: float) -> bool:
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.state is not State.UNRESOLVED or record.run_id != run_id:
            return False
        if record.check_lock_ms > now or now - record.last_check_ms < min_interval * 1000:
            return False
        self._put(
            replace(record, check_lock_ms=now + int(lock * 1000), last_check_ms=now), notify=False
        )
        return True

    async def end_check(self, check: CheckResult) -> str:
        ref, run_id, result, answer = check.ref, check.run_id, check.result, check.answer
        response, ttl, park_after, retry_in = (
            check.response,
            check.ttl,
            check.park_after,
            check.retry_in,
        )
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.state is not State.UNRESOLVED or record.run_id != run_id:
            return ""
        checked = history_event(now, "reconcile", result=result, answer=answer)
        record = replace(record, check_lock_ms=0, reconcile=answer)
        if result == "done":
            kept = self._keep(ref.digest, response)
            self._settle(record, State.COMPLETED, now, ttl, checked, response=kept)
            return "completed"
        if result == "not_done" and record.delivery:
            return self._not_done(record, now, checked, retry_in)
        if result == "not_done":
            released = history_event(now, "released", reason="the upstream says it did not run")
            self._settle(record, State.RELEASED, now, ttl, checked, released)
            return "released"
        if now - record.since_ms >= park_after * 1000:
            parked = history_event(now, "parked", reason="no conclusive check within park_after")
            self._put(self._move(record, State.PARKED, now, checked, parked))
            return "parked"
        self._put(replace(record, history=(*record.history, checked)), notify=False)
        return "unresolved"

    async def park(self, ref: KeyRef, reason: str) -> bool:
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.state is not State.UNRESOLVED:
            return False
        self._put(
            self._move(
                record,
                State.PARKED,
                now,
                history_event(now, "parked", reason=reason),
                check_lock_ms=0,
            )
        )
        return True

    # -- copying to another store --------------------------------------------------

    async def export_records(self, cursor: str = "", limit: int = EXPORT_PAGE) -> ExportPage:
        now = now_ms()
        self._purge(now)
        # Sorted per page: this store lives in one process, so only its own tests walk it.
        digests = sorted(d for d in self._records if d > cursor)[:limit]
        items = []
        for digest in digests:
            record = self._records[digest]
            sealed = self._sealed.get(digest)
            if sealed is None and record.response is not None:
                sealed = self.codec.encode(digest, record.response)
            expires = self._expires.get(digest)
            items.append(
                ExportedRecord(
                    self._out(record, now),
                    response=sealed,
                    token=self._tokens.get(digest),
                    request=self._requests.get(digest),
                    ttl_ms=None if expires is None else expires - now,
                )
            )
        return ExportPage(items, digests[-1] if len(digests) == limit else "")

    async def import_records(self, items: Sequence[ExportedRecord]) -> list[str]:
        now = now_ms()
        skipped = []
        for item in items:
            digest = item.record.digest
            if self._read(digest, now) is not None:
                skipped.append(digest)
                continue
            record = replace(item.record, now_ms=now, response=None, unreadable="", token="")
            if item.response is not None:
                response = self.read_response(digest, item.response)[0]
                if self.codec.encrypting or response is None:
                    self._sealed[digest] = item.response  # kept sealed, opened on reads
                else:
                    record = replace(record, response=response)
            if item.token is not None:
                self._tokens[digest] = item.token
            if item.request is not None:
                self._requests[digest] = item.request
            ttl = None if item.ttl_ms is None else max(1, item.ttl_ms) / 1000
            self._put(record, ttl=ttl, notify=False)
        return skipped

    async def holds_keys(self) -> bool:
        self._purge(now_ms())
        return bool(self._records)

    # -- operators ---------------------------------------------------------------

    async def operator_claim(self, ref: KeyRef, operator: str, force: bool) -> OperatorResult:
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None:
            return OperatorResult(False, refused="missing", state="missing")
        if record.state not in (State.UNRESOLVED, State.PARKED, State.CLAIMED):
            return OperatorResult(False, state=str(record.state), refused="state")
        if record.state is State.CLAIMED:
            if record.holder == operator:
                return OperatorResult(
                    True, state="claimed", holder=operator, holder_since_ms=record.holder_since_ms
                )
            if not force:
                return OperatorResult(
                    False,
                    state="claimed",
                    refused="held",
                    holder=record.holder,
                    holder_since_ms=record.holder_since_ms,
                )
            event = history_event(now, "claimed", operator=operator, takeover_from=record.holder)
        else:
            event = history_event(now, "claimed", operator=operator)
        moved = self._move(
            record, State.CLAIMED, now, event, holder=operator, holder_since_ms=now, check_lock_ms=0
        )
        self._put(moved)
        return OperatorResult(True, state="claimed", holder=operator, holder_since_ms=now)

    async def operator_resolve(
        self,
        ref: KeyRef,
        operator: str,
        outcome: str,
        note: str,
        response: StoredResponse | None,
        ttl: float,
    ) -> OperatorResult:
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None:
            return OperatorResult(False, refused="missing", state="missing")
        if record.state is not State.CLAIMED:
            return OperatorResult(False, state=str(record.state), refused="state")
        if record.holder != operator:
            return OperatorResult(False, state="claimed", refused="holder", holder=record.holder)
        event = history_event(now, "resolved", operator=operator, outcome=outcome, note=note)
        if outcome == "done":
            kept = self._keep(ref.digest, response)
            self._settle(record, State.COMPLETED, now, ttl, event, response=kept)
            return OperatorResult(True, state="completed")
        if record.delivery:  # queued again, with every attempt to come
            requeued = self._move(
                record,
                State.QUEUED,
                now,
                event,
                attempts=0,
                due_ms=now,
                reason="",
                holder="",
                holder_since_ms=0,
                check_lock_ms=0,
            )
            self._put(requeued)
            self.due.announce(Due(ref, now, now))
            return OperatorResult(True, state="queued")
        self._settle(record, State.RELEASED, now, ttl, event)
        return OperatorResult(True, state="released")

    async def delivery_token(self, ref: KeyRef) -> str:
        record = self._read(ref.digest, now_ms())
        sealed = self._tokens.get(ref.digest)
        if record is None or not record.delivery or sealed is None:
            return self.no_token()
        return self.read_token(ref.digest, sealed)

    # -- deliveries --------------------------------------------------------------

    async def accept(self, delivery: NewDelivery) -> Accepted:
        ref, run_id, fingerprint, request, token = (
            delivery.ref,
            delivery.run_id,
            delivery.fingerprint,
            delivery.request,
            delivery.token,
        )
        limit, origin, expired = delivery.limit, delivery.origin, delivery.expired
        now = now_ms()
        self._purge(now)
        record = self._read(ref.digest, now)
        if record is not None and record.state is State.IN_FLIGHT and record.lease_until_ms <= now:
            record = self._expire_lease(record, now, expired)
        if record is not None and record.state is not State.RELEASED:
            return Accepted("exists", now, self._out(record, now))
        if limit is not None and len(self._queued.get(ref.route, {})) >= limit:
            return Accepted("full", now)  # queued + retrying, kept as records move
        due = now + delivery.delay_ms
        queued = Record(
            digest=ref.digest,
            route=ref.route,
            key=ref.key,
            state=State.QUEUED,
            run_id=run_id,
            fingerprint=fingerprint,
            created_ms=now,
            now_ms=now,
            since_ms=now,
            history=record.history if record is not None else (),
            delivery=True,
            due_ms=due,
        )
        self._put(queued, notify=False)
        self._requests[ref.digest] = self.codec.encode_request(ref.digest, request)
        self._tokens[ref.digest] = self.codec.encode_token(ref.digest, token)
        self.due.announce(Due(ref, due, now, origin))
        return Accepted("queued", now)

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
        now = now_ms()
        record = self._read(hint.digest, now)
        if (
            record is not None
            and record.delivery
            and record.state is State.IN_FLIGHT
            and record.run_id == run_id
        ):  # this same pick again (the worker retries one that failed): it is that pick
            return PickResult(
                self._out(record, now),
                request=self._requests.get(record.digest, b""),
                next=self._head(route, now),
                now_ms=now,
            )
        why, due = "", 0
        if record is None or record.state not in QUEUE_STATES:
            why = "gone"
        elif record.due_ms > now:
            why, due = "not_due", record.due_ms
        if why:  # one search in the same step: the earliest due delivery of the route
            head = self._head(route)
            if head is not None and head.due_ms <= now:
                record, why, due = self._records[head.ref.digest], "", 0
        if why or record is None:
            return PickResult(None, why=why, due_ms=due, next=self._head(route, now), now_ms=now)
        if record.attempts >= max_attempts:
            parked = history_event(now, "parked", reason=park_reason)
            self._put(self._move(record, State.PARKED, now, parked, reason=park_reason, due_ms=0))
            return PickResult(None, why="exhausted", next=self._head(route, now), now_ms=now)
        attempt = record.attempts + 1
        event = history_event(now, "attempt", attempt=attempt, run_id=run_id, replica=replica)
        picked = self._move(
            record,
            State.IN_FLIGHT,
            now,
            event,
            run_id=run_id,
            lease_until_ms=now + int(lease * 1000),
            attempts=attempt,
            due_ms=0,
        )
        self._put(picked)
        self.due.taken(picked.digest)
        return PickResult(
            self._out(picked, now),
            request=self._requests.get(picked.digest, b""),
            next=self._head(route, now),
            now_ms=now,
        )

    def _head(self, route: str, now: int = 0) -> Due | None:
        """The route's earliest queued or retrying delivery, dropping stale heap entries."""
        heap, queued = self._due_heaps.get(route, []), self._queued.get(route, {})
        while heap and queued.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            return None
        due, digest = heap[0]
        return Due(KeyRef(digest, route, self._records[digest].key), due, now)

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
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.run_id != run_id or not record.delivery:
            return False
        if record.state in (State.RETRYING, State.PARKED) and record.last_attempt == attempt:
            return True  # this very call, repeated
        if record.state is not State.IN_FLIGHT:
            return False
        # The pick counted it; an uncounted attempt is not one of the delivery's.
        attempts = max(0, record.attempts - 1) if uncounted else record.attempts
        if delay is not None:
            due = now + int(delay * 1000)
            event = history_event(now, "retry_scheduled", due_ms=due, attempt=attempt)
            self._put(
                self._move(
                    record,
                    State.RETRYING,
                    now,
                    event,
                    lease_until_ms=0,
                    due_ms=due,
                    last_attempt=attempt,
                    attempts=attempts,
                )
            )
            self.due.announce(Due(ref, due, now, origin))
            return True
        reason = str(attempt.get("reason") or "attempts exhausted")
        event = history_event(now, "parked", reason=reason, attempt=attempt)
        moved = self._move(
            record,
            State.PARKED,
            now,
            event,
            lease_until_ms=0,
            reason=reason,
            last_attempt=attempt,
            attempts=attempts,
        )
        self._put(moved)
        return True

    def _not_done(
        self, record: Record, now: int, checked: dict[str, Any], retry_in: float | None
    ) -> str:
        """A check says a delivery's attempt did not run: it may run again."""
        reason = "the upstream says it did not run"
        if retry_in is None:
            parked = history_event(now, "parked", reason=reason + "; no attempt left")
            self._put(
                self._move(record, State.PARKED, now, checked, parked, reason=parked["reason"])
            )
            return "parked"
        due = now + int(retry_in * 1000)
        event = history_event(now, "retry_scheduled", due_ms=due, reason=reason)
        self._put(self._move(record, State.RETRYING, now, checked, event, due_ms=due, reason=""))
        self.due.announce(Due(KeyRef(record.digest, record.route, record.key), due, now))
        return "retrying"

    async def get_request(self, ref: KeyRef) -> StoredRequest | None:
        record = self._read(ref.digest, now_ms())
        sealed = self._requests.get(ref.digest)
        if record is None or sealed is None:
            return None
        return self.codec.decode_request(ref.digest, sealed)

    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]:
        now = now_ms()
        queued = self._queued.get(route, {})
        earliest = heapq.nsmallest(limit, queued.items(), key=lambda item: (item[1], item[0]))
        return [
            Due(KeyRef(digest, route, self._records[digest].key), due, now)
            for digest, due in earliest
        ], now

    async def queue_stats(self) -> list[QueueStat]:
        now = now_ms()
        stats = []
        for route, queued in sorted(self._queued.items()):
            if not queued:
                continue
            # Counted as they move: the orders' lengths; the earliest due, their heads.
            waiting = [self._order.get((state, route), []) for state in QUEUE_STATES_ORDER]
            earliest = min(order[0][0] for order in waiting if order)
            stats.append(
                QueueStat(route, len(waiting[0]), len(waiting[1]), max(0, now - earliest) / 1000)
            )
        return stats

    # -- listings and counts ------------------------------------------------------

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
        now = now_ms()
        start, wanted = Cursor.decode(cursor), check_limit(limit)
        check_states(states, route)
        self._purge(now)
        backward = start is not None and start.backward
        ceiling, floor = match.ceiling(now, older_than), match.floor()
        walks: list[Iterator[tuple[int, str]]] = []
        for (state, name), order in self._order.items():
            if state not in states or (route is not None and name != route):
                continue
            # An in-flight record's place is its lease: its age filters after reading.
            top = match.ceiling(now, 0.0) if state is State.IN_FLIGHT else ceiling
            walks.append(_walk(order, start, top, floor))
        found: list[tuple[Position, Record]] = []
        # Bounded as the other stores' pages are: past READ_ROUNDS x (limit + 1)
        # entries read, the page is short and goes on from the last one.
        budget, resume = READ_ROUNDS * (wanted + 1), None
        for place, digest in heapq.merge(*walks, reverse=backward):
            if budget == 0:
                break
            budget -= 1
            resume = Position(place, digest)
            record = replace(self._records[digest], now_ms=now)
            if record.state is State.IN_FLIGHT and record.state_age < older_than:
                continue
            if not match.keeps(record):
                continue
            found.append((Position(place, digest), self._out(record, now)))
            if len(found) > wanted:
                break
        return page_of(found, start, wanted, now, resume=resume if budget == 0 else None)

    async def stats(self) -> list[StateCount]:
        now = now_ms()
        return [
            StateCount(route, state, len(order), max(0, now - order[0][0]) / 1000)
            for (state, route), order in sorted(self._order.items())
            if state in OPEN_STATES
        ]

    # -- the routes' pauses ------------------------------------------------------------

    async def route_pause(self, route: str) -> PauseState:
        now = now_ms()
        return replace(self._pauses.get(route, PauseState(route)), now_ms=now)

    async def route_pauses(self) -> dict[str, PauseState]:
        now = now_ms()
        return {name: replace(s, now_ms=now) for name, s in self._pauses.items()}

    async def change_pause(self, route: str, move: PauseMove) -> tuple[PauseState, Verdict]:
        state, verdict = apply_move(self._pauses.get(route, PauseState(route)), move, now_ms())
        self._pauses[route] = state
        return state, verdict

    # -- rate limits ---------------------------------------------------------------

    async def take_token(self, name: str, per_second: float, burst: int) -> float:
        tat, wait = rate.take(self._rates.get(name, 0.0), time.time_ns() / 1e6, per_second, burst)
        self._rates[name] = tat
        return wait

    # -- the operator roster: its own part ------------------------------------------

    async def record_roster(self, marks: Mapping[str, str]) -> dict[str, RosterEntry]:
        return await self._roster.record_roster(marks)

    async def roster(self) -> dict[str, RosterEntry]:
        return await self._roster.roster()


class MemoryRoster(OperatorRoster):
    # Replaced whole by each recording, never changed in place (so a class default).
    _roster: Mapping[str, RosterEntry] = MappingProxyType({})
    #: the last time given out: the next one is later, whatever the clock does
    _roster_last_ms = 0

    async def record_roster(self, marks: Mapping[str, str]) -> dict[str, RosterEntry]:
        since = max(now_ms(), self._roster_last_ms + 1)
        entries: dict[str, RosterEntry] = {}
        for name, mark in marks.items():
            kept = self._roster.get(name)
            entries[name] = (
                kept if kept is not None and kept.mark == mark else RosterEntry(mark, since)
            )
        if any(entry.since_ms == since for entry in entries.values()):
            self._roster_last_ms = since
        self._roster = MappingProxyType(entries)
        return dict(entries)

    async def roster(self) -> dict[str, RosterEntry]:
        return dict(self._roster)


def until(order: list[tuple[int, str]], ceiling: int) -> list[str]:
    """The digests of `order` whose place is at most `ceiling`."""
    return [digest for _, digest in order[: bisect.bisect_right(order, (ceiling, "\uffff"))]]


def _walk(
    order: list[tuple[int, str]],
    start: Cursor | None,
    ceiling: int | None,
    floor: int | None = None,
) -> Iterator[tuple[int, str]]:
    """One state's (place, digest) pairs from `start` on: ascending after it, or
    descending before it, never above `ceiling` nor below `floor`. Lazy: a page reads
    what it shows."""
    top = len(order) if ceiling is None else bisect.bisect_right(order, (ceiling, "\uffff"))
    bottom = 0 if floor is None else bisect.bisect_left(order, (floor, ""))
    if start is None:
        return itertools.islice(order, bottom, top)
    at = (start.position.place, start.position.digest)
    if start.backward:
        end = min(bisect.bisect_left(order, at), top)
        return (order[i] for i in range(end - 1, bottom - 1, -1))
    return itertools.islice(order, max(bottom, bisect.bisect_right(order, at)), top)
