"""Unknown outcomes: check with the upstream, never resend blind; park what can't be
checked for a person.

`Reconciler.check` asks a route's `reconcile.url` what happened to one unresolved
key, at most one check at a time per key across all replicas (the store arbitrates):

    an answer in `done`      -> completed; repeats replay a 2xx saying it was reconciled
    an answer in `not_done`  -> released; the waiting or next request runs it
    anything else, a timeout or an error -> inconclusive: the key stays unresolved,
                                nothing is resent; past `park_after` it is parked

`Reconciler.run` sweeps in every replica: in-flight records whose lease ran out (their
gateway died) are opened per route policy on every pass, and unresolved ones are
checked once per `every`, whichever replica gets there first. Each route's backlog is
swept in a task of its own that the passes do not wait for, so a route whose backlog
takes long to check (thousands of keys, a status endpoint that times out) holds up
neither the other routes nor the lease expiry; a route still sweeping is not started
again until its sweep ends. A pass reads only the counts for a route that its last
sweep found nothing due in yet: it remembers when the soonest of its keys can be due
(at most `every` on), and reads the route's backlog again then, or at once when the
route's unresolved count has grown; an idle sweep reads each route once per `every`,
not once per pass.

A route's checks run at most `reconcile.concurrency` at a time in a process, the
sweep's and those a repeat triggers together, so a backlog after an outage reaches a
service that has just come back at that pace: N due keys take about N / concurrency
check times per process. The sweep waits for a slot; a repeat that finds none does not
wait (the sweep checks its key) and gets the unresolved answer. The sweep reads each
route's backlog a page (`PAGE` records) at a time from the store's listing, the
longest unresolved first, and never holds more than a page of it.

A route with `delivery.rate` takes a token of its rate limit before each check (the
same limit its deliveries take, shared over every replica through the store): the
sweep waits for one, a repeat that finds none leaves its key to the sweep.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Iterable
from typing import Any

from gateway.config import Config, Route
from gateway.config.templates import UNPLACEABLE, UnplaceableValue, fill_url
from gateway.delivery.retry import plan
from gateway.engine.outbound import with_key
from gateway.errors import StoreError, UpstreamError
from gateway.logs import shown_key
from gateway.metrics import Metrics
from gateway.records import KeyRef, Record, State, StoredResponse
from gateway.store.base import EXPIRED_POLICY, CheckResult, ExpiredPolicy, Store
from gateway.tasks import stop_if_cancelled
from gateway.upstream import Upstream

log = logging.getLogger("gateway.reconcile")

#: How long a check may hold a key beyond its own timeout before another may try.
_LOCK_MARGIN = 5.0
#: Unresolved records the sweep reads from the store at once, per route.
PAGE = 100


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
        #: per route: its reconcile.concurrency, and the slots its checks take
        self._slots: dict[str, tuple[int, asyncio.Semaphore]] = {}
        #: per route: its sweep under way, which the next pass leaves to finish
        self._sweeping: dict[str, asyncio.Task[None]] = {}
        #: per route: when (loop time) its next check can be due, by its last sweep,
        #: and the unresolved count that sweep started from; a pass skips the route
        #: until then unless the count has grown (a key newly unresolved)
        self._next_due: dict[str, tuple[float, int]] = {}
        self.configure(config)

    def configure(self, config: Config) -> None:
        self.routes = {route.name: route for route in config.routes}
        everies = [r.reconcile.every for r in config.routes if r.reconcile is not None]
        # Often enough for the tightest `every`, and to notice dead leases promptly.
        self.interval = max(0.2, min([5.0, *everies]))
        # A route whose bound a reload changed gets new slots; checks under way finish
        # on the old ones.
        old, self._slots = self._slots, {}
        self._next_due = {}  # an `every` may have changed
        for route in config.routes:
            if route.reconcile is None:
                continue
            for reason in UNPLACEABLE:
                # Present at 0 before the first, so increase() sees the first too.
                self.metrics.reconcile_unsent.labels(route.name, reason)
            limit, kept = route.reconcile.concurrency, old.get(route.name)
            if kept is None or kept[0] != limit:
                kept = (limit, asyncio.Semaphore(limit))
            self._slots[route.name] = kept

    def expired_policy(self, route_name: str) -> ExpiredPolicy:
        route = self.routes.get(route_name)
        # A route gone from the config: nobody can check it, a person must.
        return EXPIRED_POLICY[route.on_unknown_outcome] if route is not None else "parked"

    async def check(
        self, route: Route, record: Record, *, min_interval: float, wait: bool = False
    ) -> str:
        """Check one unresolved record. Returns its state after the check, or "" when
        no check ran (not due, another is under way, the route can't be checked, or
        all of its `concurrency` slots are taken and `wait` is false)."""
        rc = route.reconcile
        slots = self._slots.get(route.name)
        if rc is None or slots is None or route.on_unknown_outcome != "reconcile":
            return ""
        if not wait and slots[1].locked():
            return ""
        async with slots[1]:
            if not await self._token(route, wait):
                return ""
            return await self._check(route, record, min_interval)

    async def _token(self, route: Route, wait: bool) -> bool:
        """A token of the route's rate limit (`delivery.rate`, the one its deliveries
        take: a check reaches the same service) before the check is begun, so the
        check's lock never runs out while it waits. The sweep waits for one; a repeat
        does not (the sweep checks its key)."""
        dl = route.delivery
        name = dl.limit_name(route.name)
        while name is not None and dl.rate is not None:
            hold = await self.store.take_token(name, dl.rate, dl.burst)
            if hold == 0.0:
                break
            self.metrics.rate_limited.labels(route.name, "check").inc()
            if not wait:
                return False
            await asyncio.sleep(hold)
        return True

    async def _check(self, route: Route, record: Record, min_interval: float) -> str:
        rc = route.reconcile
        assert rc is not None
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
            CheckResult(
                ref,
                record.run_id,
                result,
                answer,
                response,
                route.response_ttl,
                rc.park_after,
                retry_in,
            )
        )
        shown = shown_key(record.key, route.sensitive_keys)
        log.info("reconcile %s key %r: %s -> %s", route.name, shown, result, after or "unchanged")
        return after

    async def _ask(self, route: Route, record: Record) -> tuple[str, dict[str, Any]]:
        rc = route.reconcile
        assert rc is not None
        values = {"key": record.key, "route": route.name, "run_id": record.run_id}
        try:
            url = fill_url(rc.url, values)
        except UnplaceableValue as exc:
            # Sent, the check would ask about another URL, and its answer would
            # complete or release this key on another's word.
            self.metrics.reconcile_unsent.labels(route.name, exc.reason).inc()
            log.warning(
                "reconcile %s key %r: check not sent: %s; the key stays unresolved (put "
                "{key} in the query of reconcile.url to check such keys)",
                route.name,
                shown_key(record.key, route.sensitive_keys),
                exc,
            )
            return "inconclusive", {"error": f"check not sent: {exc}"}
        headers = with_key(route, [("accept", "application/json")], record.key)
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
        """One whole pass, ended when every route's sweep it started has ended (the
        sweeps of routes already under way included)."""
        await _all(await self.start_sweep())

    async def start_sweep(self) -> list[asyncio.Task[None]]:
        """Open dead leases, then start each route with unresolved keys sweeping in a
        task of its own, the longest unresolved first; a route still sweeping from an
        earlier pass is left to it. Returns the routes' sweep tasks, without waiting:
        one slow route holds up no other, and the next pass opens dead leases on time."""
        for ref, state in await self.store.expire_leases(self.expired_policy):
            log.warning("key of route %s lost its gateway mid-request: now %s", ref.route, state)
        stats = await self.store.stats()
        counts = {s.route: s.count for s in stats if s.state is State.UNRESOLVED}
        for gone in set(self._next_due) - set(counts):
            del self._next_due[gone]
        now = asyncio.get_running_loop().time()
        tasks = []
        for name in sorted(counts):
            task = self._sweeping.get(name)
            if task is None or task.done():
                # Nothing can be due before its last sweep said: reading its backlog
                # again on every pass would cost a listing per route per pass, idle.
                due, seen = self._next_due.get(name, (0.0, 0))
                if now < due and counts[name] <= seen:
                    continue
                task = asyncio.create_task(
                    self._sweep_route(name, counts[name]), name=f"route {name}"
                )
                self._sweeping[name] = task
                task.add_done_callback(_log_failure)
            tasks.append(task)
        return tasks

    async def _sweep_route(self, name: str, count: int) -> None:
        unresolved = frozenset({State.UNRESOLVED})
        cursor = ""
        self._next_due.pop(name, None)
        #: seconds until the soonest of the records read can be due again
        soonest: float | None = None
        while True:
            page = await self.store.list_records(unresolved, route=name, cursor=cursor, limit=PAGE)
            records = [r for r in page.records if r.state is State.UNRESOLVED]
            route = self.routes.get(name)
            if (
                route is not None
                and route.reconcile is not None
                and route.on_unknown_outcome == "reconcile"
            ):
                every = route.reconcile.every
                # Not due yet (checked within `every`, or a check under way): the
                # store would refuse it too; skipping saves the round trip.
                due = [r for r in records if _due(r, every)]
                await _all(self.check(route, r, min_interval=every, wait=True) for r in due)
                for wait in (_wait(r, every) for r in records):
                    soonest = wait if soonest is None else min(soonest, wait)
            else:
                await _all(self._settle(name, route, record) for record in records)
            if not page.next:
                break
            cursor = page.next
        if soonest is not None:
            self._next_due[name] = (asyncio.get_running_loop().time() + soonest, count)

    async def _settle(self, name: str, route: Route | None, record: Record) -> None:
        """An unresolved record its route no longer checks: parked, or released."""
        ref = KeyRef(record.digest, record.route, record.key)
        if route is None:
            await self.store.park(ref, f"route {name!r} is no longer configured")
        elif route.on_unknown_outcome == "park":
            await self.store.park(ref, "route policy: park")
        else:
            # Policy `release` (changed since the key became unresolved).
            await self.store.end_check(
                CheckResult(
                    ref,
                    record.run_id,
                    "not_done",
                    {"policy": "release"},
                    None,
                    route.response_ttl,
                    0,
                )
            )

    async def run(self) -> None:
        """Sweep forever, every `interval` (jittered so replicas spread out)."""
        try:
            while True:
                try:
                    await self.start_sweep()
                except StoreError as exc:
                    log.warning("sweep skipped: %s", exc)
                except Exception:
                    log.exception("sweep failed")
                stop_if_cancelled()
                await asyncio.sleep(self.interval * random.uniform(0.8, 1.2))
        finally:
            sweeping, self._sweeping = list(self._sweeping.values()), {}
            for task in sweeping:
                task.cancel()
            await asyncio.gather(*sweeping, return_exceptions=True)


def _log_failure(task: asyncio.Task[None]) -> None:
    """A route's sweep that failed says why in the log; the next pass starts it again."""
    if task.cancelled():
        return
    exc = task.exception()
    if isinstance(exc, StoreError):
        log.warning("sweep of %s skipped: %s", task.get_name(), exc)
    elif exc is not None:
        log.error("sweep of %s failed", task.get_name(), exc_info=exc)


def _due(record: Record, every: float) -> bool:
    """Whether a check of `record` may start now, by the store's clock as it was read."""
    return record.check_lock_ms <= record.now_ms and (
        record.now_ms - record.last_check_ms >= every * 1000
    )


def _wait(record: Record, every: float) -> float:
    """Seconds from the sweep until a check of `record` can be due: `every` for one due
    as it was read (checked now, or by another replica), else until its last check is
    `every` old and any check under way has ended."""
    if _due(record, every):
        return every
    until = max(record.last_check_ms + every * 1000, record.check_lock_ms)
    return max(0.0, min(every, (until - record.now_ms) / 1000))


async def _all(work: Iterable[Awaitable[object]]) -> None:
    """Runs them together; once all have ended, raises the first error any raised
    (the sweep's loop logs it), so one failure does not abandon the others."""
    results = await asyncio.gather(*work, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
