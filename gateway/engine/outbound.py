"""The request a keyed or passthrough route sends its upstream, and how each is measured.

The engine decides whether a request goes out; this builds what the upstream gets (the
route's URL, X-Forwarded-* and Forwarded, the key header) and keeps the route's
upstream metrics (in flight, duration, last success: an answer that arrived whole) and
the trace's upstream status.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from gateway.config import Route
from gateway.headers import NO_PROXIES, TrustedProxies, forwarded_headers
from gateway.keying import RequestParts, key_header_value
from gateway.logs import current_trace
from gateway.metrics import RouteMetrics
from gateway.records import is_success
from gateway.upstream import ResponseBudget, Upstream, UpstreamResponse


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the request came from, for X-Forwarded-* and Forwarded."""

    client: str | None  # the immediate peer's address
    scheme: str
    proxies: TrustedProxies = NO_PROXIES  # server.trusted_proxies


@dataclass(frozen=True, slots=True)
class Outbound:
    """What the upstream gets: built from the caller's request (`outbound`), or from a
    delivery's stored request, the same way."""

    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes


def outbound(route: Route, parts: RequestParts, origin: Origin, key: str | None) -> Outbound:
    headers = forwarded_headers(parts.headers, origin.client, origin.scheme, origin.proxies)
    url = route.upstream + parts.path + ("?" + parts.query if parts.query else "")
    return Outbound(parts.method, url, with_key(route, headers, key), parts.body)


def with_key(
    route: Route, headers: list[tuple[str, str]], key: str | None
) -> list[tuple[str, str]]:
    """The headers with the route's key header set to `key` (none if it has none)."""
    if key is not None and route.forward_key_header:
        name = route.forward_key_header.lower()
        headers = [(n, v) for n, v in headers if n != name]
        headers.append((route.forward_key_header, key_header_value(key)))
    return headers


async def send(
    upstream: Upstream,
    budget: ResponseBudget,
    metrics: RouteMetrics,
    route: Route,
    out: Outbound,
    settles: bool,
) -> UpstreamResponse:
    """`out` to the upstream, measured. `settles`: the body's end decides a key, so it
    is read to its end even if the caller goes away."""
    metrics.in_flight.inc()
    started = time.perf_counter()
    response: UpstreamResponse | None = None
    try:
        response = await upstream.forward(
            out.method,
            out.url,
            out.headers,
            out.body,
            route.upstream_timeout,
            route.max_response_body,
            budget,  # budget, whole_up_to, read_to_end (positional: per request)
            route.max_stored_body,
            settles,
        )
    finally:
        if response is None or response.rest is None:
            _answered(metrics, started, response)
        else:  # a streamed answer is complete at its end
            response.rest.when_done(functools.partial(_answered, metrics, started, response))
    trace = current_trace.get()
    if trace is not None:
        trace.upstream_status = response.status
    return response


def _answered(metrics: RouteMetrics, started: float, response: UpstreamResponse | None) -> None:
    """The forward is over. Its answer is the route's last success only if it came
    whole: a streamed body cut off after a 200 is an unknown outcome, not a success."""
    metrics.upstream_duration.observe(time.perf_counter() - started)
    metrics.in_flight.dec()
    if response is None or not is_success(response.status):
        return
    if response.rest is None or response.rest.whole:
        metrics.last_success.set(time.time())
