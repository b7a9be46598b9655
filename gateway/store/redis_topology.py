"""Connecting to the configured Redis: one server, a master Sentinel watches, or a Cluster.

The redis-py client for each topology (pool, timeouts, the one retry, TLS, auth), the
endpoint the store's own pipelined connection dials (resp.py), and how to name the
server in messages without its password.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from gateway.config import StoreConfig, TLSConfig
from gateway.store.resp import Endpoint, RespConnectionError


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
        ssl = {"ssl": True} if config.tls is not None else {}
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(config.sentinel_nodes),
            sentinel_kwargs={
                "socket_timeout": config.socket_timeout,
                "socket_connect_timeout": config.connect_timeout,
                **sentinel_auth,
            },
            **common,
            **ssl,
        )
        # The pool asks the sentinels for the master on every new connection, so a
        # failover is followed without a restart.
        master = sentinel.master_for(config.sentinel_master, max_connections=config.pool_size)
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


class _QueueingCluster(RedisCluster):
    """A cluster client whose commands wait for a connection, as the single-Redis pool's
    do: redis-py's raises MaxConnectionsError once a node's `max_connections` are busy,
    which a burst of requests turns into 503s. At most `max_connections` commands run
    at once per process, so no node's pool is ever exhausted."""

    def __init__(self, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(max_connections=max_connections, **kwargs)
        self._slots = asyncio.Semaphore(max_connections)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._slots:
            with _closed_under_it():
                return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused by redis-py
        return _Pipeline(self, transaction)  # type: ignore[abstract]  # as redis-py does


class _Pipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        with _closed_under_it():
            return await super().execute(raise_on_error, allow_redirections)


@contextlib.contextmanager
def _closed_under_it() -> Iterator[None]:
    """redis-py 8.1's cluster client closes connections that other commands and
    pipelines are still using (after a timeout or a ClusterDownError, and in aclose());
    those then fail inside the driver on a writer or reader that is gone, with
    AttributeError. Their outcome is a lost connection's: a store error (503, or
    fail-open per route), not a 500 with a traceback (test_store_info.py)."""
    try:
        yield
    except AttributeError as exc:
        raise RedisConnectionError(f"connection closed under the command: {exc}") from exc


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
