"""Connecting to the configured Redis: one server, a master Sentinel watches, or a Cluster.

The redis-py client for each topology (pool, timeouts, the one retry, TLS, auth), the
endpoint the store's own pipelined connection dials (resp.py), and how to name the
server in messages without its password. On a Cluster, `on_slot_owner` sends commands
that must share a connection (a script, then WAIT for its write) to the primary that
owns a key's slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, PipelineCommand, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.config import StoreConfig, TLSConfig
from gateway.store.redis.resp import Endpoint, RespConnectionError
from gateway.store.redis.scripts import SharedLoads


def client_for(config: StoreConfig) -> tuple[Any, dict[str, Any]]:
    """A redis-py asyncio client for the configured topology, and the connection
    settings it was made with (for the per-shard subscribers of a cluster)."""
    common: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        # One retry on a timeout or a dropped connection: every script is safe to
        # run twice, and socket_timeout bounds each try, so a hung Redis costs a
        # request at most about 2 x socket_timeout.
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    if config.username:
        common["username"] = config.username
    if config.password:
        common["password"] = config.password
    if config.tls is not None:
        tls = config.tls
        common.update(
            ssl_cert_reqs="required" if tls.verify else "none",
            ssl_check_hostname=tls.verify,
        )
        if tls.ca_file:
            common["ssl_ca_certs"] = tls.ca_file
        if tls.cert_file:
            common.update(ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file)
    if config.kind == "sentinel":
        sentinel_auth = {"password": config.sentinel_password} if config.sentinel_password else {}
        connection: dict[str, Any] = {**common, "ssl": True} if config.tls is not None else common
        # redis-py before 8 leaves Sentinel's __init__ untyped.
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            list(config.sentinel_nodes),
            sentinel_kwargs={
                "socket_timeout": config.socket_timeout,
                "socket_connect_timeout": config.connect_timeout,
                **sentinel_auth,
            },
            **connection,
        )
        # The pool asks the sentinels for the master on every new connection, so a
        # failover is followed without a restart.
        master = sentinel.master_for(
            config.sentinel_master,
            connection_pool_class=_QueueingSentinelPool,
            max_connections=config.pool_size,
            timeout=config.socket_timeout * 2,
        )
        return master, common
    if config.kind == "cluster":
        cluster = _QueueingCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in config.cluster_nodes],
            max_connections=config.pool_size,
            ssl=config.tls is not None,
            **common,
        )
        return cluster, {**common, "ssl": config.tls is not None}
    # A bounded pool that queues for a free connection instead of failing, so a
    # burst of requests cannot open a connection each.
    pool = aioredis.BlockingConnectionPool.from_url(
        config.url,
        max_connections=config.pool_size,
        timeout=config.socket_timeout * 2,
        health_check_interval=30,
        **common,
    )
    return aioredis.Redis.from_pool(pool), common  # owns the pool: aclose() closes it


class _QueueingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A Sentinel master's pool whose callers wait for a free connection, as the
    single-Redis pool's do: redis-py's raises MaxConnectionsError once `max_connections`
    are busy, which a burst of requests (or a listing's 64 bucket reads) turns into
    503s. It still asks the sentinels for the master on every new connection."""


#: What a lost connection or a read that timed out raise.
_LOST = (RedisConnectionError, RedisTimeoutError)


#: Whether this task holds one of the cluster client's turns already: a pipeline's
#: redirected commands go again one by one inside its turn, on no extra connection.
_HOLDING: ContextVar[bool] = ContextVar("holding_a_cluster_turn", default=False)


class _QueueingCluster(RedisCluster):
    """A cluster client whose commands and pipelines wait for a connection, as the
    single-Redis pool's do, up to twice the socket timeout: redis-py's raises
    MaxConnectionsError once a node's `max_connections` are busy, which a burst of
    requests turns into 503s. At most `max_connections` commands or pipelines run at
    once per process (a pipeline takes at most one connection per node), so no node's
    pool is ever exhausted."""

    def __init__(self, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(max_connections=max_connections, **kwargs)
        self._slots = asyncio.Semaphore(max_connections)
        self._max_connections = max_connections
        self._queue_timeout = 2 * (kwargs.get("socket_timeout") or 1.0)

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """One of the `max_connections` turns, waited for up to the queue's timeout."""
        if _HOLDING.get():
            yield
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), self._queue_timeout)
        except TimeoutError:
            raise RedisConnectionError(
                f"no cluster connection free within {self._queue_timeout:g}s "
                f"(store.max_connections: {self._max_connections})"
            ) from None
        holding = _HOLDING.set(True)
        try:
            yield
        finally:
            _HOLDING.reset(holding)
            self._slots.release()

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        with _closed_under_it():
            return await super().initialize(*args, **kwargs)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.turn():
            with _closed_under_it():
                return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused by redis-py
        return _Pipeline(self, transaction)  # type: ignore[abstract]  # as redis-py does

    async def on_slot_owner(self, key: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`commands` in one write on one connection to the primary that owns `key`'s
        slot, and each one's reply (an error reply as its exception), in order.

        For a WAIT that must follow a script on the connection that ran it: WAIT
        counts the replicas holding that connection's writes. redis-py's cluster
        pipeline cannot carry it: it refuses EVALSHA, sends a keyless WAIT where its
        command table says (not where the script ran), and retries a redirected
        command alone, on another connection. Here a moved slot, a lost connection or
        a timeout sends every command again, once, to the slot's owner then (the
        commands must be safe to run twice, as the store's scripts are)."""
        async with self.turn():
            with _closed_under_it():
                await self.initialize()  # nothing to do unless the client is (re)starting
                moved: MovedError | None = None
                try:
                    replies = await self._send_to_owner(key, commands)
                    if isinstance(replies[0], MovedError):
                        moved = replies[0]
                    elif not any(isinstance(r, _LOST) for r in replies):
                        return replies
                except _LOST:
                    pass
                if moved is not None:
                    await self.nodes_manager.move_slot(moved)
                else:
                    await self.nodes_manager.initialize()
                return await self._send_to_owner(key, commands)

    async def _send_to_owner(self, key: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        node = self.nodes_manager.get_node_from_slot(self.keyslot(key))
        calls = [PipelineCommand(i, *command) for i, command in enumerate(commands)]
        await node.execute_pipeline(calls)
        return [call.result for call in calls]


class _Pipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        client = cast(_QueueingCluster, self.cluster_client)
        async with client.turn():
            with _closed_under_it():
                return await super().execute(raise_on_error, allow_redirections)


@contextlib.contextmanager
def _closed_under_it() -> Iterator[None]:
    """redis-py 8.1's cluster client closes connections that other commands and
    pipelines are still using (after a timeout or a ClusterDownError, and in aclose());
    those then fail inside the driver on a writer or reader that is gone, with
    AttributeError (on asyncio's loop) or RuntimeError (on uvloop's, the gateway's: "the
    handler is closed"). And while no node answers, or during a failover before a replica
    is promoted, its topology refresh raises RedisClusterException ("cannot be
    connected", "all slots are not covered", SlotNotCoveredError), which is no
    RedisError. Their outcome is a lost connection's: a store error (503, or fail-open
    per route; a delivery worker's pick tried again), not a 500 with a traceback or a
    background loop ended by an exception it does not expect (test_store_info.py)."""
    try:
        yield
    except (AttributeError, RuntimeError) as exc:
        raise RedisConnectionError(f"connection closed under the command: {exc}") from exc
    except RedisClusterException as exc:
        raise RedisConnectionError(f"cluster unreachable: {exc}") from exc


async def script_then_wait(
    client: Any,
    script: AsyncScript,
    keys: list[str],
    args: list[Any],
    wait: tuple[int, int],
    loads: SharedLoads | None,
) -> tuple[Any, int]:
    """Run `script`, then `WAIT replicas timeout_ms` (`wait`) on the connection that ran
    it, on the server that holds `keys` (on a Cluster: their slot's primary, with
    `loads` loading the script after NOSCRIPT). The script's reply and WAIT's count;
    a failure raises redis-py's RedisError."""
    if not isinstance(client, _QueueingCluster):
        async with client.pipeline(transaction=False) as pipe:
            await script(keys=keys, args=args, client=pipe)
            pipe.wait(*wait)
            reply, acked = await pipe.execute()
        return reply, int(acked)
    commands = [("EVALSHA", script.sha, len(keys), *keys, *args), ("WAIT", *wait)]
    reply, acked = await client.on_slot_owner(keys[0], commands)
    if isinstance(reply, NoScriptError) and loads is not None:
        await loads.load(script)
        reply, acked = await client.on_slot_owner(keys[0], commands)
    for answer in (reply, acked):
        if isinstance(answer, Exception):
            raise answer
    return reply, int(acked)


def _ssl_context(tls: TLSConfig | None) -> ssl.SSLContext:
    ca_file = tls.ca_file if tls is not None and tls.ca_file else None
    context = ssl.create_default_context(cafile=ca_file)
    if tls is not None:
        if not tls.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if tls.cert_file:
            context.load_cert_chain(tls.cert_file, tls.key_file or None)
    return context


def script_endpoint(config: StoreConfig, client: Any) -> Callable[[], Awaitable[Endpoint]]:
    """Where the scripts' connection goes: the URL's server, or the master the
    sentinels name at the time of each connect."""
    if config.kind == "sentinel":
        tls = _ssl_context(config.tls) if config.tls is not None else None

        async def master() -> Endpoint:
            try:
                host, port = await client.connection_pool.get_master_address()
            except RedisError as exc:
                raise RespConnectionError(f"no master from the sentinels: {exc}") from None
            return Endpoint(
                host=host,
                port=int(port),
                ssl=tls,
                username=config.username,
                password=config.password,
            )

        return master
    url = parse_url(config.url)
    secure = url.get("connection_class") is SSLConnection or config.tls is not None
    endpoint = Endpoint(
        host=url.get("host", ""),
        port=int(url.get("port") or 6379),
        path=url.get("path", ""),
        ssl=_ssl_context(config.tls) if secure else None,
        username=url.get("username") or config.username,
        password=url.get("password") or config.password,
        db=int(url.get("db") or 0),
    )

    async def fixed() -> Endpoint:
        return endpoint

    return fixed


def describe(config: StoreConfig) -> str:
    """The server, for messages: never the URL, which may hold a password."""
    if config.kind == "sentinel":
        return f"sentinel master {config.sentinel_master}"
    if config.kind == "cluster":
        return "cluster"
    url = parse_url(config.url)
    if url.get("path"):
        return str(url["path"])
    return f"{url.get('host', '')}:{url.get('port') or 6379}"
