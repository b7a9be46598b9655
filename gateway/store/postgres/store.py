"""The PostgreSQL store: every state change is one SQL statement, one round trip.

One row of `gateway_records` per record, keyed (prefix, digest), in the schema that
`idempotency-gateway store migrate` creates (store/postgres/sql/0NN_*.sql; the gateway
refuses a database without it). The statements are files in store/postgres/sql/, like the
Redis scripts. The claim and the completion are server-side functions (gateway_take
and gateway_complete, migration 004): the claim writes only when the key is free, so
claim-or-read is one round trip and a replay writes nothing; completion, release and
every other move are `UPDATE ... WHERE` the state and the run id still allow it.
Commits are durable before the gateway forwards (synchronous_commit, as the server is
configured), and time is the database's (`clock_timestamp()`), never a replica's.

What Redis does with a TTL, a reaper does here: completed and released rows carry
`expires_ms`, reads treat a row past it as absent, and every process runs the reaper,
which deletes them in batches of REAP_BATCH, one process at a time (an advisory lock).
Unresolved, parked, claimed, in-flight, queued and retrying rows never expire.

The parts it holds, each handed what it needs: database.py's Database (the statements,
the pool, errors), rows.py (read, claim-or-read, expire: what the request path and the
deliveries share), delivery.py (deliveries), listing.py (pages and counts), notices.py
(the LISTEN connection), roster.py (the operator roster); schema.py checks the schema.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import asyncpg

from gateway.config import StoreConfig
from gateway.config.addresses import mask_url
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
from gateway.store.base import (
    CheckResult,
    ExpiredPolicy,
    OperatorResult,
    PartsStore,
    codec_for,
    duration_ms,
)
from gateway.store.postgres.database import Database, connect_args, decode_record
from gateway.store.postgres.delivery import PostgresDeliveries
from gateway.store.postgres.listing import PostgresListing
from gateway.store.postgres.notices import PostgresNotices
from gateway.store.postgres.pauses import PostgresPauses
from gateway.store.postgres.roster import PostgresRoster
from gateway.store.postgres.rows import RecordRows
from gateway.store.postgres.schema import SchemaError, check
from gateway.store.rate import interval_ms
from gateway.store.transfer import EXPORT_PAGE, ExportedRecord, ExportPage

log = logging.getLogger("gateway.store")

#: Rows the reaper deletes per statement, and how long it rests between rounds.
REAP_BATCH = 1000
REAP_INTERVAL = (5.0, 10.0)
#: pg_try_advisory_xact_lock's key for the reaper ("idem" "reap" in ASCII).
REAP_LOCK = 0x6964656D_72656170
#: The columns the deciding operations (transactions) may write.
_WRITABLE = frozenset(
    {"state", "since_ms", "expires_ms", "response", "reason", "holder", "holder_since_ms",
     "check_lock_ms", "reconcile", "history", "attempts", "due_ms", "request"}
)  # fmt: skip


T = TypeVar("T")
#: What a decided move is: its result, the columns to write (None: refused, nothing
#: written) and, for a delivery made due, when.
Decision: TypeAlias = tuple[T, dict[str, Any] | None, int | None]


class PostgresStore(PartsStore):
    deliveries: PostgresDeliveries
    listing: PostgresListing
    operators: PostgresRoster
    pauses: PostgresPauses

    def __init__(self, config: StoreConfig, config_path: str = "FILE") -> None:
        super().__init__(codec_for(config))
        self.prefix = config.prefix
        self._config = config
        self._config_path = config_path
        self._source = mask_url(config.url)
        self._timeout = config.socket_timeout
        self._schema_checked = False
        self.db = Database(
            connect_args(config),
            config.prefix,
            timeout=config.socket_timeout,
            max_connections=config.pool_size,
            on_connect=self._check_schema,
        )
        self.channel = self.db.channel
        self.rows = RecordRows(self.db, self.opener)
        self.deliveries = PostgresDeliveries(self.db, self.rows, self.opener)
        self.listing = PostgresListing(self.db, self.opener, config.prefix)
        self.notices = PostgresNotices(
            self._connect_args,
            self.channel,
            config.socket_timeout,
            self.opener,
            self.notifier,
            self.due,
        )
        self.operators = PostgresRoster(self.db, config.prefix)
        self.pauses = PostgresPauses(self.db, config.prefix)
        self._info_seen: StoreInfo | None = None
        self._marker: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        #: Per route: when this process writes its last success next (monotonic).
        self._success_due: dict[str, float] = {}
        #: Set while the LISTEN connection is up (tests wait on it).
        self.subscribed = self.notices.subscribed

    def _connect_args(self) -> dict[str, Any]:
        return connect_args(self._config)

    async def _check_schema(self, conn: asyncpg.Connection) -> None:
        if self._schema_checked:
            return
        try:
            await check(conn, self._config_path)
        except SchemaError as exc:
            raise StoreError(str(exc)) from exc
        self._schema_checked = True

    async def start(self) -> None:
        # Start even when the database is down: requests fail closed (or open, per
        # route) until it answers, /readyz says so, and no restart is needed after. A
        # database that answers with a schema this gateway does not know is refused.
        try:
            await self.ping()
            await self.info()
        except StoreError as exc:
            if isinstance(exc.__cause__, SchemaError):
                await self.db.close()
                raise
            log.warning("%s; requests on keyed routes fail until it answers", exc)
        self._tasks = [
            asyncio.create_task(self.notices.listen(), name="store-notifications"),
            asyncio.create_task(self._reap_forever(), name="store-reaper"),
        ]

    async def close(self) -> None:
        self._closing = True
        self.notices.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.db.close()

    async def ping(self) -> None:
        await self.db.call(lambda conn: conn.fetchval("SELECT 1"), "ping")

    async def info(self) -> StoreInfo:
        sql = "SELECT current_setting('fsync'), current_setting('synchronous_commit')"
        row = await self.db.call(lambda conn: conn.fetchrow(sql), "settings read")
        fsync, commit = row if row is not None else ("", "")
        durable = fsync == "on" and commit != "off"
        # PostgreSQL never evicts a row; "aof" here is whether a commit is on disk
        # before the gateway forwards.
        found = StoreInfo("noeviction", "yes" if durable else "no", source=self._source)
        if found != self._info_seen:
            self._info_seen = found
            if not durable:
                log.warning(
                    "PostgreSQL at %s has fsync %s and synchronous_commit %s: a crash "
                    "can lose the last claims, and their keys run again. Run it with "
                    "fsync on and synchronous_commit on (or remote_apply)",
                    self._source,
                    fsync,
                    commit,
                )
        return found

    async def check_reset(self) -> int:
        token = f"{secrets.token_hex(8)}"

        async def mark(conn: asyncpg.Connection) -> str:
            await conn.execute(
                "INSERT INTO gateway_markers (prefix, token) VALUES ($1, $2)"
                " ON CONFLICT (prefix) DO NOTHING",
                self.prefix,
                token,
            )
            found = await conn.fetchval(
                "SELECT token FROM gateway_markers WHERE prefix = $1", self.prefix
            )
            return str(found)

        found = await self.db.call(mark, "marker check")
        seen, self._marker = self._marker, found
        return int(seen is not None and seen != found)

    # -- the request path -------------------------------------------------------

    async def claim(
        self,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        lease: float,
        expired: ExpiredPolicy = "unresolved",
    ) -> Record | None:
        lease_ms = duration_ms(lease)
        args = (ref.route, ref.key, run_id, fingerprint, lease_ms, expired)
        row = await self.rows.take("claim", ref, *args)
        if row["outcome"] == 1:
            return None
        record = decode_record(self.opener, ref.digest, row["now"], row)
        if record.state is State.IN_FLIGHT and record.lease_until_ms <= record.now_ms:
            return await self.rows.expired(ref, record, expired)
        return record

    async def complete(
        self,
        ref: KeyRef,
        run_id: str,
        response: StoredResponse,
        ttl: float,
        attempt: dict[str, Any] | None = None,
    ) -> bool:
        sealed = self.codec.encode(ref.digest, response)
        # The route's last success is kept to the second: this process writes it at
        # most once a second per route (the other completions skip that statement).
        now = time.monotonic()
        success = is_success(response.status) and self._success_due.get(ref.route, 0.0) <= now
        row = await self.db.batched(
            "complete",
            ref.digest,
            run_id,
            sealed,
            duration_ms(ttl),
            response.origin,
            attempt,
            success,
        )
        ok = bool(row is not None and row["ok"])
        if ok and success:
            self._success_due[ref.route] = now + 1.0
        return ok

    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        row = await self.db.fetchrow("release", ref.digest, run_id, duration_ms(ttl), reason)
        return bool(row is not None and row["ok"])

    async def mark_unresolved(
        self, ref: KeyRef, run_id: str, reason: str, *, park: bool = False
    ) -> bool:
        target = "parked" if park else "unresolved"
        row = await self.db.fetchrow("unresolved", ref.digest, run_id, reason, target)
        return bool(row is not None and row["ok"])

    async def get(self, ref: KeyRef) -> Record | None:
        return await self.rows.get(ref)

    # -- the sweep, the reaper and the reconciler ------------------------------------

    async def expire_leases(
        self, policy: Callable[[str], ExpiredPolicy], limit: int = 1000
    ) -> list[tuple[KeyRef, str]]:
        changed: list[tuple[KeyRef, str]] = []
        for row in await self.db.fetch("leases", limit):
            ref = KeyRef(row["digest"], row["route"], "")
            moved = await self.db.fetchrow("expire", ref.digest, policy(ref.route))
            if moved is not None:
                changed.append((ref, str(moved["state"])))
        return changed

    async def reap(self, limit: int = REAP_BATCH) -> int | None:
        """Delete up to `limit` rows past their expiry; None when another process is
        reaping (the advisory lock is taken), else how many went."""
        row = await self.db.fetchrow("reap", limit, REAP_LOCK)
        assert row is not None
        return int(row["deleted"]) if row["got"] else None

    async def _reap_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(random.uniform(*REAP_INTERVAL))
            try:
                for _ in range(20):  # bounded: 20 batches a round, then rest
                    deleted = await self.reap()
                    if deleted is None or deleted < REAP_BATCH:
                        break
            except StoreError as exc:
                log.debug("reaper: %s", exc)

    async def begin_check(self, ref: KeyRef, run_id: str, lock: float, min_interval: float) -> bool:
        token = secrets.token_hex(8)  # lets a retried call recognise its own lock
        row = await self.db.fetchrow(
            "check_begin", ref.digest, run_id, duration_ms(lock), int(min_interval * 1000), token
        )
        return bool(row is not None and row["ok"])

    async def end_check(self, check: CheckResult) -> str:
        ref, run_id, result, answer = check.ref, check.run_id, check.result, check.answer
        response, ttl, park_after, retry_in = (
            check.response,
            check.ttl,
            check.park_after,
            check.retry_in,
        )
        body = self.codec.encode(ref.digest, response) if response is not None else None

        def decide(record: Record | None, now: int) -> Decision[str]:
            if record is None or record.state is not State.UNRESOLVED or record.run_id != run_id:
                return "", None, None
            history = [
                *record.history,
                history_event(now, "reconcile", result=result, answer=answer),
            ]
            change: dict[str, Any] = {"check_lock_ms": 0, "reconcile": answer}
            due = None
            if result == "done":
                change |= _settled(now, ttl, state="completed", response=body)
            elif result == "not_done" and record.delivery and retry_in is None:
                reason = "the upstream says it did not run; no attempt left"
                history.append(history_event(now, "parked", reason=reason))
                change |= {"state": "parked", "since_ms": now, "reason": reason}
            elif result == "not_done" and record.delivery:
                due = now + int((retry_in or 0) * 1000)
                reason = "the upstream says it did not run"
                history.append(history_event(now, "retry_scheduled", due_ms=due, reason=reason))
                change |= {"state": "retrying", "since_ms": now, "due_ms": due, "reason": ""}
            elif result == "not_done":
                history.append(
                    history_event(now, "released", reason="the upstream says it did not run")
                )
                change |= _settled(now, ttl, state="released")
            elif now - record.since_ms >= park_after * 1000:
                reason = "no conclusive check within park_after"
                history.append(history_event(now, "parked", reason=reason))
                change |= {"state": "parked", "since_ms": now}
            change["history"] = history
            return str(change.get("state", record.state)), change, due

        return await self._decide(ref, decide, "end_check")

    async def park(self, ref: KeyRef, reason: str) -> bool:
        row = await self.db.fetchrow("park", ref.digest, reason)
        return bool(row is not None and row["ok"])

    # -- decided in Python: read, decide, then lock, decide again and write -------------

    async def _decide(
        self, ref: KeyRef, decide: Callable[[Record | None, int], Decision[T]], what: str
    ) -> T:
        """The moves with many branches (end_check, the operators'), decided in Python
        on the record: a refusal on an unlocked read costs one read and no commit; a
        move reads the row again FOR UPDATE, decides again on it, and writes it with
        one UPDATE conditional on the state it read, in one short transaction."""
        record = await self.get(ref)
        result, change, _ = decide(record, record.now_ms if record is not None else 0)
        if change is None:
            return result

        async def move(conn: asyncpg.Connection) -> T:
            row = await conn.fetchrow(self.db.statements["locked"], ref.digest)
            found = None if row is None else decode_record(self.opener, ref.digest, row["now"], row)
            now = int(row["now"]) if row is not None else 0
            result, change, due = decide(found, now)
            if change is None or found is None:
                return result
            names = sorted(change)
            assert set(names) <= _WRITABLE, names
            sets = ", ".join(f"{name} = ${i + 3}" for i, name in enumerate(names))
            sql = (
                f"UPDATE gateway_records SET {sets} WHERE prefix = $1 AND digest = $2"
                f" AND state = ${len(names) + 3}"
            )
            values = [change[name] for name in names]
            await conn.execute(sql, self.prefix, ref.digest, *values, found.state)
            # NOTIFYs are sent at commit. These moves are rare: they wake any waiter
            # without asking whether one waits.
            await conn.execute("SELECT pg_notify($1, $2)", self.channel, ref.digest)
            if due is not None:
                notice = f"!d {ref.digest}/{found.route} {due} {now} "
                await conn.execute("SELECT pg_notify($1, $2)", self.channel, notice)
            return result

        return await self.db.transaction(move, what)

    async def operator_claim(self, ref: KeyRef, operator: str, force: bool) -> OperatorResult:
        def decide(record: Record | None, now: int) -> Decision[OperatorResult]:
            if record is None:
                return OperatorResult(False, refused="missing", state="missing"), None, None
            if record.state not in OPEN_STATES:
                return OperatorResult(False, state=str(record.state), refused="state"), None, None
            event = history_event(now, "claimed", operator=operator)
            if record.state is State.CLAIMED:
                if record.holder == operator:
                    since = record.holder_since_ms
                    ok = OperatorResult(True, "claimed", holder=operator, holder_since_ms=since)
                    return ok, None, None
                if not force:
                    held = OperatorResult(
                        False,
                        state="claimed",
                        refused="held",
                        holder=record.holder,
                        holder_since_ms=record.holder_since_ms,
                    )
                    return held, None, None
                event["takeover_from"] = record.holder
            change = {
                "state": "claimed",
                "since_ms": now,
                "holder": operator,
                "holder_since_ms": now,
                "check_lock_ms": 0,
                "history": [*record.history, event],
            }
            ok = OperatorResult(True, state="claimed", holder=operator, holder_since_ms=now)
            return ok, change, None

        return await self._decide(ref, decide, "operator claim")

    async def operator_resolve(
        self,
        ref: KeyRef,
        operator: str,
        outcome: str,
        note: str,
        response: StoredResponse | None,
        ttl: float,
    ) -> OperatorResult:
        body = self.codec.encode(ref.digest, response) if response is not None else None

        def decide(record: Record | None, now: int) -> Decision[OperatorResult]:
            if record is None:
                return OperatorResult(False, refused="missing", state="missing"), None, None
            if record.state is not State.CLAIMED:
                return OperatorResult(False, state=str(record.state), refused="state"), None, None
            if record.holder != operator:
                refused = OperatorResult(
                    False, state="claimed", refused="holder", holder=record.holder
                )
                return refused, None, None
            event = history_event(now, "resolved", operator=operator, outcome=outcome, note=note)
            change: dict[str, Any] = {"history": [*record.history, event]}
            due = None
            if outcome == "done":
                change |= _settled(now, ttl, state="completed", response=body)
            elif record.delivery:  # queued again, with every attempt to come
                due = now
                change |= {
                    "state": "queued",
                    "since_ms": now,
                    "attempts": 0,
                    "due_ms": now,
                    "reason": "",
                    "holder": "",
                    "holder_since_ms": 0,
                    "check_lock_ms": 0,
                }
            else:
                change |= _settled(now, ttl, state="released")
            return OperatorResult(True, state=str(change["state"])), change, due

        return await self._decide(ref, decide, "operator resolve")

    # -- listings -----------------------------------------------------------------------

    async def delivery_token(self, ref: KeyRef) -> str:
        row = await self.db.fetchrow("token", ref.digest)
        if row is None or row["token"] is None:
            return self.no_token()
        return self.read_token(ref.digest, row["token"])

    async def last_successes(self) -> dict[str, float]:
        rows = await self.db.fetch("last_successes")
        return {row["route"]: row["age_ms"] / 1000 for row in rows}

    # -- copying to another store --------------------------------------------------

    async def export_records(self, cursor: str = "", limit: int = EXPORT_PAGE) -> ExportPage:
        rows = await self.db.fetch("export", cursor, limit)
        items = [
            ExportedRecord(
                decode_record(self.opener, row["digest"], row["now"], row),
                response=row["response"],
                token=row["token"],
                request=row["request"],
                ttl_ms=None if row["expires_ms"] is None else row["expires_ms"] - row["now"],
            )
            for row in rows
        ]
        return ExportPage(items, rows[-1]["digest"] if len(rows) == limit else "")

    async def import_records(self, items: Sequence[ExportedRecord]) -> list[str]:
        statement = self.db.statements["import"]

        async def write(conn: asyncpg.Connection) -> list[str]:
            skipped = []
            for item in items:
                r = item.record
                row = await conn.fetchrow(
                    statement,
                    r.digest, r.route, r.key, str(r.state), r.run_id, r.fingerprint,
                    r.created_ms, r.since_ms, r.lease_until_ms, item.ttl_ms, item.response,
                    r.reason, r.holder, r.holder_since_ms, r.check_lock_ms, r.last_check_ms,
                    r.reconcile, list(r.history), r.delivery, r.attempts, r.due_ms,
                    r.last_attempt, item.token, item.request,
                )  # fmt: skip
                if row is None:
                    skipped.append(r.digest)
            return skipped

        return await self.db.transaction(write, "import")

    async def holds_keys(self) -> bool:
        row = await self.db.fetchrow("holds")
        return bool(row is not None and row["held"])

    # -- rate limits ---------------------------------------------------------------

    async def take_token(self, name: str, per_second: float, burst: int) -> float:
        step = interval_ms(per_second)
        wait = await self.db.call(
            lambda conn: conn.fetchval(
                "SELECT gateway_take_token($1, $2, $3, $4)", self.prefix, name, step, burst
            ),
            "rate limit",
        )
        return float(wait)

    # -- the parts' operations ------------------------------------------------------

    async def queue_stats(self) -> list[QueueStat]:
        return await self.deliveries.queue_stats()


def _settled(now: int, ttl: float, *, state: str, response: bytes | None = None) -> dict[str, Any]:
    """What settling a record writes: its state, its expiry, no open run's fields; a
    delivery's request goes in the same step."""
    change: dict[str, Any] = {
        "state": state,
        "since_ms": now,
        "expires_ms": now + duration_ms(ttl),
        "check_lock_ms": 0,
        "holder": "",
        "holder_since_ms": 0,
        "request": None,
    }
    if response is not None:
        change["response"] = response
    return change
