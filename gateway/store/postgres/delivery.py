"""The PostgreSQL store's deliveries: accept, pick, retry_later and the queue's reads.

A part PostgresStore (store.py) holds; it takes rows as the request path does (rows.py). A
delivery is a row of gateway_records like any record (`delivery` true), its request
in the same row until it settles; the queue is the partial index
`gateway_records_due (prefix, route, due_ms) WHERE state IN ('queued', 'retrying')`,
and its counts (queue_stats, and the accept's bound) are gateway_counts' (005_counts.sql).
`pick` is Technique 3 ("claim, then process") of "Make scheduled job handlers
idempotent: safe to run twice": one UPDATE of the hint, or else of the route's
earliest due row, chosen `FOR UPDATE SKIP LOCKED`, so replicas picking at once never
take one row twice nor wait on each other. Workers are woken by NOTIFY (`!d`, `!t`,
postgres/notices.py); `due_candidates` is the rescan, from the due index.
"""

from __future__ import annotations

from typing import Any

from gateway.records import KeyRef, QueueStat, State, StoredRequest
from gateway.store.base import Accepted, NewDelivery, Opener, PickResult, duration_ms
from gateway.store.notices import Due
from gateway.store.postgres.database import Database, decode_record
from gateway.store.postgres.rows import RecordRows


class PostgresDeliveries:
    def __init__(self, db: Database, rows: RecordRows, opener: Opener) -> None:
        self.db = db
        self.rows = rows
        self.opener = opener
        self.codec = opener.codec

    async def accept(self, delivery: NewDelivery) -> Accepted:
        ref, run_id, fingerprint, request, token = (
            delivery.ref,
            delivery.run_id,
            delivery.fingerprint,
            delivery.request,
            delivery.token,
        )
        limit, origin, expired = delivery.limit, delivery.origin, delivery.expired
        args = (
            ref.route,
            ref.key,
            run_id,
            fingerprint,
            self.codec.encode_request(ref.digest, request),
            self.codec.encode_token(ref.digest, token),
            limit,
            expired,
            origin,
            delivery.delay_ms,
        )
        row = await self.rows.take("accept", ref, *args)
        if row is None:  # free, not admitted: nothing stored
            found = await self.rows.get(ref)
            if found is not None and found.state is State.IN_FLIGHT:
                # free only once its dead lease is released, as a claim would have
                found = await self.rows.expired(ref, found, expired)
            if found is not None:
                return Accepted("full", found.now_ms)
            now = await self.db.call(lambda conn: conn.fetchval("SELECT gateway_now_ms()"), "now")
            return Accepted("full", int(now))
        now = row["now"]
        if row["outcome"] == 1:
            return Accepted("queued", now)
        record = decode_record(self.opener, ref.digest, now, row)
        if record.state is State.IN_FLIGHT and record.lease_until_ms <= now:
            record = await self.rows.expired(ref, record, expired)
            if record.state is State.RELEASED:  # free now: the policy released it
                return await self.accept(delivery)
        return Accepted("exists", record.now_ms, record)

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
        row = await self.db.fetchrow(
            "pick", route, hint.digest, run_id, lease_ms, max_attempts, replica, park_reason
        )
        assert row is not None  # one row, always
        now = row["now"]
        following = None
        if row["next_digest"] is not None:
            ref = KeyRef(row["next_digest"], route, row["next_key"])
            following = Due(ref, row["next_due"], now)
        if row["digest"] is not None:
            record = decode_record(self.opener, row["digest"], now, row)
            if record.state is State.PARKED:
                return PickResult(None, why="exhausted", next=following, now_ms=now)
            return PickResult(record, request=row["request"] or b"", next=following, now_ms=now)
        if row["hint_state"] == "in_flight" and row["hint_run"] == run_id:
            # This very pick, retried after a lost connection: it took the hint.
            mine = await self.rows.get(hint)
            sealed = await self.db.fetchrow("request", hint.digest)
            if mine is not None and sealed is not None:
                return PickResult(mine, request=sealed["request"], next=following, now_ms=now)
        if row["hint_state"] in ("queued", "retrying") and row["hint_due"] > now:
            return PickResult(
                None, why="not_due", due_ms=row["hint_due"], next=following, now_ms=now
            )
        return PickResult(None, why="gone", next=following, now_ms=now)

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
        reason = str(attempt.get("reason") or "attempts exhausted")
        row = await self.db.fetchrow(
            "retry", ref.digest, run_id, delay_ms, attempt, origin, reason, uncounted
        )
        return bool(row is not None and row["ok"])

    async def get_request(self, ref: KeyRef) -> StoredRequest | None:
        row = await self.db.fetchrow("request", ref.digest)
        if row is None:
            return None
        return self.codec.decode_request(ref.digest, row["request"])

    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]:
        rows = await self.db.fetch("due", route, limit)
        now = int(rows[0]["now"])
        found = [
            Due(KeyRef(row["digest"], route, row["key"]), row["due_ms"], now)
            for row in rows
            if row["digest"] is not None
        ]
        return found, now

    async def queue_stats(self) -> list[QueueStat]:
        return [
            QueueStat(
                row["route"],
                row["queued"],
                row["retrying"],
                max(0, row["now"] - (row["earliest"] or row["now"])) / 1000,
            )
            for row in await self.db.fetch("queue_stats")
        ]
