"""Prometheus metrics, on a registry each gateway creates (so tests can build many)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.records import OPEN_STATES

if TYPE_CHECKING:
    from gateway.records import QueueStat, StateCount, StoreInfo

#: Every value the `outcome` label takes, so dashboards can rely on the set.
OUTCOMES = (
    "forwarded",  # first request for a key, response stored
    "replayed",  # a stored response was replayed
    "waited",  # waited for the first request, then got its response
    "conflict",  # 409: in flight (reject or wait timed out), unresolved or parked
    "mismatch",  # 422: same key, different request
    "unreadable",  # 500: the stored response cannot be decrypted (the record is kept)
    "missing_key",  # 400: the route needs a key and the request had none
    "missing_key_forwarded",  # no key, forwarded without dedupe (on_missing: forward)
    "bad_request",  # 400/413/431: the request could not be keyed
    "passthrough",  # a route without a key
    "upstream_error",  # never sent (502), or a status not cached: the key was released
    "unknown_outcome",  # sent, answer lost: 504, the key is unresolved
    "store_error",  # 503: the store failed and the route fails closed
    "store_bypassed",  # the store failed and the route fails open
    "accepted",  # 202: queued for delivery on a delivery: async route
    "accepted_unconfirmed",  # 202 accepted-unconfirmed: queued, a replica did not confirm it
    "queue_full",  # 503: the async route has delivery.max_queued waiting
    "status",  # a status URL answered with its delivery's state
    "status_not_found",  # 404: a status URL naming no delivery (route "": not trusted)
    "internal_error",  # 500 internal-error: an unexpected error, logged with its cause
)

#: Every value the delivery attempts' `result` label takes.
ATTEMPT_RESULTS = ("completed", "retry_scheduled", "unknown_outcome", "exhausted")
#: The queue depth's `state` values (the due indexes' two states).
QUEUE_STATES = ("queued", "retrying")


@dataclass(frozen=True, slots=True)
class RouteMetrics:
    """The per-route children a forward touches, resolved once per route: a label
    lookup takes a lock and hashes the labels, three times per request otherwise."""

    in_flight: Gauge
    upstream_duration: Histogram
    last_success: Gauge


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._counters: dict[tuple[str, str], list[Counter]] = {}
        self._routes: dict[str, RouteMetrics] = {}
        prefix = "idempotency_gateway_"
        self.requests = Counter(
            prefix + "requests",
            "Requests by route and what the gateway did with them.",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.duplicates_suppressed = Counter(
            prefix + "duplicates_suppressed",
            "Repeats of a key that did not reach the upstream.",
            ["route"],
            registry=self.registry,
        )
        self.upstream_duration = Histogram(
            prefix + "upstream_duration_seconds",
            "Time to a complete upstream answer (or failure).",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            prefix + "in_flight",
            "Forwards under way.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.last_success = Gauge(
            prefix + "last_success_timestamp_seconds",
            "When the route's upstream last completed a request (unix time).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="max",
        )

        self.reconcile = Counter(
            prefix + "reconcile",
            "Checks of unknown outcomes with the upstream, by result.",
            ["route", "result"],
            registry=self.registry,
        )
        self.reconcile_unsent = Counter(
            prefix + "reconcile_unsent",
            "Checks not sent because the key cannot be placed in reconcile.url's path "
            "without changing where it goes (each also counts as inconclusive), by reason: "
            "separator, dot_segment, empty_segment.",
            ["route", "reason"],
            registry=self.registry,
        )
        self.operator_actions = Counter(
            prefix + "operator_actions",
            "Operator actions that changed a record, by action and the operator's role "
            "(never their name: one series per person would grow without bound).",
            ["action", "role"],
            registry=self.registry,
        )
        for action in ("claim", "resolve_done", "resolve_retry"):
            # Present at 0 before the first, so increase() sees the first too.
            self.operator_actions.labels(action, "operator")
        self.keys = Gauge(
            prefix + "keys",
            "Unresolved, parked and claimed keys, cluster-wide (read from the store).",
            ["route", "state"],
            registry=self.registry,
            # Read from the store at scrape time by whichever worker answers.
            multiprocess_mode="mostrecent",
        )
        self.oldest_key_age = Gauge(
            prefix + "oldest_key_age_seconds",
            "Age in its state of the oldest unresolved, parked or claimed key.",
            ["route", "state"],
            registry=self.registry,
            # Read from the store at scrape time by whichever worker answers.
            multiprocess_mode="mostrecent",
        )
        self.store_resets = Counter(
            prefix + "store_resets",
            "Times the store was found to have lost its records (a restart without "
            "persistence, a flush): repeats of keys done before will run again.",
            registry=self.registry,
        )
        self.store_up = Gauge(
            prefix + "store_up",
            "1 if the last read of the store for these metrics succeeded.",
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.store_info = Gauge(
            prefix + "store_info",
            "1 for what the store last said about keeping records: its maxmemory-policy "
            "(anything but noeviction may evict records, and their keys run again) and "
            "whether it writes an append-only file (aof: yes, no, n/a, unknown).",
            ["maxmemory_policy", "aof"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self._store_info: tuple[str, str] | None = None
        self.buffered_response_bytes = Gauge(
            prefix + "buffered_response_bytes",
            "Response bytes held in memory: bodies being read to be stored or sent whole, "
            "and streamed parts not yet written to their callers "
            "(limit: server.max_buffered_responses).",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.buffer_full = Counter(
            prefix + "buffer_full",
            "Times server.max_buffered_responses was reached, by what it caused: "
            "streamed (a response that would have been read whole was streamed, so a "
            "keyed one was stored without its body) or paused (a streamed response's "
            "upstream read waited for memory).",
            ["action"],
            registry=self.registry,
        )
        self._buffer_full = {
            action: self.buffer_full.labels(action) for action in ("streamed", "paused")
        }
        self._buffered: Callable[[], int] | None = None
        self.queue_depth = Gauge(
            prefix + "queue_depth",
            "Deliveries waiting on async routes, cluster-wide (read from the store): "
            "queued (never attempted) and retrying (due again after a failed attempt).",
            ["route", "state"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.queue_max = Gauge(
            prefix + "queue_max",
            "Each async route's delivery.max_queued: at queue_depth's sum (queued plus "
            "retrying) new keys get 503 queue-full.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.queue_oldest_age = Gauge(
            prefix + "queue_oldest_age_seconds",
            "The longest a due delivery has waited for a worker (queued since accepted, "
            "retrying since due), cluster-wide.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.route_paused = Gauge(
            prefix + "route_paused",
            "1 while an async route is paused (read from the store): no delivery is "
            "attempted but its probes. by: auto (its upstream refused pause_after attempts "
            "in a row) or operator (paused by hand: only a resume lifts it).",
            ["route", "by"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.delivery_attempts = Counter(
            prefix + "delivery_attempts",
            "Delivery attempts by result, counted by the process that made them; "
            "exhausted also when a pick finds no attempt left (the delivery is parked).",
            ["route", "result"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            prefix + "delivery_rate_limited",
            "Times a due delivery, or a reconcile check, found its route's rate limit "
            "(delivery.rate) without a token and waited: the delivery stays queued, and "
            "the wait is no attempt.",
            ["route", "what"],
            registry=self.registry,
        )
        self.first_attempt_delay = Histogram(
            prefix + "delivery_first_attempt_delay_seconds",
            "Time from acceptance (202) to a delivery's first attempt, by the store's clock.",
            ["route"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )

    def set_key_stats(self, stats: list[StateCount], routes: list[str]) -> None:
        """Replace the key gauges with a fresh read; every route and open state is
        present, at 0 when empty, so an alert on absence is never needed."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            # Drops routes a reload removed; workers' files cannot be cleared, and
            # every current label set is written below anyway.
            self.keys.clear()
            self.oldest_key_age.clear()
        for route in routes:
            for state in OPEN_STATES:
                self.keys.labels(route, str(state)).set(0)
                self.oldest_key_age.labels(route, str(state)).set(0)
        for stat in stats:
            self.keys.labels(stat.route, str(stat.state)).set(stat.count)
            self.oldest_key_age.labels(stat.route, str(stat.state)).set(stat.oldest_seconds)

    def set_queue_stats(self, stats: list[QueueStat], routes: dict[str, int]) -> None:
        """Replace the queue gauges with a fresh read: every async route (name: its
        max_queued) x state is present at 0 when empty; a route no longer configured,
        or made sync, shows while it has work."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            self.queue_depth.clear()
            self.queue_oldest_age.clear()
            self.queue_max.clear()
        for route, limit in routes.items():
            self.queue_max.labels(route).set(limit)
            for state in QUEUE_STATES:
                self.queue_depth.labels(route, state).set(0)
            self.queue_oldest_age.labels(route).set(0)
            # Present at 0 before the first one, so increase() sees the first too.
            self.first_attempt_delay.labels(route)
            for result in ATTEMPT_RESULTS:
                self.delivery_attempts.labels(route, result)
            for what in ("delivery", "check"):
                self.rate_limited.labels(route, what)
        for stat in stats:
            self.queue_depth.labels(stat.route, "queued").set(stat.queued)
            self.queue_depth.labels(stat.route, "retrying").set(stat.retrying)
            self.queue_oldest_age.labels(stat.route).set(stat.oldest_wait_seconds)

    def set_pauses(self, paused: dict[str, str], routes: list[str]) -> None:
        """Replace the pause gauge with a fresh read (`paused`: route -> "auto" or
        "operator", the paused routes alone): every async route is present, at 0 when
        it is not paused, by both kinds; a paused route no longer configured too."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            self.route_paused.clear()
        for route in sorted({*routes, *paused}):
            for by in ("auto", "operator"):
                self.route_paused.labels(route, by).set(1 if paused.get(route) == by else 0)

    def attempt(self, route: str, result: str) -> None:
        """A delivery attempt's result ("" when nothing was attempted: not counted)."""
        if result:
            self.delivery_attempts.labels(route, result).inc()

    def first_attempt(self, route: str, delay_ms: int) -> None:
        self.first_attempt_delay.labels(route).observe(max(0, delay_ms) / 1000)

    def set_store_info(self, info: StoreInfo) -> None:
        labels = (info.maxmemory_policy, info.aof)
        old, self._store_info = self._store_info, labels
        if old is not None and old != labels:
            if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
                # Workers' files cannot be cleared: the most recent value wins.
                self.store_info.labels(*old).set(0)
            else:
                self.store_info.remove(*old)
        self.store_info.labels(*labels).set(1)

    def watch_buffered(self, held: Callable[[], int]) -> None:
        """Report `held()` as the buffered-bytes gauge: read at scrape time, so the
        per-request path never touches the gauge. Multiprocess samples are files each
        worker writes, so there `refresh_buffered` copies it in, once a second."""
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            self._buffered = held
        else:
            self.buffered_response_bytes.set_function(held)

    def refresh_buffered(self) -> None:
        if self._buffered is not None:
            self.buffered_response_bytes.set(self._buffered())

    def buffer_full_event(self, action: str) -> None:
        self._buffer_full[action].inc()

    def operator_action(self, action: str, role: str) -> None:
        self.operator_actions.labels(action, str(role)).inc()

    def last_success_age(self, route: str) -> float | None:
        """Seconds since this process's last success on `route` (None before the
        first): the gauge's value, which holds a unix time once set."""
        found = self._routes.get(route)
        if found is None:
            return None
        for metric in found.last_success.collect():
            for sample in metric.samples:
                if sample.value > 0:
                    return round(max(0.0, time.time() - sample.value), 3)
        return None

    def for_route(self, route: str) -> RouteMetrics:
        found = self._routes.get(route)
        if found is None:
            found = self._routes[route] = RouteMetrics(
                self.in_flight.labels(route),
                self.upstream_duration.labels(route),
                self.last_success.labels(route),
            )
        return found

    def count(self, route: str, outcome: str) -> None:
        # Label lookups take a lock and hash the labels: resolve each pair once.
        counters = self._counters.get((route, outcome))
        if counters is None:
            counters = [self.requests.labels(route, outcome)]
            if outcome in ("replayed", "waited", "conflict"):
                counters.append(self.duplicates_suppressed.labels(route))
            self._counters[(route, outcome)] = counters
        for counter in counters:
            counter.inc()
