"""The Redis store's deliveries: accept, pick, retry_later and the queue's reads.

A part RedisStore (store.py) holds: it runs scripts through the store's runners. The layout
it adds, under each bucket's hash tag `{b}` (so every script touches one slot):

    idem:{b}:rq:<digest>          string: a delivery's request, sealed; deleted when it settles
    idem:{b}:i:queued:<route>     zset: queued members by due time (= acceptance: FIFO)
    idem:{b}:i:retrying:<route>   zset: retrying members by due time
    idem:{b}:d                    sharded channel: the delivery notices below

(their counts are in the bucket's `n`, with the other counted states': see
redis/listing.py; the route's bound, delivery.max_queued: redis/admission.py)

The queue indexes are per route, so a route with a backlog never hides another's work
at a bucket's head. Workers are woken by notices on the bucket's `d` channel,
published by the scripts: `!d <member> <due_ms> <now_ms> <origin>` (due) and
`!t <member>` (taken). Only a process whose worker listens subscribes to it (an
accept-only one would otherwise read a notice per accepted request, its own
included); a (re)subscribe reports `due.lost()`, and `due_candidates` is the rescan,
reading the queue indexes only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.records import KeyRef, State, StoredRequest
from gateway.store.base import (
    Accepted,
    NewDelivery,
    Opener,
    PickResult,
    duration_ms,
)
from gateway.store.notices import Due, DueFeed
from gateway.store.redis.admission import ClusterAdmission
from gateway.store.redis.record import decode_record, server_now_ms, text

log = logging.getLogger("gateway.store")

#: Seconds between log lines about picks put back unsent (wait_for_replicas).
PUT_BACK_LOG_INTERVAL = 10.0

#: The queue states' index names, after the bucket tag and before the route.
QUEUE_INDEXES = ("i:queued:", "i:retrying:")


def attempt_json(attempt: dict[str, Any]) -> str:
    """One spelling per attempt, so a retried call recognises what it wrote."""
    return json.dumps(attempt, sort_keys=True, separators=(",", ":"))


class RedisDeliveries:
    #: Seconds before a delivery whose pick the replicas did not confirm is due again.
    unconfirmed_pick_delay = 1.0
    #: Picks put back since the last log line about them, and when that line was.
    _put_backs: tuple[int, float] = (0, -PUT_BACK_LOG_INTERVAL)

    def __init__(
        self,
        client: Any,
        opener: Opener,
        due: DueFeed,
        *,
        run: Callable[..., Awaitable[Any]],
        run_replicated: Callable[[str, KeyRef, tuple[Any, ...]], Awaitable[tuple[Any, int]]],
        tag: Callable[[str], str],
        tags: list[str],
        wait_for_replicas: int,
        admission: ClusterAdmission | None,
    ) -> None:
        self.client = client
        self.opener = opener
        self.codec = opener.codec
        self.due = due
        self._run = run
        self._run_replicated = run_replicated
        #: the bucket tag (with the prefix) that a record's digest lives under
        self._tag = tag
        self._tags = tags
        self.wait_for_replicas = wait_for_replicas
        #: a Cluster's admission marks, kept beside the scripts (None on one server)
        self.admission = admission

    async def _now(self) -> int:
        return await server_now_ms(self.client)

    def accept(self, delivery: NewDelivery) -> Coroutine[Any, Any, Accepted]:
        # On one server the accept itself, not one more coroutine awaiting it: this is
        # every 202's path.
        if self.admission is None:
            limit = delivery.limit
            return self._accept(delivery, "" if limit is None else str(limit))
        return self._admitted(delivery, self.admission)

    async def _admitted(self, delivery: NewDelivery, admission: ClusterAdmission) -> Accepted:
        # A Cluster: the route's slot decides first, and a mark taken here is given
        # back unless the delivery it admits waits (a failed accept, a refused one,
        # a key found settled), or every failure would shrink the bound for good.
        ref = delivery.ref
        taken = await admission.take(ref.route, ref.digest, delivery.limit)
        keep = False
        try:
            accepted = await self._accept(delivery, "" if taken else "0")
            record = accepted.record
            keep = accepted.outcome == "queued" or (
                record is not None and record.state in (State.QUEUED, State.RETRYING)
            )
            return accepted
        finally:
            if taken == "new" and not keep:
                await admission.drop(ref.route, ref.digest)

    async def _accept(self, delivery: NewDelivery, bound: str) -> Accepted:
        # One unpacking: a NamedTuple's fields read by name are each a descriptor call.
        ref, run_id, fingerprint, request, token, _, origin, expired, delay_ms = delivery
        args = (
            run_id,
            fingerprint,
            ref.route,
            ref.key,
            self.codec.encode_request(ref.digest, request),
            self.codec.encode_token(ref.digest, token),
            bound,
            expired,
            origin,
            delay_ms,
        )
        acked = None
        if self.wait_for_replicas:
            # Accept, then WAIT on the same connection until replicas hold it. A
            # record of this run found queued is this call's own, retried by redis-py
            # after a timeout: it needs the same confirmation (the script writes to
            # it, so this WAIT covers the first try's write too).
            reply, acked = await self._run_replicated("accept", ref, args)
        else:
            reply = await self._run("accept", ref, *args)
        now = int(reply[1])
        if reply[0] == 2:
            return Accepted("full", now)
        accepted = Accepted("queued", now)
        if reply[0] == 0:
            accepted = Accepted(
                "exists", now, decode_record(self.opener, ref.digest, now, reply[2:])
            )
        record = accepted.record
        ours = record is None or (record.run_id == run_id and record.state is State.QUEUED)
        if acked is not None and ours and acked < self.wait_for_replicas:
            # Kept queued (releasing it could drop work a replica may hold, and a
            # repeat finds it): stored, and will run unless a failover loses it first.
            return replace(accepted, confirmed=False)
        return accepted

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
        lease_ms = duration_ms(lease)
        args = (run_id, lease_ms, max_attempts, replica, park_reason)
        acked = None
        if self.wait_for_replicas:
            # The pick is what lets an attempt reach the upstream: like a claim, it is
            # sent only once replicas hold it (this WAIT also covers a retried pick's
            # first try: the script writes to the record it finds its own).
            reply, acked = await self._run_replicated("pick", hint, args)
        else:
            reply = await self._run("pick", hint, *args)
        now = int(reply[1])
        if reply[0] == 1 and acked is not None and acked < self.wait_for_replicas:
            due_ms = await self._put_back(hint, run_id, acked, replica)
            following = _next(reply[3], reply[4], now)
            return PickResult(None, why="unconfirmed", due_ms=due_ms, next=following, now_ms=now)
        if self.admission is not None and (reply[0] == 1 or text(reply[2]) == "exhausted"):
            # It no longer waits: this pick moved it (a hint found gone may be another
            # pick's, which drops its own mark; a record gone for good, the repair's).
            await self.admission.drop(hint.route, hint.digest)
        if reply[0] == 1:
            record = decode_record(self.opener, hint.digest, now, reply[5:])
            following = _next(reply[3], reply[4], now)
            return PickResult(record, request=reply[2] or b"", next=following, now_ms=now)
        following = _next(reply[4], reply[5], now)
        return PickResult(
            None, why=text(reply[2]), due_ms=int(reply[3]), next=following, now_ms=now
        )

    async def _put_back(self, ref: KeyRef, run_id: str, acked: int, replica: str) -> int:
        """The pick of `run_id` the replicas did not confirm, put back unsent; when it
        is due again (0: another move took it first, and it is not this run's)."""
        reason = (
            f"not sent: only {acked} of {self.wait_for_replicas} replicas confirmed the "
            "pick (store.wait_for_replicas)"
        )
        delay_ms = max(1, int(self.unconfirmed_pick_delay * 1000))
        done, due_ms = await self._run("put_back", ref, run_id, delay_ms, reason, replica)
        # While the replicas are away every due delivery is put back about once a
        # second: said once per PUT_BACK_LOG_INTERVAL, with how many, not once each.
        count, since = self._put_backs
        now = time.monotonic()
        if now - since >= PUT_BACK_LOG_INTERVAL:
            log.warning(
                "delivery %s record %s %s; due again in %gs (%d picks put back since the "
                "last line about them)",
                ref.route,
                ref.digest,
                reason,
                self.unconfirmed_pick_delay,
                count + 1,
            )
            self._put_backs = (0, now)
        else:
            self._put_backs = (count + 1, since)
        return int(due_ms) if done else 0

    async def retry_later(
        self,
        ref: KeyRef,
        run_id: str,
        delay: float | None,
        attempt: dict[str, Any],
        origin: str = "",
        *,
        uncounted: bool = False,
    ) -> bool:
        delay_ms = "" if delay is None else str(max(0, int(delay * 1000)))
        reason = str(attempt.get("reason") or "attempts exhausted")
        done = bool(
            await self._run(
                "retry",
                ref,
                run_id,
                delay_ms,
                attempt_json(attempt),
                origin,
                reason,
                "1" if uncounted else "",
            )
        )
        if done and delay is not None and self.admission is not None:
            await self.admission.mark(ref.route, ref.digest)  # it waits again
        return done

    async def get_request(self, ref: KeyRef) -> StoredRequest | None:
        try:
            sealed = await self.client.get(self._tag(ref.digest) + "rq:" + ref.digest)
        except RedisError as exc:
            raise StoreError.because("redis read failed", exc) from exc
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
            raise StoreError.because("redis queue read failed", exc) from exc
        found: list[Due] = []
        for queued, retrying in zip(replies[::2], replies[1::2], strict=True):
            heads = sorted([*queued, *retrying], key=lambda pair: (pair[1], pair[0]))[:limit]
            found += [_due_of(member, score, now) for member, score in heads]
        found.sort(key=lambda due: due.due_ms)
        return found, now

    def delivery_notice(self, data: bytes) -> None:
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
