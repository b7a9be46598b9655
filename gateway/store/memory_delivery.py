"""The memory store's deliveries: accept, pick, retry_later and the queue's reads.

Half of MemoryStore (memory.py), kept apart so each half reads on its own: this half
owns the delivery state (stored requests and tokens, sealed as Redis keeps them, and
per route the queued and retrying digests by due time), and uses the record helpers
the other half implements (declared abstract here). Same rule as there: each method
is one critical section, no await inside.
"""

from __future__ import annotations

import abc
import heapq
import time
from typing import Any

from gateway.encryption import PLAIN, ResponseCodec
from gateway.records import QUEUE_STATES, KeyRef, Record, State, StoredRequest
from gateway.store.base import Accepted, ExpiredPolicy, PickResult, QueueStat, Store
from gateway.store.notices import Due


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def event(now: int, event: str, **fields: Any) -> dict[str, Any]:
    return {"at_ms": now, "event": event, **fields}


_event = event


class MemoryDeliveries(Store):
    def __init__(self, codec: ResponseCodec = PLAIN) -> None:
        super().__init__(codec)
        self._records: dict[str, Record] = {}
        self._requests: dict[str, bytes] = {}
        self._tokens: dict[str, bytes] = {}
        # route -> digest -> due, for queued and retrying records; and per route a
        # heap of (due, digest) whose entries that no longer match are stale.
        self._queued: dict[str, dict[str, int]] = {}
        self._due_heaps: dict[str, list[tuple[int, str]]] = {}

    # -- the record helpers, in memory.py ------------------------------------------

    @abc.abstractmethod
    def _purge(self, now: int) -> None: ...

    @abc.abstractmethod
    def _read(self, digest: str, now: int) -> Record | None: ...

    @abc.abstractmethod
    def _put(self, record: Record, *, ttl: float | None = None, notify: bool = True) -> None: ...

    @abc.abstractmethod
    def _out(self, record: Record, now: int) -> Record: ...

    @abc.abstractmethod
    def _move(
        self, record: Record, state: State, now: int, *events: dict[str, Any], **changes: Any
    ) -> Record: ...

    @abc.abstractmethod
    def _expire_lease(self, record: Record, now: int, policy: ExpiredPolicy) -> Record: ...

    # -- deliveries --------------------------------------------------------------

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
        now = now_ms()
        self._purge(now)
        record = self._read(ref.digest, now)
        if record is not None and record.state is State.IN_FLIGHT and record.lease_until_ms <= now:
            record = self._expire_lease(record, now, expired)
        if record is not None and record.state is not State.RELEASED:
            return Accepted("exists", now, self._out(record, now))
        if not admit:
            return Accepted("full", now)
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
            due_ms=now,
        )
        self._put(queued, notify=False)
        self._requests[ref.digest] = self.codec.encode_request(ref.digest, request)
        self._tokens[ref.digest] = self.codec.encode_token(ref.digest, token)
        self.due.announce(Due(ref, now, now, origin))
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
            parked = _event(now, "parked", reason=park_reason)
            self._put(self._move(record, State.PARKED, now, parked, reason=park_reason, due_ms=0))
            return PickResult(None, why="exhausted", next=self._head(route, now), now_ms=now)
        attempt = record.attempts + 1
        event = _event(now, "attempt", attempt=attempt, run_id=run_id, replica=replica)
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
    ) -> bool:
        now = now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.run_id != run_id or not record.delivery:
            return False
        if record.state in (State.RETRYING, State.PARKED) and record.last_attempt == attempt:
            return True  # this very call, repeated
        if record.state is not State.IN_FLIGHT:
            return False
        if delay is not None:
            due = now + int(delay * 1000)
            event = _event(now, "retry_scheduled", due_ms=due, attempt=attempt)
            self._put(
                self._move(
                    record,
                    State.RETRYING,
                    now,
                    event,
                    lease_until_ms=0,
                    due_ms=due,
                    last_attempt=attempt,
                )
            )
            self.due.announce(Due(ref, due, now, origin))
            return True
        reason = str(attempt.get("reason") or "attempts exhausted")
        event = _event(now, "parked", reason=reason, attempt=attempt)
        moved = self._move(
            record, State.PARKED, now, event, lease_until_ms=0, reason=reason, last_attempt=attempt
        )
        self._put(moved)
        return True

    def _not_done(
        self, record: Record, now: int, checked: dict[str, Any], retry_in: float | None
    ) -> str:
        """A check says a delivery's attempt did not run: it may run again."""
        reason = "the upstream says it did not run"
        if retry_in is None:
            parked = _event(now, "parked", reason=reason + "; no attempt left")
            self._put(
                self._move(record, State.PARKED, now, checked, parked, reason=parked["reason"])
            )
            return "parked"
        due = now + int(retry_in * 1000)
        event = _event(now, "retry_scheduled", due_ms=due, reason=reason)
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
            retrying = sum(1 for d in queued if self._records[d].state is State.RETRYING)
            oldest = max(0, now - min(queued.values())) / 1000
            stats.append(QueueStat(route, len(queued) - retrying, retrying, oldest))
        return stats
