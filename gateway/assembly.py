"""The `Gateway`: the parts one process runs, built in order (the store, the upstream
client, the metrics, the routes, the operators and their roster, the reconciler, the
engine, the delivery worker), each handed what it needs when it is made; started and
closed together, and given a new config on reload (SIGHUP).

`Gateway(config, store=..., upstream=...)` is the seam tests use: pass a store to share
it, or let the config's URL choose one. The proxy's and the admin listener's apps
(gateway/proxy/app.py, gateway/admin/api.py) are views on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from dataclasses import replace

from gateway.config import Config
from gateway.delivery.worker import DeliveryWorker
from gateway.engine.core import Engine
from gateway.errors import StoreError
from gateway.headers import TrustedProxies
from gateway.metrics import Metrics
from gateway.operators.identity import Operators
from gateway.operators.roster import Roster
from gateway.reconcile import Reconciler
from gateway.routes import Router
from gateway.shared_read import SharedRead
from gateway.store import open_store
from gateway.store.base import Counts, Store
from gateway.store.route_pauses import AUTO
from gateway.tasks import stop_if_cancelled
from gateway.upstream import Upstream

log = logging.getLogger("gateway")

#: Seconds between looks at the store's markers (see Store.check_reset).
STORE_WATCH_INTERVAL = 1.0

#: Seconds the counts a scrape or an overview reports are kept for the next ones.
COUNTS_TTL = 1.0


class Gateway:
    def __init__(
        self,
        config: Config,
        *,
        store: Store | None = None,
        upstream: Upstream | None = None,
        metrics: Metrics | None = None,
        sweep: bool = True,
    ) -> None:
        # The parts, each built from those before it; a reload hands each its new config.
        self.config = config
        self.store = store if store is not None else open_store(config.store, config.source)
        self.upstream = (
            upstream
            if upstream is not None
            else Upstream(keepalive=config.server.upstream_keep_alive)
        )
        self.metrics = metrics if metrics is not None else Metrics()
        self.router = Router(config.routes)
        self.proxies = TrustedProxies(config.server.trusted_proxies)
        #: who may use the operator API, from the current config (rebuilt on reload)
        self.operators = Operators(config.admin)
        #: since when each operator's console sessions are valid (the store's answer)
        self.roster = Roster(self.store)
        self.roster.configure(self.operators.roster())
        # Unique per Gateway, so replicas (and in-process gateways) hand off to each other.
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"
        self.reconciler = Reconciler(config, self.store, self.upstream, self.metrics)
        self.engine = Engine(
            config,
            self.store,
            self.upstream,
            self.metrics,
            replica=self.replica,
            reconciler=self.reconciler,
        )
        budget = self.engine.budget
        self.metrics.watch_buffered(lambda: budget.held)
        self.delivery = DeliveryWorker(config, self.store, self.engine, self.replica)
        self.sweep = sweep
        self._sweeper: asyncio.Task[None] | None = None
        #: the kept counts scrapes and overviews report: one store read per second
        self.counts = SharedRead(self._read_counts, COUNTS_TTL)
        #: how the store keeps records, as /metrics reports it: as often
        self.store_info = SharedRead(self.store.info, COUNTS_TTL)
        self._deliverer: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._rostering: asyncio.Task[None] | None = None
        self.started = False

    async def start(self) -> None:
        await self.store.start()
        await self.upstream.start()
        if self.sweep:
            self._sweeper = asyncio.create_task(self.reconciler.run(), name="sweep")
        self._watcher = asyncio.create_task(self._watch_store(), name="store-reset-watch")
        self._deliverer = asyncio.create_task(self.delivery.run(), name="delivery")
        # The roster is recorded before the console answers; a store that is down
        # now is asked again (Roster.run), and sessions wait for it.
        with contextlib.suppress(StoreError):
            await self.roster.record()
        self._rostering = asyncio.create_task(self.roster.run(), name="operator-roster")
        self.started = True

    async def _watch_store(self) -> None:
        """Notice a store that lost its records under a running gateway, and say so
        loudly: every key completed before will run again if repeated, and keys of
        unknown outcome are gone with nobody left to check them."""
        while True:
            try:
                lost = await self.store.check_reset()
            except StoreError:
                lost = 0  # down: nothing to compare until it answers again
            except Exception:
                log.exception("store reset check failed")
                lost = 0
            stop_if_cancelled()
            self.metrics.refresh_buffered()
            if lost:
                self.metrics.store_resets.inc()
                log.error(
                    "STORE RESET: %d of the store's buckets lost every record (a restart "
                    "without persistence, a flush or an eviction). Repeats of keys that "
                    "completed before will run again, and keys whose outcome was unknown "
                    "are forgotten: check the upstreams for work done twice. Run Redis "
                    "with appendonly yes and appendfsync always (docs/reliability.md).",
                    lost,
                )
            await asyncio.sleep(STORE_WATCH_INTERVAL)

    async def close(self) -> None:
        self.started = False
        self.delivery.stop_picking()
        # Forwards still out are settled (marked unresolved) while the store is open.
        await self.engine.drain(0)
        for task in (self._deliverer, self._sweeper, self._watcher, self._rostering):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.upstream.close()
        await self.store.close()

    def reload(self, config: Config) -> list[str]:
        """Swap in a new config's routes, upstreams and policies. Requests in flight
        keep the route they started with. Listeners and the store need a restart:
        changes there are kept out and reported."""
        kept: list[str] = []
        for name, old, new in (
            ("store", self.config.store, config.store),
            ("server.listen", self.config.server.listen, config.server.listen),
            ("admin.listen", self.config.admin.listen, config.admin.listen),
            # 202s handed out name the prefix their callers will poll
            ("server.status_prefix", self.config.server.status_prefix, config.server.status_prefix),
        ):
            if old != new:
                kept.append(f"{name} changed: restart the gateway to apply it")
        config = replace(
            config,
            store=self.config.store,
            server=replace(
                config.server,
                listen=self.config.server.listen,
                status_prefix=self.config.server.status_prefix,
            ),
            admin=replace(config.admin, listen=self.config.admin.listen),
        )
        self.config = config
        self.router = Router(config.routes)
        self.proxies = TrustedProxies(config.server.trusted_proxies)
        self.operators = Operators(config.admin)
        self.roster.configure(self.operators.roster())
        self.engine.configure(config)
        self.reconciler.configure(config)
        self.delivery.configure(config)
        return kept

    async def _read_counts(self) -> Counts:
        return Counts(
            await self.store.stats(),
            await self.store.queue_stats(),
            await self.store.last_successes(),
            await self.store.route_pauses(),
        )

    async def refresh_key_metrics(self) -> None:
        """Read key counts and ages from the store (shared by concurrent scrapes, at
        most COUNTS_TTL old), so every replica reports the cluster-wide truth."""
        try:
            counts = await self.counts.get()
        except StoreError:
            self.metrics.store_up.set(0)
            return
        stats, queues = counts.stats, counts.queues
        self.metrics.store_up.set(1)
        self.metrics.set_key_stats(stats, [r.name for r in self.config.routes])
        asyncs = {
            r.name: r.delivery.max_queued for r in self.config.routes if r.delivery.mode == "async"
        }
        self.metrics.set_queue_stats(queues, asyncs)
        paused = {
            route: "auto" if state.by == AUTO else "operator"
            for route, state in counts.pauses.items()
            if state.paused
        }
        self.metrics.set_pauses(paused, list(asyncs))

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
