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
)
from gateway.config.units import format_duration, format_statuses


@settings
class ReconcileConfig(Section):
    """How to ask the upstream whether a request whose answer was lost ran."""

    example = f"reconcile: {RECONCILE_EXAMPLE}"
    none_is_empty = False

    url: ReconcileUrl  # may hold {key}, {route}, {run_id}
    method: Method = "GET"
    done: Statuses = frozenset({200})
    not_done: Statuses = frozenset({404})
    timeout: Duration = 5.0
    every: Duration = 30.0
    park_after: Duration = 3600.0

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
    example = "{name: my-job, match: {path: /jobs/x}, upstream: ...}"
    none_is_empty = False
    written_at: ClassVar[dict[str, Loc]] = {
        "path": ("match", "path"),
        "methods": ("match", "methods"),
    }

    name: RouteName
    path: PathPatternText  # exact, or a pattern like /jobs/{name}
    upstream: UpstreamUrl  # base URL, no trailing slash
    methods: Methods = None  # None: any method
    key: KeySpec | None = None  # None: plain pass-through
    fingerprint: Fingerprint = REQUEST_PARTS  # () means `none`
    concurrent: Annotated[ConcurrentPolicy, OneOf()] = "wait"
    wait_timeout: Duration = 30.0
    cache_statuses: CacheStatuses = DEFAULT_CACHE_STATUSES
    max_request_body: Size = 1024 * 1024
    max_stored_body: Size = 1024 * 1024
    #: the most response body the gateway reads; past it the outcome is unknown
    max_response_body: Size = 64 * 1024 * 1024
    forward_key_header: ForwardHeader = "Idempotency-Key"
    upstream_timeout: Duration = 30.0
    response_ttl: Duration = 86400.0
    on_unknown_outcome: Annotated[UnknownOutcomePolicy, OneOf()] = "park"
    reconcile: ReconcileConfig | None = None
    on_store_error: Annotated[StoreErrorPolicy, OneOf()] = "fail_closed"
    strip_headers: HeaderNames = frozenset()  # lower-case names never stored
    sensitive_keys: Flag = False  # logs show a hash of the key, not the key
    delivery: Annotated[DeliveryConfig, BeforeValidator(delivery_shorthand)] = SYNC
    retry: RetryConfig = DEFAULT_RETRY  # delivery: async routes only

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
                "reconcile needs a reconcile: block next to it; add e.g. reconcile: "
                "{url: 'http://127.0.0.1:5000/jobs/{key}/status', done: [200], not_done: [404]}",
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
