"""Stores of idempotency records, chosen by the URL's scheme."""

from __future__ import annotations

from gateway.config import StoreConfig
from gateway.store.base import Store


def open_store(config: StoreConfig) -> Store:
    """A store for `config.url`; nothing connects until `start()`."""
    if config.url.startswith("memory://"):
        from gateway.store.memory import MemoryStore

        return MemoryStore()
    # Imported only when used: the demo and memory:// deployments need no Redis.
    from gateway.store.redis import RedisStore

    return RedisStore(
        config.url,
        prefix=config.prefix,
        socket_timeout=config.socket_timeout,
        connect_timeout=config.connect_timeout,
    )


__all__ = ["Store", "open_store"]
