"""The Redis store's Lua scripts as they go over the wire: their sources, and each
call's EVALSHA, packed from a template per (script, route, bucket).

Every call is `EVALSHA <sha> 10 <keys> <member> <channel> <args...>` (the keys and the
two leading ARGV: RedisStore._layout). Of its 15 leading arguments only the record's
digest varies within a bucket and route: it is in the record's key, the request's key
and the member `digest/route`; the bucket's indexes and channel, the route's queue
indexes and the script's sha are the same for every call. So they are RESP-encoded
once, into a CommandTemplate; a call joins its pieces with the digest and packs only
its own arguments. On the two-round-trip first request this was most of the store's
Python work per call (docs/performance.md, session 9).

The bytes are those hiredis (and redis-py's own packer) give the whole command
(test_resp.py, over random arguments, for every script). The sha is redis-py's
(`AsyncScript.sha`, the SHA-1 of the source); a reload after NOSCRIPT takes the sha
Redis answers, as redis-py's own fallback does, and a sha that changed drops the
script's templates, so none keeps sending a digest Redis does not know.

Cluster and `wait_for_replicas` calls go through redis-py (its slot routing, WAIT on
a pooled connection), which packs them itself: no template is used there.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from redis.commands.core import AsyncScript

from gateway.store.resp import CommandTemplate, pack_command

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
    "retry",
)

#: Stands for the digest while a template is built. No configured prefix or route
#: holds a NUL; a route read back from Redis that does is packed without a template.
_MARKER = "\x00digest\x00"
#: Templates kept; past it they are built again (routes read back from Redis, such as
#: a removed route's, could otherwise add one per name for ever).
_TEMPLATE_MEMORY = 4096

Layout = Callable[[int, str, str], tuple[list[str], list[str]]]


def script_source(name: str) -> str:
    lua = resources.files("gateway.store") / "lua"
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
