"""Copying the Redis store's records out and in (Store.export_records, import_records,
holds_keys): a walk of the keyspace, for a store no gateway writes to.

Completed and released records are in no index (Redis expires them), so the walk is a
SCAN of the record names (`{prefix}{b}:` and 32 hex digits: no index, count or request
matches), on each master of a Cluster in turn; the cursor says which master and where
on it. A record moved during a SCAN may come twice: an import skips a digest it holds.
Each record is read with its expiry and its stored request; an import writes it with
import.lua, which files and counts it as the other scripts would have.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.records import KeyRef, State
from gateway.store.base import Opener
from gateway.store.pages import place_of
from gateway.store.redis.admission import ClusterAdmission
from gateway.store.redis.record import decode_record, server_now_ms
from gateway.store.transfer import ExportedRecord, ExportPage

#: SCAN rounds one page makes at most while they find no record (a keyspace mostly
#: of other names): a page may be empty with its `next` set.
_ROUNDS = 8

Runner = Callable[..., Awaitable[Any]]


def record_pattern(prefix: str) -> str:
    """The SCAN MATCH pattern of every record name under `prefix` (its glob characters
    escaped)."""
    escaped = re.sub(r"([*?\[\]\\])", r"\\\1", prefix)
    return escaped + "{[0-9a-f][0-9a-f]}:" + "[0-9a-f]" * 32


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class RedisTransfer:
    def __init__(
        self,
        client: Any,
        opener: Opener,
        prefix: str,
        *,
        cluster: bool,
        run: Runner,
        admission: ClusterAdmission | None,
    ) -> None:
        self.client = client
        self.opener = opener
        self.prefix = prefix
        self.cluster = cluster
        self.run = run
        self.admission = admission
        self.pattern = record_pattern(prefix)

    def _nodes(self) -> list[Any]:
        if not self.cluster:
            return [None]
        return sorted(self.client.get_primaries(), key=lambda node: node.name)

    async def _scan(self, node: Any, cursor: int, count: int) -> tuple[int, list[bytes]]:
        args = ("SCAN", cursor, "MATCH", self.pattern, "COUNT", count)
        try:
            if node is None:
                found = await self.client.execute_command(*args)
            else:
                found = await self.client.execute_command(*args, target_nodes=node)
        except RedisError as exc:
            raise StoreError.because("redis export failed", exc) from exc
        cursor_found, names = found
        if isinstance(cursor_found, dict):  # a Cluster's: each node's cursor, by name
            cursor_found = next(iter(cursor_found.values()))
        return int(cursor_found), list(names)

    async def scan_page(self, cursor: str, limit: int) -> tuple[list[bytes], str]:
        """Record names from `cursor` ("node:cursor"), and where the next page starts."""
        nodes = self._nodes()
        at, _, position = cursor.partition(":")
        index, scan = (int(at), int(position)) if cursor else (0, 0)
        for _ in range(_ROUNDS):
            if index >= len(nodes):
                return [], ""
            scan, names = await self._scan(nodes[index], scan, limit)
            if scan == 0:
                index += 1
            after = f"{index}:{scan}" if index < len(nodes) else ""
            if names:
                return names, after
            if not after:
                return [], ""
        return [], f"{index}:{scan}"

    async def export_records(self, cursor: str, limit: int) -> ExportPage:
        names, after = await self.scan_page(cursor, limit)
        now = await server_now_ms(self.client)
        items = await asyncio.gather(*(self._read(name, now) for name in names))
        return ExportPage([item for item in items if item is not None], after)

    async def _read(self, name: bytes, now: int) -> ExportedRecord | None:
        key = name.decode()
        tag, digest = key[: -len("0" * 32)], key[-32:]
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.pttl(key)
            pipe.get(f"{tag}rq:{digest}")
            fields, ttl, request = await pipe.execute()
        except RedisError as exc:
            raise StoreError.because("redis export failed", exc) from exc
        if not fields or ttl == -2:
            return None  # gone since the SCAN
        flat = [part for pair in fields.items() for part in pair]
        return ExportedRecord(
            decode_record(self.opener, digest, now, flat),
            response=fields.get(b"resp"),
            token=fields.get(b"tk"),
            request=request,
            ttl_ms=None if ttl < 0 else max(1, int(ttl)),
        )

    async def import_records(self, items: Sequence[ExportedRecord]) -> list[str]:
        written = await asyncio.gather(*(self._write(item) for item in items))
        return [item.record.digest for item, done in zip(items, written, strict=True) if not done]

    async def _write(self, item: ExportedRecord) -> int:
        r = item.record
        ref = KeyRef(r.digest, r.route, r.key)
        listed = r.state is not State.RELEASED and (r.state is not State.COMPLETED or r.delivery)
        args = (
            str(r.state), r.since_ms, r.run_id, r.fingerprint, r.created_ms, r.route, r.key,
            r.lease_until_ms or "", item.response or b"", r.reason,
            _compact(list(r.history)) if r.history else "",
            r.check_lock_ms or "", r.last_check_ms or "",
            _compact(r.reconcile) if r.reconcile else "",
            r.holder, r.holder_since_ms, "1" if r.delivery else "", r.attempts, r.due_ms,
            _compact(r.last_attempt) if r.last_attempt else "", item.token or b"",
            item.request or b"", "" if item.ttl_ms is None else max(1, item.ttl_ms),
            place_of(r) if listed else 0,
        )  # fmt: skip
        done = int(await self.run("import", ref, *args))
        if done and self.admission is not None and r.state in (State.QUEUED, State.RETRYING):
            await self.admission.mark(r.route, r.digest)
        return done

    async def holds_keys(self) -> bool:
        cursor = ""
        while True:
            names, cursor = await self.scan_page(cursor, 1000)
            if names:
                return True
            if not cursor:
                return False
