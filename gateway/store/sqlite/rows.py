"""The SQLite store's rows: a record read from its row, and written back whole, with
the counts (gateway_counts) kept in the same transaction. What every part shares; all
of it runs on the store's thread, inside an operation's savepoint.

A move is decided in Python on the record read in the same transaction (the file's
write lock is held from `BEGIN IMMEDIATE` to the commit, so nothing else writes in
between, in this process or another), and the effects it has on waiters and delivery
workers (`Effects`) are told once the commit returned.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from gateway.encryption import ResponseCodec
from gateway.records import (
    KeyRef,
    Record,
    State,
    StoredResponse,
    read_history,
    read_object,
)
from gateway.store.base import ExpiredPolicy, Opener, duration_ms
from gateway.store.notices import Due
from gateway.store.pages import COUNTED_STATES, listed_completed, place_of

#: The states a listing shows (pages.place_of gives their place); the others have none
#: (but completed deliveries: pages.listed_completed).
LISTED = COUNTED_STATES | {State.IN_FLIGHT}

#: A record's columns, as written by `write` (the blobs are written apart).
COLUMNS = (
    "route", "key", "state", "run_id", "fingerprint", "created_ms", "since_ms",
    "lease_until_ms", "reason", "holder", "holder_since_ms", "check_lock_ms",
    "last_check_ms", "reconcile", "history", "delivery", "attempts", "due_ms",
    "last_attempt", "place", "expires_ms",
)  # fmt: skip
#: What a read selects: the columns, then the response and the token (never the request).
SELECT = f"SELECT digest, {', '.join(COLUMNS)}, response, token FROM gateway_records"

_UPSERT = (
    f"INSERT INTO gateway_records (digest, {', '.join(COLUMNS)}) "
    f"VALUES ({', '.join('?' * (len(COLUMNS) + 1))}) "
    f"ON CONFLICT (digest) DO UPDATE SET "
    + ", ".join(f"{name} = excluded.{name}" for name in COLUMNS)
)
_COUNT = (
    "INSERT INTO gateway_counts (route, state, count) VALUES (?, ?, ?) "
    "ON CONFLICT (route, state) DO UPDATE SET count = count + excluded.count"
)

#: How long a released tombstone stays when a lease expiry releases it.
TOMBSTONE_TTL = 86400.0


def now_ms() -> int:
    """The store's clock: the host's, shared by every process on the file."""
    return time.time_ns() // 1_000_000


@dataclass
class Effects:
    """What a committed move tells this process's listeners: keys that changed (with
    a completion's response), deliveries made due and deliveries taken."""

    changed: list[tuple[str, tuple[str, StoredResponse] | None]] = field(default_factory=list)
    due: list[Due] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Rows:
    """Reads and writes records on a connection (the store's thread)."""

    def __init__(self, opener: Opener) -> None:
        self.opener = opener

    def decode(self, row: sqlite3.Row | tuple[Any, ...], now: int) -> Record:
        (digest, route, key, state, run_id, fingerprint, created, since, lease, reason,
         holder, holder_since, check_lock, last_check, reconcile, history, delivery,
         attempts, due, last_attempt, _place, _expires, response, token) = row  # fmt: skip
        opened, unreadable = (
            (None, "") if response is None else self.opener.read_response(digest, response)
        )
        return Record(
            digest=digest,
            route=route,
            key=key,
            state=State(state),
            run_id=run_id,
            fingerprint=fingerprint,
            created_ms=created,
            now_ms=now,
            lease_until_ms=lease,
            response=opened,
            unreadable=unreadable,
            reason=reason,
            since_ms=since,
            holder=holder,
            holder_since_ms=holder_since,
            check_lock_ms=check_lock,
            last_check_ms=last_check,
            reconcile=read_object(reconcile),
            history=read_history(history, created),
            delivery=bool(delivery),
            attempts=attempts,
            due_ms=due,
            last_attempt=read_object(last_attempt),
            token="" if token is None else self.opener.read_token(digest, token),
        )

    def read(self, conn: sqlite3.Connection, digest: str, now: int) -> Record | None:
        """The record, or None (none, or one past its expiry)."""
        row = conn.execute(
            SELECT + " WHERE digest = ? AND (expires_ms IS NULL OR expires_ms > ?)",
            (digest, now),
        ).fetchone()
        return None if row is None else self.decode(row, now)

    def write(
        self,
        conn: sqlite3.Connection,
        record: Record,
        old: Record | None,
        *,
        ttl: float | None = None,
        **blobs: bytes | None,
    ) -> None:
        """Write `record` whole over `old` (what this transaction read, or None), with
        an expiry of `ttl` seconds if given; `blobs` (response, request, token) are
        written when named (None clears one). A settled record's request goes."""
        expires = None if ttl is None else record.now_ms + duration_ms(ttl)
        listed = record.state in LISTED or listed_completed(record)
        place = place_of(record) if listed else None
        values = (
            record.digest, record.route, record.key, str(record.state), record.run_id,
            record.fingerprint, record.created_ms, record.since_ms, record.lease_until_ms,
            record.reason, record.holder, record.holder_since_ms, record.check_lock_ms,
            record.last_check_ms, _dump(record.reconcile), _dump(list(record.history)),
            int(record.delivery), record.attempts, record.due_ms, _dump(record.last_attempt),
            place, expires,
        )  # fmt: skip
        conn.execute(_UPSERT, values)
        if record.state in (State.COMPLETED, State.RELEASED):
            blobs.setdefault("request", None)
        if blobs:
            names = sorted(blobs)
            sets = ", ".join(f"{name} = ?" for name in names)
            conn.execute(
                f"UPDATE gateway_records SET {sets} WHERE digest = ?",
                (*(blobs[name] for name in names), record.digest),
            )
        self._recount(conn, old, record)

    def delete(self, conn: sqlite3.Connection, record: Record) -> None:
        conn.execute("DELETE FROM gateway_records WHERE digest = ?", (record.digest,))
        self._recount(conn, record, None)

    @staticmethod
    def _recount(conn: sqlite3.Connection, old: Record | None, new: Record | None) -> None:
        before = (old.route, old.state) if old is not None else None
        after = (new.route, new.state) if new is not None else None
        if before == after:
            return
        if before is not None and before[1] in COUNTED_STATES:
            Rows.count(conn, before[0], before[1], -1)
        if after is not None and after[1] in COUNTED_STATES:
            Rows.count(conn, after[0], after[1], 1)

    @staticmethod
    def count(conn: sqlite3.Connection, route: str, state: State, change: int) -> None:
        """`change` to the count of `route`'s records in `state` (a counted state), for
        a row written without `write`."""
        conn.execute(_COUNT, (route, str(state), change))

    def take(self, conn: sqlite3.Connection, digest: str, now: int) -> Record | None:
        """The record, or None; a row past its expiry is deleted in the same read, so a
        new claim takes its place whole (one statement where `read` then a delete
        would be two)."""
        row = conn.execute(SELECT + " WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            return None
        record = self.decode(row, now)
        if row[21] is not None and row[21] <= now:  # expires_ms
            self.delete(conn, record)
            return None
        return record


def ref_of(record: Record) -> KeyRef:
    return KeyRef(record.digest, record.route, record.key)


def moved(
    record: Record, state: State, now: int, *events: dict[str, Any], **changes: Any
) -> Record:
    """`record` in `state` from `now`, its history carried on with `events`."""
    return replace(
        record,
        state=state,
        since_ms=now,
        now_ms=now,
        history=(*record.history, *events),
        **changes,
    )


T = TypeVar("T")


class Host(Protocol):
    """What the store's parts (deliveries, listing, roster) use of the store that holds
    them: its one connection's runner, the claim's reading of a key, its rows and its
    codec."""

    @property
    def rows(self) -> Rows: ...

    @property
    def codec(self) -> ResponseCodec: ...

    async def run(
        self, operation: Callable[[sqlite3.Connection, int, Effects], T], what: str
    ) -> T: ...

    def take(
        self, conn: sqlite3.Connection, ref: KeyRef, now: int, expired: ExpiredPolicy, fx: Effects
    ) -> tuple[Record | None, Record | None]: ...

    def read_token(self, digest: str, data: bytes) -> str: ...
