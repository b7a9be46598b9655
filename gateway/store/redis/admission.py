"""An async route's bound (`delivery.max_queued`) on Redis: the route's admission marks.

The marks are a zset per route, `{prefix}{q:<route>}:admitted`, of the digests of its
queued and retrying deliveries by when each was marked; a new key is admitted only
while fewer than the bound are marked (or its own digest is: a retried accept). One
set per route, whose size is the route's count across every bucket, every replica and
every process.

On one server (and Sentinel) the record scripts keep the marks in the same step as
the record (lua/_lib.lua's move(), accept.lua): a mark exists exactly while its
delivery waits, and the accept decides on them atomically.

On a Cluster a script touches the keys of one slot only, and a route's deliveries
spread over 64 buckets (slots), so the marks live in the route's own slot and the
store keeps them with calls of their own (`ClusterAdmission`), in the order that errs
towards refusing:
- accept: `take` a mark first (refused when the bound is reached), then the accept
  script; a mark it took is dropped again unless the key turns out to wait: a repeat
  of a settled key, an accept that fails or is cancelled after `take` (a store error,
  the script refusing). Should the failed accept have stored its delivery after all
  (its reply lost), that delivery waits unmarked: one admission more, until the
  repair.
- a pick (the delivery stops waiting): the mark is dropped after the pick. A process
  that dies in between leaves the mark: one admission fewer, until the repair.
- a retry scheduled, a check's "not done", an operator's requeue (the delivery waits
  again): marked after the move. A process that dies in between leaves it unmarked:
  one admission more, until the repair.
So a crash can move the bound by one delivery per crash, either way, for at most one
repair interval. `repair_marks` (run by every replica's delivery worker about once a
minute, via Store.repair_counts) compares the marks with the buckets' counts and,
when they differ, marks the waiting deliveries that are not, and drops marks older
than a minute whose deliveries do not wait: a younger mark may be an accept under way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.store.redis.record import text

log = logging.getLogger("gateway.store")

#: Runs a script on keys of one slot: RedisStore._run_keys.
Runner = Callable[[str, list[str], list[Any]], Awaitable[Any]]

#: A mark younger than this is never dropped by a repair: an accept may be under way.
GRACE_MS = 60_000
#: Digests per repair call.
_CHUNK = 500


def admission_key(prefix: str, route: str) -> str:
    """The route's admission marks, under a hash tag of the route's own (route names
    are `[A-Za-z0-9][A-Za-z0-9_.-]*`: no brace ends the tag early)."""
    return f"{prefix}{{q:{route}}}:admitted"


class ClusterAdmission:
    """The admission marks on a Cluster, kept by calls beside the record scripts."""

    def __init__(self, prefix: str, run: Runner) -> None:
        self.prefix = prefix
        self._run = run

    async def take(self, route: str, digest: str, limit: int | None) -> str:
        """Mark `digest` for an accept: "new" (marked now), "held" (it was: a waiting
        delivery's, or a retried accept's), or "" (`limit` other digests are marked:
        full). Without a limit the mark is taken all the same: others count it."""
        key = admission_key(self.prefix, route)
        if limit is None:
            await self._run("admission", [key], ["mark", digest])
            return "new"
        taken = int(await self._run("admission", [key], ["take", digest, limit]))
        return {1: "new", 2: "held"}.get(taken, "")

    async def mark(self, route: str, digest: str) -> None:
        """The delivery waits again. A failure is logged: the repair marks it."""
        await self._quietly("mark", route, digest)

    async def drop(self, route: str, digest: str) -> None:
        """The delivery no longer waits. A failure is logged: the repair drops it."""
        await self._quietly("drop", route, digest)

    async def _quietly(self, op: str, route: str, digest: str) -> None:
        try:
            await self._run("admission", [admission_key(self.prefix, route)], [op, digest])
        except StoreError as exc:
            log.warning(
                "admission mark of a delivery of route %s not updated (%s): the count "
                "repair fixes it within a minute",
                route,
                exc,
            )


async def repair_marks(
    client: Any, run: Runner, prefix: str, route: str, waiting: int, tags: list[str]
) -> int:
    """Make the route's marks the digests of its waiting deliveries (`waiting` of them,
    by the buckets' counts), sparing marks younger than GRACE_MS; how many changed.
    Reads the marks' size only, unless it differs from `waiting`."""
    key = admission_key(prefix, route)
    try:
        if int(await client.zcard(key)) == waiting:
            return 0
        async with client.pipeline(transaction=False) as pipe:
            for tag in tags:
                pipe.zrange(f"{tag}i:queued:{route}", 0, -1)
                pipe.zrange(f"{tag}i:retrying:{route}", 0, -1)
            members = await pipe.execute()
        marked = {text(d) for d in await client.zrange(key, 0, -1)}
    except RedisError as exc:
        raise StoreError.because("redis admission read failed", exc) from exc
    now_waiting = {text(m).partition("/")[0] for found in members for m in found}
    changes = [f"+{d}" for d in sorted(now_waiting - marked)]
    changes += [f"-{d}" for d in sorted(marked - now_waiting)]
    mended = 0
    for i in range(0, len(changes), _CHUNK):
        mended += int(await run("admission", [key], ["repair", GRACE_MS, *changes[i : i + _CHUNK]]))
    return mended
