"""A route's delivery (`sync`, or `async`: 202 at once, delivered by the gateway) and
the retry schedule of its deliveries, with the checks that tie them to the route's
other settings (an async route needs a key, a stored job, a policy that never resends
blind).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from gateway.config.http import HeaderNames
from gateway.config.issues import Problems
from gateway.config.sections import Section, settings
from gateway.config.types import Duration, OneOf, Whole
from gateway.config.units import format_duration

DeliveryMode = Literal["sync", "async"]


@settings
class RetryConfig(Section):
    """When a delivery that was never sent, or answered a status not cached, runs again."""

    example = "retry: {attempts: 8, backoff: 2s, max_backoff: 10m}"

    attempts: Annotated[int, Whole(1, 1000)] = 8  # in all, the first included
    backoff: Duration = 2.0
    max_backoff: Duration = 600.0

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
    """`sync`: the caller waits for the upstream. `async`: the caller gets 202 and a
    status URL at once; the gateway delivers the request, retrying per `retry`."""

    example = "delivery: async   (or {mode: async, concurrency: 4, max_queued: 10000})"

    mode: Annotated[DeliveryMode, OneOf()] = "sync"
    concurrency: Annotated[int, Whole(1, 1000)] = 4  # per route, per process
    max_queued: Annotated[int, Whole(1, 10_000_000)] = 10_000  # queued + retrying
    drop_headers: HeaderNames = frozenset()  # request headers never stored

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        if values.get("mode") == "sync":
            for name in ("concurrency", "max_queued", "drop_headers"):
                if name in given:
                    problems.add((name,), f"{name} is set but delivery is sync; add mode: async")
        return {}


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
