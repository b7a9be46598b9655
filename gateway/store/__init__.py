"""Stores of idempotency records: memory, Redis (single, Sentinel, Cluster), PostgreSQL
or SQLite.

base.py is the interface every store implements (its docstrings are the contract) and
what each store shares: pages.py (a listing's order, cursor and page), notices.py
(waking waiters and delivery workers), operator_roster.py (the roster's contract).
memory.py is the in-process store, whole; redis/, postgres/ and sqlite/ are a store
each, its `store.py` holding the parts it hands what they need (see each package's
docstring). Nothing here imports a store but `open_store`, and only the one configured."""

from __future__ import annotations

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.store.base import Store, codec_for


def open_store(config: StoreConfig, config_path: str = "FILE") -> Store:
    """A store for the configured topology; nothing connects until `start()`.
    `config_path` is named in the message of a database that needs `store migrate`."""
    if config.kind == "memory":
        from gateway.store.memory import MemoryStore

        return MemoryStore(codec_for(config))
    if config.kind == "postgres":
        # Imported only when used, and an extra: a Redis user never needs the driver.
        try:
            from gateway.store.postgres import PostgresStore
        except ImportError as exc:
            raise StoreError(
                f"a PostgreSQL store needs its driver ({exc.name} is missing): "
                "pip install 'idempotency-gateway[postgres]'"
            ) from None
        return PostgresStore(config, config_path)
    if config.kind == "sqlite":
        from gateway.store.sqlite import SqliteStore

        return SqliteStore(config)
    # Imported only when used: the demo and memory:// deployments need no Redis.
    from gateway.store.redis import RedisStore

    return RedisStore(config)


__all__ = ["Store", "codec_for", "open_store"]
