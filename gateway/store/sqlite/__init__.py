"""The SQLite store: records in one file on this host (store.py)."""

from gateway.store.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
