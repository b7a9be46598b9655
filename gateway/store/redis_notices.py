"""The Redis store's subscriber: one per process, for every bucket's sharded channel
(on a cluster, one connection per shard, for the channels it owns). What the scripts
publish there: a changed record's member (with a completion's response riding along,
see _lib.lua's notify), or a delivery notice starting with `!` (redis_delivery.py).
Half of RedisStore (redis.py), which sets the attributes declared here.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.store.base import Store

log = logging.getLogger("gateway.store")


class RedisNotices(Store):
    # Set by RedisStore (redis.py):
    client: Any
    cluster: bool
    subscribed: asyncio.Event
    _channels: list[str]
    _connection_kwargs: dict[str, Any]
    _closing: bool

    @abc.abstractmethod
    def _delivery_notice(self, data: bytes) -> None: ...

    async def _listen(self) -> None:
        """One subscriber per process for every bucket's channel (on a cluster, one
        per shard, for the channels it owns); waiters are woken locally. After a
        reconnect, all waiters are woken: they re-read."""
        delay = 0.1
        while not self._closing:
            subscribers: list[tuple[Any, Any]] = []  # (pub/sub, its own client or None)
            try:
                if self.cluster:
                    await self.client.initialize()
                    owners: dict[str, tuple[str, int, list[str]]] = {}
                    for channel in self._channels:
                        node = self.client.get_node_from_key(channel)
                        owners.setdefault(node.name, (node.host, node.port, []))[2].append(channel)
                    for host, port, channels in owners.values():
                        shard = aioredis.Redis(host=host, port=port, **self._connection_kwargs)
                        pubsub = shard.pubsub()
                        subscribers.append((pubsub, shard))
                        for channel in channels:  # one SSUBSCRIBE may name one slot only
                            await pubsub.ssubscribe(channel)
                else:
                    pubsub = self.client.pubsub()
                    subscribers.append((pubsub, None))
                    await pubsub.ssubscribe(*self._channels)
                self.subscribed.set()
                self.notifier.notify_all()
                self.due.lost()  # deliveries announced while unsubscribed: rescan
                delay = 0.1
                await asyncio.gather(*(self._read(pubsub) for pubsub, _ in subscribers))
            except (RedisError, OSError) as exc:
                log.warning("store notifications lost (%s); reconnecting", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                self.subscribed.clear()
                for pubsub, shard in subscribers:
                    await bounded(pubsub.aclose(), "pub/sub")
                    if shard is not None:
                        await bounded(shard.aclose(), "shard")

    async def _read(self, pubsub: Any) -> None:
        while not self._closing:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None and message["type"] == "smessage":
                self._notice(message["data"])

    def _notice(self, data: bytes) -> None:
        """`digest/route`, then for a completion `\\n fingerprint \\n response`; or a
        delivery notice, starting with `!`."""
        if data[:1] == b"!":
            self._delivery_notice(data)
            return
        member, _, notice = data.partition(b"\n")
        digest = member.split(b"/", 1)[0].decode()
        if not self.notifier.watching(digest):
            return  # every process hears every bucket; most notices are for others
        completed = None
        if notice:
            fingerprint, _, blob = notice.partition(b"\n")
            response, _ = self.read_response(digest, blob)
            if response is not None:  # unreadable: the waiter reads the record instead
                completed = (fingerprint.decode(), response)
        self.notifier.notify(digest, completed)


async def bounded(closing: Awaitable[Any], what: str) -> None:
    try:
        async with asyncio.timeout(1):
            await closing
    except (TimeoutError, RedisError, OSError) as exc:
        log.warning("closing the redis %s did not finish cleanly: %r", what, exc)
