"""The delivery worker: who picks which accepted (202) request when, and how many at
once. Each attempt is `attempt` (gateway/delivery/attempt.py: pick, then the engine's
classifier forwards and settles); this is mechanics.

- One `Lane` per async route: a heap of hints (`Due`) ordered by when each is ready
  in this process's loop clock, woken by the store's `DueFeed` notices and by its own
  timer for the head's due time. No polling loop: the rescan (`due_candidates`) runs
  at start, when the store says notices may have been lost (`due.lost()`), and as a
  slow backstop every `BACKSTOP` seconds.
- Limits: `delivery.concurrency` attempts per route, and `server.max_deliveries` in
  all, per process; always taken in that order. `max_deliveries: 0`: no lanes, the
  process accepts only. `delivery.rate` holds over every process: each attempt takes
  a token from the store first (`Store.take_token`); without one its hint goes back
  to its place and the lane picks nothing until the store's next token.
- The replica that accepted or scheduled a delivery tries it at once; the others wait
  `HANDOFF` first, and drop the hint when told it was taken.
- `stop_picking()` (SIGTERM): no new picks; attempts under way are the engine's tasks,
  which `Engine.drain` gives the grace and then marks unresolved.
- A paused route (store/route_pauses.py) is not attempted: before each attempt its
  lane reads the route's row; while it is paused the lane holds every hint until the
  next probe is due (an operator's pause: `MANUAL_RECHECK`), and one process of all
  takes each probe. After an attempt, a refusal is counted (it may pause the route),
  and an answer resets the count and ends an automatic pause.
- `delivery.max_queued` is not decided here: `Store.accept` decides it against the
  store's own count, in the same step as the queueing. The queue watch reads
  `queue_stats` (to find work a route that is no longer async still has), and every
  `REPAIR` seconds asks the store to repair its counts (`Store.repair_counts`: on a
  Redis Cluster, the routes' admission marks a crash between two writes left apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import random
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.config import Config, Route
from gateway.delivery.attempt import Delivery, attempt
from gateway.errors import StoreError
from gateway.store.base import duration_ms
from gateway.store.notices import Due
from gateway.store.route_pauses import AUTO, PauseMove, PauseState, Verdict
from gateway.tasks import stop_if_cancelled

if TYPE_CHECKING:
    from gateway.engine.core import Engine
    from gateway.store.base import Store

log = logging.getLogger("gateway.delivery")

HANDOFF = 0.2  # s: other replicas wait this long for the one that queued an item
QUEUE_WATCH = 1.0  # s: how soon a route made sync has its leftover work found
BACKSTOP = 20.0  # s: the rescan when no notice was lost, in case one was anyway
REPAIR = 60.0  # s: between repairs of the store's counts (and a Cluster's admission marks)
STORE_BACKOFF = (0.1, 2.0)  # s: after a StoreError, doubling
MANUAL_RECHECK = 1.0  # s: how soon a lane sees an operator's resume
ONE_ASK = 1.0  # s: after the rate limit held a lane back, its tokens are asked one at a time


def _free(*slots: asyncio.Semaphore | asyncio.Task[None]) -> None:
    for slot in slots:
        if isinstance(slot, asyncio.Semaphore):
            slot.release()


class Lane:
    """One async route's hints, in this process."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.heap: list[tuple[float, int, Due]] = []
        self.live: dict[str, int] = {}  # digest -> seq of its entry (others are stale)
        self.due_at: dict[str, float] = {}  # digest -> ready time of its live entry
        self.wake = asyncio.Event()
        self.slots = asyncio.Semaphore(route.delivery.concurrency)
        self.task: asyncio.Task[None] | None = None
        #: loop time before which no hint is ready: the route is paused, or its rate
        #: limit has no token (no store call until then)
        self.held_until = 0.0
        #: loop time before which the lane asks for one token at a time (the limit binds)
        self.one_ask_until = 0.0
        self.asking = 0  # token asks under way

    def push(self, ready_at: float, seq: int, due: Due) -> None:
        digest = due.ref.digest
        if self.route.delivery.rate is not None and self.due_at.get(digest, ready_at) < ready_at:
            # A rate-limited queue is worked in due order: a hint again (an attempt's
            # `next`, a notice, a rescan) keeps the place its first one has.
            self.wake.set()
            return
        heapq.heappush(self.heap, (ready_at, seq, due))
        self.live[digest] = seq
        self.due_at[digest] = ready_at
        self.wake.set()

    def drop(self, digest: str) -> None:
        self.live.pop(digest, None)
        self.due_at.pop(digest, None)

    def head(self) -> tuple[float, Due] | None:
        while self.heap:
            ready_at, seq, due = self.heap[0]
            if self.live.get(due.ref.digest) == seq:
                return ready_at, due
            heapq.heappop(self.heap)
        return None

    def ready(self, now: float) -> bool:
        """Whether the head hint may be taken: its time has come, the route is not held
        (paused, or no token), and no token ask is under way while the limit binds."""
        head = self.head()
        if head is None or max(head[0], self.held_until) > now:
            return False
        return not (self.asking and now < self.one_ask_until)

    def asked(self) -> None:
        """A token ask counted at the pick has ended (answered, or not made)."""
        self.asking -= 1
        self.wake.set()

    def pop(self) -> Due:
        _, _, due = heapq.heappop(self.heap)
        self.drop(due.ref.digest)
        return due


class DeliveryWorker:
    """Delivers the async routes' accepted requests, in every process that runs one."""

    def __init__(self, config: Config, store: Store, engine: Engine, replica: str) -> None:
        self.store, self.engine, self.replica = store, engine, replica
        self.picking = True
        self.lanes: dict[str, Lane] = {}
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._rescan = asyncio.Event()
        self._pending: set[str] = set()  # routes with queued work, as of the last watch
        self._unlisten: Callable[[], None] | None = None
        self._notices = False  # whether the registration wants due and taken
        self._running = False
        self.configure(config)

    # -- configuration -----------------------------------------------------------

    def configure(self, config: Config) -> None:
        """Lanes for the async routes of `config` (added, kept, removed), and limits."""
        self.config = config
        limit = config.server.max_deliveries
        if getattr(self, "_limit", None) != limit:
            self._limit = limit
            self.slots = asyncio.Semaphore(max(limit, 1))
        # A route a reload made sync keeps a lane while it has work it accepted as
        # async: that work was answered 202 and is delivered, not left queued.
        wanted = {
            r.name: r
            for r in config.routes
            if r.delivery.mode == "async" or r.name in self._pending
        }
        if limit == 0:
            wanted = {}
        for name in list(self.lanes):
            if name not in wanted:
                lane = self.lanes.pop(name)
                if lane.task is not None:
                    lane.task.cancel()
        for name, route in wanted.items():
            found = self.lanes.get(name)
            if found is None:
                self.lanes[name] = found = Lane(route)
                if self._running:
                    self._start_lane(found)
                    self._rescan.set()
            elif found.route.delivery.concurrency != route.delivery.concurrency:
                found.slots = asyncio.Semaphore(route.delivery.concurrency)
            found.route = route
        self._listen()

    def _listen(self) -> None:
        """Hear the store's due and taken notices only with a lane to give them to: a
        process that delivers nothing (no async route, or max_deliveries 0) then never
        reads one (the Redis store does not even subscribe), though it still rescans
        on `lost` (removed routes' work). Registered from the constructor, before the
        store starts, so its first subscription is already the right one; registered
        again when lanes come or go (a reload, a sync route's leftovers)."""
        notices = bool(self.lanes)
        if self._unlisten is not None and self._notices == notices:
            return
        old, self._notices = self._unlisten, notices
        self._unlisten = self.store.due.listen(
            self._on_due, self._on_taken, self._rescan.set, notices=notices
        )
        if old is not None:
            old()

    # -- running -------------------------------------------------------------------

    async def run(self) -> None:
        """The lanes and the queue watch, until cancelled (Gateway.close)."""
        self._running = True
        self._listen()
        try:
            for lane in self.lanes.values():
                self._start_lane(lane)
            self._rescan.set()  # at start: what was queued before this process
            await asyncio.gather(self._watch(), self._rescans())
        finally:
            self._running = False
            if self._unlisten is not None:
                self._unlisten()
                self._unlisten = None
            tasks = [lane.task for lane in self.lanes.values() if lane.task is not None]
            for task in [*tasks, *self._tasks]:  # attempts' forwards are drained already
                task.cancel()
            await asyncio.gather(*tasks, *self._tasks, return_exceptions=True)

    def stop_picking(self) -> None:
        """SIGTERM: no new pick from now on; queued items stay for the other replicas."""
        self.picking = False
        for lane in self.lanes.values():
            lane.wake.set()

    def _start_lane(self, lane: Lane) -> None:
        lane.task = asyncio.create_task(self._lane(lane), name=f"delivery-{lane.route.name}")

    def _hint(self, lane: Lane, due: Due) -> None:
        wait = max(0, due.due_ms - due.now_ms) / 1000 if due.now_ms else 0.0
        if due.origin and due.origin != self.replica:
            wait += HANDOFF
        lane.push(asyncio.get_running_loop().time() + wait, next(self._seq), due)

    def _on_due(self, due: Due) -> None:
        lane = self.lanes.get(due.ref.route)
        if lane is not None:
            self._hint(lane, due)

    def _on_taken(self, digest: str) -> None:
        for lane in self.lanes.values():
            lane.drop(digest)

    async def _lane(self, lane: Lane) -> None:
        loop = asyncio.get_running_loop()
        while self.picking:
            route_slots, process_slots = lane.slots, self.slots
            await route_slots.acquire()
            try:
                ready = await self._take(lane, loop, process_slots)
            except BaseException:
                route_slots.release()
                raise
            if ready is None:  # stopped picking
                route_slots.release()
                return
            limited = lane.route.delivery.rate is not None
            if limited:
                lane.asking += 1  # counted from the pick: the task may not have run yet
            task = asyncio.create_task(self._attempt(lane, *ready, limited))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(functools.partial(_free, process_slots, route_slots))

    async def _take(
        self, lane: Lane, loop: asyncio.AbstractEventLoop, process_slots: asyncio.Semaphore
    ) -> tuple[float, Due] | None:
        """The next hint that may be taken and when it was ready, with one of the
        process's slots held for it. The slot is taken only once a hint is ready: a lane
        waiting for a far-off due time, a pause to end or a token holds none, so other
        routes' due work is not kept waiting."""
        while await self._ready(lane, loop):
            await process_slots.acquire()
            head = lane.head()
            if self.picking and head is not None and lane.ready(loop.time()):
                return head[0], lane.pop()
            process_slots.release()  # taken or dropped while this lane waited for the slot
        return None

    async def _ready(self, lane: Lane, loop: asyncio.AbstractEventLoop) -> bool:
        """Once a hint may be taken (`Lane.ready`), waiting on the notices and the
        timers: the head's due time, and while the route is paused or its rate limit
        has no token (`Lane.held_until`, set by `_gate` and `_token`) that time alone,
        with no store call. While the limit binds (`Lane.one_ask_until`), one token ask
        at a time: a lane with `concurrency` hints ready would otherwise ask for that
        many tokens where one is there; its answer wakes the lane. False: stopped
        picking."""
        while self.picking:
            lane.wake.clear()
            head = lane.head()
            now = loop.time()
            if lane.ready(now):
                return True
            timeout = None
            if head is not None and max(head[0], lane.held_until) > now:
                timeout = max(head[0], lane.held_until) - now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await lane.wake.wait()
        return False

    async def _gate(self, lane: Lane) -> tuple[Verdict, PauseState | None]:
        """Whether the route may be attempted now: "open", "probe" (this process took
        the probe) or "closed" (paused: the lane is held until the next look). A store
        that does not answer opens it: the pick that follows meets the same store."""
        route = lane.route
        try:
            state = await self.store.route_pause(route.name)
            verdict = state.verdict
            if verdict == "probe":
                every = duration_ms(route.delivery.probe_every)
                state, verdict = await self.store.change_pause(
                    route.name, PauseMove("probe", probe_every_ms=every)
                )
        except StoreError as exc:
            log.debug("pause of %s not read: %s", route.name, exc)
            return "open", None
        if verdict == "closed":
            wait = MANUAL_RECHECK
            if state.by == AUTO:
                wait = min(route.delivery.probe_every, max(0, state.probe_ms - state.now_ms) / 1000)
            loop = asyncio.get_running_loop()
            lane.held_until = max(lane.held_until, loop.time() + max(wait, 0.01))
        return verdict, state

    async def _count(self, lane: Lane, result: Delivery, before: PauseState | None) -> None:
        """What the attempt says of the upstream, into the route's row: a refusal
        counted (when `pause_after` is set), an answer resetting a count or ending an
        automatic pause (written only when there is one to reset or end)."""
        route = lane.route
        move = None
        if result.upstream == "refused" and route.delivery.pause_after:
            move = PauseMove(
                "refused",
                why=result.error[:200],
                pause_after=route.delivery.pause_after,
                probe_every_ms=duration_ms(route.delivery.probe_every),
            )
        elif result.upstream == "answered" and (
            before is None or before.failures or (before.paused and before.by == AUTO)
        ):
            move = PauseMove("answered")
        if move is None:
            return
        try:
            state, _ = await self.store.change_pause(route.name, move)
        except StoreError as exc:
            log.warning("pause count of %s not written: %s", route.name, exc)
            return
        if move.move == "refused" and state.paused and state.since_ms == state.now_ms:
            log.warning(
                "route %s paused after %d attempts in a row refused (last: %s); "
                "one probe every %gs",
                route.name,
                state.failures,
                result.error,
                route.delivery.probe_every,
            )
        elif move.move == "answered" and before is not None and before.paused and not state.paused:
            log.warning("route %s resumed: a probe was answered", route.name)

    async def _token(self, lane: Lane, ready_at: float, due: Due) -> bool:
        """A token of the route's rate limit before the pick, so a delivery without one
        is never leased and never counts as an attempt. Asked in the attempt's task,
        not the lane's loop, so the lane picks the next hint meanwhile. Without one,
        the hint goes back to its place in due order, the lane picks nothing until the
        store's next token, and then asks for one token at a time while the limit
        binds."""
        try:
            wait = await self._take_token(lane.route)
        finally:
            lane.asked()
        if wait > 0.0:
            now = asyncio.get_running_loop().time()
            lane.held_until = max(lane.held_until, now + wait)
            lane.one_ask_until = lane.held_until + ONE_ASK
            lane.push(ready_at, next(self._seq), due)
            return False
        return True

    async def _take_token(self, route: Route) -> float:
        """0.0 once a token of the route's rate limit is taken (or it has none), else
        the seconds to wait for one; a store that fails holds the lane back a while."""
        name = route.delivery.limit_name(route.name)
        if name is None or route.delivery.rate is None:
            return 0.0
        try:
            wait = await self.store.take_token(name, route.delivery.rate, route.delivery.burst)
        except StoreError as exc:
            log.warning(
                "rate limit of %s failed (%s); again in %gs", route.name, exc, STORE_BACKOFF[1]
            )
            return STORE_BACKOFF[1]
        if wait > 0.0:
            self.engine.metrics.rate_limited.labels(route.name, "delivery").inc()
        return wait

    async def _attempt(self, lane: Lane, ready_at: float, due: Due, limited: bool) -> None:
        route = lane.route
        try:
            verdict, before = await self._gate(lane)
        except BaseException:
            if limited:
                lane.asked()
            raise
        if verdict == "closed":  # never sent: it counts as no attempt, nor takes a token
            if limited:
                lane.asked()
            lane.push(ready_at, next(self._seq), due)
            return
        if limited and not await self._token(lane, ready_at, due):
            return
        failures = 0
        # One run id for the attempt, kept when its pick is tried again after a store
        # error: a first try that took the delivery (its answer lost) is then found as
        # this attempt's, not left in flight until its lease makes it an unknown outcome.
        run_id = secrets.token_hex(8)
        while True:
            try:
                result = await attempt(
                    self.engine, route, due.ref, self.replica, run_id, verdict == "probe"
                )
                self.engine.metrics.attempt(route.name, result.result)
                break
            except StoreError as exc:
                failures += 1
                pause = min(STORE_BACKOFF[1], STORE_BACKOFF[0] * 2 ** (failures - 1))
                log.warning("delivery pick on %s failed (%s); again in %gs", route.name, exc, pause)
                await asyncio.sleep(pause)
                if not self.picking:
                    return
            except Exception:
                log.exception("delivery on route %s failed", route.name)
                return
        await self._count(lane, result, before)
        if result.next is not None:
            self._hint(lane, result.next)
        if result.why in ("not_due", "unconfirmed"):  # due later: try it then
            self._hint(lane, Due(due.ref, result.due_ms, result.now_ms))

    async def _watch(self) -> None:
        """The routes with waiting work, every QUEUE_WATCH (jittered so replicas spread
        out). With no async route it still looks, every BACKSTOP: work accepted while a
        route was async (before a reload or a restart made it sync) is delivered all the
        same. About every REPAIR seconds (and at start), the store's counts are repaired."""
        repair_at = 0.0
        loop = asyncio.get_running_loop()
        while True:
            asyncs = [r.name for r in self.config.routes if r.delivery.mode == "async"]
            busy = bool(self.lanes) or bool(asyncs)
            try:
                if loop.time() >= repair_at:
                    repair_at = loop.time() + REPAIR * random.uniform(0.8, 1.2)
                    await self.store.repair_counts(sorted({*asyncs, *self._pending}))
                stats = await self.store.queue_stats()
            except StoreError as exc:
                log.debug("queue watch: %s", exc)  # accept fails on its own, and says so
            except Exception:
                # One that nobody foresaw ends neither this loop nor, through run()'s
                # gather, the lanes: the worker keeps delivering, as the sweep does.
                log.exception("delivery queue watch failed")
                stop_if_cancelled()
            else:
                pending, self._pending = self._pending, {s.route for s in stats}
                if self._pending - pending:
                    self.configure(self.config)  # lanes for sync routes' leftovers
                    self._rescan.set()
            await asyncio.sleep((QUEUE_WATCH if busy else BACKSTOP) * random.uniform(0.8, 1.2))

    async def _rescans(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BACKSTOP * random.uniform(0.8, 1.2)):
                    await self._rescan.wait()
            self._rescan.clear()
            for lane in list(self.lanes.values()):
                limit = 2 * lane.route.delivery.concurrency
                try:
                    found, _ = await self.store.due_candidates(lane.route.name, limit)
                except Exception as exc:
                    if isinstance(exc, StoreError):
                        log.warning("delivery rescan of %s failed: %s", lane.route.name, exc)
                    else:
                        log.exception("delivery rescan of %s failed", lane.route.name)
                    stop_if_cancelled()
                    self._rescan.set()
                    await asyncio.sleep(STORE_BACKOFF[1])
                    break
                for due in found:
                    if due.ref.digest not in lane.live:
                        self._hint(lane, due)
            await self._park_orphans()

    async def _park_orphans(self) -> None:
        """Deliveries of a route no longer configured: nobody can deliver them, so a
        person decides (as the sweep does with such a route's unresolved keys)."""
        configured = {route.name for route in self.config.routes}
        for name in sorted(self._pending - configured):
            reason = f"route {name!r} is no longer configured"
            try:
                found, _ = await self.store.due_candidates(name, 100)
                for due in found:
                    await self.store.pick(name, due.ref, "orphan", 1.0, 0, self.replica, reason)
            except StoreError as exc:
                log.warning("parking deliveries of removed route %s failed: %s", name, exc)
            except Exception:
                log.exception("parking deliveries of removed route %s failed", name)
                stop_if_cancelled()
