"""What a Redis deployment says about keeping records, and what the gateway logs about it.

Its eviction policy and AOF, read with INFO from the server (or the master Sentinel
names, or every Cluster master, reporting the worst), and the warnings a policy that
may lose records gets. Whether /readyz refuses is StoreInfo.refusal's (store/base.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial, reduce
from typing import Any

from redis.exceptions import RedisError, ResponseError

from gateway.errors import StoreError
from gateway.records import StoreInfo

log = logging.getLogger("gateway.store")


async def read_info(client: Any, cluster: bool, source: str) -> StoreInfo:
    """The deployment's StoreInfo: the server's, or a cluster's worst master's."""
    try:
        if cluster:
            await client.initialize()
            masters = [
                await _server_info(partial(client.info, target_nodes=node), node.name)
                for node in client.get_primaries()
            ]
            if not masters:
                raise StoreError("redis INFO failed: the cluster names no master")
            found = reduce(StoreInfo.worse, masters)
        else:
            # Sentinel: the master, which the client connects to.
            found = await _server_info(client.info, source)
    except RedisError as exc:
        raise StoreError.because("redis INFO failed", exc) from exc
    return found


def report(info: StoreInfo, allow_eviction: bool) -> None:
    """Log what `info` means for the records: a refusal, eviction, no AOF."""
    refusal = info.refusal(allow_eviction)
    if refusal:
        said = f" Redis said: {info.error}" if info.error else ""
        log.error("%s. Until then /readyz answers 503.%s", refusal, said)
    elif info.error:
        log.warning("Redis did not say its maxmemory-policy: %s", info.error)
    where = f" at {info.source}" if info.source else ""
    if not refusal and info.evicts:
        log.warning(
            "Redis%s has maxmemory-policy %s: records may be evicted and their keys "
            "run again; allowed by store.allow_eviction",
            where,
            info.maxmemory_policy,
        )
    if info.aof == "no":
        log.warning(
            "Redis%s has appendonly no: a restart loses the records written since its "
            "last snapshot, and their keys run again. Run it with appendonly yes and "
            "appendfsync always (docs/reliability.md)",
            where,
        )


async def _server_info(info: Callable[[str], Awaitable[Any]], source: str) -> StoreInfo:
    """One server's eviction policy and AOF, from INFO (one section per call: Redis
    before 7 takes one)."""
    try:
        memory = await info("memory")
        persistence = await info("persistence")
    except ResponseError as exc:  # e.g. NOPERM: the ACL does not allow INFO
        return StoreInfo("unknown", "unknown", source=source, error=str(exc))
    policy = memory.get("maxmemory_policy")
    aof = persistence.get("aof_enabled")
    return StoreInfo(
        maxmemory_policy=_text(policy) if policy is not None else "unknown",
        aof="unknown" if aof is None else "yes" if int(aof) else "no",
        source=source,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
