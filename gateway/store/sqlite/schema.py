"""The SQLite store's schema: the migrations in store/sqlite/sql/0NN_*.sql, applied on
start under the file's write lock (`BEGIN IMMEDIATE`), so workers starting together
apply each once and the others find it done.

The file is the gateway's: it carries the gateway's `application_id`, and its
`user_version` is the last migration applied. A file that is another program's, was
written by a newer gateway, is damaged, or that another process keeps locked past the
deadline is refused at start with a SchemaError naming the file and the fix.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from importlib import resources
from pathlib import Path

from gateway.store.sqlite.database import describe

log = logging.getLogger("gateway.store")

#: PRAGMA application_id of a gateway's file: "IDGW" in ASCII.
APPLICATION_ID = 0x49444757


class SchemaError(Exception):
    """The file cannot be used as it is; the message names it and the fix."""


def migrations() -> list[tuple[int, str]]:
    """The migrations, (version, SQL), in order."""
    found = []
    for entry in resources.files("gateway.store.sqlite").joinpath("sql").iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:3].isdigit():
            found.append((int(name[:3]), entry.read_text(encoding="utf-8")))
    return sorted(found)


def latest() -> int:
    return migrations()[-1][0]


def prepare(conn: sqlite3.Connection, path: Path, synchronous: str, deadline: float) -> None:
    """Set the connection up (WAL, `synchronous`, the busy deadline) and bring the
    file's schema up to date; SchemaError if the file cannot be the gateway's."""
    try:
        conn.execute(f"PRAGMA busy_timeout = {max(1, int(deadline * 1000))}")
        try:
            _migrate(conn, path)
        except sqlite3.Error as exc:
            if not _read_only(exc) or not _current(conn):
                raise
            # A file that is the gateway's and up to date, but read-only (its mount, its
            # permissions): the gateway starts, and every write is a StoreError (503,
            # or forwarded unguarded on fail_open routes) until it is writable.
            log.warning(
                "the SQLite store's file %s is read-only: requests on keyed routes fail "
                "(503, or fail_open) until it is writable and the gateway restarted",
                path,
            )
            return
        mode = _write_ahead(conn, deadline)
        if mode != "wal":
            raise SchemaError(
                f"{path}: SQLite cannot keep a write-ahead log beside this file (journal "
                f"mode {mode}); put the database on a local file system the gateway can write"
            )
        conn.execute(f"PRAGMA synchronous = {'NORMAL' if synchronous == 'normal' else 'FULL'}")
    except sqlite3.Error as exc:
        raise SchemaError(_refusal(path, exc, deadline)) from exc


def _write_ahead(conn: sqlite3.Connection, deadline: float) -> str:
    """Put the file in WAL mode (once for good: the mode is kept in the file); the mode
    it then has. The switch takes the file's exclusive lock without waiting for it, so
    while other workers open the file it is tried again until `deadline`."""
    give_up = time.monotonic() + deadline
    while True:
        mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
        if mode == "wal":
            return mode
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
        except sqlite3.OperationalError as exc:
            busy = getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_BUSY
            if not busy or time.monotonic() >= give_up:
                raise
            time.sleep(0.01)


def _read_only(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_READONLY


def _current(conn: sqlite3.Connection) -> bool:
    """Whether the file is the gateway's at the newest schema (read without writing)."""
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error:
        return False
    return bool(app == APPLICATION_ID and version == latest())


def _refusal(path: Path, exc: sqlite3.Error, deadline: float) -> str:
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return (
            f"{path} is locked by another process for longer than {deadline:g}s; stop the "
            "program holding it (another gateway's migration, a backup or a sqlite3 shell "
            "in a transaction) and start again"
        )
    if code == sqlite3.SQLITE_READONLY:
        return (
            f"{path} is read-only and does not hold the gateway's current schema; make the "
            "file and its folder writable by the gateway's user and start again"
        )
    if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return (
            f"{path} is damaged or not an SQLite database ({describe(exc)}); restore it from "
            "a backup, or move it away to start with an empty store"
        )
    return (
        f"{path} cannot be opened as the gateway's store ({describe(exc)}); check the path "
        "and its permissions"
    )


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    steps = migrations()
    newest = steps[-1][0]
    # The write lock first: a second worker waits here and then finds the work done.
    conn.execute("BEGIN IMMEDIATE")
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        if app != APPLICATION_ID and (app != 0 or tables):
            raise SchemaError(
                f"{path} is not an Idempotency Gateway database (it holds another program's "
                "tables); give store.url a file of its own"
            )
        if version > newest:
            raise SchemaError(
                f"{path} has schema version {version}, written by a newer gateway than this "
                f"one (which knows up to {newest}); run that gateway's version, or restore "
                "a backup taken before the upgrade"
            )
        for number, sql in steps:
            if number > version:
                for statement in _statements(sql):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {number}")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _statements(sql: str) -> list[str]:
    """The statements of a migration file, split where sqlite3 says one is complete."""
    found, current = [], ""
    for line in sql.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            found.append(current.strip())
            current = ""
    return [statement for statement in found if statement]


def open_file(path: Path, synchronous: str, deadline: float) -> int:
    """Open `path` and bring it up to date, as a store's start does; the schema version
    it then has. SchemaError if the file cannot be the gateway's."""
    try:
        conn = sqlite3.connect(path, timeout=deadline, isolation_level=None)
    except sqlite3.Error as exc:
        raise SchemaError(_refusal(path, exc, deadline)) from exc
    try:
        prepare(conn, path, synchronous, deadline)
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()
