"""The PostgreSQL store's rows of gateway_records as the request path and the
deliveries both take them: read one, claim-or-read one (gateway_take: a claim or an
accept), and turn one whose lease ran out into what the route's policy says."""

from __future__ import annotations

from typing import Any

from gateway.errors import StoreError
from gateway.records import KeyRef, Record
from gateway.store.base import ExpiredPolicy, Opener
from gateway.store.postgres.database import Database, decode_record


class RecordRows:
    def __init__(self, db: Database, opener: Opener) -> None:
        self.db = db
        self.opener = opener
        #: Per route: whether its last claim took a new key (gateway_take then inserts
        #: first).
        self.fresh: dict[str, bool] = {}

    async def get(self, ref: KeyRef) -> Record | None:
        row = await self.db.fetchrow("get", ref.digest)
        return None if row is None else decode_record(self.opener, ref.digest, row["now"], row)

    async def take(self, name: str, ref: KeyRef, *args: Any) -> Any:
        """Run claim.sql or accept.sql: their row, or None (accept: free, not admitted)."""
        # gateway_take reads again itself when a concurrent claim beat it, so only an
        # accept with nothing admitted comes back empty. Its order (insert or read
        # first) is a guess from the route's last claim: both decide alike.
        row = await self.db.batched(name, ref.digest, *args, self.fresh.get(ref.route, True))
        if row is None and name == "claim":
            raise StoreError("postgresql claim failed: no record and no claim")
        if row is not None:
            self.fresh[ref.route] = row["outcome"] == 1
        return row

    async def expired(self, ref: KeyRef, record: Record, policy: ExpiredPolicy) -> Record:
        """What an in-flight record whose lease ran out is after the route's policy."""
        row = await self.db.fetchrow("expire", ref.digest, policy)
        if row is not None:
            return decode_record(self.opener, ref.digest, row["now"], row)
        return await self.get(ref) or record  # moved by someone else meanwhile
