"""The Redis store's Lua scripts as they go over the wire: their sources, and each
call's EVALSHA, packed from a template per (script, route, bucket).

Every record script's call is `EVALSHA <sha> <n> <keys> <member> <channel> <args...>`
(the keys and the two leading ARGV: RedisStore._layout; n is 12 on one server, 11 on a
Cluster, which keeps the route's admission marks apart). Of its leading arguments only
the record's digest varies within a bucket and route: it is in the record's key, the
request's key and the member `digest/route`; the bucket's indexes, counts and
channel, the route's indexes and admission marks and the script's sha are the same for
every call. So they are RESP-encoded
once, into a CommandTemplate; a call joins its pieces with the digest and packs only
its own arguments. On the two-round-trip first request this was most of the store's
Python work per call (docs/performance.md, "Redis round trips and work per request").

The bytes are those hiredis (and redis-py's own packer) give the whole command
(test_resp.py, over random arguments, for every script). The sha is redis-py's
(`AsyncScript.sha`, the SHA-1 of the source); a reload after NOSCRIPT takes the sha
Redis answers, as redis-py's own fallback does, and a sha that changed drops the
script's templates, so none keeps sending a digest Redis does not know.

Cluster and `wait_for_replicas` calls go through redis-py (its slot routing, WAIT on
a pooled connection), which packs them itself: no template is used there. On a cluster
the scripts run through SharedLoads: after NOSCRIPT one SCRIPT LOAD per script is in
flight at a time, which every caller that met NOSCRIPT waits for (a script followed by
WAIT, which goes to its slot's owner on one connection, loads through it too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from gateway.store.redis.resp import CommandTemplate, pack_command

SCRIPTS = (
    "claim",
    "complete",
    "release",
    "unresolved",
    "expire",
    "check_begin",
    "check_end",
    "park",
    "op_claim",
    "op_resolve",
    "accept",
    "pick",
    "put_back",
    "retry",
    "list",
    "recount",
    "admission",
    "import",
)
#: Scripts that read no record: sent as they are, without the helpers of _lib.lua.
STANDALONE = frozenset({"list", "recount", "admission"})

#: Stands for the digest while a template is built. No configured prefix or route
#: holds a NUL; a route read back from Redis that does is packed without a template.
_MARKER = "\x00digest\x00"
#: Templates kept; past it they are built again (routes read back from Redis, such as
#: a removed route's, could otherwise add one per name for ever).
_TEMPLATE_MEMORY = 4096

Layout = Callable[[int, str, str], tuple[list[str], list[str]]]


def script_source(name: str) -> str:
    lua = resources.files("gateway.store.redis") / "lua"
    if name in STANDALONE:
        return (lua / f"{name}.lua").read_text()
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class ScriptCommands:
    """The EVALSHA bytes of each script call, over the store's own connection."""

    def __init__(self, scripts: dict[str, AsyncScript], layout: Layout, prefix: str) -> None:
        self._scripts = scripts
        #: (bucket, digest, route) -> (KEYS, the two leading ARGV): the store's layout
        self._layout = layout
        self._templated = _MARKER not in prefix
        self._templates: dict[tuple[str, str, int], CommandTemplate] = {}

    def command(
        self, name: str, bucket: int, digest: str, route: str, args: tuple[Any, ...]
    ) -> bytes:
        hole = digest.encode()
        slot = (name, route, bucket)  # each has its own keys: none may share a template
        template = self._templates.get(slot)
        if template is None or template.hole_size != len(hole) or template.arity != len(args):
            if not self._templated or _MARKER in route:
                keys, head = self._layout(bucket, digest, route)
                sha = self._scripts[name].sha
                return pack_command(("EVALSHA", sha, len(keys), *keys, *head, *args))
            keys, head = self._layout(bucket, _MARKER, route)
            leading: tuple[str | int, ...] = (
                "EVALSHA",
                self._scripts[name].sha,
                len(keys),
                *keys,
                *head,
            )
            template = CommandTemplate(leading, _MARKER, len(hole), len(args))
            if len(self._templates) >= _TEMPLATE_MEMORY:
                self._templates.clear()
            self._templates[slot] = template
        return template.pack(hole, args)

    def loaded(self, name: str, sha: str) -> None:
        """Redis loaded script `name` as `sha`: its calls are packed with `sha` from
        now on (a sha other than the one they were sent with drops their templates)."""
        script = self._scripts[name]
        if script.sha != sha:
            script.sha = sha
            for key in [key for key in self._templates if key[0] == name]:
                del self._templates[key]


class SharedLoads:
    """Scripts run on a Redis Cluster, loaded once per NOSCRIPT, not once per caller.

    redis-py's AsyncScript answers NOSCRIPT by loading the script itself, in every
    caller that met it; on a cluster each SCRIPT LOAD goes to every primary. The first
    burst after a start or a flush (1,000 accepts of a storm) became thousands of
    loads at once: they timed out, and redis-py's cluster client then closed
    connections that other commands were still using, which failed inside the driver
    (AttributeError) and reached a caller as a 500 (seen in CI on
    test_storm_two_replicas_twenty_deliveries[cluster]). Here the first caller's load
    is shared: the others wait for it, then run the script again."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._loading: dict[str, asyncio.Future[Any]] = {}

    async def run(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(script)
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)

    async def load(self, script: AsyncScript) -> None:
        """Load `script` on every primary, or wait for the load another caller began."""
        loading = self._loading.get(script.sha)
        if loading is None:
            loading = asyncio.ensure_future(self._client.script_load(script.script))
            self._loading[script.sha] = loading
            loading.add_done_callback(lambda done, sha=script.sha: self._done(sha, done))
        # Shielded: a caller cancelled while it waits does not cancel the others' load.
        await asyncio.shield(loading)

    def _done(self, sha: str, done: asyncio.Future[Any]) -> None:
        self._loading.pop(sha, None)  # a later NOSCRIPT (a flushed node) loads again
        if not done.cancelled():
            done.exception()  # retrieved here too: every waiter may have gone
