"""The Redis store (a single server, Sentinel or Cluster).

store.py is the `Store` itself; the record's fields (record.py) and the Lua scripts that
change it (lua/, loaded by scripts.py); how it connects (topology.py, and resp.py, the
pipelined connection of the hot path); the queue bound a Cluster shares (admission.py);
the operator surfaces' pages and counts (listing.py); change and due notices over
pub/sub (notices.py); the operator roster (roster.py); what INFO says about
persistence and eviction (info.py).
"""

from gateway.store.redis.listing import BUCKETS
from gateway.store.redis.store import RedisStore

__all__ = ["BUCKETS", "RedisStore"]
