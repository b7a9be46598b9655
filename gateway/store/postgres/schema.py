"""The PostgreSQL store's schema: versioned migrations, applied by `store migrate`.

The migrations are the files `store/postgres/sql/NNN_name.sql`, applied in order, each once:
`idempotency-gateway store migrate --config FILE` runs the missing ones in one
transaction under an advisory lock (two replicas migrating at once: the second waits,
then finds nothing to do) and records each in `gateway_schema`. A gateway never
changes the schema itself: it checks the version when it connects and refuses a
database it does not know (none yet, or one a newer gateway migrated), naming the
command to run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import asyncpg

from gateway.config.addresses import mask_url

if TYPE_CHECKING:
    from gateway.config import StoreConfig

#: pg_advisory_xact_lock's key while migrating ("idem" "mig" in ASCII).
MIGRATE_LOCK = 0x6964656D_6D6967

_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """Every migration the package has, in order."""
    found = []
    for entry in (resources.files("gateway.store.postgres") / "sql").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text()))
    found.sort(key=lambda m: m.version)
    return found


#: The schema version this gateway reads and writes.
VERSION = migrations()[-1].version


class SchemaError(Exception):
    """The database's schema is not the one this gateway knows; the message says why
    and what to run."""


def fix(config_path: str = "FILE") -> str:
    return f"idempotency-gateway store migrate --config {config_path}"


async def applied(conn: asyncpg.Connection) -> int:
    """The schema version the database has (0: none)."""
    exists = await conn.fetchval("SELECT to_regclass('gateway_schema') IS NOT NULL")
    if not exists:
        return 0
    version = await conn.fetchval("SELECT max(version) FROM gateway_schema")
    return int(version or 0)


async def check(conn: asyncpg.Connection, config_path: str = "FILE") -> None:
    """Raise SchemaError unless the database has exactly this gateway's schema."""
    version = await applied(conn)
    if version == VERSION:
        return
    if version == 0:
        raise SchemaError(
            "the PostgreSQL database has no gateway schema yet: run "
            f"`{fix(config_path)}` once (any replica; it is safe to repeat)"
        )
    if version < VERSION:
        raise SchemaError(
            f"the PostgreSQL database has gateway schema version {version}, and this "
            f"gateway needs {VERSION}: run `{fix(config_path)}`"
        )
    raise SchemaError(
        f"the PostgreSQL database has gateway schema version {version}, newer than this "
        f"gateway knows ({VERSION}): a newer gateway migrated it; run that version"
    )


async def migrate(conn: asyncpg.Connection) -> list[Migration]:
    """Apply the missing migrations, in one transaction under an advisory lock; the
    ones applied (none when the schema is current). Raises SchemaError for a database
    newer than this gateway."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATE_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS gateway_schema ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        version = await applied(conn)
        if version > VERSION:
            raise SchemaError(
                f"the database has gateway schema version {version}, newer than this "
                f"gateway knows ({VERSION}); nothing was changed"
            )
        done = []
        for migration in migrations():
            if migration.version <= version:
                continue
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO gateway_schema (version, name) VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
            done.append(migration)
        return done


async def _connect(config: StoreConfig) -> asyncpg.Connection:
    from gateway.store.postgres.database import connect_args

    args = connect_args(config)
    args.pop("command_timeout")
    # The request path's lock_timeout is for batches of claims; a migration waits for
    # another replica's migration (the advisory lock) and for the tables' locks up to
    # the statement's timeout, as it did before.
    args["server_settings"].pop("lock_timeout")
    return await asyncpg.connect(**args)


async def migrate_store(config: StoreConfig) -> tuple[int, str]:
    """`store migrate`: (exit status, what to print)."""
    where = mask_url(config.url)
    try:
        conn = await _connect(config)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return 1, f"error: cannot reach PostgreSQL at {where}: {exc}"
    try:
        done = await migrate(conn)
    except SchemaError as exc:
        return 1, f"error: {exc}"
    except asyncpg.PostgresError as exc:
        return 1, f"error: migrating PostgreSQL at {where} failed, nothing was changed: {exc}"
    finally:
        await conn.close()
    if not done:
        return 0, f"{where}: gateway schema version {VERSION}, current; nothing to do"
    names = ", ".join(f"{m.version:03d}_{m.name}" for m in done)
    return 0, f"{where}: applied {names}; gateway schema version {VERSION}"


async def refusal(config: StoreConfig, config_path: str) -> str:
    """Why `run` must not start on this database ("" to start). A database that does not
    answer is no reason: the gateway starts, fails closed and checks when it connects."""
    try:
        conn = await _connect(config)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return ""
    try:
        await check(conn, config_path)
    except SchemaError as exc:
        return str(exc)
    except asyncpg.PostgresError:
        return ""
    finally:
        await conn.close()
    return ""
