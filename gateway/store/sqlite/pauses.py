"""The SQLite store's route pauses (store/route_pauses.py's contract): the table
gateway_route_pauses. A move is one operation, so it holds the file's write lock
throughout: moves of two processes are applied one after the other, each whole. A part
SqliteStore (store.py) holds.
"""

from __future__ import annotations

import sqlite3

from gateway.store.route_pauses import PauseMove, PauseState, RoutePauses, Verdict, apply_move
from gateway.store.sqlite.rows import Effects, Host

_READ = (
    "SELECT route, failures, since_ms, by_whom, why, probe_ms, changed_ms FROM gateway_route_pauses"
)


def _states(conn: sqlite3.Connection, now: int, route: str | None = None) -> list[PauseState]:
    if route is None:
        rows = conn.execute(_READ).fetchall()
    else:
        rows = conn.execute(_READ + " WHERE route = ?", (route,)).fetchall()
    return [
        PauseState(route, failures, since, by, why, probe, changed, now)
        for route, failures, since, by, why, probe, changed in rows
    ]


class SqlitePauses(RoutePauses):
    def __init__(self, store: Host) -> None:
        self.store = store

    async def route_pause(self, route: str) -> PauseState:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> PauseState:
            found = _states(conn, now, route)
            return found[0] if found else PauseState(route, now_ms=now)

        return await self.store.run(op, "route pause read")

    async def route_pauses(self) -> dict[str, PauseState]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> dict[str, PauseState]:
            return {state.route: state for state in _states(conn, now)}

        return await self.store.run(op, "route pauses")

    async def change_pause(self, route: str, move: PauseMove) -> tuple[PauseState, Verdict]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> tuple[PauseState, Verdict]:
            found = _states(conn, now, route)
            state, verdict = apply_move(found[0] if found else PauseState(route), move, now)
            conn.execute(
                "INSERT INTO gateway_route_pauses"
                " (route, failures, since_ms, by_whom, why, probe_ms, changed_ms)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (route) DO UPDATE SET"
                " failures = excluded.failures, since_ms = excluded.since_ms,"
                " by_whom = excluded.by_whom, why = excluded.why,"
                " probe_ms = excluded.probe_ms, changed_ms = excluded.changed_ms",
                (
                    route,
                    state.failures,
                    state.since_ms,
                    state.by,
                    state.why,
                    state.probe_ms,
                    state.changed_ms,
                ),
            )
            return state, verdict

        return await self.store.run(op, "route pause")
