"""The Redis store: every state change is one Lua script, one round trip.

Layout, for a prefix `idem:` and a record digest `d` in bucket `b` (0..BUCKETS-1) of
route `r`:

    idem:{b}:d               hash: the record (its fields: FIELDS in redis/record.py)
    idem:{b}:i:in_flight     zset: in-flight members by lease deadline (the sweep's work list)
    idem:{b}:i:unresolved:r  zset: route r's members by the time they entered the state;
    idem:{b}:i:parked:r            likewise for parked and claimed: listings read these,
    idem:{b}:i:claimed:r           never the keyspace
    idem:{b}:n               hash: `state/route` -> members of that index, for the counted
                             states (unresolved, parked, claimed, queued, retrying): the
                             overview's and the gauges' figures, kept by the scripts
    idem:{b}:c               sharded pub/sub channel: a member changed
    idem:{b}:d               sharded pub/sub channel: a delivery is due or taken (heard
                             only by processes that deliver: redis/notices.py)
    idem:{b}:m               a marker that never expires: if it vanishes, the bucket
                             lost its records (see check_reset)
    idem:{b}:rq:..., i:queued:r, i:retrying:r    deliveries: see redis/delivery.py
    idem:{b}:ls              hash: route -> ms of its last success completed in the
                             bucket (last_successes reads every bucket's, takes the max)
    idem:{b}:i:completed:r   zset: route r's completed deliveries by when each completed
                             (entries past the route's response_ttl trimmed at each
                             completion): the run log's listing
    idem:{q:r}:admitted      zset: route r's admission marks (delivery.max_queued):
                             see redis/admission.py

A member is `digest/route`. Everything a script touches shares the `{b}` hash tag
(but the admission marks, which a script touches only on one server), so the scripts
run unchanged on Redis Cluster, and a bucket's indexes can be read without scanning
the keyspace. User keys never appear in Redis names: a key such as `../*{x}` is
hashed into the digest, so it cannot reach another record.

Beside it: redis/delivery.py (the delivery operations), redis/listing.py (pages and
counts), redis/admission.py (the bound on a Cluster), redis/notices.py (the
subscriber to the buckets' channels), redis/scripts.py (the scripts' sources and each
call's bytes on the wire), redis/topology.py (connecting to one server, Sentinel or
Cluster), redis/record.py (the record's fields and reading them), redis/info.py (INFO
and the warnings about eviction and AOF), redis/roster.py (the operator roster).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from importlib import resources
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import (
    KeyRef,
    QueueStat,
    Record,
    State,
    StoredResponse,
    StoreInfo,
    is_success,
)
from gateway.store.base import (
    CheckResult,
    ExpiredPolicy,
    OperatorResult,
    PartsStore,
    codec_for,
    duration_ms,
)
from gateway.store.rate import interval_ms
from gateway.store.redis.admission import ClusterAdmission, admission_key
from gateway.store.redis.delivery import RedisDeliveries, attempt_json
from gateway.store.redis.info import read_info, report
from gateway.store.redis.listing import BUCKETS, RedisListing, bucket_of
from gateway.store.redis.notices import RedisNotices, bounded
from gateway.store.redis.pauses import RedisPauses
from gateway.store.redis.record import decode_record, text
from gateway.store.redis.resp import RespConnection, RespConnectionError, RespError, pack_command
from gateway.store.redis.roster import RedisRoster
from gateway.store.redis.scripts import SCRIPTS, ScriptCommands, SharedLoads, script_source
from gateway.store.redis.topology import client_for, describe, script_endpoint, script_then_wait
from gateway.store.redis.transfer import RedisTransfer
from gateway.store.transfer import EXPORT_PAGE, ExportedRecord, ExportPage

log = logging.getLogger("gateway.store")

#: A record's state indexes after its bucket's tag, in the scripts' KEYS order: the
#: bucket's in-flight members (every route's), then the route's own per state.
ROUTE_INDEXES = ("unresolved", "parked", "claimed", "queued", "retrying")

__all__ = ["BUCKETS", "RedisStore"]


def rate_source() -> str:
    """lua/rate.lua, run alone: a bucket is no record's, so it is not a record script."""
    return (resources.files("gateway.store.redis") / "lua" / "rate.lua").read_text()


class RedisStore(PartsStore):
    deliveries: RedisDeliveries
    listing: RedisListing
    operators: RedisRoster
    pauses: RedisPauses

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
        # lua/rate.lua runs alone (no record's), over the same connection as the rest.
        self._scripts["rate"] = self.client.register_script(rate_source())
        self._commands = ScriptCommands(self._scripts, self._layout, self.prefix)
        self._cluster_scripts = SharedLoads(self.client) if self.cluster else None
        #: on a Cluster, the route's admission marks are kept apart (redis/admission.py)
        self.admission = ClusterAdmission(self.prefix, self._run_keys) if self.cluster else None
        self._listener: asyncio.Task[None] | None = None
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
        # The parts, each handed what it needs: the scripts run through this store's
        # runners (one connection, or redis-py's) on the buckets' names above.
        self.deliveries = RedisDeliveries(
            self.client,
            self.opener,
            self.due,
            run=self._run,
            run_replicated=self._run_replicated,
            tag=self._tag,
            tags=self._tags,
            wait_for_replicas=self.wait_for_replicas,
            admission=self.admission,
        )
        self.listing = RedisListing(
            self.client,
            self.opener,
            self.prefix,
            self._tags,
            cluster=self.cluster,
            admission=self.admission,
            pipe=self._pipe,
            run_keys=self._run_keys,
        )
        self.notices = RedisNotices(
            self.client,
            self._connection_kwargs,
            self.opener,
            self.notifier,
            self.due,
            cluster=self.cluster,
            channels=self._channels,
            due_channels=self._due_channels,
            on_delivery=self.deliveries.delivery_notice,
        )
        self.due.changed = self.notices.due_changed
        #: Set while the notification subscribers are up (tests wait on it).
        self.subscribed = self.notices.subscribed
        self.operators = RedisRoster(self.client, self.prefix)
        self.pauses = RedisPauses(self.client, self.prefix)
        self.transfer = RedisTransfer(
            self.client,
            self.opener,
            self.prefix,
            cluster=self.cluster,
            run=self._run,
            admission=self.admission,
        )

    def _keys(self, ref: KeyRef) -> tuple[list[str], list[str]]:
        """The script KEYS (see _lib.lua) and the two ARGV every script starts with."""
        return self._layout(bucket_of(ref.digest), ref.digest, ref.route)

    def _layout(self, bucket: int, digest: str, route: str) -> tuple[list[str], list[str]]:
        tag = self._tags[bucket]
        keys = [
            tag + digest,
            tag + "i:in_flight",
            *(f"{tag}i:{state}:{route}" for state in ROUTE_INDEXES),
            tag + "n",
            tag + "rq:" + digest,
            tag + "ls",
            f"{tag}i:completed:{route}",
        ]
        if not self.cluster:  # a Cluster's scripts touch one slot: redis/admission.py
            keys.append(admission_key(self.prefix, route))
        return keys, [f"{digest}/{route}", self._channels[bucket]]

    def _tag(self, digest: str) -> str:
        return self._tags[bucket_of(digest)]

    async def _run(self, name: str, ref: KeyRef, *args: Any) -> Any:
        if self._pipe is not None:
            bucket = bucket_of(ref.digest)
            build = self._commands.command
            return await self._evalsha(
                self._pipe, name, build, name, bucket, ref.digest, ref.route, args
            )
        keys, head = self._keys(ref)
        return await self._run_keys(name, keys, [*head, *args])

    async def _run_keys(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Script `name` on `keys` (all of one slot) with `args`, over whichever
        connection this topology uses; StoreError if it fails."""
        if self._pipe is not None:
            return await self._evalsha(self._pipe, name, self._pack_keys, name, keys, args)
        try:
            if self._cluster_scripts is not None:
                return await self._cluster_scripts.run(self._scripts[name], keys, args)
            return await self._scripts[name](keys=keys, args=args)
        except RedisError as exc:
            raise StoreError.because(f"redis {name} failed", exc) from exc

    async def _run_replicated(
        self, name: str, ref: KeyRef, args: tuple[Any, ...]
    ) -> tuple[Any, int]:
        """Script `name`, then WAIT on the connection that ran it: its reply, and how
        many replicas confirmed its write within `replica_timeout_ms`."""
        keys, head = self._keys(ref)
        wait = (self.wait_for_replicas, self.replica_timeout_ms)
        try:
            return await script_then_wait(
                self.client, self._scripts[name], keys, [*head, *args], wait, self._cluster_scripts
            )
        except RedisError as exc:
            raise StoreError.because(f"redis {name} failed", exc) from exc

    def _pack_keys(self, name: str, keys: list[str], args: list[Any]) -> bytes:
        return pack_command(("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args))

    async def _evalsha(
        self, pipe: RespConnection, name: str, build: Callable[..., bytes], *parts: Any
    ) -> Any:
        """Script `name` on `pipe`, its command `build(*parts)` (built again with the
        sha Redis gives a script it had to load). The parts are passed, not captured
        in a closure: this runs on every request's path."""
        command = build(*parts)
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
                    command = build(*parts)
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
                    raise StoreError.because(f"redis {name} failed", exc) from None
                # Once more on a new connection, as redis-py's Retry does: a script
                # that ran before the connection broke is safe to run again.
                retried = True
                await asyncio.sleep(0.02)

    async def _load(self, pipe: RespConnection, name: str) -> str:
        try:
            return text(await pipe.call("SCRIPT", "LOAD", self._scripts[name].script))
        except (RespError, RespConnectionError) as exc:
            raise StoreError.because(f"redis {name} failed: cannot load the script", exc) from None

    async def start(self) -> None:
        # Start even when Redis is down: requests fail closed (or open, per route)
        # until it answers, /readyz says so, and no restart is needed after.
        try:
            await self.ping()
            await self.info()  # logs an eviction policy that may drop records
        except StoreError as exc:
            log.warning("%s; requests on keyed routes fail until it answers", exc)
        self._listener = asyncio.create_task(self.notices.listen(), name="store-notifications")

    async def close(self) -> None:
        # Bounded: a shutdown must not hang on a client that cannot say goodbye.
        self.notices.close()
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
            raise StoreError.because("redis unreachable", exc) from exc

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
            raise StoreError.because("redis marker check failed", exc) from exc
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
        args = (run_id, fingerprint, duration_ms(lease), ref.route, ref.key, expired)
        if self.wait_for_replicas:
            return await self._claim_replicated(ref, run_id, args)
        reply = await self._run("claim", ref, *args)
        return (
            None
            if reply[0] == 1
            else decode_record(self.opener, ref.digest, int(reply[1]), reply[2:])
        )

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
        reply, acked = await self._run_replicated("claim", ref, args)
        record = (
            None
            if reply[0] == 1
            else decode_record(self.opener, ref.digest, int(reply[1]), reply[2:])
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
                duration_ms(ttl),
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
            raise StoreError.because("redis read failed", exc) from exc
        latest: dict[str, int] = {}
        for bucket in buckets:
            for route, at in bucket.items():
                latest[text(route)] = max(int(at), latest.get(text(route), 0))
        now_ms = now[0] * 1000 + now[1] // 1000
        return {route: max(0, now_ms - at) / 1000 for route, at in latest.items()}

    async def release(self, ref: KeyRef, run_id: str, ttl: float, reason: str) -> bool:
        return bool(await self._run("release", ref, run_id, duration_ms(ttl), reason))

    async def mark_unresolved(
        self, ref: KeyRef, run_id: str, reason: str, *, park: bool = False
    ) -> bool:
        target = "parked" if park else "unresolved"
        return bool(await self._run("unresolved", ref, run_id, reason, target))

    async def get(self, ref: KeyRef) -> Record | None:
        records = await self.listing.read_many([ref.digest])
        return records[0]

    async def delivery_token(self, ref: KeyRef) -> str:
        try:
            delivery, sealed = await self.client.hmget(
                self._tags[bucket_of(ref.digest)] + ref.digest, ["dl", "tk"]
            )
        except RedisError as exc:
            raise StoreError.because("redis read failed", exc) from exc
        if delivery in (None, b"0") or sealed is None:
            return self.no_token()
        return self.read_token(ref.digest, sealed)

    async def _in_flight(self, max_score: str) -> list[tuple[str, str]]:
        """(digest, route) of the in-flight members whose lease ends by `max_score`,
        across all buckets."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for tag in self._tags:
                    pipe.zrangebyscore(tag + "i:in_flight", "-inf", max_score)
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreError.because("redis index read failed", exc) from exc
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
            raise StoreError.because("redis unreachable", exc) from exc
        now_ms = str(seconds * 1000 + micros // 1000)
        changed: list[tuple[KeyRef, str]] = []
        for digest, route in (await self._in_flight(now_ms))[:limit]:
            ref = KeyRef(digest, route, "")
            after = await self._run("expire", ref, policy(route))
            if after:
                changed.append((ref, text(after)))
        return changed

    async def begin_check(self, ref: KeyRef, run_id: str, lock: float, min_interval: float) -> bool:
        token = secrets.token_hex(8)  # lets a retried call recognise its own lock
        return bool(
            await self._run(
                "check_begin", ref, run_id, duration_ms(lock), int(min_interval * 1000), token
            )
        )

    async def end_check(self, check: CheckResult) -> str:
        ref, run_id, result, answer = check.ref, check.run_id, check.result, check.answer
        response, ttl, park_after, retry_in = (
            check.response,
            check.ttl,
            check.park_after,
            check.retry_in,
        )
        after = await self._run(
            "check_end",
            ref,
            run_id,
            result,
            json.dumps(answer),
            self.codec.encode(ref.digest, response) if response is not None else b"",
            duration_ms(ttl),
            duration_ms(park_after),
            "" if retry_in is None else str(max(0, int(retry_in * 1000))),
        )
        state = text(after) if after else ""
        if state == "retrying" and self.admission is not None:
            await self.admission.mark(ref.route, ref.digest)  # it waits again
        return state

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
        reply = await self._run("op_resolve", ref, operator, outcome, note, body, duration_ms(ttl))
        if reply[0] == 1:
            state = text(reply[1])
            if state == "queued" and self.admission is not None:
                await self.admission.mark(ref.route, ref.digest)  # it waits again
            return OperatorResult(True, state=state)
        kind, value = text(reply[1]), text(reply[2])
        if kind == "holder":
            return OperatorResult(False, state="claimed", refused="holder", holder=value)
        return OperatorResult(
            False, state=value, refused="missing" if value == "missing" else "state"
        )

    # -- the parts' operations ------------------------------------------------------

    async def repair_counts(self, routes: Collection[str]) -> int:
        return await self.listing.repair_counts(routes)

    async def queue_stats(self) -> list[QueueStat]:
        return await self.listing.queue_stats()

    # -- rate limits ---------------------------------------------------------------

    async def take_token(self, name: str, per_second: float, burst: int) -> float:
        # One key per bucket, its own hash tag: on a Cluster, the node that owns it.
        key = f"{self.prefix}{{rate:{name}}}"
        reply = await self._run_keys("rate", [key], [repr(interval_ms(per_second)), burst])
        return float(text(reply)) / 1000.0

    # -- copying to another store --------------------------------------------------

    async def export_records(self, cursor: str = "", limit: int = EXPORT_PAGE) -> ExportPage:
        return await self.transfer.export_records(cursor, limit)

    async def import_records(self, items: Sequence[ExportedRecord]) -> list[str]:
        return await self.transfer.import_records(items)

    async def holds_keys(self) -> bool:
        return await self.transfer.holds_keys()
