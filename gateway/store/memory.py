"""The in-memory store: one process, nothing survives a restart.

For the demo, tests and a single instance. It keeps the same contract as the Redis
store, move for move (each method is one critical section: no await inside), but
its records live in this process only: a restart forgets every completed key (so
repeats run again) and every unresolved one (so nothing is left to reconcile), and
two processes never see each other's keys. `run` refuses several workers on it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gateway.encryption import PLAIN, ResponseCodec
from gateway.records import QUEUE_STATES, KeyRef, Record, State, StoredResponse, is_success
from gateway.store.base import ExpiredPolicy, OperatorResult, StoreInfo
from gateway.store.memory_delivery import MemoryDeliveries
from gateway.store.memory_delivery import event as _event
from gateway.store.memory_delivery import now_ms as _now_ms
from gateway.store.notices import Due

_INDEXED = (State.IN_FLIGHT, State.UNRESOLVED, State.PARKED, State.CLAIMED)
_TOMBSTONE_TTL = 86400.0


class MemoryStore(MemoryDeliveries):
    def __init__(self, codec: ResponseCodec = PLAIN) -> None:
        super().__init__(codec)
        # With an encryption key, completed records hold no response: it is kept
        # here sealed, as the Redis store keeps it, and opened on every read.
        self._sealed: dict[str, bytes] = {}
        self._index: dict[State, set[str]] = {state: set() for state in _INDEXED}
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
        if record is not None and record.state in self._index:
            self._index[record.state].discard(digest)
        if record is not None:
            self._queued.get(record.route, {}).pop(digest, None)

    def _read(self, digest: str, now: int) -> Record | None:
        expires = self._expires.get(digest)
        if expires is not None and expires <= now:
            self._drop(digest)
        return self._records.get(digest)

    def _put(self, record: Record, *, ttl: float | None = None, notify: bool = True) -> None:
        old = self._records.get(record.digest)
        if old is not None and old.state in self._index:
            self._index[old.state].discard(record.digest)
        if record.state in self._index:
            self._index[record.state].add(record.digest)
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
        events = [_event(now, "unknown", reason=reason)]
        if target is State.PARKED:
            events.append(_event(now, "parked", reason="route policy: park"))
        moved = self._move(record, target, now, *events, reason=reason, lease_until_ms=0)
        self._put(moved)
        return moved

    def _expire_lease(self, record: Record, now: int, policy: ExpiredPolicy) -> Record:
        if policy == "release" and not record.delivery:
            event = _event(now, "released", reason="lease expired; route policy: release")
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
        now = _now_ms()
        self._purge(now)
        record = self._read(ref.digest, now)
        if record is not None and record.state is State.IN_FLIGHT and record.lease_until_ms <= now:
            record = self._expire_lease(record, now, expired)
        if record is None or record.state is State.RELEASED:
            fresh = Record(
                digest=ref.digest,
                route=ref.route,
                key=ref.key,
                state=State.IN_FLIGHT,
                run_id=run_id,
                fingerprint=fingerprint,
                created_ms=now,
                now_ms=now,
                since_ms=now,
                lease_until_ms=now + int(lease * 1000),
                history=record.history if record is not None else (),
            )
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
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.run_id != run_id:
            return False
        if record.state is State.COMPLETED:
            return True  # a repeated completion of our own run
        if record.state not in (State.IN_FLIGHT, State.UNRESOLVED):
            return False
        events = []
        if record.state is State.UNRESOLVED or record.history:
            events.append(_event(now, "completed", origin=response.origin))
        kept = self._keep(ref.digest, response)
        if record.delivery and attempt is not None:
            record = replace(record, last_attempt=attempt)
        self._settle(record, State.COMPLETED, now, ttl, *events, response=kept, reason="")
        if is_success(response.status):
            self._successes[record.route] = max(now, self._successes.get(record.route, 0))
        return True

    async def last_successes(self) -> dict[str, float]:
        now = _now_ms()
        return {route: max(0, now - at) / 1000 for route, at in self._successes.items()}

    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None:
            return True
        if record.run_id != run_id or record.state is not State.IN_FLIGHT:
            return False
        if record.history:
            self._settle(record, State.RELEASED, now, ttl, _event(now, "released", reason=reason))
            return True
        self._drop(ref.digest)
        self.notifier.notify(ref.digest)
        return True

    async def mark_unresolved(
        self, ref: KeyRef, run_id: str, reason: str, *, park: bool = False
    ) -> bool:
        now = _now_ms()
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
        now = _now_ms()
        record = self._read(ref.digest, now)
        return None if record is None else self._out(record, now)

    # -- the sweep and the reconciler -----------------------------------------------

    async def expire_leases(
        self, policy: Callable[[str], ExpiredPolicy], limit: int = 1000
    ) -> list[tuple[KeyRef, str]]:
        now = _now_ms()
        changed: list[tuple[KeyRef, str]] = []
        for digest in list(self._index[State.IN_FLIGHT]):
            record = self._records[digest]
            if record.lease_until_ms > now:
                continue
            after = self._expire_lease(record, now, policy(record.route))
            changed.append((KeyRef(digest, record.route, record.key), str(after.state)))
            if len(changed) >= limit:
                break
        return changed

    async def begin_check(self, ref: KeyRef, run_id: str, lock: float, min_interval: float) -> bool:
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.state is not State.UNRESOLVED or record.run_id != run_id:
            return False
        if record.check_lock_ms > now or now - record.last_check_ms < min_interval * 1000:
            return False
        self._put(
            replace(record, check_lock_ms=now + int(lock * 1000), last_check_ms=now), notify=False
        )
        return True

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
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.state is not State.UNRESOLVED or record.run_id != run_id:
            return ""
        checked = _event(now, "reconcile", result=result, answer=answer)
        record = replace(record, check_lock_ms=0, reconcile=answer)
        if result == "done":
            kept = self._keep(ref.digest, response)
            self._settle(record, State.COMPLETED, now, ttl, checked, response=kept)
            return "completed"
        if result == "not_done" and record.delivery:
            return self._not_done(record, now, checked, retry_in)
        if result == "not_done":
            released = _event(now, "released", reason="the upstream says it did not run")
            self._settle(record, State.RELEASED, now, ttl, checked, released)
            return "released"
        if now - record.since_ms >= park_after * 1000:
            parked = _event(now, "parked", reason="no conclusive check within park_after")
            self._put(self._move(record, State.PARKED, now, checked, parked))
            return "parked"
        self._put(replace(record, history=(*record.history, checked)), notify=False)
        return "unresolved"

    async def park(self, ref: KeyRef, reason: str) -> bool:
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.state is not State.UNRESOLVED:
            return False
        self._put(
            self._move(
                record, State.PARKED, now, _event(now, "parked", reason=reason), check_lock_ms=0
            )
        )
        return True

    # -- operators ---------------------------------------------------------------

    async def operator_claim(self, ref: KeyRef, operator: str, force: bool) -> OperatorResult:
        now = _now_ms()
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
            event = _event(now, "claimed", operator=operator, takeover_from=record.holder)
        else:
            event = _event(now, "claimed", operator=operator)
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
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None:
            return OperatorResult(False, refused="missing", state="missing")
        if record.state is not State.CLAIMED:
            return OperatorResult(False, state=str(record.state), refused="state")
        if record.holder != operator:
            return OperatorResult(False, state="claimed", refused="holder", holder=record.holder)
        event = _event(now, "resolved", operator=operator, outcome=outcome, note=note)
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

    async def open_records(self, states: frozenset[State]) -> list[Record]:
        now = _now_ms()
        return [
            replace(self._records[digest], now_ms=now)
            for state in _INDEXED
            if state in states
            for digest in self._index[state]
        ] + [  # deliveries waiting: from the due indexes
            replace(self._records[digest], now_ms=now)
            for queued in self._queued.values()
            for digest in queued
            if self._records[digest].state in states
        ]
