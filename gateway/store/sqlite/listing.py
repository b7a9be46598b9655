"""The SQLite store's listings and counts: a page from a cursor, and the figures behind
the overview and the gauges.

A part SqliteStore (store.py) holds. Every listed record has its `place`
(pages.place_of) in its row, and the index gateway_records_listed (state, route,
place, digest) holds them in listing order: a page is one scan per (state, route) pair
from the cursor on, merged, reading about a page of rows. The counts are
gateway_counts' (kept in each move's transaction, rows.py); each pair's oldest is its
index's head.
"""

from __future__ import annotations

import heapq
import sqlite3

from gateway.records import OPEN_STATES, QueueStat, Record, State, StateCount
from gateway.store.pages import (
    ANY,
    PAGE_SIZE,
    READ_ROUNDS,
    Cursor,
    Match,
    Page,
    Position,
    check_limit,
    check_states,
    page_of,
)
from gateway.store.sqlite.rows import SELECT, Effects, Host

_OLDEST = (
    "SELECT place FROM gateway_records WHERE state = ? AND route = ? AND place IS NOT NULL"
    " ORDER BY place, digest LIMIT 1"
)


class SqliteListing:
    def __init__(self, store: Host) -> None:
        self.store = store
        self.rows = store.rows

    async def stats(self) -> list[StateCount]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> list[StateCount]:
            found = []
            counts = conn.execute(
                "SELECT route, state, count FROM gateway_counts WHERE count > 0"
                " ORDER BY route, state"
            ).fetchall()
            for route, state, count in counts:
                if State(state) not in OPEN_STATES:
                    continue
                oldest = conn.execute(_OLDEST, (state, route)).fetchone()
                age = max(0, now - oldest[0]) / 1000 if oldest is not None else 0.0
                found.append(StateCount(route, State(state), count, age))
            return found

        return await self.store.run(op, "stats")

    async def queue_stats(self) -> list[QueueStat]:
        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> list[QueueStat]:
            waiting: dict[str, dict[str, int]] = {}
            for route, state, count in conn.execute(
                "SELECT route, state, count FROM gateway_counts WHERE count > 0"
                " AND state IN ('queued', 'retrying') ORDER BY route"
            ):
                waiting.setdefault(route, {})[state] = count
            found = []
            for route, counts in sorted(waiting.items()):
                heads = [conn.execute(_OLDEST, (state, route)).fetchone() for state in counts]
                earliest = min((head[0] for head in heads if head is not None), default=now)
                found.append(
                    QueueStat(
                        route,
                        counts.get("queued", 0),
                        counts.get("retrying", 0),
                        max(0, now - earliest) / 1000,
                    )
                )
            return found

        return await self.store.run(op, "queue stats")

    async def list_records(
        self,
        states: frozenset[State],
        *,
        route: str | None = None,
        older_than: float = 0.0,
        cursor: str = "",
        limit: int = PAGE_SIZE,
        match: Match = ANY,
    ) -> Page:
        start, wanted = Cursor.decode(cursor), check_limit(limit)
        check_states(states, route)
        backward = start is not None and start.backward

        def op(conn: sqlite3.Connection, now: int, fx: Effects) -> Page:
            ceiling = match.ceiling(now, older_than)
            bounds = (match.floor(), match.ceiling(now, 0.0))
            pairs: list[tuple[State, str | None]] = [
                (State(state), name)
                for name, state in conn.execute(
                    "SELECT route, state FROM gateway_counts WHERE count > 0"
                )
                if State(state) in states and (route is None or name == route)
            ]
            if State.IN_FLIGHT in states:  # not counted: one walk over every route's
                pairs.append((State.IN_FLIGHT, route))
            if State.COMPLETED in states:  # not counted either: the route's own walk
                pairs.append((State.COMPLETED, route))
            # What drops rows after reading (the in-flight walk's age filter, the
            # match's key prefix and status) reads READ_ROUNDS pages' worth, the rest a
            # page.
            sizes = {
                state: READ_ROUNDS * (wanted + 1)
                if (state is State.IN_FLIGHT and older_than > 0) or match.reads_past
                else wanted + 1
                for state, _ in pairs
            }
            walks = [
                self._walk(
                    conn,
                    state,
                    name,
                    start,
                    (bounds[0], bounds[1] if state is State.IN_FLIGHT else ceiling),
                    sizes[state],
                    now,
                )
                for state, name in pairs
            ]
            # A walk that read all it asked for may hold more past its last row: the
            # merge is certain only up to the nearest such last row, and a page that
            # has not filled by then goes on from there.
            ends = [
                walk[-1][0]
                for walk, (state, _) in zip(walks, pairs, strict=True)
                if len(walk) >= sizes[state]
            ]
            bound = (max(ends) if backward else min(ends)) if ends else None
            found: list[tuple[Position, Record]] = []
            merged = heapq.merge(*walks, key=lambda item: item[0], reverse=backward)
            for position, record in merged:
                if len(found) > wanted:
                    break
                if bound is not None and (position < bound if backward else position > bound):
                    break
                if record.state is State.IN_FLIGHT and record.state_age < older_than:
                    continue
                if not match.keeps(record):
                    continue
                found.append((position, record))
            return page_of(found, start, wanted, now, resume=bound)

        return await self.store.run(op, "listing")

    def _walk(
        self,
        conn: sqlite3.Connection,
        state: State,
        route: str | None,
        start: Cursor | None,
        bounds: tuple[int | None, int | None],
        n: int,
        now: int,
    ) -> list[tuple[Position, Record]]:
        """Up to `n` records of one (state, route) (every route's: None) from `start` on,
        in the walk's order, their places within `bounds` (lowest, highest; None: open)."""
        where = ["state = ?", "place IS NOT NULL"]
        args: list[object] = [str(state)]
        if route is not None:
            where.append("route = ?")
            args.append(route)
        if state is State.COMPLETED:  # kept until it expires; the reaper deletes it later
            where.append("(expires_ms IS NULL OR expires_ms > ?)")
            args.append(now)
        floor, ceiling = bounds
        if floor is not None:
            where.append("place >= ?")
            args.append(floor)
        if ceiling is not None:
            where.append("place <= ?")
            args.append(ceiling)
        order = "ASC"
        if start is not None:
            beyond = "<" if start.backward else ">"
            order = "DESC" if start.backward else "ASC"
            where.append(f"(place, digest) {beyond} (?, ?)")
            args += [start.position.place, start.position.digest]
        sql = f"{SELECT} WHERE {' AND '.join(where)} ORDER BY place {order}, digest {order} LIMIT ?"
        rows = conn.execute(sql, (*args, n)).fetchall()
        return [(Position(row[20], row[0]), self.rows.decode(row, now)) for row in rows]
