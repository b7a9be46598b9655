"""The Redis store's listings and counts: a page from a cursor, and the figures behind
the overview and the gauges, none of which reads more than a page or the counts.

A part RedisStore (store.py) holds: it runs scripts through the store's runner. What it
reads, under each bucket's hash tag `{b}`:

    idem:{b}:n                  hash: `state/route` -> records in that state index
                                (kept by the scripts: _lib.lua's move())
    idem:{b}:i:<state>:<route>  zset: a route's members of a counted state, by place
    idem:{b}:i:in_flight        zset: the bucket's in-flight members, by lease deadline
    idem:{b}:i:completed:<route> zset: a route's completed deliveries, by completion

A page is a merge of the state indexes of every bucket, in (place, digest) order.
list.lua returns one bucket's next candidates after (or before) a position; the
buckets are asked together (one round trip), a few candidates each, and asked again
only where a bucket may still hold one of the page's rows (`_merge`): a page of 100
over 64 buckets reads about 800 index entries (a script per bucket) and 101 records,
whatever the number of records. The counts are one HGETALL per bucket, and the oldest
of a (route, state) is the head of its index in each bucket holding some. On one
server these reads go over the scripts' own connection (`_fast_reads`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.records import OPEN_STATES, QueueStat, Record, State, StateCount
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
from gateway.store.redis.admission import ClusterAdmission, repair_marks
from gateway.store.redis.record import decode_record, server_now_ms, text
from gateway.store.redis.resp import RespConnection, RespConnectionError, RespError

log = logging.getLogger("gateway.store")

#: Records are spread over this many hash tags: enough to balance a cluster's
#: shards, few enough that the sweep and the metrics read every index cheaply.
BUCKETS = 64

#: The counted states' index names after the bucket's tag: `i:<state>:<route>`.
_COUNTED_NAMES = {str(state): state for state in COUNTED_STATES}
#: What an older layout kept, folded into the routes' own indexes by repair_counts.
_LEGACY = ("i:unresolved", "i:parked", "i:claimed", "qr")


def bucket_of(digest: str) -> int:
    """The bucket (hash tag) a record lives under, from its digest."""
    return int(digest[:4], 16) % BUCKETS


@dataclass(frozen=True, slots=True)
class _Candidate:
    """An index entry a listing may show: its position, its member and its index."""

    position: Position
    member: str
    state: State


#: One bucket's indexes a page reads: (key, its state, the highest place, route filter).
_Stream = tuple[str, State, str, str]


class RedisListing:
    def __init__(
        self,
        client: Any,
        opener: Opener,
        prefix: str,
        tags: list[str],
        *,
        cluster: bool,
        admission: ClusterAdmission | None,
        pipe: RespConnection | None,
        run_keys: Callable[[str, list[str], list[Any]], Awaitable[Any]],
    ) -> None:
        self.client = client
        self.opener = opener
        self.prefix = prefix
        self._tags = tags
        self.cluster = cluster
        self.admission = admission
        #: the scripts' own connection, None where there is none (a Cluster, WAIT)
        self._pipe = pipe
        self._run_keys = run_keys

    async def _now(self) -> int:
        return await server_now_ms(self.client)

    # -- reads ---------------------------------------------------------------------

    async def _fast_reads(self, commands: list[tuple[Any, ...]]) -> list[Any] | None:
        """Read-only commands answered in order over the store's own connection, where
        it has one (pipelined: a few microseconds of this process's CPU each, where a
        redis-py pipeline spends ten times that); None where it has none (a Cluster,
        wait_for_replicas). Raw replies: HGETALL a flat list, TIME two strings."""
        pipe = self._pipe
        if pipe is None:
            return None
        retried = False
        while True:
            try:
                return list(await asyncio.gather(*(pipe.call(*command) for command in commands)))
            except RespConnectionError as exc:
                if retried:
                    raise StoreError.because("redis read failed", exc) from None
                retried = True  # once more on a new connection, as a script call is
            except RespError as exc:
                raise StoreError.because("redis read failed", exc) from None

    async def read_many(self, digests: list[str]) -> list[Record | None]:
        """Records by digest, read with the store's clock (admin and sweep paths)."""
        keys = [self._tags[bucket_of(digest)] + digest for digest in digests]
        fast = await self._fast_reads([("TIME",), *(("HGETALL", key) for key in keys)])
        if fast is not None:
            (seconds, micros), *found = fast
            now = int(seconds) * 1000 + int(micros) // 1000
            return [
                decode_record(self.opener, digest, now, flat) if flat else None
                for digest, flat in zip(digests, found, strict=True)
            ]
        try:
            seconds, micros = await self.client.time()
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hgetall(key)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError.because("redis read failed", exc) from exc
        now = seconds * 1000 + micros // 1000
        return [
            decode_record(self.opener, digest, now, [x for pair in fields.items() for x in pair])
            if fields
            else None
            for digest, fields in zip(digests, replies, strict=True)
        ]

    # -- counts --------------------------------------------------------------------

    async def _counts(self) -> tuple[list[dict[tuple[State, str], int]], int]:
        """Each bucket's counts by (state, route), and the store's now (one round trip;
        a Cluster's pipeline cannot carry TIME, which goes beside it)."""
        fast = await self._fast_reads([("TIME",), *(("HGETALL", tag + "n") for tag in self._tags)])
        if fast is not None:
            (seconds, micros), *flats = fast
            found: list[Any] = [dict(zip(f[::2], f[1::2], strict=True)) for f in flats]
            return self._decode_counts(found), int(seconds) * 1000 + int(micros) // 1000

        async def read() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                if not self.cluster:
                    pipe.time()
                for tag in self._tags:
                    pipe.hgetall(tag + "n")
                replies: list[Any] = await pipe.execute()
            return replies

        try:
            if self.cluster:
                now, found = await asyncio.gather(self._now(), read())
            else:
                (seconds, micros), *found = await read()
                now = int(seconds) * 1000 + int(micros) // 1000
        except RedisError as exc:
            raise StoreError.because("redis count read failed", exc) from exc
        return self._decode_counts(found), now

    @staticmethod
    def _decode_counts(found: list[Any]) -> list[dict[tuple[State, str], int]]:
        counts: list[dict[tuple[State, str], int]] = []
        for fields in found:
            bucket: dict[tuple[State, str], int] = {}
            for field, value in fields.items():
                name, _, route = text(field).partition("/")
                state = _COUNTED_NAMES.get(name)
                if state is not None and int(value) > 0:
                    bucket[(state, route)] = int(value)
            counts.append(bucket)
        return counts

    async def _figures(
        self, states: frozenset[State]
    ) -> tuple[dict[tuple[str, State], tuple[int, int]], int]:
        """(route, state) -> (count, earliest place) for `states`, and the store's now:
        the counts, then the head of each non-empty index (two round trips)."""
        counts, now = await self._counts()
        heads = [
            (tag, state, route, n)
            for tag, bucket in zip(self._tags, counts, strict=True)
            for (state, route), n in bucket.items()
            if state in states
        ]
        if not heads:
            return {}, now
        names = [f"{tag}i:{state}:{route}" for tag, state, route, _ in heads]
        fast = await self._fast_reads([("ZRANGE", name, 0, 0, "WITHSCORES") for name in names])
        if fast is not None:
            places = [int(float(head[1])) if head else None for head in fast]
        else:
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    for name in names:
                        pipe.zrange(name, 0, 0, withscores=True)
                    replies = await pipe.execute()
            except RedisError as exc:
                raise StoreError.because("redis count read failed", exc) from exc
            places = [int(head[0][1]) if head else None for head in replies]
        figures: dict[tuple[str, State], tuple[int, int]] = {}
        for (_, state, route, n), place in zip(heads, places, strict=True):
            count, earliest = figures.get((route, state), (0, now))
            if place is not None:
                earliest = min(earliest, place)
            figures[(route, state)] = (count + n, earliest)
        return figures, now

    async def stats(self) -> list[StateCount]:
        figures, now = await self._figures(OPEN_STATES)
        return [
            StateCount(route, state, count, max(0, now - earliest) / 1000)
            for (route, state), (count, earliest) in sorted(figures.items())
        ]

    async def queue_stats(self) -> list[QueueStat]:
        figures, now = await self._figures(frozenset({State.QUEUED, State.RETRYING}))
        stats = []
        for route in sorted({route for route, _ in figures}):
            queued, first = figures.get((route, State.QUEUED), (0, now))
            retrying, second = figures.get((route, State.RETRYING), (0, now))
            oldest = max(0, now - min(first, second)) / 1000
            stats.append(QueueStat(route, queued, retrying, oldest))
        return stats

    # -- pages ---------------------------------------------------------------------

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
        streams, now = await self._streams(states, route, older_than, match)
        found: list[tuple[Position, Record]] = []
        more, at, rounds = bool(streams), start, 0
        # What the indexes cannot filter (an in-flight key's age, a record moved since
        # its index was read) is dropped after reading: the walk reads on until the
        # page fills, the indexes end, or it has read READ_ROUNDS rounds; then the page
        # is short and its `next` goes on from the last entry read.
        while more and len(found) <= wanted and rounds < READ_ROUNDS:
            rounds += 1
            candidates = await self._merge(streams, at, wanted + 1, match.floor())
            records = await self.read_many([c.position.digest for c in candidates])
            for candidate, record in zip(candidates, records, strict=True):
                if record is None or record.state is not candidate.state:
                    continue  # moved since its index was read: its page shows it
                if route is not None and record.route != route:
                    continue
                if record.state is State.IN_FLIGHT and record.state_age < older_than:
                    continue
                if not match.keeps(record):
                    continue
                found.append((candidate.position, record))
            if records and records[0] is not None:
                now = records[0].now_ms
            more = len(candidates) > wanted
            if more:
                at = Cursor(candidates[-1].position, backward=at is not None and at.backward)
        resume = at.position if more and at is not None and at is not start else None
        return page_of(found, start, wanted, now, more=more, resume=resume)

    async def _streams(
        self, states: frozenset[State], route: str | None, older_than: float, match: Match
    ) -> tuple[dict[int, list[_Stream]], int]:
        """Per bucket, the indexes a page reads, and the store's now. A route given
        names its own; otherwise the counts say which routes each bucket holds."""
        counted = [state for state in sorted(states) if state in COUNTED_STATES]
        if route is not None or not counted:
            now = await self._now()
            counts = None
        else:
            counts, now = await self._counts()
        ceiling, flying = match.ceiling(now, older_than), match.ceiling(now, 0.0)
        top = "" if ceiling is None else str(ceiling)
        lease_top = "" if flying is None else str(flying)
        streams: dict[int, list[_Stream]] = {}
        for bucket, tag in enumerate(self._tags):
            chosen: list[_Stream] = []
            if counts is None:
                chosen += [(f"{tag}i:{s}:{route}", s, top, "") for s in counted]
            else:
                chosen += [
                    (f"{tag}i:{s}:{name}", s, top, "")
                    for (s, name) in sorted(counts[bucket])
                    if s in states
                ]
            if State.COMPLETED in states:  # a route's own (check_states)
                chosen.append((f"{tag}i:completed:{route}", State.COMPLETED, top, ""))
            if State.IN_FLIGHT in states:  # every route's: filtered in the script
                chosen.append((tag + "i:in_flight", State.IN_FLIGHT, lease_top, route or ""))
            if chosen:
                streams[bucket] = chosen
        return streams, now

    async def _merge(
        self,
        streams: dict[int, list[_Stream]],
        start: Cursor | None,
        wanted: int,
        floor: int | None = None,
    ) -> list[_Candidate]:
        """The first `wanted` candidates of all buckets in the walk's order.

        Each round asks the buckets that may still hold one for their next few (one
        round trip). A candidate is certain once no bucket that may hold more has read
        past it: whatever a bucket has not yet returned comes after its last one. The
        first round asks each bucket for a few times its share of the page; later
        rounds double that where a bucket ran short before the page filled."""
        backward = start is not None and start.backward
        at = {b: start.position if start is not None else None for b in streams}
        # A few times a bucket's share: records spread evenly over the buckets (and
        # their order over time), so the first round is nearly always the last.
        ask = dict.fromkeys(streams, min(wanted, 4 * wanted // len(streams) + 6))
        got: list[_Candidate] = []
        live = set(streams)
        pending = set(streams)

        def later(a: Position, b: Position) -> bool:
            return a < b if backward else a > b

        while pending:
            order = sorted(pending)
            replies = await asyncio.gather(
                *(self._list_bucket(streams[b], at[b], ask[b], backward, floor) for b in order)
            )
            for bucket, found in zip(order, replies, strict=True):
                got += found
                if len(found) < ask[bucket]:
                    live.discard(bucket)
                elif found:
                    at[bucket] = found[-1].position
            got.sort(key=lambda c: (c.position.place, c.position.digest), reverse=backward)
            if not live:
                break
            # Every live bucket has read up to at[b]: what precedes the least of them is
            # certain, and the page needs `wanted` of it.
            reached = [p for p in (at[b] for b in live) if p is not None]
            bound = max(reached) if backward else min(reached)
            certain = [c for c in got if not later(c.position, bound)]
            if len(certain) >= wanted:
                return certain[:wanted]
            cutoff = got[wanted - 1].position if len(got) >= wanted else None
            pending = set()
            for bucket in live:
                last = at[bucket]
                if last is None or cutoff is None or not later(last, cutoff):
                    pending.add(bucket)
                    ask[bucket] = min(wanted, 2 * ask[bucket])
        return got[:wanted]

    async def _list_bucket(
        self,
        streams: list[_Stream],
        at: Position | None,
        n: int,
        backward: bool,
        floor: int | None = None,
    ) -> list[_Candidate]:
        args: list[Any] = [
            "b" if backward else "a",
            "" if at is None else at.place,
            "" if at is None else at.digest,
            n,
            "" if floor is None else floor,
        ]
        for _, _, top, route in streams:
            args += [top, route]
        reply = await self._run_keys("list", [key for key, _, _, _ in streams], args)
        found = []
        for i in range(0, len(reply), 3):
            member = text(reply[i])
            digest = member.partition("/")[0]
            state = streams[int(reply[i + 2]) - 1][1]
            found.append(_Candidate(Position(int(reply[i + 1]), digest), member, state))
        return found

    # -- repair --------------------------------------------------------------------

    async def repair_counts(self, routes: Collection[str]) -> int:
        """Each bucket's counts from its indexes (recount.lua, which also files an
        older layout's members), then the admission marks of `routes` from the
        waiting deliveries."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for tag in self._tags:
                    pipe.hkeys(tag + "n")
                    pipe.hkeys(tag + "qr")
                    for legacy in _LEGACY[:3]:
                        pipe.zrange(tag + legacy, 0, -1)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError.because("redis count read failed", exc) from exc
        waiting: dict[str, int] = {}
        recounts = []
        for bucket, tag in enumerate(self._tags):
            fields, queues, *olds = replies[5 * bucket : 5 * bucket + 5]
            named = {text(f).partition("/")[2] for f in fields} | {text(q) for q in queues}
            named |= {text(m).partition("/")[2] for old in olds for m in old}
            named |= set(routes)
            ordered = sorted(named)
            keys = [tag + "n", *(tag + legacy for legacy in _LEGACY)]
            for name in ordered:
                keys += [f"{tag}i:{state}:{name}" for state in _ROUTE_STATES]
            recounts.append(self._run_keys("recount", keys, list(ordered)))
        mended = sum(int(found) for found in await asyncio.gather(*recounts))
        counts, _ = await self._counts()
        for found in counts:
            for (state, name), n in found.items():
                if state in (State.QUEUED, State.RETRYING):
                    waiting[name] = waiting.get(name, 0) + n
        for name in sorted(routes):
            mended += await repair_marks(
                self.client, self._run_keys, self.prefix, name, waiting.get(name, 0), self._tags
            )
        if mended:
            log.warning(
                "store counts repaired: %d count(s) or admission mark(s) differed from "
                "the records (a script that failed midway, or records written by an "
                "older gateway)",
                mended,
            )
        return mended


#: The counted states in the order recount.lua takes a route's indexes.
_ROUTE_STATES = ("unresolved", "parked", "claimed", "queued", "retrying")

__all__ = ["BUCKETS", "RedisListing", "bucket_of"]
