"""The PostgreSQL store's route pauses (store/route_pauses.py's contract): the table
gateway_route_pauses (migration 008). A move is one transaction that locks the route's
row first, so moves of two processes are applied one after the other, each whole. A
part PostgresStore (store.py) holds.
"""

from __future__ import annotations

import asyncpg

from gateway.store.postgres.database import Database
from gateway.store.route_pauses import PauseMove, PauseState, RoutePauses, Verdict, apply_move

_COLUMNS = "route, failures, since_ms, by_whom, why, probe_ms, changed_ms"
_READ = f"SELECT {_COLUMNS}, gateway_now_ms() AS now FROM gateway_route_pauses WHERE prefix = $1"


def _state(row: asyncpg.Record) -> PauseState:
    return PauseState(
        row["route"],
        row["failures"],
        row["since_ms"],
        row["by_whom"],
        row["why"],
        row["probe_ms"],
        row["changed_ms"],
        row["now"],
    )


class PostgresPauses(RoutePauses):
    def __init__(self, db: Database, prefix: str) -> None:
        self.db = db
        self.prefix = prefix

    async def route_pause(self, route: str) -> PauseState:
        async def read(conn: asyncpg.Connection) -> PauseState:
            row = await conn.fetchrow(_READ + " AND route = $2", self.prefix, route)
            if row is None:
                return PauseState(route, now_ms=await conn.fetchval("SELECT gateway_now_ms()"))
            return _state(row)

        return await self.db.call(read, "route pause read")

    async def route_pauses(self) -> dict[str, PauseState]:
        rows = await self.db.call(lambda conn: conn.fetch(_READ, self.prefix), "route pauses")
        return {row["route"]: _state(row) for row in rows}

    async def change_pause(self, route: str, move: PauseMove) -> tuple[PauseState, Verdict]:
        async def change(conn: asyncpg.Connection) -> tuple[PauseState, Verdict]:
            await conn.execute(
                "INSERT INTO gateway_route_pauses (prefix, route) VALUES ($1, $2)"
                " ON CONFLICT (prefix, route) DO NOTHING",
                self.prefix,
                route,
            )
            row = await conn.fetchrow(_READ + " AND route = $2 FOR UPDATE", self.prefix, route)
            assert row is not None  # inserted above, in this transaction
            state, verdict = apply_move(_state(row), move, row["now"])
            await conn.execute(
                "UPDATE gateway_route_pauses SET failures = $3, since_ms = $4, by_whom = $5,"
                " why = $6, probe_ms = $7, changed_ms = $8 WHERE prefix = $1 AND route = $2",
                self.prefix,
                route,
                state.failures,
                state.since_ms,
                state.by,
                state.why,
                state.probe_ms,
                state.changed_ms,
            )
            return state, verdict

        return await self.db.transaction(change, "route pause")
