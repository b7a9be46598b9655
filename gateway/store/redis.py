"""The Redis store: every state change is one Lua script, one round trip.

Layout, for a prefix `idem:` and a record digest `d` in bucket `b` (0..BUCKETS-1):

    idem:{b}:d               hash: the record (its fields: FIELDS in redis_record.py)
    idem:{b}:i:in_flight     zset: in-flight members by lease deadline (the sweep's work list)
    idem:{b}:i:unresolved    zset: members by the time they entered the state; likewise
    idem:{b}:i:parked              for parked and claimed: listings and age metrics read
    idem:{b}:i:claimed             these, never the keyspace
    idem:{b}:c               sharded pub/sub channel: a member changed
    idem:{b}:d               sharded pub/sub channel: a delivery is due or taken (heard
                             only by processes that deliver: redis_notices.py)
    idem:{b}:m               a marker that never expires: if it vanishes, the bucket
                             lost its records (see check_reset)
    idem:{b}:rq:..., i:queued:..., i:retrying:..., qr    deliveries: see redis_delivery.py
    idem:{b}:ls              hash: route -> ms of its last success completed in the
                             bucket (last_successes reads every bucket's, takes the max)

A member is `digest/route`. Everything a script touches shares the `{b}` hash tag,
so the scripts run unchanged on Redis Cluster, and a bucket's indexes can be read
without scanning the keyspace. User keys never appear in Redis names: a key such as
`../*{x}` is hashed into the digest, so it cannot reach another record.

Beside it: redis_delivery.py (the delivery operations), redis_notices.py (the
subscriber to the buckets' channels), redis_scripts.py (the scripts' sources and each
call's bytes on the wire), redis_topology.py (connecting to one server,
Sentinel or Cluster), redis_record.py (the record's fields and reading them),
redis_info.py (INFO and the warnings about eviction and AOF).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import KeyRef, Record, State, StoredResponse, is_success
from gateway.store.base import ExpiredPolicy, OperatorResult, StoreInfo, codec_for
from gateway.store.redis_delivery import RedisDeliveries, attempt_json
from gateway.store.redis_info import read_info, report
from gateway.store.redis_notices import RedisNotices, bounded
from gateway.store.redis_record import decode_record, text
from gateway.store.redis_scripts import SCRIPTS, ScriptCommands, SharedLoads, script_source
from gateway.store.redis_topology import client_for, describe, script_endpoint
from gateway.store.resp import RespConnection, RespConnectionError, RespError

log = logging.getLogger("gateway.store")

_INDEXED = ("in_flight", "unresolved", "parked", "claimed")

#: Records are spread over this many hash tags: enough to balance a cluster's
#: shards, few enough that the sweep and the metrics read every index cheaply.
BUCKETS = 64


class RedisStore(RedisDeliveries, RedisNotices):
    def __init__(self, config: StoreConfig) -> None:
        super().__init__(codec_for(config))
        self.allow_eviction = config.allow_eviction
        self._info_seen: StoreInfo | None = None
        self._source = describe(config)
        self.prefix = config.prefix
        self.cluster = config.kind == "cluster"
        self.client, self._connection_kwargs = client_for(config)
        self.wait_for_replicas = config.wait_for_replicas
        # WAIT gives up at half the socket timeout, so its answer (too few replicas)
        # arrives before the read does: a read that timed out instead loses the answer,
        # and redis-py retries the claim, finding its own unconfirmed write.
        self.replica_timeout_ms = max(1, int(config.socket_timeout * 500))
        self._scripts: dict[str, AsyncScript] = {
            name: self.client.register_script(script_source(name)) for name in SCRIPTS
        }
        # Each bucket's names, built once: its hash tag, and the channel, marker and
        # state indexes under it (the same for every record in the bucket).
        self._tags = [f"{self.prefix}{{{b:02x}}}:" for b in range(BUCKETS)]
        self._channels = [tag + "c" for tag in self._tags]
        self._due_channels = [tag + "d" for tag in self._tags]  # _lib.lua's due_notice
        self._markers = [tag + "m" for tag in self._tags]
        self._indexes = [[tag + "i:" + state for state in _INDEXED] for tag in self._tags]
        self._commands = ScriptCommands(self._scripts, self._layout, self.prefix)
        self._cluster_scripts = SharedLoads(self.client) if self.cluster else None
        self._listener: asyncio.Task[None] | None = None
        self._closing = False
        self._hearing_due: bool | None = None
        self._subscribers: list[Any] = []
        self._pokes: set[asyncio.Task[Any]] = set()
        self.due.changed = self._due_changed
        #: Set while the notification subscribers are up (tests wait on it).
        self.subscribed = asyncio.Event()
        # Scripts go over one pipelined connection of our own (see resp.py), except on
        # a cluster (redis-py routes by slot) and with wait_for_replicas (WAIT blocks
        # the connection it runs on, so it needs pooled ones).
        self._pipe: RespConnection | None = None
        if not self.cluster and not self.wait_for_replicas:
            self._pipe = RespConnection(
                script_endpoint(config, self.client),
                timeout=config.socket_timeout,
                connect_timeout=config.connect_timeout,
            )
        #: each bucket's marker as last seen; None until Redis first answered
        self._marks: list[bytes | None] | None = None

    def _keys(self, ref: KeyRef) -> tuple[list[str], list[str]]:
        """The script KEYS (see _lib.lua) and the two ARGV every script starts with."""
        return self._layout(_bucket(ref.digest), ref.digest, ref.route)

    def _layout(self, bucket: int, digest: str, route: str) -> tuple[list[str], list[str]]:
        tag = self._tags[bucket]
        keys = [
            tag + digest,
            *self._indexes[bucket],
            f"{tag}i:queued:{route}",
            f"{tag}i:retrying:{route}",
            tag + "qr",
            tag + "rq:" + digest,
            tag + "ls",
        ]
        return keys, [f"{digest}/{route}", self._channels[bucket]]

    def _tag(self, digest: str) -> str:
        return self._tags[_bucket(digest)]

    async def _run(self, name: str, ref: KeyRef, *args: Any) -> Any:
        if self._pipe is not None:
            return await self._evalsha(self._pipe, name, ref, args)
        keys, head = self._keys(ref)
        try:
            if self._cluster_scripts is not None:
                return await self._cluster_scripts.run(self._scripts[name], keys, [*head, *args])
            return await self._scripts[name](keys=keys, args=[*head, *args])
        except RedisError as exc:
            raise StoreError(f"redis {name} failed: {exc}") from exc

    async def _evalsha(
        self, pipe: RespConnection, name: str, ref: KeyRef, args: tuple[Any, ...]
    ) -> Any:
        bucket = _bucket(ref.digest)
        command = self._commands.command(name, bucket, ref.digest, ref.route, args)
        retried = loaded = False
        while True:
            try:
                return await pipe.call_packed(command)
            except RespError as exc:
                message = str(exc)
                if message.startswith("NOSCRIPT") and not loaded:
                    # A restarted or flushed Redis: load the script, then run it
                    # (with the sha Redis gave it, should that be another).
                    self._commands.loaded(name, await self._load(pipe, name))
                    command = self._commands.command(name, bucket, ref.digest, ref.route, args)
                    loaded = True
                    continue
                if message.startswith("READONLY") and not retried:
                    # A failover left us on a replica: reconnect to the master.
                    pipe.reset()
                    retried = True
                    continue
                raise StoreError(f"redis {name} failed: {message}") from None
            except RespConnectionError as exc:
                if retried:
                    raise StoreError(f"redis {name} failed: {exc}") from None
                # Once more on a new connection, as redis-py's Retry does: a script
                # that ran before the connection broke is safe to run again.
                retried = True
                await asyncio.sleep(0.02)

    async def _load(self, pipe: RespConnection, name: str) -> str:
        try:
            return text(await pipe.call("SCRIPT", "LOAD", self._scripts[name].script))
        except (RespError, RespConnectionError) as exc:
            raise StoreError(f"redis {name} failed: cannot load the script: {exc}") from None

    async def start(self) -> None:
        # Start even when Redis is down: requests fail closed (or open, per route)
        # until it answers, /readyz says so, and no restart is needed after.
        try:
            await self.ping()
            await self.info()  # logs an eviction policy that may drop records
        except StoreError as exc:
            log.warning("%s; requests on keyed routes fail until it answers", exc)
        self._listener = asyncio.create_task(self._listen(), name="store-notifications")

    async def close(self) -> None:
        # Bounded: a shutdown must not hang on a client that cannot say goodbye.
        self._closing = True
        for poke in list(self._pokes):
            poke.cancel()
        listener = self._listener
        if listener is not None:
            # redis-py 8.1's get_message can swallow a cancel that lands beside its own
            # read timeout, so cancel again until the task ends (the flag stops the
            # loop at its next message or timeout otherwise).
            for _ in range(50):
                listener.cancel()
                await asyncio.wait({listener}, timeout=0.2)
                if listener.done():
                    break
        if self._pipe is not None:
            await self._pipe.close()
        await bounded(self.client.aclose(), "client")
        pool = getattr(self.client, "connection_pool", None)  # a cluster has one per node
        sentinels = getattr(pool, "sentinel_manager", None)
        if sentinels is not None:  # the master's client does not close the sentinels'
            await bounded(sentinels.aclose(), "sentinel clients")

    async def ping(self) -> None:
        try:
            await self.client.ping()
        except RedisError as exc:
            raise StoreError(f"redis unreachable: {exc}") from exc

    async def info(self) -> StoreInfo:
        found = await read_info(self.client, self.cluster, self._source)
        if found != self._info_seen:  # say it once, not on every readiness probe
            self._info_seen = found
            report(found, self.allow_eviction)
        return found

    async def check_reset(self) -> int:
        token = f"{secrets.token_hex(8)} {time.time():.0f}".encode()
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for marker in self._markers:
                    pipe.set(marker, token, nx=True)  # no expiry: only a loss removes it
                    pipe.get(marker)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis marker check failed: {exc}") from exc
        marks: list[bytes | None] = replies[1::2]
        seen, self._marks = self._marks, marks
        if seen is None:
            return 0
        # A marker that is gone (and set again just now), or that another gateway
        # set again first: either way the bucket was emptied since the last look.
        return sum(1 for before, now in zip(seen, marks, strict=True) if before != now)

    async def claim(
        self,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        lease: float,
        expired: ExpiredPolicy = "unresolved",
    ) -> Record | None:
        args = (run_id, fingerprint, _ms(lease), ref.route, ref.key, expired)
        if self.wait_for_replicas:
            return await self._claim_replicated(ref, run_id, args)
        reply = await self._run("claim", ref, *args)
        return None if reply[0] == 1 else decode_record(self, ref.digest, int(reply[1]), reply[2:])

    async def _claim_replicated(
        self, ref: KeyRef, run_id: str, args: tuple[Any, ...]
    ) -> Record | None:
        """Claim, then WAIT on the same connection until replicas hold the claim.
        A claim they did not confirm is released and reported as a store error: a
        failover right now could lose it, and the key would run twice.

        A claim of this run found in flight is this call's own, retried by redis-py
        after a timeout (often WAIT's own): the first try's write may not have reached
        a replica, so it needs the same confirmation. (The script writes to such a
        record, so this WAIT covers the first try's write too.)"""
        keys, head = self._keys(ref)
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                await self._scripts["claim"](keys=keys, args=[*head, *args], client=pipe)
                pipe.wait(self.wait_for_replicas, self.replica_timeout_ms)
                reply, acked = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis claim failed: {exc}") from exc
        record = (
            None if reply[0] == 1 else decode_record(self, ref.digest, int(reply[1]), reply[2:])
        )
        ours = record is None or (record.run_id == run_id and record.state is State.IN_FLIGHT)
        if ours and acked < self.wait_for_replicas:
            try:
                await self.release(ref, run_id, 1, "replicas did not confirm the claim")
            finally:
                raise StoreError(
                    f"only {acked} of {self.wait_for_replicas} replicas confirmed the claim"
                )
        return record

    async def complete(
        self,
        ref: KeyRef,
        run_id: str,
        response: StoredResponse,
        ttl: float,
        attempt: dict[str, Any] | None = None,
    ) -> bool:
        return bool(
            await self._run(
                "complete",
                ref,
                run_id,
                self.codec.encode(ref.digest, response),
                _ms(ttl),
                response.origin,
                "" if attempt is None else attempt_json(attempt),
                "1" if is_success(response.status) else "",
            )
        )

    async def last_successes(self) -> dict[str, float]:
        try:
            now = await self.client.time()
            async with self.client.pipeline(transaction=False) as pipe:
                for tag in self._tags:
                    pipe.hgetall(tag + "ls")
                buckets = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis read failed: {exc}") from exc
        latest: dict[str, int] = {}
        for bucket in buckets:
            for route, at in bucket.items():
                latest[text(route)] = max(int(at), latest.get(text(route), 0))
        now_ms = now[0] * 1000 + now[1] // 1000
        return {route: max(0, now_ms - at) / 1000 for route, at in latest.items()}

    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        return bool(await self._run("release", ref, run_id, _ms(ttl), reason))

    async def mark_unresolved(
        self, ref: KeyRef, run_id: str, reason: str, *, park: bool = False
    ) -> bool:
        target = "parked" if park else "unresolved"
        return bool(await self._run("unresolved", ref, run_id, reason, target))

    async def get(self, ref: KeyRef) -> Record | None:
        records = await self._read_many([ref.digest])
        return records[0]

    async def _read_many(self, digests: list[str]) -> list[Record | None]:
        """Records by digest, read with the store's clock (admin and sweep paths)."""
        try:
            seconds, micros = await self.client.time()
            async with self.client.pipeline(transaction=False) as pipe:
                for digest in digests:
                    pipe.hgetall(self._tags[_bucket(digest)] + digest)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis read failed: {exc}") from exc
        now = seconds * 1000 + micros // 1000
        return [
            decode_record(self, digest, now, [x for pair in fields.items() for x in pair])
            if fields
            else None
            for digest, fields in zip(digests, replies, strict=True)
        ]

    async def _members(self, index: str, max_score: str = "+inf") -> list[tuple[str, str]]:
        """(digest, route) of every member of one index, across all buckets."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for bucket in range(BUCKETS):
                    pipe.zrangebyscore(self._tags[bucket] + "i:" + index, "-inf", max_score)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis index read failed: {exc}") from exc
        members: list[tuple[str, str]] = []
        for reply in replies:
            for member in reply:
                digest, _, route = member.decode().partition("/")
                members.append((digest, route))
        return members

    async def expire_leases(
        self, policy: Callable[[str], ExpiredPolicy], limit: int = 1000
    ) -> list[tuple[KeyRef, str]]:
        try:
            seconds, micros = await self.client.time()
        except RedisError as exc:
            raise StoreError(f"redis unreachable: {exc}") from exc
        now_ms = str(seconds * 1000 + micros // 1000)
        changed: list[tuple[KeyRef, str]] = []
        for digest, route in (await self._members("in_flight", now_ms))[:limit]:
            ref = KeyRef(digest, route, "")
            after = await self._run("expire", ref, policy(route))
            if after:
                changed.append((ref, text(after)))
        return changed

    async def begin_check(self, ref: KeyRef, run_id: str, lock: float, min_interval: float) -> bool:
        token = secrets.token_hex(8)  # lets a retried call recognise its own lock
        return bool(
            await self._run("check_begin", ref, run_id, _ms(lock), int(min_interval * 1000), token)
        )

    async def end_check(
        self,
        ref: KeyRef,
        run_id: str,
        result: str,
        answer: dict[str, Any],
        response: StoredResponse | None,
        ttl: float,
        park_after: float,
        retry_in: float | None = None,
    ) -> str:
        after = await self._run(
            "check_end",
            ref,
            run_id,
            result,
            json.dumps(answer),
            self.codec.encode(ref.digest, response) if response is not None else b"",
            _ms(ttl),
            _ms(park_after),
            "" if retry_in is None else str(max(0, int(retry_in * 1000))),
        )
        return text(after) if after else ""

    async def park(self, ref: KeyRef, reason: str) -> bool:
        return bool(await self._run("park", ref, reason))

    async def operator_claim(self, ref: KeyRef, operator: str, force: bool) -> OperatorResult:
        reply = await self._run("op_claim", ref, operator, "1" if force else "0")
        if reply[0] == 1:
            record = await self.get(ref)
            since = record.holder_since_ms if record is not None else 0
            return OperatorResult(True, state="claimed", holder=operator, holder_since_ms=since)
        if text(reply[1]) == "held":
            return OperatorResult(
                False,
                state="claimed",
                refused="held",
                holder=text(reply[2]),
                holder_since_ms=int(reply[3]),
            )
        state = text(reply[2])
        return OperatorResult(
            False, state=state, refused="missing" if state == "missing" else "state"
        )

    async def operator_resolve(
        self,
        ref: KeyRef,
        operator: str,
        outcome: str,
        note: str,
        response: StoredResponse | None,
        ttl: float,
    ) -> OperatorResult:
        body = self.codec.encode(ref.digest, response) if response is not None else b""
        reply = await self._run("op_resolve", ref, operator, outcome, note, body, _ms(ttl))
        if reply[0] == 1:
            return OperatorResult(True, state=text(reply[1]))
        kind, value = text(reply[1]), text(reply[2])
        if kind == "holder":
            return OperatorResult(False, state="claimed", refused="holder", holder=value)
        return OperatorResult(
            False, state=value, refused="missing" if value == "missing" else "state"
        )

    async def open_records(self, states: frozenset[State]) -> list[Record]:
        digests = [
            digest
            for state in _INDEXED
            if State(state) in states
            for digest, _ in await self._members(state)
        ]
        digests += await self.queue_members(states)
        if not digests:
            return []
        return [r for r in await self._read_many(digests) if r is not None]


def _bucket(digest: str) -> int:
    """The bucket (hash tag) a record lives under, from its digest."""
    return int(digest[:4], 16) % BUCKETS


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
