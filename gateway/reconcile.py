"""Unknown outcomes: check with the upstream, never resend blind; park what can't be
checked for a person.

`Reconciler.check` asks a route's `reconcile.url` what happened to one unresolved
key, at most one check at a time per key across all replicas (the store arbitrates):

    an answer in `done`      -> completed; repeats replay a 2xx saying it was reconciled
    an answer in `not_done`  -> released; the waiting or next request runs it
    anything else, a timeout or an error -> inconclusive: the key stays unresolved,
                                nothing is resent; past `park_after` it is parked

`Reconciler.sweep` runs in every replica: in-flight records whose lease ran out (their
gateway died) are opened per route policy, and unresolved ones are checked once per
`every`, whichever replica gets there first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any
from urllib.parse import quote

from gateway.config import Config, Route
from gateway.config.templates import fill_placeholders
from gateway.delivery import plan
from gateway.errors import StoreError, UpstreamError
from gateway.metrics import Metrics
from gateway.records import KeyRef, Record, State, StoredResponse
from gateway.store.base import EXPIRED_POLICY, ExpiredPolicy, Store
from gateway.upstream import Upstream

log = logging.getLogger("gateway.reconcile")

#: How long a check may hold a key beyond its own timeout before another may try.
_LOCK_MARGIN = 5.0


def reconciled_response(record: Record, status: int) -> StoredResponse:
    body = json.dumps(
        {
            "status": "completed",
            "reconciled": True,
            "key": record.key,
            "detail": (
                f"The first request's outcome was unknown; the upstream's status check "
                f"answered {status}, so the work ran. It was not run again."
            ),
        }
    ).encode()
    return StoredResponse(200, (("content-type", "application/json"),), body, origin="reconciled")


class Reconciler:
    def __init__(self, config: Config, store: Store, upstream: Upstream, metrics: Metrics) -> None:
        self.store = store
        self.upstream = upstream
        self.metrics = metrics
        self.configure(config)

    def configure(self, config: Config) -> None:
        self.routes = {route.name: route for route in config.routes}
        everies = [r.reconcile.every for r in config.routes if r.reconcile is not None]
        # Often enough for the tightest `every`, and to notice dead leases promptly.
        self.interval = max(0.2, min([5.0, *everies]))

    def expired_policy(self, route_name: str) -> ExpiredPolicy:
        route = self.routes.get(route_name)
        # A route gone from the config: nobody can check it, a person must.
        return EXPIRED_POLICY[route.on_unknown_outcome] if route is not None else "parked"

    async def check(self, route: Route, record: Record, *, min_interval: float) -> str:
        """Check one unresolved record. Returns its state after the check, or "" when
        no check ran (not due, another is under way, or the route can't be checked)."""
        rc = route.reconcile
        if rc is None or route.on_unknown_outcome != "reconcile":
            return ""
        ref = KeyRef(record.digest, record.route, record.key)
        if not await self.store.begin_check(
            ref, record.run_id, rc.timeout + _LOCK_MARGIN, min_interval
        ):
            return ""
        result, answer = await self._ask(route, record)
        self.metrics.reconcile.labels(route.name, result).inc()
        response = (
            reconciled_response(record, answer.get("status", 0)) if result == "done" else None
        )
        # A delivery the upstream says did not run goes again per its retry plan.
        retry_in = plan(route, record.attempts, None) if record.delivery else None
        after = await self.store.end_check(
            ref,
            record.run_id,
            result,
            answer,
            response,
            route.response_ttl,
            rc.park_after,
            retry_in,
        )
        log.info(
            "reconcile %s key %r: %s -> %s", route.name, record.key, result, after or "unchanged"
        )
        return after

    async def _ask(self, route: Route, record: Record) -> tuple[str, dict[str, Any]]:
        rc = route.reconcile
        assert rc is not None
        values = {"key": record.key, "route": route.name, "run_id": record.run_id}
        url = fill_placeholders(rc.url, {k: quote(v, safe="") for k, v in values.items()})
        headers = [("accept", "application/json")]
        if route.forward_key_header:
            headers.append((route.forward_key_header, record.key))
        try:
            response = await self.upstream.forward(
                rc.method, url, headers, b"", rc.timeout, route.max_response_body
            )
        except UpstreamError as exc:
            return "inconclusive", {"error": exc.reason}
        if response.status in rc.done:
            return "done", {"status": response.status}
        if response.status in rc.not_done:
            return "not_done", {"status": response.status}
        return "inconclusive", {"status": response.status}

    async def sweep(self) -> None:
        """One pass: open dead leases, then check or park the unresolved."""
        for ref, state in await self.store.expire_leases(self.expired_policy):
            log.warning("key of route %s lost its gateway mid-request: now %s", ref.route, state)
        for record in await self.store.open_records(frozenset({State.UNRESOLVED})):
            route = self.routes.get(record.route)
            ref = KeyRef(record.digest, record.route, record.key)
            if route is None:
                await self.store.park(ref, f"route {record.route!r} is no longer configured")
            elif route.on_unknown_outcome == "park":
                await self.store.park(ref, "route policy: park")
            elif route.on_unknown_outcome == "reconcile" and route.reconcile is not None:
                await self.check(route, record, min_interval=route.reconcile.every)
            else:
                # Policy `release` (changed since the key became unresolved).
                await self.store.end_check(
                    ref,
                    record.run_id,
                    "not_done",
                    {"policy": "release"},
                    None,
                    route.response_ttl,
                    0,
                )

    async def run(self) -> None:
        """Sweep forever, every `interval` (jittered so replicas spread out)."""
        while True:
            try:
                await self.sweep()
            except StoreError as exc:
                log.warning("sweep skipped: %s", exc)
            except Exception:
                log.exception("sweep failed")
            stop_if_cancelled()
            await asyncio.sleep(self.interval * random.uniform(0.8, 1.2))


def stop_if_cancelled() -> None:
    """Raise CancelledError if this task was told to stop. A client library that
    turns a cancellation mid-call into its own error (redis-py's pipeline can) would
    otherwise leave a background loop running, and `Gateway.close` waiting on it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
