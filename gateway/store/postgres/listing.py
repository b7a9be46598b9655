"""The PostgreSQL store's listings and counts: a page from a cursor, and the figures
behind the overview and the gauges.

A part PostgresStore (store.py) holds. The counts are gateway_counts' (kept by triggers
in the same statement as each record's move: 005_counts.sql): `stats` sums them and
probes each (route, state)'s oldest in its listing index. A page is one statement: a
`UNION ALL` of one index scan per (state, route) (the pairs gateway_counts names, or
the route asked for), each from the cursor on in its index's order and limited to the
page, merged by the planner (a Merge Append reads only what the page needs):

    unresolved, parked, claimed   gateway_records_listed  (prefix, state, route, since_ms, digest)
    queued, retrying              gateway_records_waiting (prefix, state, route, due_ms, digest)
    in_flight                     gateway_records_leases  (prefix, lease_until_ms)
    completed (deliveries)        gateway_records_listed  (a route's: pages.check_states)
"""

from __future__ import annotations

import asyncpg

from gateway.records import OPEN_STATES, Record, State, StateCount
from gateway.store.base import Opener
from gateway.store.pages import (
    ANY,
    COUNTED_STATES,
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
from gateway.store.postgres.database import Database, decode_record, expand

#: Each state's place column (base.place_of).
_PLACE = {
    State.IN_FLIGHT: "lease_until_ms",
    State.QUEUED: "due_ms",
    State.RETRYING: "due_ms",
    **{state: "since_ms" for state in OPEN_STATES},
    State.COMPLETED: "since_ms",
}


class PostgresListing:
    def __init__(self, db: Database, opener: Opener, prefix: str) -> None:
        self.db = db
        self.opener = opener
        self.prefix = prefix
        self.channel = db.channel

    async def stats(self) -> list[StateCount]:
        return [
            StateCount(row["route"], State(row["state"]), row["count"], row["oldest_ms"] / 1000)
            for row in await self.db.fetch("stats")
            if row["oldest_ms"] is not None
        ]

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
        counted = sorted(state for state in states if state in COUNTED_STATES)
        if route is not None:
            pairs = [(state, route) for state in counted]
            if State.COMPLETED in states:
                pairs.append((State.COMPLETED, route))
        elif counted:
            rows = await self.db.fetch("counted")
            pairs = [(State(r["state"]), r["route"]) for r in rows if State(r["state"]) in states]
        else:
            pairs = []
        flying = State.IN_FLIGHT in states
        if not pairs and not flying:
            now = await self.db.call(lambda c: c.fetchval("SELECT gateway_now_ms()"), "now")
            return page_of([], start, wanted, int(now))
        found: list[tuple[Position, Record]] = []
        now, more, at, rounds = 0, True, start, 0
        # An in-flight key's age is its state's, not its place's: those too young are
        # dropped after reading, as are those the match's key prefix or status drops,
        # and the walk reads on until the page fills, the rows
        # end, or it has read READ_ROUNDS rounds; then the page is short and its
        # `next` goes on from the last row read.
        while more and len(found) <= wanted and rounds < READ_ROUNDS:
            rounds += 1
            sql, args = self._page_query(pairs, flying, route, older_than, match, at, wanted + 1)

            async def read(
                conn: asyncpg.Connection, sql: str = sql, args: list[object] = args
            ) -> list[asyncpg.Record]:
                got: list[asyncpg.Record] = await conn.fetch(sql, *args)
                return got

            rows = await self.db.call(read, "listing")
            for row in rows:
                record = decode_record(self.opener, row["digest"], row["now"], row)
                now = record.now_ms
                if record.state is State.IN_FLIGHT and record.state_age < older_than:
                    continue
                if not match.keeps(record):
                    continue
                found.append((Position(row["place"], row["digest"]), record))
            more = len(rows) > wanted
            if more:
                last = Position(rows[-1]["place"], rows[-1]["digest"])
                at = Cursor(last, backward=at is not None and at.backward)
        if not now:
            now = int(await self.db.call(lambda c: c.fetchval("SELECT gateway_now_ms()"), "now"))
        resume = at.position if more and at is not None and at is not start else None
        return page_of(found, start, wanted, now, more=more, resume=resume)

    def _page_query(
        self,
        pairs: list[tuple[State, str]],
        flying: bool,
        route: str | None,
        older_than: float,
        match: Match,
        start: Cursor | None,
        n: int,
    ) -> tuple[str, list[object]]:
        """The page's statement and its parameters: $1 the page's size, $2 and $3 the
        cursor's place and digest, $4 the oldest place shown (now - older_than), $5 and
        $6 the match's time range, then the routes of the (state, route) pairs."""
        backward = start is not None and start.backward
        beyond, order = ("<", "DESC") if backward else (">", "ASC")
        args: list[object] = [
            n,
            start.position.place if start is not None else 0,
            start.position.digest if start is not None else "",
            int(older_than * 1000),
            match.since_ms,
            match.until_ms,
        ]
        ranged = []
        if match.since_ms:
            ranged.append("r.{place} >= $5")
        if match.until_ms:
            ranged.append("r.{place} <= $6")
        scans = []
        for state, name in pairs:
            args.append(name)
            place = _PLACE[state]
            where = [f"r.state = '{state.value}'", f"r.route = ${len(args)}"]
            if older_than > 0:
                where.append(f"r.{place} <= (SELECT now FROM t) - $4")
            if state is State.COMPLETED:  # a delivery's, kept until it expires
                where += [
                    "r.delivery",
                    "(r.expires_ms IS NULL OR r.expires_ms > (SELECT now FROM t))",
                ]
            where += [bound.format(place=place) for bound in ranged]
            scans.append(self._scan(place, where, start, beyond, order))
        if flying:
            where = ["r.state = 'in_flight'"]
            if route is not None:
                args.append(route)
                where.append(f"r.route = ${len(args)}")
            where += [bound.format(place="lease_until_ms") for bound in ranged]
            scans.append(self._scan("lease_until_ms", where, start, beyond, order))
        union = " UNION ALL ".join(f"({scan})" for scan in scans)
        sql = (
            # Every parameter is named once here, so each has its type in every page.
            "WITH t AS MATERIALIZED (SELECT gateway_now_ms() AS now, $1::integer AS n,"
            " $2::bigint AS at, $3::text AS after, $4::bigint AS older,"
            " $5::bigint AS since, $6::bigint AS until) "
            f"SELECT (SELECT now FROM t) AS now, u.* FROM ({union}) u "
            f"ORDER BY u.place {order}, u.digest {order} LIMIT $1"
        )
        return expand(sql, self.prefix, self.channel), args

    @staticmethod
    def _scan(place: str, where: list[str], start: Cursor | None, beyond: str, order: str) -> str:
        conditions = ["r.prefix = @prefix", *where]
        if start is not None:
            # The first condition lets the index start at the cursor's place; the row
            # comparison then passes over the ties already shown.
            edge = "<=" if beyond == "<" else ">="
            conditions += [f"r.{place} {edge} $2", f"(r.{place}, r.digest) {beyond} ($2, $3)"]
        return (
            f"SELECT r.{place} AS place, r.digest, @record(r) FROM gateway_records r "
            f"WHERE {' AND '.join(conditions)} "
            f"ORDER BY r.{place} {order}, r.digest {order} LIMIT $1"
        )
