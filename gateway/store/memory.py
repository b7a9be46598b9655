"""The in-memory store: one process, nothing survives a restart.

For the demo, tests and a single instance. It keeps the same contract as the Redis
store (each method is one critical section: no await inside), but its records live
in this process only: a restart forgets every completed key (so repeats run again)
and every unresolved one (so nothing is left to reconcile), and two processes never
see each other's keys. `run` refuses to start several workers on it.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import replace

from gateway.records import KeyRef, Record, State, StoredResponse
from gateway.store.base import Store


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class MemoryStore(Store):
    def __init__(self) -> None:
        super().__init__()
        self._records: dict[str, Record] = {}
        self._expires: dict[str, int] = {}  # digest -> ms; only completed records expire
        self._expiry_heap: list[tuple[int, str]] = []  # may hold stale entries

    def _purge(self, now: int) -> None:
        # Amortised O(log n) a write: memory stays bounded by live records.
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, digest = heapq.heappop(heap)
            expires = self._expires.get(digest)
            if expires is not None and expires <= now:
                del self._expires[digest]
                self._records.pop(digest, None)

    def _read(self, digest: str, now: int) -> Record | None:
        record = self._records.get(digest)
        if record is None:
            return None
        expires = self._expires.get(digest)
        if expires is not None and expires <= now:
            del self._records[digest]
            del self._expires[digest]
            return None
        return record

    def _write(self, record: Record) -> None:
        self._records[record.digest] = record
        self.notifier.notify(record.digest)

    async def claim(
        self, ref: KeyRef, run_id: str, fingerprint: str, lease: float
    ) -> Record | None:
        now = _now_ms()
        self._purge(now)
        record = self._read(ref.digest, now)
        if record is None:
            self._records[ref.digest] = Record(
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
            )
            return None
        if record.state is State.IN_FLIGHT and record.lease_until_ms <= now:
            record = replace(
                record,
                state=State.UNRESOLVED,
                reason="lease_expired",
                since_ms=now,
                history=(*record.history, _event(now, "unknown", reason="lease_expired")),
            )
            self._write(record)
        return replace(record, now_ms=now)

    async def complete(
        self, ref: KeyRef, run_id: str, response: StoredResponse, ttl: float
    ) -> bool:
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.run_id != run_id:
            return False
        if record.state is State.COMPLETED:
            return True  # a repeated completion of our own run
        if record.state not in (State.IN_FLIGHT, State.UNRESOLVED):
            return False
        history = record.history
        if record.state is State.UNRESOLVED:
            history = (*history, _event(now, "completed", origin=response.origin))
        self._write(
            replace(
                record,
                state=State.COMPLETED,
                response=response,
                since_ms=now,
                lease_until_ms=0,
                history=history,
            )
        )
        expires = now + int(ttl * 1000)
        self._expires[ref.digest] = expires
        heapq.heappush(self._expiry_heap, (expires, ref.digest))
        return True

    async def release(self, ref: KeyRef, run_id: str) -> bool:
        record = self._read(ref.digest, _now_ms())
        if record is None or record.run_id != run_id or record.state is not State.IN_FLIGHT:
            return False
        del self._records[ref.digest]
        self.notifier.notify(ref.digest)
        return True

    async def mark_unresolved(self, ref: KeyRef, run_id: str, reason: str) -> bool:
        now = _now_ms()
        record = self._read(ref.digest, now)
        if record is None or record.run_id != run_id:
            return False
        if record.state is State.UNRESOLVED and record.reason == reason:
            return True
        if record.state is not State.IN_FLIGHT:
            return False
        self._write(
            replace(
                record,
                state=State.UNRESOLVED,
                reason=reason,
                since_ms=now,
                lease_until_ms=0,
                history=(*record.history, _event(now, "unknown", reason=reason)),
            )
        )
        return True

    async def get(self, ref: KeyRef) -> Record | None:
        now = _now_ms()
        record = self._read(ref.digest, now)
        return None if record is None else replace(record, now_ms=now)


def _event(now: int, event: str, **fields: str) -> dict[str, str | int]:
    return {"at_ms": now, "event": event, **fields}
