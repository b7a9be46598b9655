"""Routes: what a route is, its settings, the `defaults:` they inherit, and the checks
that span settings (a `{path.x}` the path lacks, a response_ttl shorter than the
upstream timeout, a reconcile policy without its block).

In the file a route's method and path sit under `match:`; the object has them as
`methods` and `path`, which the router reads on every request.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar

from pydantic import BeforeValidator

from gateway.config.addresses import RECONCILE_EXAMPLE, ReconcileUrl, UpstreamUrl
from gateway.config.delivery import (
    DEFAULT_RETRY,
    SYNC,
    DeliveryConfig,
    RetryConfig,
    check_async,
    delivery_shorthand,
)
from gateway.config.http import (
    DEFAULT_CACHE_STATUSES,
    REQUEST_PARTS,
    CacheStatuses,
    Fingerprint,
    ForwardHeader,
    HeaderNames,
    Method,
    Methods,
    Statuses,
)
from gateway.config.issues import Loc, Problems
from gateway.config.keys import KeySpec, templates_in
from gateway.config.paths import PathPatternText, scan_path_pattern
from gateway.config.sections import INHERITED, Section, field_adapter, settings
from gateway.config.templates import scan_template
from gateway.config.text import kind, show, unknown_setting
from gateway.config.types import (
    ConcurrentPolicy,
    Duration,
    Flag,
    OneOf,
    RouteName,
    Size,
    StoreErrorPolicy,
    UnknownOutcomePolicy,
    Whole,
)
from gateway.config.units import format_duration, format_statuses


@settings
class ReconcileConfig(Section):
    """How to ask the upstream whether a request whose answer was lost ran. Any answer
    but `done` and `not_done`, a timeout or an error is inconclusive: the key stays
    unresolved and nothing is resent. A status endpoint should answer something else
    while the job still runs (202 is a good choice). A repeat that arrives for an
    unresolved key triggers a check, at most one at a time per key across all replicas;
    the background sweep runs in every replica and checks each key once per `every`,
    not once per replica."""

    example = f"reconcile: {RECONCILE_EXAMPLE}"
    none_is_empty = False

    url: ReconcileUrl
    """The status endpoint asked, e.g. `http://127.0.0.1:5000/jobs/status?key={key}`;
    `{key}`, `{route}` and `{run_id}` (the latest attempt's) are filled in, each
    percent-encoded for its place. The query is the safe place for `{key}`: a key that
    would change where a check in the path goes (`..`, `/`) is never sent there, and
    the check counts as inconclusive. `check-config` warns of `{key}` in the path and
    refuses a placeholder in the scheme, host or port."""
    method: Method = "GET"
    """The check's method."""
    done: Statuses = frozenset({200})
    """Statuses that say the work ran: the key completes with the check's response, and
    repeats get a 2xx saying it was reconciled."""
    not_done: Statuses = frozenset({404})
    """Statuses that say it did not run: the key is released, so the waiting or next
    request runs it (on an async route the next attempt is scheduled). A status must
    not be in both lists."""
    timeout: Duration = 5.0
    """The longest one check may take; past it the check is inconclusive."""
    every: Duration = 30.0
    """The background sweep checks an unresolved key this often."""
    park_after: Duration = 3600.0
    """Still inconclusive this long after the outcome became unknown: the key is parked
    for a person."""
    concurrency: Annotated[int, Whole(1, 1000)] = 4
    """Status checks at once per route and process, the sweep's and repeats' together: a
    backlog of N keys clears in about N / (concurrency x processes) x the check's time.
    A repeat that finds no free slot gets 409 at once and the sweep checks its key
    later."""

    @classmethod
    def from_yaml(cls, given: dict[str, Any], problems: Problems) -> dict[str, Any]:
        return {"url": None, **given}  # a missing url is reported as missing

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        both = values.get("done", frozenset()) & values.get("not_done", frozenset())
        if both:
            problems.add(
                ("not_done",),
                f"{format_statuses(frozenset(both))} is in both done and not_done; "
                "a status must mean one thing",
            )
        return {}


@settings
class Route(Section):
    """One route: which requests it takes (`match:`), where they go (`upstream`), where
    their key comes from (`key`), and what the gateway does with them."""

    example = "{name: my-job, match: {path: /jobs/x}, upstream: ...}"
    none_is_empty = False
    written_at: ClassVar[dict[str, Loc]] = {
        "path": ("match", "path"),
        "methods": ("match", "methods"),
    }
    blocks: ClassVar[dict[str, str]] = {
        "match": "Which requests the route takes: `{methods: [POST], path: /jobs/x}`.",
    }

    name: RouteName
    """The route's name, unique: metrics, logs, records, status URLs and the operator
    API name the route by it."""
    path: PathPatternText
    """The path matched: exact (`/jobs/send-reminder`), or a pattern whose `{name}`
    matches one segment and `{rest:path}` the rest of the path; a trailing slash counts.
    Requests are matched after dot-segments are removed, as they are forwarded. A path
    only under `server.status_prefix` is refused."""
    upstream: UpstreamUrl
    """Where requests are forwarded: a base URL (`http://127.0.0.1:5000`) the request's
    path and query are appended to; no query or fragment of its own. An `https`
    upstream is verified against the system's CAs (`SSL_CERT_FILE` names others)."""
    methods: Methods = None
    """The methods matched; unset: any method."""
    key: KeySpec | None = None
    """Where a request's idempotency key comes from (below). Unset: the route passes
    requests through, without dedupe."""
    fingerprint: Fingerprint = REQUEST_PARTS
    """What must match for a repeat to be replayed, else 422: `method`, `path`,
    `query`, `body`, `header.<Name>`; `none` to skip the check."""
    concurrent: Annotated[ConcurrentPolicy, OneOf()] = "wait"
    """A repeat while the first request still runs: `wait` for the first's answer (up
    to `wait_timeout`, woken by a notification), or `reject` it at once with 409 and
    `Retry-After`."""
    wait_timeout: Duration = 30.0
    """How long a repeat waits for the first under `concurrent: wait`; then 409 with
    `Retry-After`."""
    cache_statuses: CacheStatuses = DEFAULT_CACHE_STATUSES
    """The answers that mean the upstream handled the request: stored, and replayed to
    repeats. Any other answer releases the key, so the retry runs (a delivery: attempted
    again). Default: 2xx, 3xx and 4xx but 408 and 429. Items: `200`, `"2xx"`, `"!408"`
    (leave one out); only exclusions means the default less them. `check-config` and
    `explain` say what a route's setting does."""
    max_request_body: Size = 1024 * 1024
    """A larger request gets 413, before its body is read (a declared length) or while
    it arrives (chunked); nothing is forwarded."""
    max_stored_body: Size = 1024 * 1024
    """Response bodies up to this size are read whole, stored and sent; larger ones
    stream to the first caller as they arrive, and repeats get the status and headers
    only, with `Idempotent-Body-Omitted: true`."""
    max_response_body: Size = 64 * 1024 * 1024
    """The most response body the gateway reads; a longer (or never-ending) body stops
    the read, and the outcome is unknown."""
    forward_key_header: ForwardHeader = "Idempotency-Key"
    """The header the key is passed upstream in, so the providers the job calls can
    drop duplicates too; `false` (or `null`) to not forward it. A key of printable
    ASCII without `%`, `"` or `\\` and without a space at either end is sent as it
    is; any other as its UTF-8 bytes percent-encoded, all but letters, digits and
    `-._~` (`café` is `caf%C3%A9`, `50%` is `50%25`, `"x"` is `%22x%22`), so no
    spelling is a quoted string, which a reader of the Idempotency-Key draft would
    unquote. The forward, each delivery attempt and each reconcile check send this
    same spelling, and no two keys share one."""
    upstream_timeout: Duration = 30.0
    """One deadline around the whole upstream call: connect, send, the full response.
    On keyed routes it covers a streamed body too: a caller reading slowly may hold the
    upstream read back for the first 75% of it, then its response is cut and the rest
    is read, so the key completes in time. On routes without a key, time spent waiting
    for the caller does not count. Set it above the scheduler's own timeout."""
    response_ttl: Duration = 86400.0
    """How long a completed key is replayed; at least `upstream_timeout`."""
    on_unknown_outcome: Annotated[UnknownOutcomePolicy, OneOf()] = "park"
    """A key whose request was sent but whose answer was lost: `park` it for a person,
    `reconcile` (ask the upstream, with a `reconcile:` block), or `release` it (for
    naturally idempotent endpoints only: the retry resends it). Async routes take
    `park` or `reconcile`."""
    reconcile: ReconcileConfig | None = None
    """How to ask the upstream whether a request whose answer was lost ran (below);
    with `on_unknown_outcome: reconcile` only."""
    on_store_error: Annotated[StoreErrorPolicy, OneOf()] = "fail_closed"
    """The store unreachable: `fail_closed` answers 503 with `Retry-After`; `fail_open`
    forwards without dedupe (counted `store_bypassed`). Async routes take
    `fail_closed`."""
    strip_headers: HeaderNames = frozenset()
    """Response headers never stored, so never replayed (`Set-Cookie` never is)."""
    sensitive_keys: Flag = False
    """Logs show a hash of the key instead of the key."""
    delivery: Annotated[DeliveryConfig, BeforeValidator(delivery_shorthand)] = SYNC
    """`sync`: the caller waits for the upstream. `async`: 202 at once with a status
    URL, and the gateway delivers the request (below). An async route needs a key,
    `on_missing: reject`, `on_store_error: fail_closed` and `on_unknown_outcome`
    `park` or `reconcile`."""
    retry: RetryConfig = DEFAULT_RETRY
    """When an async route's delivery is attempted again (below); a sync route takes
    none (inherited from `defaults`, it is ignored)."""

    @classmethod
    def yaml_names(cls) -> tuple[str, ...]:
        return ("name", "match", "upstream", *SETTINGS)

    @classmethod
    def unknown(cls, name: object, problems: Problems) -> None:
        if name in ("methods", "path"):
            message = f"{name} belongs under match:, e.g. match: {{{name}: ...}}"
            problems.add((str(name),), message, name=True)
        else:
            super().unknown(name, problems)

    @classmethod
    def from_yaml(cls, given: dict[str, Any], problems: Problems) -> dict[str, Any]:
        kwargs = {name: value for name, value in given.items() if name in SETTINGS}
        kwargs["name"], kwargs["upstream"] = given.get("name"), given.get("upstream")
        match = given.get("match")
        if match is None:
            problems.add(("match",), "every route needs match: {path: /jobs/...}")
        elif not isinstance(match, dict):
            example = "match: {methods: [POST], path: /jobs/x}"
            message = f"expected a mapping (name: value), got {kind(match)}; write e.g. {example}"
            problems.add(("match",), message)
        else:
            for name in match:
                if name not in ("methods", "path"):
                    unknown = unknown_setting(str(name), ["methods", "path"])
                    problems.add(("match", str(name)), unknown, name=True)
            kwargs["methods"] = match.get("methods")
            kwargs["path"] = match.get("path")  # None: reported as missing
        return kwargs

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        check_async(values, given, inherited, problems)
        pattern = values.get("path")
        if pattern is not None and given.get("key") is not None:
            _check_path_params(pattern, given["key"], problems)
        ttl, timeout = values.get("response_ttl"), values.get("upstream_timeout")
        if ttl is not None and timeout is not None and ttl < timeout:
            fmt = format_duration
            problems.add(
                ("response_ttl" if "response_ttl" in given else "upstream_timeout",),
                f"response_ttl {fmt(ttl)} is shorter than upstream_timeout {fmt(timeout)}, so a "
                f"response could expire before its request finishes; make response_ttl at least "
                f"{fmt(timeout)} or upstream_timeout shorter",
            )
        if "on_unknown_outcome" not in values or "reconcile" not in values:
            return {}
        policy, block = values["on_unknown_outcome"], values["reconcile"]
        if policy == "reconcile" and block is None:
            problems.add(
                ("on_unknown_outcome",),
                f"reconcile needs a reconcile: block next to it; add e.g. reconcile: "
                f"{RECONCILE_EXAMPLE}",
            )
        elif policy != "reconcile" and block is not None:
            if "reconcile" in inherited:
                # The route chose another policy than the shared default; the block is not its.
                return {"reconcile": None}
            problems.add(
                ("reconcile",),
                f"reconcile is set but on_unknown_outcome is {policy}; add on_unknown_outcome: "
                "reconcile, or remove the reconcile block",
            )
        return {}


#: What `defaults:` is, for users (the JSON Schema and docs/configuration.md).
DEFAULTS = (
    "Route settings every route takes unless it sets its own: any route setting but "
    "`name`, `match` and `upstream`. A route's own value replaces the default whole (a "
    "`key` or `retry` block is not merged). A `reconcile` block here is dropped on routes "
    "whose policy is not `reconcile`, and `retry` on sync routes."
)

#: The settings a route may also take from `defaults:`.
SETTINGS = tuple(
    f.name
    for f in dataclasses.fields(Route)
    if f.name not in ("name", "path", "upstream", "methods")
)
ROUTES_EXAMPLE = "routes: [{name: my-job, match: {path: /jobs/x}, upstream: http://127.0.0.1:5000}]"


def _check_path_params(pattern: str, key: object, problems: Problems) -> None:
    params = scan_path_pattern(pattern)[0]
    have = ", ".join(f"{{path.{p}}}" for p in params) or "none"
    for loc, template in templates_in(key):
        for param in scan_template(template).path_params:
            if param not in params:
                problems.add(
                    ("key", *loc),
                    f"{{path.{param}}}: the route's path {show(pattern)} has no {{{param}}} "
                    f"parameter (available: {have})",
                )


def route_defaults(value: object, problems: Problems) -> dict[str, Any]:
    """The settings under `defaults:`, checked once where they are written; returns
    them as written, for the routes that do not set them."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        example = "defaults: {upstream_timeout: 30s}"
        message = f"expected a mapping (name: value), got {kind(value)}; write e.g. {example}"
        problems.add(("defaults",), message)
        return {}
    inherit: dict[str, Any] = {}
    for name, setting in value.items():
        loc = ("defaults", str(name))
        if name in ("name", "match", "upstream"):
            problems.add(loc, f"{name} can only be set on a route, not under defaults", name=True)
        elif name not in SETTINGS:
            problems.add(loc, unknown_setting(str(name), sorted(SETTINGS)), name=True)
        else:
            problems.check(field_adapter(Route, name), setting, loc)
            # Inherited even when wrong: the route is then wrong too, and the problem,
            # found again there, is reported once, at defaults.
            inherit[name] = setting
    return inherit


def with_defaults(routes: object, inherit: dict[str, Any]) -> object:
    """Each route as written, plus the defaults it does not set (marked INHERITED)."""
    if not isinstance(routes, list) or not inherit:
        return routes
    merged: list[object] = []
    for raw in routes:
        if isinstance(raw, dict):
            inherited = frozenset(name for name in inherit if name not in raw)
            raw = {**{name: inherit[name] for name in inherited}, **raw, INHERITED: inherited}
        merged.append(raw)
    return merged


def routes_list(value: object) -> object:
    if value is None:
        raise ValueError(f"at least one route is required; add {ROUTES_EXAMPLE}")
    if isinstance(value, list) and not value:
        raise ValueError(f"at least one route is required; add {ROUTES_EXAMPLE}")
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a list, got {kind(value)}; write e.g. {ROUTES_EXAMPLE}")
    return value


def check_status_prefix(routes: object, prefix: str, failed: set[int], problems: Problems) -> None:
    """A route that can only match under `{prefix}/` would never be reached: the gateway
    answers those paths itself (its status URLs)."""
    own = prefix[1:].split("/")
    for i, raw in enumerate(routes if isinstance(routes, list) else ()):
        match = raw.get("match") if isinstance(raw, dict) else None
        path = match.get("path") if isinstance(match, dict) else None
        if i in failed or not isinstance(path, str):
            continue
        segments = path[1:].split("/")
        if len(segments) > len(own) and segments[: len(own)] == own:
            problems.add(
                ("routes", i, "match", "path"),
                f"{show(path)} is under server.status_prefix {show(prefix)}, which the gateway "
                "answers itself; move the route, or set another status_prefix",
            )
