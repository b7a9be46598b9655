"""Group commit for the PostgreSQL store: claims (and completions) that wait for a
connection at the same moment go to the database together, in one statement.

Why: a first request costs the database two commits and the gateway two awaited
statements, and on a busy machine those dominate (docs/performance.md, "The PostgreSQL
store"): about 250 us of the database's CPU per first request, and 34-45 us of the
gateway's per statement that waits for its commit. When every pooled connection is
busy, the callers queued for one would each pay that in turn. Here, the callers of one
statement that are waiting when a connection comes free go in ONE statement: one
round trip, one commit (one WAL flush), one wake-up of the event loop for the batch.

Natural batching, no timer:

- A call when the pool has an idle connection or room to open one, and nothing of its
  statement is queued, runs alone, as before: the same statement text (claim.sql,
  complete.sql), so a lone request still costs 2 round trips (1 for a replay), and
  nothing waits for company.
- Otherwise the call is queued, and if no drainer of that statement is waiting for a
  connection one is started (a Task: the statement runs in it, so a caller cancelled
  while its entry is in flight does not cancel the others'). The drainer waits in the
  pool's queue like any call; when it gets a connection it takes every queued entry
  (at most BATCH_CAP; more start another drainer) and sends them as one statement
  (claim_batch.sql, complete_batch.sql: `unnest(...) WITH ORDINALITY` joined LATERAL
  with the same function, gateway_take or gateway_complete, per entry). Each row
  carries its entry's ordinal, and each caller gets the row of its own ordinal. A
  batch of one entry (the others were cancelled) runs the lone statement.
- A caller cancelled while queued is dropped from the queue; one cancelled while its
  batch is in flight just no longer waits for its row (as a lone call cancelled after
  its statement was sent: the claim may have been made, and its lease settles it).

Deadlocks: every row lock a batch takes is the row of one of its entries (gateway_take
inserts, updates or marks `waiting` only the row of its digest; gateway_complete
updates only its record, and a completion that asks for the route's last success, a
second lock in gateway_successes, never joins a batch: it runs alone). A batch's
entries are sorted by digest before they are sent and the functions run in that order,
so every batch takes its locks in ascending digest order (one prefix per store, so per
(prefix, digest)), and two batches cannot wait on each other in a cycle. A lone
statement holds one row lock and waits for nothing while holding it; the reaper and
the delivery pick lock with SKIP LOCKED and never wait. Should a deadlock still be
detected, it is a server error like any other (below): the batch's entries run alone.

The same key twice in one batch (two callers of one key, one process) decides as the
two statements would one after the other: the functions are VOLATILE, so each entry's
statements see the earlier entries' uncommitted rows of the same transaction (the
second claim finds the first's key in flight, marks it waiting and reads it).

Errors, by the rules of Database.call: a lost connection runs the batch once more on a
new connection (every entry is safe to run twice, so the batch is); a timeout (the
client's deadline, or the server's statement_timeout) is never retried, and every
entry gets the StoreError; any other server error (one entry's PL/pgSQL exception,
"changed under twelve reads"; a deadlock; a serialization failure) aborted the whole
transaction, so nothing was written, and each entry is then run alone by its caller,
where it fails or succeeds on its own. Messages never carry the connection string.
Closing the store cancels the drainers: their entries fail with StoreError.

The order the functions run in is the executor's: a LATERAL join over `unnest(...)
WITH ORDINALITY` is a nested loop that calls the function once per array element, in
the arrays' order (no ORDER BY can say so). The lock order and the same-key rule rest
on that; test_store_postgres_batch.py holds both (a deadlock there shows as entries
run alone). A PL/pgSQL wrapper looping over the arrays would state it outright, at the
price of a migration.

Batches form only when the pool is exhausted, so the pool's size sets their size: in
tests/benchmarks/postgres.py (wrk -c32, 2 cores) a pool of 10 gave about 2 calls per
commit, 4 about 4, 2 about 7 (its "writing transactions/req": 2 without batching).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import asyncpg

from gateway.errors import StoreError
from gateway.store.postgres.pool import Pool

T = TypeVar("T")


class Statements(Protocol):
    """What a batch runs on: database.py's Database (the pool, the statements by name and
    its bounded, retried calls). Named here so the batch needs nothing of the database
    but these."""

    @property
    def statements(self) -> Mapping[str, str]: ...

    def pool(self) -> Pool: ...

    async def fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None: ...

    async def call(self, work: Callable[[asyncpg.Connection], Awaitable[T]], what: str) -> T: ...


#: The most entries one statement carries (a larger queue is drained by more batches).
BATCH_CAP = 64

#: An entry's answer when its batch failed on a server error: run it alone.
_ALONE = object()
#: Server errors that mean the connection went, not the statement: Database.call retries
#: the whole batch once on a new connection (asyncpg makes them PostgresErrors too).
_CONNECTION_LOST = (
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
)


class _Entry:
    __slots__ = ("args", "future")

    def __init__(self, args: tuple[Any, ...], future: asyncio.Future[Any]) -> None:
        self.args = args
        self.future = future


def claim_arrays(args: Sequence[tuple[Any, ...]]) -> list[list[Any]]:
    """claim.sql's parameters ($1 digest .. $8 fresh) as claim_batch.sql's arrays."""
    return [list(column) for column in zip(*args, strict=True)]


def complete_arrays(args: Sequence[tuple[Any, ...]]) -> list[list[Any]]:
    """complete.sql's parameters as complete_batch.sql's arrays: the attempt as JSON
    text (cast to jsonb in the statement), the last success ($7, false in a batch)
    left out."""
    columns = [list(column) for column in zip(*args, strict=True)]
    columns[5] = [None if a is None else json.dumps(a) for a in columns[5]]
    return columns[:6]


class Batched:
    """One statement's calls, batched when they queue for a connection."""

    def __init__(
        self,
        db: Statements,
        name: str,
        arrays: Callable[[Sequence[tuple[Any, ...]]], list[list[Any]]],
        *,
        alone: Callable[[tuple[Any, ...]], bool] | None = None,
        cap: int = BATCH_CAP,
    ) -> None:
        self._db = db
        self.name = name
        self._arrays = arrays
        self._alone = alone
        self._cap = max(1, cap)
        self._queue: list[_Entry] = []
        #: a drainer is waiting for a connection (it will take the queue)
        self._waiting = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        #: statements the drainers sent, those of more than one entry, the entries those
        #: carried, and the entries sent back to run alone (tests read them)
        self.sent = 0
        self.batches = 0
        self.batched = 0
        self.alone = 0

    async def fetchrow(self, *args: Any) -> asyncpg.Record | None:
        if self._closed:
            raise StoreError(f"postgresql {self.name} failed: the store is closed")
        db = self._db
        if (not self._queue and db.pool().free()) or (self._alone and self._alone(args)):
            return await db.fetchrow(self.name, *args)
        loop = asyncio.get_running_loop()
        entry = _Entry(args, loop.create_future())
        self._queue.append(entry)
        if not self._waiting:
            self._start()
        try:
            result = await entry.future
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                self._queue.remove(entry)  # not taken yet: nobody sends it
            raise
        if result is _ALONE:
            return await db.fetchrow(self.name, *args)
        return cast("asyncpg.Record | None", result)

    async def close(self) -> None:
        """End the drainers (the store is closing): every entry, taken or queued, fails
        with StoreError. A drainer cancelled before its first step never runs its own
        error path, so the queue is failed here too (else its callers wait forever)."""
        self._closed = True
        while self._tasks:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        queued, self._queue = self._queue, []
        self._waiting = False
        for entry in queued:
            if not entry.future.done():
                entry.future.set_exception(
                    StoreError(f"postgresql {self.name} failed: the store is closed")
                )

    def _start(self) -> None:
        self._waiting = True
        task = asyncio.get_running_loop().create_task(self._drain(), name=f"store-{self.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take(self, everything: bool = False) -> list[_Entry]:
        """The queue's entries, up to the cap (or all), in digest order (the lock
        order); a stable sort keeps two entries of one key in the order their callers
        came."""
        self._waiting = False  # from now on a new entry needs a new drainer
        cut = len(self._queue) if everything else self._cap
        taken = [e for e in self._queue[:cut] if not e.future.done()]
        del self._queue[:cut]
        if self._queue:
            self._start()
        taken.sort(key=lambda e: e.args[0])
        return taken

    async def _drain(self) -> None:
        taken: list[_Entry] | None = None

        async def work(conn: asyncpg.Connection) -> list[Any]:
            nonlocal taken
            if taken is None:  # not on the retry after a lost connection: the same batch
                taken = self._take()
            return await self._send(conn, taken)

        try:
            answers = await self._db.call(work, self.name)
        except BaseException as exc:
            if taken is None:
                # No connection came within the deadline: the database is down or hung,
                # and every queued call would wait as long for the same answer. All of
                # them fail now; taking only a batch would answer the rest one deadline
                # per BATCH_CAP later (minutes behind a long queue).
                taken = self._take(everything=True)
            message = str(exc) if isinstance(exc, StoreError) else f"postgresql {self.name} failed"
            for entry in taken:
                if not entry.future.done():
                    entry.future.set_exception(StoreError(message))
            if not isinstance(exc, Exception):
                raise
            return
        assert taken is not None
        for entry, answer in zip(taken, answers, strict=True):
            if not entry.future.done():
                entry.future.set_result(answer)

    async def _send(self, conn: asyncpg.Connection, taken: list[_Entry]) -> list[Any]:
        statements = self._db.statements
        if not taken:
            return []
        self.sent += 1
        if len(taken) == 1:  # alone after all: the lone statement, its errors its own
            return [await conn.fetchrow(statements[self.name], *taken[0].args)]
        self.batches += 1
        self.batched += len(taken)
        try:
            rows = await conn.fetch(
                statements[f"{self.name}_batch"], *self._arrays([e.args for e in taken])
            )
        except (asyncpg.QueryCanceledError, *_CONNECTION_LOST):
            raise  # a timeout (never retried), or a lost connection (retried whole)
        except asyncpg.PostgresError:
            # One entry's error aborted the transaction: nothing was written. Each runs
            # alone, and fails or succeeds on its own. lock_timeout (connect_args: half
            # the statement's) lands here too, so one entry's key held by another
            # transaction does not time out the others.
            self.alone += len(taken)
            return [_ALONE] * len(taken)
        by_ordinal = {row["i"]: row for row in rows}
        return [by_ordinal.get(i) for i in range(1, len(taken) + 1)]
