"""The PostgreSQL store's operator roster (store/operator_roster.py's contract): the
tables gateway_roster and gateway_roster_times (migration 006). A recording is one
transaction that locks the prefix's row of gateway_roster_times first, so recordings
of two processes are applied one after the other, each whole. A part PostgresStore
(store.py) holds.
"""

from __future__ import annotations

from collections.abc import Mapping

import asyncpg

from gateway.store.operator_roster import OperatorRoster, RosterEntry
from gateway.store.postgres.database import Database

_LOCK = (
    "INSERT INTO gateway_roster_times AS t (prefix, last_ms) VALUES ($1, 0)"
    " ON CONFLICT (prefix) DO UPDATE SET last_ms = t.last_ms"
    " RETURNING greatest(gateway_now_ms(), t.last_ms + 1)"
)
_READ = "SELECT entry, mark, since_ms FROM gateway_roster WHERE prefix = $1"


class PostgresRoster(OperatorRoster):
    def __init__(self, db: Database, prefix: str) -> None:
        self.db = db
        self.prefix = prefix

    async def record_roster(self, marks: Mapping[str, str]) -> dict[str, RosterEntry]:
        names, wanted = list(marks), [marks[name] for name in marks]

        async def record(conn: asyncpg.Connection) -> dict[str, RosterEntry]:
            since = await conn.fetchval(_LOCK, self.prefix)  # the row lock: one at a time
            await conn.execute(
                "DELETE FROM gateway_roster WHERE prefix = $1 AND NOT entry = ANY($2::text[])",
                self.prefix,
                names,
            )
            renewed = await conn.fetchval(
                "WITH wanted AS (SELECT * FROM unnest($2::text[], $3::text[]) AS w(entry, mark)),"
                " changed AS (INSERT INTO gateway_roster (prefix, entry, mark, since_ms)"
                "  SELECT $1, entry, mark, $4 FROM wanted"
                "  ON CONFLICT (prefix, entry) DO UPDATE SET mark = excluded.mark,"
                "   since_ms = excluded.since_ms"
                "  WHERE gateway_roster.mark <> excluded.mark RETURNING 1)"
                " SELECT count(*) FROM changed",
                self.prefix,
                names,
                wanted,
                since,
            )
            if renewed:
                await conn.execute(
                    "UPDATE gateway_roster_times SET last_ms = $2 WHERE prefix = $1",
                    self.prefix,
                    since,
                )
            return _entries(await conn.fetch(_READ, self.prefix))

        return await self.db.transaction(record, "roster")

    async def roster(self) -> dict[str, RosterEntry]:
        return _entries(
            await self.db.call(lambda conn: conn.fetch(_READ, self.prefix), "roster read")
        )


def _entries(rows: list[asyncpg.Record]) -> dict[str, RosterEntry]:
    return {row["entry"]: RosterEntry(row["mark"], row["since_ms"]) for row in rows}
