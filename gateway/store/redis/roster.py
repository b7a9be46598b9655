"""The Redis store's operator roster (store/operator_roster.py's contract).

    idem:{roster}:operators   hash: entry -> "<since_ms> <mark>"
    idem:{roster}:last        the last time given out (the next one is later)

Both keys share the `{roster}` hash tag, so the one script that changes them
(lua/roster.lua, run alone: it is not a record's script) runs unchanged on a Cluster,
on the node that owns that slot; on Sentinel, on the master. The keys never expire:
a Redis that loses them (a flush, an eviction) makes every entry new at the next
recording, which ends sessions and never revives one. A part RedisStore (store.py)
holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.store.operator_roster import OperatorRoster, RosterEntry
from gateway.store.redis.record import text


def roster_source() -> str:
    return (resources.files("gateway.store.redis") / "lua" / "roster.lua").read_text()


class RedisRoster(OperatorRoster):
    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def _roster_keys(self) -> list[str]:
        return [f"{self.prefix}{{roster}}:operators", f"{self.prefix}{{roster}}:last"]

    async def record_roster(self, marks: Mapping[str, str]) -> dict[str, RosterEntry]:
        script = self.client.register_script(roster_source())
        args = [part for entry in marks.items() for part in entry]
        try:
            reply = await script(keys=self._roster_keys(), args=args)
        except RedisError as exc:
            raise StoreError.because("redis roster failed", exc) from exc
        return _entries(reply)

    async def roster(self) -> dict[str, RosterEntry]:
        try:
            stored = await self.client.hgetall(self._roster_keys()[0])
        except RedisError as exc:
            raise StoreError.because("redis roster read failed", exc) from exc
        return _entries([part for pair in stored.items() for part in pair])


def _entries(flat: list[Any]) -> dict[str, RosterEntry]:
    entries = {}
    for name, held in zip(flat[::2], flat[1::2], strict=True):
        since, _, mark = text(held).partition(" ")
        entries[text(name)] = RosterEntry(mark, int(since))
    return entries
