"""The PostgreSQL store's SQL: the statement files in store/postgres/sql/, and running them.

Each state change is one statement in a file of its own (claim.sql, complete.sql, ...),
as each Redis one is a Lua script (lua/): conditional on the state and the run id,
timed by the database's clock (`gateway_now_ms()`: clock_timestamp()), and safe to run
twice. Loading expands three names: `@prefix` and `@channel` (this store's prefix and
NOTIFY channel, as SQL literals) and `@record(x)` (the columns a Record is read from,
RECORD_COLUMNS, of table alias x or of a composite value `(c.rec)`). A statement
retried after a lost connection may already have run: every one of them recognises its
own earlier effect (the contract's "safe to repeat").

`Database` owns the pool (postgres/pool.py): a bounded call (statement_timeout on the
server, the same deadline on the client), one retry on a lost connection, StoreError
for everything else, with the driver's message and never the connection string.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import ssl
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from gateway.errors import StoreError
from gateway.records import Record, State, read_history, read_object, stored_json
from gateway.store.base import Opener
from gateway.store.postgres.batch import Batched, claim_arrays, complete_arrays
from gateway.store.postgres.pool import Pool

if TYPE_CHECKING:
    from gateway.config import StoreConfig

T = TypeVar("T")

#: The columns of gateway_records a Record is read from, in this order.
RECORD_COLUMNS = (
    "state", "run_id", "fingerprint", "route", "key", "created_ms", "since_ms",
    "lease_until_ms", "response", "reason", "holder", "holder_since_ms", "check_lock_ms",
    "last_check_ms", "reconcile", "history", "delivery", "attempts", "due_ms",
    "last_attempt", "token",
)  # fmt: skip

#: Errors after which the statement may or may not have run, and a new connection may
#: work: the call is made once more (every statement is safe to run twice).
RETRIED = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
    # a connection whose protocol a crash left mid-operation (see call())
    asyncpg.InternalClientError,
)
#: A call that ran out of time is not retried: a hung database costs a request about
#: 2 x socket_timeout (the pool's queue and the statement), then 503, as on Redis.
FAILED = (*RETRIED, TimeoutError, asyncpg.PostgresError)

_RECORD = re.compile(r"@record\((\w+|\(\w+\.\w+\))\)")


def literal(text: str) -> str:
    """`text` as an SQL string literal (standard_conforming_strings: quotes doubled)."""
    return "'" + text.replace("'", "''") + "'"


def sql_file(name: str) -> str:
    return (resources.files("gateway.store.postgres") / "sql" / f"{name}.sql").read_text()


def channel_for(prefix: str) -> str:
    """The store's NOTIFY channel: readable when short, a hash when a prefix is too long
    for a channel name (63 bytes)."""
    name = f"gateway:{prefix}"
    if len(name.encode()) <= 63:
        return name
    return "gateway:" + hashlib.sha256(prefix.encode()).hexdigest()[:32]


def expand(sql: str, prefix: str, channel: str) -> str:
    sql = _RECORD.sub(lambda m: ", ".join(f"{m[1]}.{c}" for c in RECORD_COLUMNS), sql)
    return sql.replace("@prefix", literal(prefix)).replace("@channel", literal(channel))


_STATEMENTS = (
    "claim", "complete", "release", "unresolved", "expire", "get", "leases", "check_begin",
    "park", "locked", "stats", "reap", "accept", "pick", "retry", "request", "due",
    "queue_stats", "last_successes", "claim_batch", "complete_batch", "token",
    "counted", "export", "import", "holds",
)  # fmt: skip


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in and out as Python values (history, reconcile, attempts)
    await conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=stored_json, schema="pg_catalog", format="text"
    )


class Database:
    """The pool and the statements of one store (one prefix), and its NOTIFY channel."""

    def __init__(
        self,
        connect: dict[str, Any],
        prefix: str,
        *,
        timeout: float,
        max_connections: int,
        on_connect: Callable[[asyncpg.Connection], Awaitable[None]] | None = None,
    ) -> None:
        self.connect = connect
        self.timeout = timeout
        self.channel = channel = channel_for(prefix)
        self.statements = {name: expand(sql_file(name), prefix, channel) for name in _STATEMENTS}
        self._max = max_connections
        self._on_connect = on_connect
        self._pool: Pool | None = None
        #: claims and completions, batched when they queue for a connection
        #: (postgres/batch.py); a completion that writes the last success runs alone
        self.batchers = {
            "claim": Batched(self, "claim", claim_arrays),
            "complete": Batched(self, "complete", complete_arrays, alone=lambda a: bool(a[6])),
        }

    async def _setup(self, conn: asyncpg.Connection) -> None:
        await _init_connection(conn)
        if self._on_connect is not None:
            await self._on_connect(conn)

    def pool(self) -> Pool:
        if self._pool is None:
            self._pool = Pool(self.connect, self._max, self._setup)
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            for batcher in self.batchers.values():
                await batcher.close()
            await self._pool.close()

    async def fetch(self, name: str, *args: Any, what: str = "") -> list[asyncpg.Record]:
        return await self.call(lambda conn: conn.fetch(self.statements[name], *args), what or name)

    async def fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        return await self.call(lambda conn: conn.fetchrow(self.statements[name], *args), name)

    async def batched(self, name: str, *args: Any) -> asyncpg.Record | None:
        """fetchrow, batched with the same statement's other callers when they all
        queue for a connection (claim and complete; the others are not batched)."""
        batcher = self.batchers.get(name)
        if batcher is None:
            return await self.fetchrow(name, *args)
        return await batcher.fetchrow(*args)

    async def call(self, work: Callable[[asyncpg.Connection], Awaitable[T]], what: str) -> T:
        """`work` on a pooled connection within the store's timeout, once more on a new
        connection if that one was lost; StoreError if it still fails."""
        retried = False
        pool = self.pool()
        while True:
            try:
                async with asyncio.timeout(self.timeout * 2):  # the pool's queue, too
                    conn = await pool.acquire()
                    # Kept only after a result or the server's own error: a timeout, a
                    # cancellation or a confused protocol ("another operation is in
                    # progress", after a crash of the database) may leave it
                    # mid-operation, and it is closed, never lent again.
                    keep = False
                    try:
                        result = await work(conn)
                        keep = True
                        return result
                    except asyncpg.PostgresError:
                        keep = True
                        raise
                    finally:
                        pool.release(conn, keep=keep)
            except RETRIED as exc:
                # TimeoutError is an OSError: a call that ran out of time lands here
                # too, and is not retried (a hung database would cost it twice).
                if retried or isinstance(exc, TimeoutError):
                    raise StoreError(f"postgresql {what} failed: {_message(exc)}") from None
                retried = True
                await asyncio.sleep(0.02)
            except (TimeoutError, asyncpg.PostgresError) as exc:
                raise StoreError(f"postgresql {what} failed: {_message(exc)}") from None

    async def transaction(self, work: Callable[[asyncpg.Connection], Awaitable[T]], what: str) -> T:
        """`work` in one short transaction (retried whole, as a statement is)."""

        async def run(conn: asyncpg.Connection) -> T:
            async with conn.transaction():
                return await work(conn)

        return await self.call(run, what)


def _message(exc: BaseException) -> str:
    """The driver's words, without a connection string (asyncpg never puts the password
    in a message; OSErrors name the address)."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]


def decode_record(opener: Opener, digest: str, now: int, row: Any) -> Record:
    """The Record of a row holding RECORD_COLUMNS (by name), read at `now`."""
    # gateway_take (003_take_function.sql) sends a field at its default as NULL,
    # which costs no decoding (a jsonb field: no json.loads): the default here.
    raw, sealed = row["response"], row["token"]
    response, unreadable = (None, "") if raw is None else opener.read_response(digest, raw)
    return Record(
        digest=digest,
        route=row["route"],
        key=row["key"],
        state=State(row["state"]),
        run_id=row["run_id"],
        fingerprint=row["fingerprint"],
        created_ms=row["created_ms"],
        now_ms=now,
        lease_until_ms=row["lease_until_ms"],
        response=response,
        unreadable=unreadable,
        reason=row["reason"] or "",
        since_ms=row["since_ms"],
        holder=row["holder"] or "",
        holder_since_ms=row["holder_since_ms"] or 0,
        check_lock_ms=row["check_lock_ms"] or 0,
        last_check_ms=row["last_check_ms"] or 0,
        reconcile=read_object(row["reconcile"]),
        history=read_history(row["history"], row["created_ms"]),
        delivery=row["delivery"],
        attempts=row["attempts"],
        due_ms=row["due_ms"],
        last_attempt=read_object(row["last_attempt"]),
        token="" if sealed is None else opener.read_token(digest, sealed),
    )


def connect_args(config: StoreConfig) -> dict[str, Any]:
    """asyncpg's connection arguments for the store: the URL (its user and password win
    over store.username and store.password, as on Redis), the timeouts (the server's
    statement_timeout is store.socket_timeout too) and TLS."""
    parts = urlsplit(config.url)
    timeout_ms = str(max(1, int(config.socket_timeout * 1000)))
    args: dict[str, Any] = {
        "dsn": config.url,
        "timeout": config.connect_timeout,
        "command_timeout": config.socket_timeout,
        "server_settings": {
            "statement_timeout": timeout_ms,
            # A key locked by another transaction for half the statement's time fails
            # the statement instead: a batch of claims or completions then runs its
            # entries alone, so one held key does not time out the others
            # (postgres/batch.py).
            "lock_timeout": str(max(1, int(config.socket_timeout * 500))),
            "application_name": "idempotency-gateway",
        },
    }
    if config.username and not parts.username:
        args["user"] = config.username
    if config.password and not parts.password:
        args["password"] = config.password
    if config.tls is not None:
        tls = config.tls
        context = ssl.create_default_context(cafile=tls.ca_file or None)
        if tls.cert_file:
            context.load_cert_chain(tls.cert_file, tls.key_file or None)
        if not tls.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        args["ssl"] = context
    return args
