"""The Redis store: every state change is one Lua script, one round trip.

Layout, for a prefix `idem:` and a record digest `d` in bucket `b` (0..BUCKETS-1):

    idem:{b}:d               hash: the record (fields in _FIELDS)
    idem:{b}:i:in_flight     zset: in-flight members by lease deadline (the sweep's work list)
    idem:{b}:i:unresolved    zset: unresolved members by the time they became so
    idem:{b}:c               sharded pub/sub channel: a member changed

A member is `digest/route`. Everything a script touches shares the `{b}` hash tag,
so the scripts run unchanged on Redis Cluster, and a bucket's indexes can be read
without scanning the keyspace. User keys never appear in Redis names: a key such as
`../*{x}` is hashed into the digest, so it cannot reach another record.
"""

from __future__ import annotations

import asyncio
import json
import logging
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from gateway.errors import StoreError
from gateway.records import KeyRef, Record, State, StoredResponse
from gateway.store.base import Store

log = logging.getLogger("gateway.store")

#: Records are spread over this many hash tags: enough to balance a cluster's
#: shards, few enough that the sweep and the metrics read every index cheaply.
BUCKETS = 64


def _script_source(name: str) -> str:
    lua = resources.files("gateway.store") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class RedisStore(Store):
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "idem:",
        socket_timeout: float = 2.0,
        connect_timeout: float = 2.0,
        max_connections: int = 64,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        # One retry on a timeout or a dropped connection: every script is safe to
        # run twice, and socket_timeout bounds each try, so a hung Redis costs a
        # request at most about 2 x socket_timeout.
        # A bounded pool that queues (up to socket_timeout) instead of failing:
        # a burst of requests must not open a connection each.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=socket_timeout,
            decode_responses=False,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=30,
        )
        self.client = aioredis.Redis.from_pool(pool)  # owns it: aclose() closes it
        self._scripts: dict[str, AsyncScript] = {
            name: self.client.register_script(_script_source(name))
            for name in ("claim", "complete", "release", "unresolved")
        }
        self._channels = [self._tag(b) + "c" for b in range(BUCKETS)]
        self._listener: asyncio.Task[None] | None = None

    def _tag(self, bucket: int) -> str:
        return f"{self.prefix}{{{bucket:02x}}}:"

    def _names(self, ref: KeyRef) -> tuple[list[str], str, str]:
        tag = self._tag(int(ref.digest[:4], 16) % BUCKETS)
        keys = [tag + ref.digest, tag + "i:in_flight", tag + "i:unresolved"]
        return keys, f"{ref.digest}/{ref.route}", tag + "c"

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._scripts[name](keys=keys, args=args)
        except RedisError as exc:
            raise StoreError(f"redis {name} failed: {exc}") from exc

    async def start(self) -> None:
        # Start even when Redis is down: requests fail closed (or open, per route)
        # until it answers, /readyz says so, and no restart is needed after.
        try:
            await self.ping()
        except StoreError as exc:
            log.warning("%s; requests on keyed routes fail until it answers", exc)
        self._listener = asyncio.create_task(self._listen(), name="store-notifications")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            try:
                await self._listener
            except asyncio.CancelledError:
                pass
        await self.client.aclose()

    async def ping(self) -> None:
        try:
            await self.client.ping()
        except RedisError as exc:
            raise StoreError(f"redis unreachable: {exc}") from exc

    async def claim(
        self, ref: KeyRef, run_id: str, fingerprint: str, lease: float
    ) -> Record | None:
        keys, member, channel = self._names(ref)
        reply = await self._run(
            "claim",
            keys,
            [run_id, fingerprint, int(lease * 1000), ref.route, ref.key, member, channel],
        )
        if reply[0] == 1:
            return None
        return _record(ref.digest, int(reply[1]), reply[2:])

    async def complete(
        self, ref: KeyRef, run_id: str, response: StoredResponse, ttl: float
    ) -> bool:
        keys, member, channel = self._names(ref)
        args = [run_id, response.encode(), max(1, int(ttl * 1000)), member, channel]
        return bool(await self._run("complete", keys, [*args, response.origin]))

    async def release(self, ref: KeyRef, run_id: str) -> bool:
        keys, member, channel = self._names(ref)
        return bool(await self._run("release", keys[:2], [run_id, member, channel]))

    async def mark_unresolved(self, ref: KeyRef, run_id: str, reason: str) -> bool:
        keys, member, channel = self._names(ref)
        return bool(await self._run("unresolved", keys, [run_id, reason, member, channel]))

    async def get(self, ref: KeyRef) -> Record | None:
        keys, _, _ = self._names(ref)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.time()
                pipe.hgetall(keys[0])
                (seconds, micros), fields = await pipe.execute()
        except RedisError as exc:
            raise StoreError(f"redis read failed: {exc}") from exc
        if not fields:
            return None
        flat: list[Any] = [x for pair in fields.items() for x in pair]
        return _record(ref.digest, seconds * 1000 + micros // 1000, flat)

    async def _listen(self) -> None:
        """One subscriber per process for every bucket's channel; waiters are woken
        locally. After a reconnect, all waiters are woken: they re-read."""
        delay = 0.1
        while True:
            pubsub: PubSub = self.client.pubsub()
            try:
                await pubsub.ssubscribe(*self._channels)
                self.notifier.notify_all()
                delay = 0.1
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                    if message is not None and message["type"] == "smessage":
                        member: bytes = message["data"]
                        self.notifier.notify(member.split(b"/", 1)[0].decode())
            except asyncio.CancelledError:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                raise
            except (RedisError, OSError) as exc:
                log.warning("store notifications lost (%s); reconnecting", exc)
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


def _text(value: bytes | None) -> str:
    return value.decode() if value is not None else ""


def _record(digest: str, now_ms: int, flat: list[Any]) -> Record:
    fields: dict[bytes, bytes] = dict(zip(flat[::2], flat[1::2], strict=True))
    response = fields.get(b"resp")
    history: Any = json.loads(fields[b"h"]) if b"h" in fields else []
    reconcile: Any = json.loads(fields[b"rc"]) if b"rc" in fields else {}
    return Record(
        digest=digest,
        route=_text(fields.get(b"rt")),
        key=_text(fields.get(b"k")),
        state=State(_text(fields.get(b"s"))),
        run_id=_text(fields.get(b"r")),
        fingerprint=_text(fields.get(b"f")),
        created_ms=int(fields.get(b"c", 0)),
        now_ms=now_ms,
        lease_until_ms=int(fields.get(b"l", 0)),
        response=StoredResponse.decode(response) if response is not None else None,
        reason=_text(fields.get(b"why")),
        since_ms=int(fields.get(b"u", 0)),
        holder=_text(fields.get(b"op")),
        reconcile=reconcile if isinstance(reconcile, dict) else {},
        history=tuple(history) if isinstance(history, list) else (),
    )
