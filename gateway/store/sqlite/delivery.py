"""The SQLite store's deliveries: accept, pick, retry_later and the queue's reads.

A part SqliteStore (store.py) holds. A delivery is a row of gateway_records like any
record (`delivery` 1), its sealed request and token in the same row until it settles;
the queue is the partial index gateway_records_due (route, due_ms, digest) over queued
and retrying rows, and its counts are gateway_counts'. Each operation holds the file's
write lock, so `pick` can search in the same step as memory's does: the hint, or else
the route's earliest due row. No row is taken twice, by any process on the file.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from gateway.records import QUEUE_STATES, KeyRef, Record, State, StoredRequest, history_event
from gateway.store.base import Accepted, NewDelivery, PickResult, duration_ms
from gateway.store.notices import Due
from gateway.store.sqlite.rows import Effects, Host, moved

_HEAD = (
    "SELECT digest, key, due_ms FROM gateway_records WHERE route = ?"
    " AND state IN ('queued', 'retrying') ORDER BY due_ms, digest LIMIT ?"
)


#: An accept of a key with no row, while the route's queue is under its bound: the row
#: queued whole, due (and listed) at ?10 (the columns not named are a fresh record's
#: defaults), or nothing (then it is decided on what is there, or the queue is full).
_ACCEPT_NEW = (
    "INSERT INTO gateway_records (digest, route, key, state, run_id, fingerprint,"
    " created_ms, since_ms, delivery, due_ms, place, request, token)"
    " SELECT ?1, ?2, ?3, 'queued', ?4, ?5, ?6, ?6, 1, ?10, ?10, ?7, ?8"
    " WHERE (SELECT coalesce(sum(count), 0) FROM gateway_counts WHERE route = ?2"
    " AND state IN ('queued', 'retrying')) < ?9"
    " ON CONFLICT (digest) DO NOTHING"
)
#: The bound of a route whose queue has none (SQLite's largest integer).
_UNBOUNDED = 2**63 - 1


class SqliteDeliveries:
    def __init__(self, store: Host) -> None:
        self.store = store
        self.rows = store.rows
        self.codec = store.codec

    def _head(self, conn: sqlite3.Connection, route: str, now: int) -> Due | None:
        row = conn.execute(_HEAD, (route, 1)).fetchone()
        return None if row is None else Due(KeyRef(row[0], route, row[1]), row[2], now)

    async def accept(self, delivery: NewDelivery) -> Accepted:
        ref = delivery.ref
        request = self.codec.encode_request(ref.digest, delivery.request)
        token = self.codec.encode_token(ref.digest, delivery.token)

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> Accepted:
            # A new key with room in the queue (most accepts): one INSERT, nothing read
            # or decoded. Anything else is decided below.
            bound = _UNBOUNDED if delivery.limit is None else delivery.limit
            due = now + delivery.delay_ms
            inserted = conn.execute(
                _ACCEPT_NEW, (ref.digest, ref.route, ref.key, delivery.run_id,
                              delivery.fingerprint, now, request, token, bound, due),
            )  # fmt: skip
            if inserted.rowcount == 1:
                self.rows.count(conn, ref.route, State.QUEUED, 1)
                fx.due.append(Due(ref, due, now, delivery.origin))
                return Accepted("queued", now)
            found, released = self.store.take(conn, ref, now, delivery.expired, fx)
            if found is not None:
                return Accepted("exists", now, found)
            if delivery.limit is not None:
                (waiting,) = conn.execute(
                    "SELECT coalesce(sum(count), 0) FROM gateway_counts WHERE route = ?"
                    " AND state IN ('queued', 'retrying')",
                    (ref.route,),
                ).fetchone()
                if waiting >= delivery.limit:
                    return Accepted("full", now)
            queued = Record(
                digest=ref.digest,
                route=ref.route,
                key=ref.key,
                state=State.QUEUED,
                run_id=delivery.run_id,
                fingerprint=delivery.fingerprint,
                created_ms=now,
                now_ms=now,
                since_ms=now,
                history=released.history if released is not None else (),
                delivery=True,
                due_ms=due,
            )
            self.rows.write(conn, queued, released, response=None, request=request, token=token)
            fx.due.append(Due(ref, due, now, delivery.origin))
            return Accepted("queued", now)

        return await self.store.run(op, "accept")

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
        lease_ms = duration_ms(lease)

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> PickResult:
            record = self.rows.read(conn, hint.digest, now)
            if (
                record is not None
                and record.delivery
                and record.state is State.IN_FLIGHT
                and record.run_id == run_id
            ):  # this same pick again (the worker retries one that failed): it is that pick
                return PickResult(
                    record,
                    request=self._request(conn, record.digest),
                    next=self._head(conn, route, now),
                    now_ms=now,
                )
            why, due = "", 0
            if record is None or record.state not in QUEUE_STATES:
                why = "gone"
            elif record.due_ms > now:
                why, due = "not_due", record.due_ms
            if why:  # one search in the same step: the earliest due delivery of the route
                head = self._head(conn, route, now)
                if head is not None and head.due_ms <= now:
                    record, why, due = self.rows.read(conn, head.ref.digest, now), "", 0
            if why or record is None:
                following = self._head(conn, route, now)
                return PickResult(None, why=why, due_ms=due, next=following, now_ms=now)
            if record.attempts >= max_attempts:
                parked = history_event(now, "parked", reason=park_reason)
                after = moved(record, State.PARKED, now, parked, reason=park_reason, due_ms=0)
                self.rows.write(conn, after, record)
                fx.changed.append((record.digest, None))
                following = self._head(conn, route, now)
                return PickResult(None, why="exhausted", next=following, now_ms=now)
            attempt = record.attempts + 1
            event = history_event(now, "attempt", attempt=attempt, run_id=run_id, replica=replica)
            picked = moved(
                record,
                State.IN_FLIGHT,
                now,
                event,
                run_id=run_id,
                lease_until_ms=now + lease_ms,
                attempts=attempt,
                due_ms=0,
            )
            self.rows.write(conn, picked, record)
            fx.changed.append((record.digest, None))
            fx.taken.append(record.digest)
            return PickResult(
                picked,
                request=self._request(conn, picked.digest),
                next=self._head(conn, route, now),
                now_ms=now,
            )

        return await self.store.run(op, "pick")

    @staticmethod
    def _request(conn: sqlite3.Connection, digest: str) -> bytes:
        row = conn.execute(
            "SELECT request FROM gateway_records WHERE digest = ?", (digest,)
        ).fetchone()
        return b"" if row is None or row[0] is None else bytes(row[0])

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
        delay_ms = None if delay is None else max(0, int(delay * 1000))

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bool:
            record = self.rows.read(conn, ref.digest, now)
            if record is None or record.run_id != run_id or not record.delivery:
                return False
            if record.state in (State.RETRYING, State.PARKED) and record.last_attempt == attempt:
                return True  # this very call, repeated
            if record.state is not State.IN_FLIGHT:
                return False
            # The pick counted it; an uncounted attempt is not one of the delivery's.
            attempts = max(0, record.attempts - 1) if uncounted else record.attempts
            fx.changed.append((ref.digest, None))
            if delay_ms is not None:
                due = now + delay_ms
                event = history_event(now, "retry_scheduled", due_ms=due, attempt=attempt)
                after = moved(
                    record,
                    State.RETRYING,
                    now,
                    event,
                    lease_until_ms=0,
                    due_ms=due,
                    last_attempt=attempt,
                    attempts=attempts,
                )
                self.rows.write(conn, after, record)
                fx.due.append(Due(ref, due, now, origin))
                return True
            reason = str(attempt.get("reason") or "attempts exhausted")
            event = history_event(now, "parked", reason=reason, attempt=attempt)
            after = moved(
                record,
                State.PARKED,
                now,
                event,
                lease_until_ms=0,
                reason=reason,
                last_attempt=attempt,
                attempts=attempts,
            )
            self.rows.write(conn, after, record)
            return True

        return await self.store.run(op, "retry later")

    def not_done(
        self,
        conn: sqlite3.Connection,
        record: Record,
        old: Record,
        now: int,
        checked: dict[str, Any],
        retry_in: float | None,
        fx: Effects,
    ) -> str:
        """A check says a delivery's attempt did not run: it may run again."""
        reason = "the upstream says it did not run"
        if retry_in is None:
            parked = history_event(now, "parked", reason=reason + "; no attempt left")
            after = moved(record, State.PARKED, now, checked, parked, reason=parked["reason"])
            self.rows.write(conn, after, old)
            return "parked"
        due = now + int(retry_in * 1000)
        event = history_event(now, "retry_scheduled", due_ms=due, reason=reason)
        after = moved(record, State.RETRYING, now, checked, event, due_ms=due, reason="")
        self.rows.write(conn, after, old)
        fx.due.append(Due(KeyRef(record.digest, record.route, record.key), due, now))
        return "retrying"

    async def get_request(self, ref: KeyRef) -> StoredRequest | None:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bytes | None:
            if self.rows.read(conn, ref.digest, now) is None:
                return None
            row = conn.execute(
                "SELECT request FROM gateway_records WHERE digest = ?", (ref.digest,)
            ).fetchone()
            return None if row is None or row[0] is None else bytes(row[0])

        sealed = await self.store.run(op, "request read")
        return None if sealed is None else self.codec.decode_request(ref.digest, sealed)

    async def delivery_token(self, ref: KeyRef) -> str:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bytes | None:
            row = conn.execute(
                "SELECT token FROM gateway_records WHERE digest = ? AND delivery = 1"
                " AND (expires_ms IS NULL OR expires_ms > ?)",
                (ref.digest, now),
            ).fetchone()
            return None if row is None or row[0] is None else bytes(row[0])

        sealed = await self.store.run(op, "token read")
        return "" if sealed is None else self.store.read_token(ref.digest, sealed)

    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> tuple[list[Due], int]:
            rows = conn.execute(_HEAD, (route, limit)).fetchall()
            return [Due(KeyRef(digest, route, key), due, now) for digest, key, due in rows], now

        return await self.store.run(op, "due read")
