"""The SQLite store's operator roster (store/operator_roster.py's contract): the tables
gateway_roster and gateway_roster_times. A recording is one operation, so it holds the
file's write lock throughout: recordings of two processes are applied one after the
other, each whole. A part SqliteStore (store.py) holds.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping

from gateway.store.operator_roster import OperatorRoster, RosterEntry
from gateway.store.sqlite.rows import Effects, Host

_READ = "SELECT entry, mark, since_ms FROM gateway_roster"


def _entries(conn: sqlite3.Connection) -> dict[str, RosterEntry]:
    return {entry: RosterEntry(mark, since) for entry, mark, since in conn.execute(_READ)}


class SqliteRoster(OperatorRoster):
    def __init__(self, store: Host) -> None:
        self.store = store

    async def record_roster(self, marks: Mapping[str, str]) -> dict[str, RosterEntry]:
        wanted = dict(marks)

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> dict[str, RosterEntry]:
            row = conn.execute("SELECT last_ms FROM gateway_roster_times WHERE id = 1").fetchone()
            since = max(now, (row[0] if row is not None else 0) + 1)
            kept = _entries(conn)
            for name in kept.keys() - wanted.keys():
                conn.execute("DELETE FROM gateway_roster WHERE entry = ?", (name,))
            renewed = False
            for name, mark in wanted.items():
                old = kept.get(name)
                if old is not None and old.mark == mark:
                    continue
                renewed = True
                conn.execute(
                    "INSERT INTO gateway_roster (entry, mark, since_ms) VALUES (?, ?, ?)"
                    " ON CONFLICT (entry) DO UPDATE SET mark = excluded.mark,"
                    " since_ms = excluded.since_ms",
                    (name, mark, since),
                )
            if renewed:
                conn.execute(
                    "INSERT INTO gateway_roster_times (id, last_ms) VALUES (1, ?)"
                    " ON CONFLICT (id) DO UPDATE SET last_ms = excluded.last_ms",
                    (since,),
                )
            return _entries(conn)

        return await self.store.run(op, "roster")

    async def roster(self) -> dict[str, RosterEntry]:
        return await self.store.run(lambda conn, now, fx: _entries(conn), "roster read")
