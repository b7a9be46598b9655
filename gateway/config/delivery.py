"""A route's delivery (`sync`, or `async`: 202 at once, delivered by the gateway) and
the retry schedule of its deliveries, with the checks that tie them to the route's
other settings (an async route needs a key, a stored job, a policy that never resends
blind).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from gateway.config.http import HOP_BY_HOP, HeaderNames, HeaderOrOff
from gateway.config.issues import Problems
from gateway.config.sections import Section, settings
from gateway.config.types import Duration, GraceDuration, GroupName, OneOf, Rate, Whole
from gateway.config.units import format_duration

DeliveryMode = Literal["sync", "async"]


@settings
class RetryConfig(Section):
    """When a delivery that was never sent, or answered a status not in
    `cache_statuses`, is attempted again. Before attempt n the gateway waits a delay
    drawn from 0 to min(`max_backoff`, `backoff` x 2^(n-2)) (full jitter), or the
    upstream's `Retry-After` if it sent one, capped by `max_backoff`. An attempt whose
    outcome is unknown is never retried: `on_unknown_outcome` decides. `explain` prints
    the first delays."""

    example = "retry: {attempts: 8, backoff: 2s, max_backoff: 10m}"

    attempts: Annotated[int, Whole(1, 1000)] = 8
    """Attempts in all, the first included; after the last, the delivery is parked for
    an operator."""
    backoff: Duration = 2.0
    """The ceiling of the first retry's delay, doubled for each retry after it."""
    max_backoff: Duration = 600.0
    """The longest delay before an attempt, `Retry-After` included; at least
    `backoff`."""

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        backoff, cap = values.get("backoff"), values.get("max_backoff")
        if backoff is not None and backoff <= 0:
            problems.add(("backoff",), "must be more than 0s; write e.g. backoff: 2s")
        elif backoff is not None and cap is not None and cap < backoff:
            fmt = format_duration
            problems.add(
                ("max_backoff",),
                f"max_backoff {fmt(cap)} is shorter than backoff {fmt(backoff)}; make it at "
                f"least {fmt(backoff)}",
            )
        return {}


@settings
class DeliveryConfig(Section):
    """How the route's requests reach the upstream. `delivery: async` is short for
    `{mode: async}`. On an async route a new key is stored and queued in one store round
    trip and answered 202 at once, with the status URL in `Location` and the body's
    `status_url`; a worker of any replica delivers it, retrying per `retry`. A repeat
    gets the same 202 with the current state (`Idempotent-Replayed: true`)."""

    example = "delivery: async   (or {mode: async, concurrency: 4, rate: 20/s, burst: 5})"
    written = "`sync`, `async`, or a mapping"

    mode: Annotated[DeliveryMode, OneOf()] = "sync"
    """`sync`: the caller waits for the upstream's answer. `async`: the gateway
    delivers."""
    concurrency: Annotated[int, Whole(1, 1000)] = 4
    """Attempts of this route under way at once, per process; every process also
    counts them toward its `server.max_deliveries`. An upstream sees at most this
    times the number of processes."""
    max_queued: Annotated[int, Whole(1, 10_000_000)] = 10_000
    """Deliveries of this route waiting, queued plus retrying over all replicas. At it,
    new keys get 503 `queue-full` with `Retry-After: 30`; repeats of accepted keys
    still get their 202."""
    drop_headers: HeaderNames = frozenset()
    """Request headers never stored with a queued request, so never delivered. The key
    header is re-added at each attempt."""
    delay: GraceDuration = 0.0
    """How long after acceptance a new key's first attempt is due, unless the request
    asks for another time (`delay_header`, `not_before_header`). At most `max_delay`.
    A delay is kept in the store's due-time index, as a retry's is: it outlasts a
    restart, and waiting is never an attempt."""
    max_delay: Duration = 7 * 86400.0
    """The latest a request may ask its delivery for, from acceptance. A request that
    asks for more is refused with 400 `bad-delivery-time`, nothing stored: a job run
    earlier than asked would be worse."""
    delay_header: HeaderOrOff = "Delivery-Delay"
    """The request header that asks for a delay before the first attempt: a duration
    (`90s`, `15m`, `2h`; seconds when it has no unit), in ASCII digits. Read, then
    never stored or delivered. `false`: no header is read. Not a header the key is
    read from or forwarded in, a hop-by-hop or framing header, or `not_before_header`."""
    not_before_header: HeaderOrOff = "Delivery-Not-Before"
    """The request header that asks for the first attempt not before a time, an
    HTTP-date (`Fri, 04 Dec 2026 18:00:00 GMT`); a time past is due at once. Read,
    then never stored or delivered. `false`: no header is read. Not a header the key
    is read from or forwarded in, a hop-by-hop or framing header, or `delay_header`."""
    pause_after: Annotated[int, Whole(0, 1000)] = 0
    """Attempts in a row, over all replicas, refused or never sent (the connection
    refused or failed, a 5xx, a 429) after which the route pauses: no delivery is
    attempted but one probe every `probe_every` (a real attempt of that delivery), and
    the first probe the upstream answers resumes the route. While paused nothing uses
    up an attempt or is parked for exhaustion: a probe refused or never sent is not
    counted as one of its delivery's attempts, which is due again after `probe_every`.
    An unknown outcome (sent, then no answer) leaves the count as it is. 0: never."""
    probe_every: Duration = 30.0
    """While the route is paused by `pause_after`, how often one delivery is attempted
    as a probe, by one process of all replicas. An operator's pause sends no probe."""
    rate: Rate | None = None
    """The most attempts a second the upstream sees from this route, over every replica
    and worker (`20/s`, `600/m`, `1000/h`), kept in the store; its reconcile checks
    count against it too. A delivery that finds no token waits queued, in due order,
    and is not attempted: the wait never counts as an attempt. `unset`: no limit
    (each process still keeps to `concurrency`)."""
    burst: Annotated[int, Whole(1, 100_000)] = 1
    """The most attempts sent at once after a quiet spell: over any
    span t the upstream sees at most rate x t + burst. Only with `rate`."""
    rate_group: GroupName | None = None
    """A name for the service behind the route: the routes that give the same
    `rate_group` share one limit, so the service sees at most `rate` from all of them
    together. Each must give the same `rate` and `burst`. `unset`: the route's limit
    is its own. Only with `rate`."""

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        if "rate" not in given:
            for name in ("burst", "rate_group"):
                if name in given:
                    problems.add((name,), f"{name} needs a rate; add e.g. rate: 20/s")
        if values.get("mode") == "sync":
            for name in (
                "concurrency",
                "max_queued",
                "drop_headers",
                "delay",
                "max_delay",
                "delay_header",
                "not_before_header",
                "pause_after",
                "probe_every",
                "rate",
            ):
                if name in given:
                    problems.add((name,), f"{name} is set but delivery is sync; add mode: async")
            return {}
        delay, cap = values.get("delay"), values.get("max_delay")
        if delay is not None and cap is not None and delay > cap:
            fmt = format_duration
            problems.add(
                ("delay",),
                f"delay {fmt(delay)} is longer than max_delay {fmt(cap)}; make it at most "
                f"{fmt(cap)}, or raise max_delay",
            )
        return {}

    def limit_name(self, route: str) -> str | None:
        """The store's name of the route's rate limit (its group's, shared), or None."""
        if self.rate is None:
            return None
        return f"group:{self.rate_group}" if self.rate_group else f"route:{route}"


def delivery_shorthand(value: object) -> object:
    """`delivery: async` means `delivery: {mode: async}`."""
    return {"mode": value} if isinstance(value, str) else value


SYNC = DeliveryConfig()
DEFAULT_RETRY = RetryConfig()


def check_async(
    values: dict[str, Any], given: dict[str, Any], inherited: frozenset[str], problems: Problems
) -> None:
    """The settings an async route cannot have, each with its fix; and `retry` written
    on a sync route (inherited from `defaults:`, it is ignored there)."""
    delivery = values.get("delivery")
    if delivery is None or delivery.mode != "async":
        if "retry" in given and "retry" not in inherited and delivery is not None:
            problems.add(
                ("retry",),
                "retry applies to delivery: async routes; set delivery: async or remove it",
            )
        return
    key = values.get("key")
    if "key" in values and key is None:
        problems.add(
            ("delivery",),
            "delivery: async needs a key, so repeats are deduplicated; add e.g. key: "
            "{header: Idempotency-Key}",
        )
    elif key is not None and key.on_missing == "forward":
        problems.add(
            ("key", "on_missing"),
            "a request without a key cannot be queued on a delivery: async route; use "
            "on_missing: reject",
        )
    _check_time_headers(values, delivery, key, problems)
    if values.get("on_store_error") == "fail_open":
        problems.add(
            ("on_store_error",),
            "an accepted job must be stored: fail_open would forward it unqueued on a "
            "delivery: async route; use fail_closed (503, the caller retries)",
        )
    if values.get("on_unknown_outcome") == "release":
        problems.add(
            ("on_unknown_outcome",),
            "release is refused on a delivery: async route: the caller got 202 and will "
            "not retry, and an unknown outcome is never retried blind, so release would "
            "resend blind or forget the work; use reconcile (with a reconcile: block) or park",
        )


#: The header each delivery-time setting reads by default, to suggest instead.
_TIME_HEADER_DEFAULTS = {
    "delay_header": "Delivery-Delay",
    "not_before_header": "Delivery-Not-Before",
}


def _check_time_headers(
    values: dict[str, Any], delivery: DeliveryConfig, key: Any, problems: Problems
) -> None:
    """A delivery-time header must mean nothing else to the request: a key read from it
    (`3600` would be an hour's delay), the key header forwarded, a hop-by-hop or framing
    header (`Content-Length` read as seconds), or the other delivery-time header."""
    taken: dict[str, str] = {}
    for source in getattr(key, "sources", ()):
        names = [source.name] if source.kind == "header" else []
        if source.kind == "template":
            names = re.findall(r"\{header\.([^}]+)\}", source.name)
        elif source.kind == "hash":
            names = [part[len("header.") :] for part in source.parts if part.startswith("header.")]
        for name in names:
            taken.setdefault(name.lower(), f"the key is read from {name}")
    forwarded = values.get("forward_key_header")
    if forwarded:
        taken.setdefault(str(forwarded).lower(), f"the key is forwarded in {forwarded}")
    for setting in ("delay_header", "not_before_header"):
        name = getattr(delivery, setting)
        if not name:
            continue
        lowered = name.lower()
        why = taken.get(lowered)
        if why is None and lowered in HOP_BY_HOP:
            why = f"{name} frames the request on one hop"
        if why is not None:
            problems.add(
                ("delivery", setting),
                f"{setting} {name} cannot ask for a delivery time: {why}; use a header "
                f"of its own, e.g. {_TIME_HEADER_DEFAULTS[setting]}, or false",
            )
        taken.setdefault(lowered, f"delay_header reads {name}")
