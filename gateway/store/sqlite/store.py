"""The SQLite store: records in one file on this host, durable with nothing else to run.

One row of `gateway_records` per record, in the schema of store/sqlite/sql/0NN_*.sql,
applied on start (schema.py). Every operation is a function of the connection that
reads the record and decides its move in Python, run on the store's thread inside
one transaction with the operations of other callers (database.py: the file's write
lock is held throughout, so the decision and the write are one step for every process
on the file, and one fsync carries the batch). With WAL and `synchronous=FULL` (the
default) a committed claim or completion survives a crash of the machine;
`store.sqlite.synchronous: normal` keeps it through a crash of the gateway, not of the
machine.

What Redis does with a TTL, the reaper does here, as on PostgreSQL: completed and
released rows carry `expires_ms`, reads treat a row past it as absent, and every
process deletes them in batches now and then.

The parts it holds: database.py (the thread, group commit), rows.py (reading and
writing a record, its counts), delivery.py (deliveries), listing.py (pages and
counts), notices.py (the other workers' notices), roster.py (the operator roster);
schema.py checks and migrates the file.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import (
    OPEN_STATES,
    KeyRef,
    QueueStat,
    Record,
    State,
    StoredResponse,
    StoreInfo,
    history_event,
    is_success,
)
from gateway.store import rate
from gateway.store.base import (
    CheckResult,
    ExpiredPolicy,
    OperatorResult,
    PartsStore,
    codec_for,
    duration_ms,
)
from gateway.store.notices import Due
from gateway.store.sqlite.database import Database
from gateway.store.sqlite.delivery import SqliteDeliveries
from gateway.store.sqlite.listing import SqliteListing
from gateway.store.sqlite.notices import SqliteNotices
from gateway.store.sqlite.pauses import SqlitePauses
from gateway.store.sqlite.roster import SqliteRoster
from gateway.store.sqlite.rows import COLUMNS, TOMBSTONE_TTL, Effects, Rows, moved, now_ms
from gateway.store.sqlite.schema import SchemaError, prepare
from gateway.store.transfer import EXPORT_PAGE, ExportedRecord, ExportPage

log = logging.getLogger("gateway.store")

T = TypeVar("T")

#: Rows the reaper deletes per transaction, and how long it rests between rounds.
REAP_BATCH = 1000
REAP_INTERVAL = (5.0, 10.0)


#: A claim of a key with no row: the row in flight, or nothing (then it is decided on
#: the row that is there). The columns not named are a fresh record's defaults.
_CLAIM_NEW = (
    "INSERT INTO gateway_records (digest, route, key, state, run_id, fingerprint, created_ms,"
    " since_ms, lease_until_ms, place) VALUES (?, ?, ?, 'in_flight', ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (digest) DO NOTHING"
)
#: The completion of a run in flight whose record has no history and is no delivery:
#: what `settled` makes of it, written in place (no count changes: neither state is
#: counted). Returns nothing when the record is any other.
_COMPLETE_PLAIN = (
    "UPDATE gateway_records SET state = 'completed', since_ms = ?, lease_until_ms = 0,"
    " check_lock_ms = 0, holder = '', holder_since_ms = 0, reason = '', place = NULL,"
    " expires_ms = ?, response = ?, request = NULL"
    " WHERE digest = ? AND run_id = ? AND state = 'in_flight' AND history = '[]'"
    " AND delivery = 0 RETURNING route, fingerprint"
)
_LAST_SUCCESS = (
    "INSERT INTO gateway_last_success (route, at_ms) VALUES (?, ?)"
    " ON CONFLICT (route) DO UPDATE SET at_ms = max(at_ms, excluded.at_ms)"
)


#: An export page: the live rows after a digest, in digest order (the primary key's).
_EXPORT = (
    f"SELECT digest, {', '.join(COLUMNS)}, response, token, request FROM gateway_records"
    " WHERE digest > ? AND (expires_ms IS NULL OR expires_ms > ?) ORDER BY digest LIMIT ?"
)
_EXPIRES = 1 + COLUMNS.index("expires_ms")


def sqlite_path(url: str) -> Path:
    """The file a `sqlite://` URL names: `sqlite:///var/lib/gw.db` is absolute,
    `sqlite://gw.db` relative to the working directory."""
    return Path(url.removeprefix("sqlite://"))


class SqliteStore(PartsStore):
    deliveries: SqliteDeliveries
    listing: SqliteListing
    operators: SqliteRoster
    pauses: SqlitePauses

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(codec_for(config))
        self.path = sqlite_path(config.url)
        self.synchronous = config.sqlite_synchronous
        self.db = Database(
            self.path,
            timeout=config.socket_timeout,
            setup=lambda conn: prepare(
                conn, self.path, self.synchronous, max(config.connect_timeout, 1.0)
            ),
        )
        self.rows = Rows(self.opener)
        self.deliveries = SqliteDeliveries(self)
        self.listing = SqliteListing(self)
        self.operators = SqliteRoster(self)
        self.pauses = SqlitePauses(self)
        self.notices = SqliteNotices(self.path, self.notifier, self.due)
        #: Set while this process hears the other workers' notices (tests wait on it).
        self.subscribed = self.notices.subscribed
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._info_seen: StoreInfo | None = None

    async def run(self, operation: Callable[[sqlite3.Connection, int, Effects], T], what: str) -> T:
        """`operation(conn, now, effects)` in a transaction; once it is committed,
        tells the listeners of this process what it changed (what its last run said:
        an operation can run again before its commit, database.py)."""
        runs: list[Effects] = []

        def attempt(conn: sqlite3.Connection) -> T:
            runs.append(Effects())
            return operation(conn, now_ms(), runs[-1])

        self.db.turns.shared = self.notices.shared()
        result = await self.db.run(attempt, what)
        effects = runs[-1]
        for digest, completed in effects.changed:
            self.notifier.notify(digest, completed)
        for due in effects.due:
            self.due.announce(due)
        for digest in effects.taken:
            self.due.taken(digest)
        self.notices.publish(effects)
        return result

    async def start(self) -> None:
        try:
            await self.db.open()
        except SchemaError as exc:
            raise StoreError(str(exc)) from exc
        self.notices.start()
        log.info(
            "SQLite store at %s (synchronous=%s)", self.path.resolve(), self.synchronous.upper()
        )
        self._tasks = [asyncio.create_task(self._reap_forever(), name="store-reaper")]

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.notices.close()
        await self.db.close()

    async def ping(self) -> None:
        await self.db.run(lambda conn: conn.execute("SELECT 1").fetchone(), "ping")

    async def info(self) -> StoreInfo:
        found = StoreInfo(
            "noeviction", "yes" if self.synchronous == "full" else "no", source=str(self.path)
        )
        if found != self._info_seen:
            self._info_seen = found
            if self.synchronous != "full":
                log.warning(
                    "the SQLite store at %s commits with synchronous=normal: a power cut "
                    "can lose the last claims and completions (a gateway crash cannot), "
                    "and their keys run again. Remove store.sqlite.synchronous for FULL",
                    self.path,
                )
        return found

    # -- the request path -------------------------------------------------------

    def expire_lease(
        self, conn: sqlite3.Connection, record: Record, now: int, policy: ExpiredPolicy, fx: Effects
    ) -> Record:
        """An in-flight record whose lease ran out becomes what `policy` says."""
        if policy == "release" and not record.delivery:
            event = history_event(now, "released", reason="lease expired; route policy: release")
            after = self.settled(record, State.RELEASED, now, event)
            self.rows.write(conn, after, record, ttl=TOMBSTONE_TTL)
            fx.changed.append((record.digest, None))
            return after
        target = State.UNRESOLVED if policy == "release" else State(policy)
        return self.unknown(conn, record, target, now, "lease_expired", fx)

    def unknown(
        self,
        conn: sqlite3.Connection,
        record: Record,
        target: State,
        now: int,
        reason: str,
        fx: Effects,
    ) -> Record:
        events = [history_event(now, "unknown", reason=reason)]
        if target is State.PARKED:
            events.append(history_event(now, "parked", reason="route policy: park"))
        after = moved(record, target, now, *events, reason=reason, lease_until_ms=0)
        self.rows.write(conn, after, record)
        fx.changed.append((record.digest, None))
        return after

    @staticmethod
    def settled(
        record: Record, state: State, now: int, *events: dict[str, Any], **changes: Any
    ) -> Record:
        return moved(
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

    def take(
        self, conn: sqlite3.Connection, ref: KeyRef, now: int, expired: ExpiredPolicy, fx: Effects
    ) -> tuple[Record | None, Record | None]:
        """What a claim or an accept finds at `ref`: (the live record, or None when
        the key is free; a released record whose history a new run carries on)."""
        record = self.rows.take(conn, ref.digest, now)
        if record is not None and record.state is State.IN_FLIGHT and record.lease_until_ms <= now:
            record = self.expire_lease(conn, record, now, expired, fx)
        if record is not None and record.state is State.RELEASED:
            return None, record
        return record, None

    async def claim(
        self,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        lease: float,
        expired: ExpiredPolicy = "unresolved",
    ) -> Record | None:
        lease_ms = duration_ms(lease)

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> Record | None:
            lease_until = now + lease_ms
            # A new key (most first requests): one INSERT, nothing read or decoded.
            taken = conn.execute(
                _CLAIM_NEW, (ref.digest, ref.route, ref.key, run_id, fingerprint, now, now,
                             lease_until, lease_until),
            )  # fmt: skip
            if taken.rowcount == 1:
                return None
            found, released = self.take(conn, ref, now, expired, fx)
            if found is not None:
                return found
            fresh = Record.claimed(ref, run_id, fingerprint, now, now + lease_ms, released)
            self.rows.write(conn, fresh, released, response=None, request=None, token=None)
            return None

        return await self.run(op, "claim")

    async def complete(
        self,
        ref: KeyRef,
        run_id: str,
        response: StoredResponse,
        ttl: float,
        attempt: dict[str, Any] | None = None,
    ) -> bool:
        sealed = self.codec.encode(ref.digest, response)

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bool:
            success = is_success(response.status)
            # The run in flight with nothing to carry on (no history, not a delivery):
            # one UPDATE, nothing read or decoded. Anything else is decided below.
            done = conn.execute(
                _COMPLETE_PLAIN, (now, now + duration_ms(ttl), sealed, ref.digest, run_id)
            ).fetchone()
            if done is not None:
                route, fingerprint = done
                if success:
                    self.note_success(route, now)
                fx.changed.append((ref.digest, (fingerprint, response)))
                return True
            record = self.rows.read(conn, ref.digest, now)
            if record is None or record.run_id != run_id:
                return False
            if record.state is State.COMPLETED:
                return True  # a repeated completion of our own run
            if record.state not in (State.IN_FLIGHT, State.UNRESOLVED):
                return False
            events = []
            if record.state is State.UNRESOLVED or record.history:
                events.append(history_event(now, "completed", origin=response.origin))
            after = record
            if record.delivery and attempt is not None:
                after = replace(record, last_attempt=attempt)
            after = self.settled(after, State.COMPLETED, now, *events, reason="")
            self.rows.write(conn, after, record, ttl=ttl, response=sealed)
            if success:
                self.note_success(record.route, now)
            fx.changed.append((ref.digest, (record.fingerprint, response)))
            return True

        return await self.run(op, "complete")

    def note_success(self, route: str, now: int) -> None:
        """`route` succeeded at `now`: written once per commit, whatever number of its
        completions the commit carries."""
        self.db.defer(("last success", route), _LAST_SUCCESS, (route, now))

    async def last_successes(self) -> dict[str, float]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> dict[str, float]:
            rows = conn.execute("SELECT route, at_ms FROM gateway_last_success").fetchall()
            return {route: max(0, now - at) / 1000 for route, at in rows}

        return await self.run(op, "last successes")

    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bool:
            record = self.rows.read(conn, ref.digest, now)
            if record is None:
                return True
            if record.run_id != run_id or record.state is not State.IN_FLIGHT:
                return False
            fx.changed.append((ref.digest, None))
            if record.history:
                event = history_event(now, "released", reason=reason)
                after = self.settled(record, State.RELEASED, now, event)
                self.rows.write(conn, after, record, ttl=ttl)
                return True
            self.rows.delete(conn, record)
            return True

        return await self.run(op, "release")

    async def mark_unresolved(
        self, ref: KeyRef, run_id: str, reason: str, *, park: bool = False
    ) -> bool:
        target = State.PARKED if park else State.UNRESOLVED

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bool:
            record = self.rows.read(conn, ref.digest, now)
            if record is None or record.run_id != run_id:
                return False
            if record.state is target and record.reason == reason:
                return True
            if record.state is not State.IN_FLIGHT:
                return False
            self.unknown(conn, record, target, now, reason, fx)
            return True

        return await self.run(op, "mark unresolved")

    async def get(self, ref: KeyRef) -> Record | None:
        return await self.run(lambda conn, now, fx: self.rows.read(conn, ref.digest, now), "read")

    # -- the sweep, the reaper and the reconciler ------------------------------------

    async def expire_leases(
        self, policy: Callable[[str], ExpiredPolicy], limit: int = 1000
    ) -> list[tuple[KeyRef, str]]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> list[tuple[KeyRef, str]]:
            digests = [
                digest
                for (digest,) in conn.execute(
                    "SELECT digest FROM gateway_records WHERE state = 'in_flight'"
                    " AND place IS NOT NULL AND place <= ? ORDER BY place LIMIT ?",
                    (now, limit),
                )
            ]
            changed = []
            for digest in digests:
                record = self.rows.read(conn, digest, now)
                if record is None:
                    continue
                after = self.expire_lease(conn, record, now, policy(record.route), fx)
                changed.append((KeyRef(digest, record.route, record.key), str(after.state)))
            return changed

        return await self.run(op, "lease expiry")

    async def reap(self, limit: int = REAP_BATCH) -> int:
        """Delete up to `limit` rows past their expiry; how many went."""

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> int:
            cursor = conn.execute(
                "DELETE FROM gateway_records WHERE digest IN (SELECT digest FROM "
                "gateway_records WHERE expires_ms <= ? ORDER BY expires_ms LIMIT ?)",
                (now, limit),
            )
            return cursor.rowcount

        return await self.run(op, "reap")

    async def _reap_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(random.uniform(*REAP_INTERVAL))
            try:
                for _ in range(20):  # bounded: 20 batches a round, then rest
                    if await self.reap() < REAP_BATCH:
                        break
            except StoreError as exc:
                log.debug("reaper: %s", exc)

    async def begin_check(self, ref: KeyRef, run_id: str, lock: float, min_interval: float) -> bool:
        lock_ms = duration_ms(lock)

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bool:
            record = self.rows.read(conn, ref.digest, now)
            if record is None or record.state is not State.UNRESOLVED or record.run_id != run_id:
                return False
            if record.check_lock_ms > now or now - record.last_check_ms < min_interval * 1000:
                return False
            after = replace(record, check_lock_ms=now + lock_ms, last_check_ms=now)
            self.rows.write(conn, after, record)
            return True

        return await self.run(op, "check begin")

    async def end_check(self, check: CheckResult) -> str:
        ref, run_id, result, answer = check.ref, check.run_id, check.result, check.answer
        response, ttl, park_after, retry_in = (
            check.response,
            check.ttl,
            check.park_after,
            check.retry_in,
        )
        sealed = self.codec.encode(ref.digest, response) if response is not None else None

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> str:
            record = self.rows.read(conn, ref.digest, now)
            if record is None or record.state is not State.UNRESOLVED or record.run_id != run_id:
                return ""
            checked = history_event(now, "reconcile", result=result, answer=answer)
            base = replace(record, check_lock_ms=0, reconcile=answer)
            fx.changed.append((ref.digest, None))
            if result == "done":
                after = self.settled(base, State.COMPLETED, now, checked)
                self.rows.write(conn, after, record, ttl=ttl, response=sealed)
                return "completed"
            if result == "not_done" and record.delivery:
                return self.deliveries.not_done(conn, base, record, now, checked, retry_in, fx)
            if result == "not_done":
                event = history_event(now, "released", reason="the upstream says it did not run")
                after = self.settled(base, State.RELEASED, now, checked, event)
                self.rows.write(conn, after, record, ttl=ttl)
                return "released"
            if now - record.since_ms >= park_after * 1000:
                reason = "no conclusive check within park_after"
                parked = history_event(now, "parked", reason=reason)
                self.rows.write(conn, moved(base, State.PARKED, now, checked, parked), record)
                return "parked"
            after = replace(base, history=(*record.history, checked), now_ms=now)
            self.rows.write(conn, after, record)
            return "unresolved"

        return await self.run(op, "check end")

    async def park(self, ref: KeyRef, reason: str) -> bool:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bool:
            record = self.rows.read(conn, ref.digest, now)
            if record is None or record.state is not State.UNRESOLVED:
                return False
            event = history_event(now, "parked", reason=reason)
            after = moved(record, State.PARKED, now, event, check_lock_ms=0)
            self.rows.write(conn, after, record)
            fx.changed.append((ref.digest, None))
            return True

        return await self.run(op, "park")

    # -- operators ---------------------------------------------------------------

    async def operator_claim(self, ref: KeyRef, operator: str, force: bool) -> OperatorResult:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> OperatorResult:
            record = self.rows.read(conn, ref.digest, now)
            if record is None:
                return OperatorResult(False, refused="missing", state="missing")
            if record.state not in OPEN_STATES:
                return OperatorResult(False, state=str(record.state), refused="state")
            if record.state is State.CLAIMED:
                if record.holder == operator:
                    since = record.holder_since_ms
                    return OperatorResult(True, "claimed", holder=operator, holder_since_ms=since)
                if not force:
                    return OperatorResult(
                        False,
                        state="claimed",
                        refused="held",
                        holder=record.holder,
                        holder_since_ms=record.holder_since_ms,
                    )
                event = history_event(
                    now, "claimed", operator=operator, takeover_from=record.holder
                )
            else:
                event = history_event(now, "claimed", operator=operator)
            after = moved(
                record,
                State.CLAIMED,
                now,
                event,
                holder=operator,
                holder_since_ms=now,
                check_lock_ms=0,
            )
            self.rows.write(conn, after, record)
            fx.changed.append((ref.digest, None))
            return OperatorResult(True, state="claimed", holder=operator, holder_since_ms=now)

        return await self.run(op, "operator claim")

    async def operator_resolve(
        self,
        ref: KeyRef,
        operator: str,
        outcome: str,
        note: str,
        response: StoredResponse | None,
        ttl: float,
    ) -> OperatorResult:
        sealed = self.codec.encode(ref.digest, response) if response is not None else None

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> OperatorResult:
            record = self.rows.read(conn, ref.digest, now)
            if record is None:
                return OperatorResult(False, refused="missing", state="missing")
            if record.state is not State.CLAIMED:
                return OperatorResult(False, state=str(record.state), refused="state")
            if record.holder != operator:
                return OperatorResult(
                    False, state="claimed", refused="holder", holder=record.holder
                )
            event = history_event(now, "resolved", operator=operator, outcome=outcome, note=note)
            fx.changed.append((ref.digest, None))
            if outcome == "done":
                after = self.settled(record, State.COMPLETED, now, event)
                blobs = {} if sealed is None else {"response": sealed}
                self.rows.write(conn, after, record, ttl=ttl, **blobs)
                return OperatorResult(True, state="completed")
            if record.delivery:  # queued again, with every attempt to come
                after = moved(
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
                self.rows.write(conn, after, record)
                fx.due.append(Due(ref, now, now))
                return OperatorResult(True, state="queued")
            after = self.settled(record, State.RELEASED, now, event)
            self.rows.write(conn, after, record, ttl=ttl)
            return OperatorResult(True, state="released")

        return await self.run(op, "operator resolve")

    # -- copying to another store --------------------------------------------------

    async def export_records(self, cursor: str = "", limit: int = EXPORT_PAGE) -> ExportPage:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> ExportPage:
            rows = conn.execute(_EXPORT, (cursor, now, limit)).fetchall()
            items = []
            for row in rows:
                expires = row[_EXPIRES]
                items.append(
                    ExportedRecord(
                        self.rows.decode(row[:-1], now),
                        response=row[-3],
                        token=row[-2],
                        request=row[-1],
                        ttl_ms=None if expires is None else expires - now,
                    )
                )
            return ExportPage(items, rows[-1][0] if len(rows) == limit else "")

        return await self.run(op, "export")

    async def import_records(self, items: Sequence[ExportedRecord]) -> list[str]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> list[str]:
            skipped = []
            for item in items:
                if self.rows.take(conn, item.record.digest, now) is not None:
                    skipped.append(item.record.digest)
                    continue  # a live record: kept (take deleted one past its expiry)
                ttl = None if item.ttl_ms is None else item.ttl_ms / 1000
                blobs = {"response": item.response, "token": item.token, "request": item.request}
                self.rows.write(conn, replace(item.record, now_ms=now), None, ttl=ttl, **blobs)
            return skipped

        return await self.run(op, "import")

    async def take_token(self, name: str, per_second: float, burst: int) -> float:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> float:
            row = conn.execute(
                "SELECT tat_ms FROM gateway_rates WHERE name = ?", (name,)
            ).fetchone()
            tat, wait = rate.take(row[0] if row is not None else 0.0, now, per_second, burst)
            if wait == 0.0:
                conn.execute(
                    "INSERT INTO gateway_rates (name, tat_ms) VALUES (?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET tat_ms = excluded.tat_ms",
                    (name, tat),
                )
            return wait

        return await self.run(op, "rate limit")

    async def holds_keys(self) -> bool:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> bool:
            found = conn.execute(
                "SELECT 1 FROM gateway_records WHERE expires_ms IS NULL OR expires_ms > ? LIMIT 1",
                (now,),
            ).fetchone()
            return found is not None

        return await self.run(op, "holds keys")

    # -- the parts' operations ------------------------------------------------------

    async def delivery_token(self, ref: KeyRef) -> str:
        return await self.deliveries.delivery_token(ref)

    async def queue_stats(self) -> list[QueueStat]:
        return await self.listing.queue_stats()
