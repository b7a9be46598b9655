"""The engine: the only place that decides claim, forward, complete, release, unresolved.

One request on a keyed route:

    claim ──free──> forward ──cached status──> complete ──> the response
      │                 ├──other status───────> release  ──> the response (retry runs)
      │                 ├──NotSent────────────> release  ──> 502
      │                 └──OutcomeLost────────> unresolved (or release, per route) ──> 504
      ├──completed──> replay (422 if the fingerprint differs)
      ├──in_flight──> wait for the change, then look again (or 409)
      └──unresolved, parked, claimed──> 409

The forward runs in a task of its own, shielded from the caller: a caller that hangs
up does not cancel it, so the response is still stored and the retry gets it.

A body larger than the route's max_stored_body (or one the process's response budget
has no room for) reaches the caller as it arrives (Reply.rest); the key is decided
when it ends, by a task of its own, exactly as it would be for a body read whole:
complete (headers only, body_omitted), release for a status not cached, unresolved
when it is cut off. The caller going away does not change that: the body is read to
its end for the key.

On an async route (delivery: async) `_accept` queues the request and answers 202
(accept.py: what is stored, the 202); a delivery attempt (gateway/delivery/attempt.py)
later sends it through the same classifier, `forward_unattended`. settlement.py holds
how a caller's forward settles (`SyncSettlement`); a delivery's settles by its own
(`DeliverySettlement`, beside the attempt). Beside it: replay.py, refusals.py (the
problems' words) and outbound.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from gateway.config import Config, Route
from gateway.engine.accept import (
    accepted_reply,
    delivery_ids,
    first_delay_ms,
    rfc3339,
    stored_request,
)
from gateway.engine.outbound import Origin, Outbound, outbound, send
from gateway.engine.refusals import (
    fingerprint_mismatch,
    in_flight_conflict,
    missing_key_detail,
    open_conflict,
    queue_full,
    store_unavailable,
    token_unreadable,
    unreadable,
    upstream_status,
)
from gateway.engine.replay import replay_headers, to_store
from gateway.engine.settlement import Reply, Settlement, SyncSettlement, guarded, settle_change
from gateway.errors import (
    MissingKey,
    NotSent,
    OutcomeLost,
    OutcomeUnknown,
    ProblemError,
    StoreError,
    UpstreamFailed,
)
from gateway.keying import RequestParts, extract_key, fingerprint, record_digest, scope_value
from gateway.logs import current_trace
from gateway.metrics import Metrics
from gateway.records import OPEN_STATES, QUEUE_STATES, KeyRef, Record, State, StoredResponse
from gateway.routes import RouteMatch
from gateway.store.base import EXPIRED_POLICY, NewDelivery, Store
from gateway.upstream import ResponseBudget, Upstream, UpstreamResponse

log = logging.getLogger("gateway.engine")

#: A shared read that failed: each sharer asks the store itself.
_RETRY = object()


@dataclass(slots=True)
class _LocalRun:
    """A forward this process is running: same-process duplicates wait on it
    without touching the store."""

    fingerprint: str
    done: asyncio.Future[StoredResponse | None]


class Reconciler(Protocol):
    """What the engine asks of the reconciler (gateway/reconcile.py) when a repeat
    finds its key unresolved: check it with the upstream now, if it can."""

    async def check(self, route: Route, record: Record, *, min_interval: float) -> str: ...


class Engine:
    def __init__(
        self,
        config: Config,
        store: Store,
        upstream: Upstream,
        metrics: Metrics,
        *,
        replica: str = "",
        reconciler: Reconciler | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.upstream = upstream
        self.metrics = metrics
        self._local: dict[str, _LocalRun] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        #: releases of claims that failed in the store (nothing forwarded on them)
        self._cleanups: set[asyncio.Task[None]] = set()
        #: response bytes in memory, process-wide (server.max_buffered_responses)
        self.budget = ResponseBudget(
            config.server.max_buffered_responses, metrics.buffer_full_event
        )
        self._reading: dict[str, asyncio.Future[Record | object | None]] = {}
        self.reconciler = reconciler
        self.replica = replica  # this process, as deliveries name it
        # The lease outlives the upstream deadline plus the store writes after it
        # (each may retry once), so a live gateway always settles its own keys.
        store_cfg = config.store
        self._lease_margin = 4 * store_cfg.socket_timeout + 2 * store_cfg.connect_timeout + 1

    def configure(self, config: Config) -> None:
        """A reload's config: requests under way keep the route they started with."""
        self.config = config
        self.budget.limit = config.server.max_buffered_responses

    async def drain(self, grace: float) -> None:
        """Let forwards under way finish for up to `grace` seconds, then cancel the
        rest, which marks them unresolved."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=grace)
        pending = set(self.tasks)
        for task in pending:
            task.cancel()
        if pending:
            log.warning(
                "%d forward(s) still running after %gs: marked unresolved", len(pending), grace
            )
            await asyncio.wait(pending)

    def count(self, route: Route, outcome: str) -> None:
        self.metrics.count(route.name, outcome)
        trace = current_trace.get()
        if trace is not None:
            trace.outcome = outcome

    def lease_for(self, route: Route) -> float:
        return route.upstream_timeout + self._lease_margin

    async def handle(self, match: RouteMatch, parts: RequestParts, origin: Origin) -> Reply:
        route = match.route
        if route.key is None:
            self.count(route, "passthrough")
            return await self._passthrough(route, parts, origin, None)
        key = extract_key(route.key, parts, datetime.now(UTC))
        if key is None:
            if route.key.on_missing == "reject":
                self.count(route, "missing_key")
                raise MissingKey(missing_key_detail(route), route=route.name)
            self.count(route, "missing_key_forwarded")
            return await self._passthrough(route, parts, origin, None)
        trace = current_trace.get()
        if trace is not None:
            trace.key, trace.sensitive = key, route.sensitive_keys
        ref = KeyRef(record_digest(route.name, scope_value(route.key, parts), key), route.name, key)
        fp = fingerprint(route.fingerprint, parts)
        try:
            if route.delivery.mode == "async":
                return await self._accept(route, ref, fp, parts, origin)
            return await self._keyed(route, ref, fp, parts, origin)
        except StoreError as exc:
            if route.on_store_error == "fail_open":
                log.warning("store failed, forwarding %s without dedupe: %s", route.name, exc)
                self.count(route, "store_bypassed")
                return await self._passthrough(route, parts, origin, key)
            log.error("store failed on route %s: %s", route.name, exc)
            self.count(route, "store_error")
            raise store_unavailable(route, key) from exc

    async def _keyed(
        self, route: Route, ref: KeyRef, fp: str, parts: RequestParts, origin: Origin
    ) -> Reply:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + route.wait_timeout
        waited = False
        while True:
            local = self._local.get(ref.digest)
            if local is not None:
                self._check_fingerprint(route, ref, local.fingerprint, fp)
                remaining = self._wait_budget(route, ref, give_up)
                waited = True
                try:
                    stored = await asyncio.wait_for(asyncio.shield(local.done), remaining)
                except TimeoutError:
                    raise self._conflict(route, ref, "in_flight", waited=True) from None
                if stored is not None:
                    return self._replay(route, stored, "waited")
                continue  # released or unresolved: look at the store again
            # Watch before reading, so a change between the read and the wait is seen.
            with self.store.notifier.watch(ref.digest) as changed:
                run_id = secrets.token_hex(8)
                shared = self._reading.get(ref.digest)
                if shared is not None:
                    # Another request of this process is reading this key right now:
                    # share its answer instead of asking the store again.
                    answer = await asyncio.shield(shared)
                    if not isinstance(answer, Record):
                        continue  # it claimed the key (wait on its run), or failed
                    record = answer
                else:
                    claimed = await self._claim(route, ref, run_id, fp)
                    if claimed is None:
                        break
                    record = claimed
                self._check_fingerprint(route, ref, record.fingerprint, fp)
                if record.state is State.COMPLETED and record.response is not None:
                    return self._replay(route, record.response, "waited" if waited else "replayed")
                if record.unreadable:
                    raise self._unreadable(route, ref, record)
                if record.state in QUEUE_STATES:  # a reload made its route sync
                    raise self._conflict(route, ref, str(record.state))
                if record.state in OPEN_STATES:
                    if record.state is State.UNRESOLVED and self.reconciler is not None:
                        after = await self.reconciler.check(route, record, min_interval=0)
                        if after in ("completed", "released"):
                            continue  # look again: replay it, or run it
                    raise self._open_conflict(route, ref, record)
                remaining = self._wait_budget(route, ref, give_up)
                waited = True
                await self.store.wait(ref, changed, remaining)
                if changed.completed is not None:
                    # The completion came with its response: replay it, no re-read.
                    completed_fp, response = changed.completed
                    self._check_fingerprint(route, ref, completed_fp, fp)
                    return self._replay(route, response, "waited")
        return await self._first(route, ref, run_id, fp, parts, origin)

    async def _accept(
        self, route: Route, ref: KeyRef, fp: str, parts: RequestParts, origin: Origin
    ) -> Reply:
        """An async route: queue the request (one store round trip) and answer 202 with
        its status URL, and its due time when it waits for one; a repeat gets the same
        202 with the current state (and the due time its first request was given)."""
        delay_ms = first_delay_ms(route, parts.headers, time.time())
        run_id, token = delivery_ids()
        accepted = await self.store.accept(
            NewDelivery(  # limit, origin, expired: positional, as a keyword call costs more
                ref,
                run_id,
                fp,
                stored_request(route, parts, origin),
                token,
                route.delivery.max_queued,
                self.replica,
                EXPIRED_POLICY[route.on_unknown_outcome],
                delay_ms,
            )
        )
        record, outcome = accepted.record, "replayed"
        if accepted.outcome == "full":
            self.count(route, "queue_full")
            raise queue_full(route, ref)
        due_ms = accepted.now_ms + delay_ms if delay_ms else 0
        if record is None or (record.run_id == run_id and record.state is State.QUEUED):  # ours
            if record is not None:  # its retried command: the due time it was given
                due_ms = record.due_ms if record.due_ms > record.now_ms else 0
            record, outcome = None, "accepted" if accepted.confirmed else "accepted_unconfirmed"
        elif not record.delivery:  # a reload made its route async: answer as sync would
            return await self._keyed(route, ref, fp, parts, origin)
        else:
            self._check_fingerprint(route, ref, record.fingerprint, fp)
            if not record.token:
                self.count(route, "unreadable")
                raise token_unreadable(route, ref, record)
            token = record.token
            # The first request's due time, never this one's: a repeat asks for nothing.
            waiting = record.state in QUEUE_STATES and record.due_ms > record.now_ms
            due_ms = record.due_ms if waiting else 0
        self.count(route, outcome)
        state = str(record.state) if record is not None else "queued"
        prefix = self.config.server.status_prefix
        due = rfc3339(due_ms) if due_ms else ""
        return accepted_reply(prefix, route, ref, state, token, outcome, due)

    def _wait_budget(self, route: Route, ref: KeyRef, give_up: float) -> float:
        """Seconds a duplicate may still wait for the first request, or the 409 it
        gets instead (`concurrent: reject`, or `wait_timeout` used up)."""
        if route.concurrent == "reject":
            raise self._conflict(route, ref, "in_flight")
        remaining = give_up - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise self._conflict(route, ref, "in_flight", waited=True)
        return remaining

    async def _claim(self, route: Route, ref: KeyRef, run_id: str, fp: str) -> Record | None:
        """Claim or read, publishing the answer to same-process requests for the key.
        None: this run holds the key."""
        sharing: asyncio.Future[Record | object | None] = asyncio.get_running_loop().create_future()
        self._reading[ref.digest] = sharing
        result: Record | object | None = _RETRY
        try:
            try:
                record = await self.store.claim(
                    ref, run_id, fp, self.lease_for(route), EXPIRED_POLICY[route.on_unknown_outcome]
                )
            except StoreError:
                self._release_unsent(route, ref, run_id)
                raise
            mine = record is None or (record.run_id == run_id and record.state is State.IN_FLIGHT)
            result = None if mine else record
            return None if mine else record
        finally:
            # Sharers run only after this task next yields; by then a claimant has
            # registered its local run (see _first), so they wait on it.
            del self._reading[ref.digest]
            sharing.set_result(result)

    def _release_unsent(self, route: Route, ref: KeyRef, run_id: str) -> None:
        """A claim that failed may still land: its command was written before the
        store stopped answering, and the store runs it when it resumes. Nothing was
        sent on `run_id`, so whatever it took is released (compare-and-release: only
        `run_id`'s in_flight record), in the background so the caller's 503 does not
        wait for it."""
        task = asyncio.create_task(self._release_unsent_run(route, ref, run_id))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _release_unsent_run(self, route: Route, ref: KeyRef, run_id: str) -> None:
        # Until the store answers, and no longer than the lease: past it, the claim
        # (if it landed) is no longer in flight, and a release changes nothing.
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.lease_for(route)
        reason = "not sent: the claim failed in the store"
        pause = 0.1
        while True:
            try:
                await self.store.release(ref, run_id, route.response_ttl, reason)
                # A release that found nothing may have run before a claim still in
                # the store's socket buffer; a read after its answer comes after it.
                record = await self.store.get(ref)
            except StoreError as exc:
                if loop.time() + pause >= give_up:
                    log.warning(
                        "key %r on %s: a claim that failed may hold it until its lease "
                        "ends; the store did not answer its release (%s)",
                        ref.key,
                        route.name,
                        exc,
                    )
                    return
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)
                continue
            except Exception:
                # A fault of the gateway's own (or a store closed under it at shutdown):
                # the lease is what remains, as when a settlement fails.
                log.exception("releasing %s key %r after its claim failed", route.name, ref.key)
                return
            if record is None or record.run_id != run_id or record.state is not State.IN_FLIGHT:
                log.info("key %r on %s: a claim that failed holds nothing", ref.key, route.name)
                return
            if loop.time() >= give_up:
                log.warning("key %r on %s: a claim that failed still holds it", ref.key, route.name)
                return

    async def _first(
        self,
        route: Route,
        ref: KeyRef,
        run_id: str,
        fp: str,
        parts: RequestParts,
        origin: Origin,
    ) -> Reply:
        trace = current_trace.get()
        if trace is not None:
            trace.run_id = run_id
        done: asyncio.Future[StoredResponse | None] = asyncio.get_running_loop().create_future()
        self._local[ref.digest] = _LocalRun(fp, done)
        out = outbound(route, parts, origin, ref.key)
        settle = SyncSettlement(self, route, ref, run_id)
        task = asyncio.create_task(self._forward_and_settle(route, ref, out, done, settle))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._unsent)  # its reply will find nobody to write it
            raise

    async def forward_unattended(
        self, route: Route, ref: KeyRef, out: Outbound, settle: Settlement
    ) -> None:
        """A forward nobody waits for (a delivery's attempt): the classifier in a task
        of its own, shielded, so a cancelled caller does not cut it short; its reply
        is discarded (its budget back, a streamed body read to its end) and the key
        settles through `settle` once the body has ended."""
        done: asyncio.Future[StoredResponse | None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._forward_and_settle(route, ref, out, done, settle))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            reply = await asyncio.shield(task)
        except ProblemError:
            return  # the settlement recorded what happened
        self._unsent(task)  # nobody writes it: its budget back, a stream read to its end
        if reply.settling is not None:
            await asyncio.shield(reply.settling)

    def _unsent(self, task: asyncio.Task[Reply]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        reply = task.result()
        if reply.held:
            self.budget.release(reply.held)
        if reply.rest is not None:
            reply.rest.abandon()  # a key's body is still read to its end

    async def _forward_and_settle(
        self,
        route: Route,
        ref: KeyRef,
        out: Outbound,
        done: asyncio.Future[StoredResponse | None],
        settle: Settlement,
    ) -> Reply:
        """The one classifier, for a caller's forward and a delivery's attempt alike:
        what the upstream did decides the key, through `settle`."""
        stored: StoredResponse | None = None
        streamed = False
        try:
            try:
                metrics = self.metrics.for_route(route.name)
                response = await send(self.upstream, self.budget, metrics, route, out, True)
            except asyncio.CancelledError:
                # Only drain() cancels a forward: the gateway is shutting down with
                # this request still out. Its outcome is unknown; say so now rather
                # than leave it to the lease.
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # we handle it; later awaits must not see it
                reason = "the gateway shut down before the upstream answered"
                await guarded(settle.lost(reason), settle)
                raise OutcomeUnknown(reason, route=route.name, key=ref.key) from None
            except NotSent as exc:
                await guarded(settle.retry(f"not sent: {exc.reason}"), settle)
                raise UpstreamFailed(
                    f"{exc.reason}. The key was released, so a retry runs the job.",
                    route=route.name,
                    key=ref.key,
                ) from exc
            except OutcomeLost as exc:
                # Even a status line alone says the request arrived: its work ran, or
                # runs still. The key stays open, whatever that status was.
                await guarded(settle.lost(exc.reason), settle)
                raise OutcomeUnknown(
                    f"{exc.reason}. The upstream may have done the work; the gateway will "
                    "not resend it blind.",
                    route=route.name,
                    key=ref.key,
                    **upstream_status(exc),
                ) from exc
            if response.rest is not None:
                # The caller gets the body as it arrives; its end decides the key.
                settling = asyncio.create_task(self._settle_stream(response, done, settle))
                self.tasks.add(settling)
                settling.add_done_callback(self.tasks.discard)
                streamed = True
                return Reply(response.status, response.headers, b"", 0, response.rest, settling)
            try:
                stored = await guarded(self._conclude(route, response, settle), settle)
            except BaseException:
                self.budget.release(response.held)  # drain() cancelled it: nobody writes it
                raise
            return Reply(response.status, response.headers, response.body, response.held)
        finally:
            if not streamed:
                self._local.pop(ref.digest, None)
                if not done.done():
                    done.set_result(stored)

    async def _settle_stream(
        self,
        response: UpstreamResponse,
        done: asyncio.Future[StoredResponse | None],
        settle: Settlement,
    ) -> None:
        """Decide the key when a streamed body ends, as _forward_and_settle does when
        a body read whole ends. Its caller may be gone by then: the body is read to
        its end all the same."""
        rest = response.rest
        assert rest is not None
        stored: StoredResponse | None = None
        try:
            try:
                await rest.finished()
            except asyncio.CancelledError:
                task = asyncio.current_task()  # drain(): the gateway is shutting down
                if task is not None:
                    task.uncancel()
                rest.close()
                reason = "the gateway shut down before the upstream's body was complete"
            except OutcomeLost as exc:
                # The caller's response is cut short too (never completed): the work ran.
                reason = exc.reason
            else:
                stored = await guarded(self._conclude(settle.route, response, settle), settle)
                return
            await guarded(settle.lost(reason), settle)
        finally:
            self._local.pop(settle.ref.digest, None)
            if not done.done():
                done.set_result(stored)

    async def _conclude(
        self, route: Route, response: UpstreamResponse, settle: Settlement
    ) -> StoredResponse | None:
        """The answer arrived whole: complete the key with it, or let it run again for a
        status the route does not cache. The stored response, if any."""
        if response.status not in route.cache_statuses:
            await settle.retry(f"upstream answered {response.status}", response)
            return None
        stored = to_store(route, response)
        await settle.complete(stored, response)
        return stored

    async def release(self, route: Route, ref: KeyRef, run_id: str, reason: str) -> None:
        change = self.store.release(ref, run_id, route.response_ttl, reason)
        await settle_change(change, ref, "release")

    async def unknown(self, route: Route, ref: KeyRef, run_id: str, reason: str) -> None:
        """The request may have run: keep the key open per route policy, never free."""
        self.count(route, "unknown_outcome")
        log.warning("outcome unknown on %s key %r: %s", route.name, ref.key, reason)
        if route.on_unknown_outcome == "release":
            await self.release(route, ref, run_id, f"{reason}; route policy: release")
            return
        park = route.on_unknown_outcome == "park"
        change = self.store.mark_unresolved(ref, run_id, reason, park=park)
        await settle_change(change, ref, "unresolved")

    async def _passthrough(
        self, route: Route, parts: RequestParts, origin: Origin, key: str | None
    ) -> Reply:
        metrics = self.metrics.for_route(route.name)
        try:
            out = outbound(route, parts, origin, key)
            response = await send(self.upstream, self.budget, metrics, route, out, False)
        except NotSent as exc:
            raise UpstreamFailed(exc.reason, route=route.name) from exc
        except OutcomeLost as exc:
            raise OutcomeUnknown(exc.reason, route=route.name, **upstream_status(exc)) from exc
        return Reply(response.status, response.headers, response.body, response.held, response.rest)

    def _replay(self, route: Route, stored: StoredResponse, outcome: str) -> Reply:
        self.count(route, outcome)
        return Reply(stored.status, replay_headers(stored), stored.body)

    def _check_fingerprint(self, route: Route, ref: KeyRef, stored: str, fp: str) -> None:
        if stored != fp:
            self.count(route, "mismatch")
            raise fingerprint_mismatch(route, ref)

    def _conflict(
        self, route: Route, ref: KeyRef, state: str, *, waited: bool = False
    ) -> ProblemError:
        self.count(route, "conflict")
        return in_flight_conflict(route, ref, state, waited=waited)

    def _unreadable(self, route: Route, ref: KeyRef, record: Record) -> ProblemError:
        self.count(route, "unreadable")
        return unreadable(route, ref, record)

    def _open_conflict(self, route: Route, ref: KeyRef, record: Record) -> ProblemError:
        self.count(route, "conflict")
        return open_conflict(route, ref, record)
