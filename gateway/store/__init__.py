"""Stores of idempotency records: memory, or Redis (single, Sentinel, Cluster)."""

from __future__ import annotations

from gateway.config import StoreConfig
from gateway.store.base import Store, codec_for


def open_store(config: StoreConfig) -> Store:
    """A store for the configured topology; nothing connects until `start()`."""
    if config.kind == "memory":
        from gateway.store.memory import MemoryStore

        return MemoryStore(codec_for(config))
    # Imported only when used: the demo and memory:// deployments need no Redis.
    from gateway.store.redis import RedisStore

    return RedisStore(config)


__all__ = ["Store", "codec_for", "open_store"]
