"""The Redis store's route pauses (store/route_pauses.py's contract).

    idem:{pauses}:routes   hash: route -> the row as JSON

One key under the `{pauses}` hash tag, changed by one script (lua/pause.lua, run
alone: it is not a record's script), so a move is atomic on one server, on a Cluster
(the node that owns the slot) and on Sentinel (the master). The key never expires: a
Redis that loses it forgets its pauses, and the routes deliver (and pause again if
their upstreams still refuse). A part RedisStore (store.py) holds.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.store.redis.record import text
from gateway.store.route_pauses import PauseMove, PauseState, RoutePauses, Verdict

#: The store's TIME and rows (ARGV: the routes; none: all), as TIME's two parts then
#: route, row, ...: read alone on the node that owns the key.
_READ = """
local t = redis.call('TIME')
local out = {t[1], t[2]}
if #ARGV == 0 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all do out[#out + 1] = all[i] end
else
  for i = 1, #ARGV do
    local row = redis.call('HGET', KEYS[1], ARGV[i])
    if row then
      out[#out + 1] = ARGV[i]
      out[#out + 1] = row
    end
  end
end
return out
"""


def pause_source() -> str:
    return (resources.files("gateway.store.redis") / "lua" / "pause.lua").read_text()


def _state(route: str, row: Any, now: int) -> PauseState:
    held = json.loads(text(row))
    return PauseState(
        route,
        int(held["failures"]),
        int(held["since_ms"]),
        str(held["by"]),
        str(held["why"]),
        int(held["probe_ms"]),
        int(held["changed_ms"]),
        now,
    )


class RedisPauses(RoutePauses):
    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.key = f"{prefix}{{pauses}}:routes"

    async def _read(self, routes: list[str]) -> tuple[int, list[Any]]:
        """The store's now and the rows of `routes` (every route when empty) as
        route, row, ..., read together on the node that holds them."""
        script = self.client.register_script(_READ)
        try:
            reply = await script(keys=[self.key], args=routes)
        except RedisError as exc:
            raise StoreError.because("redis route pause read failed", exc) from exc
        return int(text(reply[0])) * 1000 + int(text(reply[1])) // 1000, reply[2:]

    async def route_pause(self, route: str) -> PauseState:
        now, flat = await self._read([route])
        return PauseState(route, now_ms=now) if not flat else _state(route, flat[1], now)

    async def route_pauses(self) -> dict[str, PauseState]:
        now, flat = await self._read([])
        return {
            text(name): _state(text(name), row, now)
            for name, row in zip(flat[::2], flat[1::2], strict=True)
        }

    async def change_pause(self, route: str, move: PauseMove) -> tuple[PauseState, Verdict]:
        script = self.client.register_script(pause_source())
        args = [
            route,
            move.move,
            move.by,
            move.why,
            move.pause_after,
            move.probe_every_ms,
        ]
        try:
            row, verdict, now = await script(keys=[self.key], args=args)
        except RedisError as exc:
            raise StoreError.because("redis route pause failed", exc) from exc
        answer: Verdict = (
            "probe"
            if text(verdict) == "probe"
            else ("open" if text(verdict) == "open" else "closed")
        )
        return _state(route, row, int(text(now))), answer
