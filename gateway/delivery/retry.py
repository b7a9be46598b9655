"""The retry schedule of an async route's deliveries: when the next attempt goes
(`plan`: full jitter from `retry.backoff`, capped by `retry.max_backoff`, none after
`retry.attempts`), and the upstream's Retry-After read as seconds (`parse_retry_after`:
delta-seconds or an HTTP-date, anything else ignored). The reconciler plans a
delivery the upstream says did not run by the same schedule.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from gateway.config import RetryConfig, Route
from gateway.digits import capped_number
from gateway.headers import http_date


def next_delay(
    retry: RetryConfig,
    attempts: int,
    retry_after: float | None,
    rand: Callable[[float, float], float] = random.uniform,
) -> float:
    """Seconds before the next attempt, after `attempts` attempts: the upstream's
    Retry-After if it sent one (capped by max_backoff: it named the time, jitter would
    only delay it), else full jitter: uniform(0, min(max_backoff, backoff * 2 ** (n-1)))."""
    if retry_after is not None:
        return min(retry_after, retry.max_backoff)
    ceiling = min(retry.max_backoff, retry.backoff * 2.0 ** min(max(attempts - 1, 0), 60))
    return rand(0, ceiling)


#: RFC 9111 1.2.2: a delta-seconds too large to hold is read as 2^31 (68 years); the
#: route's max_backoff caps it anyway.
RETRY_AFTER_CAP = 2**31


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Retry-After (RFC 9110 10.2.3) as seconds from `now`, 0 to RETRY_AFTER_CAP:
    delta-seconds, ASCII `1*DIGIT` (one too large to hold is RETRY_AFTER_CAP), or an
    HTTP-date in one of its three formats. None when absent, and for anything else:
    ignored, never an error."""
    if value is None:
        return None
    value = value.strip(" \t")  # OWS; a parser hands the value over without it anyway
    seconds = capped_number(value, RETRY_AFTER_CAP)
    if seconds is not None:
        return float(seconds)
    when = http_date(value, now)
    return None if when is None else min(max(0.0, when - now), float(RETRY_AFTER_CAP))


def plan(route: Route, attempts: int, retry_after: float | None) -> float | None:
    """The next attempt's delay after `attempts` attempts, or None when they are all
    used (the delivery is parked)."""
    if attempts >= route.retry.attempts:
        return None
    return next_delay(route.retry, attempts, retry_after)
