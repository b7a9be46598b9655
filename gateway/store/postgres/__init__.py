"""The PostgreSQL store.

store.py is the `Store` itself; database.py runs the statements of sql/ (each one round
trip, conditional on the state and the run id) and decodes rows into records;
batch.py groups concurrent claims and completions into one statement; pool.py holds
the connections; schema.py migrates and checks the schema (sql/NNN_*.sql); the
operator surfaces' pages and counts (listing.py); change and due notices over
LISTEN/NOTIFY (notices.py); the operator roster (roster.py).
"""

from gateway.store.postgres.store import REAP_LOCK, PostgresStore

__all__ = ["REAP_LOCK", "PostgresStore"]
