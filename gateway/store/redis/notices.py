"""The Redis store's subscriber: one per process, for every bucket's sharded channels
(on a cluster, one connection per shard, for the channels it owns). What the scripts
publish: on a bucket's `c`, a changed record's member (with a completion's response
riding along, see _lib.lua's notify); on its `d`, delivery notices starting with `!`
(redis/delivery.py). The `d` channels are heard only while a worker listens
(`due.listening`): a process that delivers nothing would read, and Redis write to it,
a notice per accepted request that nobody in it wants.
A part RedisStore (store.py) holds and starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import RedisError

from gateway.store.base import Opener
from gateway.store.notices import DueFeed, Notifier

log = logging.getLogger("gateway.store")


def _listener_pool(client: Any) -> Any:
    """A pool of the subscriber's own, made like the client's (the same server, or
    the same Sentinel master, with the same settings) but outside its bound: the
    subscription holds its connection for good, and on a pool of `max_connections`
    it would leave the commands one fewer; at 1, none, and every request would wait
    for a connection that never comes back."""
    pool = client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
    kwargs["connection_class"] = pool.connection_class
    if isinstance(pool, SentinelConnectionPool):
        return SentinelConnectionPool(  # type: ignore[no-untyped-call]
            pool.service_name, pool.sentinel_manager, **kwargs
        )
    return aioredis.ConnectionPool(**kwargs)


class RedisNotices:
    def __init__(
        self,
        client: Any,
        connection_kwargs: dict[str, Any],
        opener: Opener,
        notifier: Notifier,
        due: DueFeed,
        *,
        cluster: bool,
        channels: list[str],
        due_channels: list[str],
        on_delivery: Callable[[bytes], None],
    ) -> None:
        self.client = client
        self._connection_kwargs = connection_kwargs
        self.opener = opener
        self.notifier = notifier
        self.due = due
        self.cluster = cluster
        self._channels = channels
        self._due_channels = due_channels
        #: a delivery notice (`!d`, `!t`), for the deliveries
        self._delivery_notice = on_delivery
        self._closing = False
        #: whether the subscription up now has the `d` channels (None: none is up)
        self._hearing_due: bool | None = None
        self._subscribers: list[Any] = []
        self._pokes: set[asyncio.Task[Any]] = set()
        #: Set while the notification subscribers are up (tests wait on it).
        self.subscribed = asyncio.Event()

    def close(self) -> None:
        """Stop resubscribing and cancel pending pokes: the listening task is its
        owner's to cancel."""
        self._closing = True
        for poke in list(self._pokes):
            poke.cancel()

    async def listen(self) -> None:
        """One subscriber per process for every bucket's channel (on a cluster, one
        per shard, for the channels it owns); waiters are woken locally. After a
        reconnect, all waiters are woken: they re-read. When a worker starts or stops
        listening for delivery notices, it subscribes again with or without them."""
        delay = 0.1
        while not self._closing:
            subscribers: list[tuple[Any, Any]] = []  # (pub/sub, its own client)
            due = self.due.listening
            channels = [*self._channels, *self._due_channels] if due else self._channels
            try:
                if self.cluster:
                    await self.client.initialize()
                    owners: dict[str, tuple[str, int, list[str]]] = {}
                    for channel in channels:
                        node = self.client.get_node_from_key(channel)
                        owners.setdefault(node.name, (node.host, node.port, []))[2].append(channel)
                    for host, port, channels in owners.values():
                        shard = aioredis.Redis(host=host, port=port, **self._connection_kwargs)
                        pubsub = shard.pubsub()
                        subscribers.append((pubsub, shard))
                        for channel in channels:  # one SSUBSCRIBE may name one slot only
                            await pubsub.ssubscribe(channel)
                else:
                    listener = aioredis.Redis.from_pool(_listener_pool(self.client))
                    pubsub = listener.pubsub()
                    subscribers.append((pubsub, listener))
                    await pubsub.ssubscribe(*channels)
                self._hearing_due = due
                self._subscribers = [pubsub for pubsub, _ in subscribers]
                if due == self.due.listening:  # else a subscription of the right kind follows
                    self.subscribed.set()
                self.notifier.notify_all()
                self.due.lost()  # deliveries announced while unsubscribed: rescan
                delay = 0.1
                await asyncio.gather(*(self._read(pubsub, due) for pubsub, _ in subscribers))
            except (RedisError, OSError) as exc:
                log.warning("store notifications lost (%s); reconnecting", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                self.subscribed.clear()
                self._hearing_due, self._subscribers = None, []
                for pubsub, shard in subscribers:
                    await bounded(pubsub.aclose(), "pub/sub")
                    await bounded(shard.aclose(), "subscriber")

    async def _read(self, pubsub: Any, due: bool) -> None:
        while not self._closing and due == self.due.listening:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None and message["type"] == "smessage":
                self._notice(message["data"])

    def due_changed(self) -> None:
        """`due.listening` changed: subscribe again, with or without the `d` channels.
        A PING wakes each reader now instead of at its next 1 s timeout."""
        if self._hearing_due is None or self._hearing_due == self.due.listening:
            return  # nothing up yet (it will subscribe as wanted), or already as wanted
        self.subscribed.clear()  # until the new subscription is up
        for pubsub in self._subscribers:
            poke = asyncio.create_task(self._poke(pubsub))
            self._pokes.add(poke)
            poke.add_done_callback(self._pokes.discard)

    async def _poke(self, pubsub: Any) -> None:
        # Only one still up: a PING on a closed pub/sub would open a new connection.
        if pubsub in self._subscribers and pubsub.connection is not None:
            with contextlib.suppress(RedisError, OSError):  # a broken one reconnects anyway
                await pubsub.ping()

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
            response, _ = self.opener.read_response(digest, blob)
            if response is not None:  # unreadable: the waiter reads the record instead
                completed = (fingerprint.decode(), response)
        self.notifier.notify(digest, completed)


async def bounded(closing: Awaitable[Any], what: str) -> None:
    try:
        async with asyncio.timeout(1):
            await closing
    except (TimeoutError, RedisError, OSError) as exc:
        log.warning("closing the redis %s did not finish cleanly: %r", what, exc)
