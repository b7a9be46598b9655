"""The Redis store's deliveries: accept, pick, retry_later and the queue's reads.

Half of RedisStore (redis.py), which owns connecting and running scripts. The layout
it adds, under each bucket's hash tag `{b}` (so every script touches one slot):

    idem:{b}:rq:<digest>          string: a delivery's request, sealed; deleted when it settles
    idem:{b}:i:queued:<route>     zset: queued members by due time (= acceptance: FIFO)
    idem:{b}:i:retrying:<route>   zset: retrying members by due time
    idem:{b}:qr                   hash: route -> its pending (queued + retrying) members here
    idem:{b}:d                    sharded channel: the delivery notices below

The queue indexes are per route, so a route with a backlog never hides another's work
at a bucket's head. Workers are woken by notices on the bucket's `d` channel,
published by the scripts: `!d <member> <due_ms> <now_ms> <origin>` (due) and
`!t <member>` (taken). Only a process whose worker listens subscribes to it (an
accept-only one would otherwise read a notice per accepted request, its own
included); a (re)subscribe reports `due.lost()`, and `due_candidates` is the rescan,
reading the queue indexes only.
"""

from __future__ import annotations

import abc
import json
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.records import KeyRef, State, StoredRequest
from gateway.store.base import Accepted, ExpiredPolicy, PickResult, QueueStat, Store
from gateway.store.notices import Due
from gateway.store.redis_record import decode_record, text

#: The queue states' index names, after the bucket tag and before the route.
QUEUE_INDEXES = ("i:queued:", "i:retrying:")
QUEUE_STATES_ORDER = (State.QUEUED, State.RETRYING)


def attempt_json(attempt: dict[str, Any]) -> str:
    """One spelling per attempt, so a retried call recognises what it wrote."""
    return json.dumps(attempt, sort_keys=True, separators=(",", ":"))


class RedisDeliveries(Store):
    # Set by RedisStore (redis.py):
    client: Any
    wait_for_replicas: int
    replica_timeout_ms: int
    _tags: list[str]
    _scripts: dict[str, AsyncScript]

    @abc.abstractmethod
    def _keys(self, ref: KeyRef) -> tuple[list[str], list[str]]: ...

    @abc.abstractmethod
    async def _run(self, name: str, ref: KeyRef, *args: Any) -> Any: ...

    @abc.abstractmethod
    def _tag(self, digest: str) -> str:
        """The bucket tag (with the prefix) that record `digest` lives under."""

    async def _now(self) -> int:
        try:
            seconds, micros = await self.client.time()
        except RedisError as exc:
            raise StoreError(f"redis unreachable: {exc}") from exc
        return int(seconds) * 1000 + int(micros) // 1000

    async def accept(
        self,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        request: StoredRequest,
        token: str,
        *,
        admit: bool = True,
        origin: str = "",
        expired: ExpiredPolicy = "unresolved",
    ) -> Accepted:
        args = (
            run_id,
            fingerprint,
            ref.route,
            ref.key,
            self.codec.encode_request(ref.digest, request),
            self.codec.encode_token(ref.digest, token),
            "1" if admit else "0",
            expired,
            origin,
        )
        acked = None
        if self.wait_for_replicas:
            reply, acked = await self._accept_replicated(ref, args)
        else:
            reply = await self._run("accept", ref, *args)
        now = int(reply[1])
        if reply[0] == 2:
            return Accepted("full", now)
        accepted = Accepted("queued", now)
        if reply[0] == 0:
            accepted = Accepted("exists", now, decode_record(self, ref.digest, now, reply[2:]))
        record = accepted.record
        ours = record is None or (record.run_id == run_id and record.state is State.QUEUED)
        if acked is not None and ours and acked < self.wait_for_replicas:
            # Left queued: releasing it could drop work, and a repeat finds it (202).
            raise StoreError(
                f"only {acked} of {self.wait_for_replicas} replicas confirmed the accepted delivery"
            )
        return accepted

    async def _accept_replicated(self, ref: KeyRef, args: tuple[Any, ...]) -> tuple[Any, int]:
        """Accept, then WAIT on the same connection until replicas hold it. One they
        did not confirm is a store error (the caller answers 503, not 202) but stays
        queued. A record of this run found queued is this call's own, retried by
        redis-py after a timeout: it needs the same confirmation (the script writes to
        it, so this WAIT covers the first try's write too)."""
        keys, head = self._keys(ref)
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                await self._scripts["accept"](keys=keys, args=[*head, *args], client=pipe)
                pipe.wait(self.wait_for_replicas, self.replica_timeout_ms)
                reply, acked = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis accept failed: {exc}") from exc
        return reply, int(acked)

    async def pick(
        self,
        route: str,
        hint: KeyRef,
        run_id: str,
        lease: float,
        max_attempts: int,
        replica: str,
        park_reason: str = "attempts exhausted",
    ) -> PickResult:
        lease_ms = max(1, int(lease * 1000))
        reply = await self._run("pick", hint, run_id, lease_ms, max_attempts, replica, park_reason)
        now = int(reply[1])
        if reply[0] == 1:
            record = decode_record(self, hint.digest, now, reply[5:])
            following = _next(reply[3], reply[4], now)
            return PickResult(record, request=reply[2] or b"", next=following, now_ms=now)
        following = _next(reply[4], reply[5], now)
        return PickResult(
            None, why=text(reply[2]), due_ms=int(reply[3]), next=following, now_ms=now
        )

    async def retry_later(
        self,
        ref: KeyRef,
        run_id: str,
        delay: float | None,
        attempt: dict[str, Any],
        origin: str = "",
    ) -> bool:
        delay_ms = "" if delay is None else str(max(0, int(delay * 1000)))
        reason = str(attempt.get("reason") or "attempts exhausted")
        return bool(
            await self._run("retry", ref, run_id, delay_ms, attempt_json(attempt), origin, reason)
        )

    async def get_request(self, ref: KeyRef) -> StoredRequest | None:
        try:
            sealed = await self.client.get(self._tag(ref.digest) + "rq:" + ref.digest)
        except RedisError as exc:
            raise StoreError(f"redis read failed: {exc}") from exc
        return None if sealed is None else self.codec.decode_request(ref.digest, sealed)

    async def due_candidates(self, route: str, limit: int) -> tuple[list[Due], int]:
        now = await self._now()
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for tag in self._tags:
                    for index in QUEUE_INDEXES:
                        pipe.zrange(tag + index + route, 0, limit - 1, withscores=True)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis queue read failed: {exc}") from exc
        found: list[Due] = []
        for queued, retrying in zip(replies[::2], replies[1::2], strict=True):
            heads = sorted([*queued, *retrying], key=lambda pair: (pair[1], pair[0]))[:limit]
            found += [_due_of(member, score, now) for member, score in heads]
        found.sort(key=lambda due: due.due_ms)
        return found, now

    async def queue_stats(self) -> list[QueueStat]:
        now = await self._now()
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for tag in self._tags:
                    pipe.hgetall(tag + "qr")
                counts = await pipe.execute()
            pending = [
                (tag, text(route))
                for tag, routes in zip(self._tags, counts, strict=True)
                for route in routes
            ]
            if not pending:
                return []
            async with self.client.pipeline(transaction=False) as pipe:
                for tag, route in pending:
                    for index in QUEUE_INDEXES:
                        pipe.zcard(tag + index + route)
                        pipe.zrange(tag + index + route, 0, 0, withscores=True)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis queue read failed: {exc}") from exc
        totals: dict[str, list[int]] = {}  # route -> [queued, retrying, earliest due]
        for i, (_, route) in enumerate(pending):
            queued, queued_head, retrying, retrying_head = replies[4 * i : 4 * i + 4]
            total = totals.setdefault(route, [0, 0, now])
            total[0] += int(queued)
            total[1] += int(retrying)
            for head in (queued_head, retrying_head):
                if head:
                    total[2] = min(total[2], int(head[0][1]))
        return [
            QueueStat(route, queued, retrying, max(0, now - earliest) / 1000)
            for route, (queued, retrying, earliest) in sorted(totals.items())
            if queued or retrying
        ]

    async def queue_members(self, states: frozenset[State]) -> list[str]:
        """Digests of the queued and retrying deliveries among `states`, from the due
        indexes of the routes each bucket's `qr` names: never a keyspace scan."""
        indexes = [i for i, s in zip(QUEUE_INDEXES, QUEUE_STATES_ORDER, strict=True) if s in states]
        if not indexes:
            return []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for tag in self._tags:
                    pipe.hkeys(tag + "qr")
                routes = await pipe.execute()
            pending = [
                (tag, text(r)) for tag, rs in zip(self._tags, routes, strict=True) for r in rs
            ]
            if not pending:
                return []
            async with self.client.pipeline(transaction=False) as pipe:
                for tag, route in pending:
                    for index in indexes:
                        pipe.zrange(tag + index + route, 0, -1)
                members = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis queue read failed: {exc}") from exc
        return [text(m).partition("/")[0] for found in members for m in found]

    def _delivery_notice(self, data: bytes) -> None:
        """`!d <member> <due_ms> <now_ms> <origin>` or `!t <member>`, from the scripts."""
        kind, _, rest = data.partition(b" ")
        try:
            if kind == b"!t":
                self.due.taken(rest.split(b"/", 1)[0].decode())
            elif kind == b"!d":
                member, due, now, origin = rest.split(b" ", 3)
                self.due.announce(_due_of(member, int(due), int(now), origin.decode()))
        except (ValueError, UnicodeDecodeError):
            return  # not one of ours: the store's writers are trusted, its notices hints


def _due_of(member: bytes | str, score: Any, now: int, origin: str = "") -> Due:
    """A hint from an index member `digest/route` and its due time."""
    digest, _, route = text(member).partition("/")
    return Due(KeyRef(digest, route, ""), int(float(score)), now, origin)


def _next(member: bytes | str, score: Any, now: int) -> Due | None:
    return _due_of(member, score, now) if member else None
