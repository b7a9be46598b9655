"""Routes: what a route is, the `defaults:` merge and the checks that span settings."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from gateway.config.issues import INVALID, Issues
from gateway.config.keys import KeySpec, _ParsedKey
from gateway.config.paths import scan_path_pattern
from gateway.config.route_settings import (
    _ROUTE_SETTINGS,
    DEFAULT_CACHE_STATUSES,
    ReconcileConfig,
    method_set,
    route_name,
    upstream_url,
)
from gateway.config.text import join, show, unknown_setting
from gateway.config.types import REQUEST_PARTS, format_duration

ConcurrentPolicy = Literal["wait", "reject"]
UnknownOutcomePolicy = Literal["park", "release", "reconcile"]
StoreErrorPolicy = Literal["fail_closed", "fail_open"]


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    path: str  # exact, or a pattern like /jobs/{name}
    upstream: str  # base URL, no trailing slash
    methods: frozenset[str] | None = None  # None: any method
    key: KeySpec | None = None  # None: plain pass-through
    fingerprint: tuple[str, ...] = REQUEST_PARTS  # () means `none`
    concurrent: ConcurrentPolicy = "wait"
    wait_timeout: float = 30.0
    cache_statuses: frozenset[int] = DEFAULT_CACHE_STATUSES
    max_request_body: int = 1024 * 1024
    max_stored_body: int = 1024 * 1024
    #: the most response body the gateway reads; past it the outcome is unknown
    max_response_body: int = 64 * 1024 * 1024
    forward_key_header: str | None = "Idempotency-Key"
    upstream_timeout: float = 30.0
    response_ttl: float = 86400.0
    on_unknown_outcome: UnknownOutcomePolicy = "park"
    reconcile: ReconcileConfig | None = None
    on_store_error: StoreErrorPolicy = "fail_closed"
    strip_headers: frozenset[str] = frozenset()  # lower-case names never stored
    sensitive_keys: bool = False  # logs show a hash of the key, not the key


_ROUTE_DEFAULTS = {f.name: f.default for f in fields(Route)}


def _routes(top: dict[str, Any], issues: Issues) -> tuple[Route, ...] | None:
    defaults: dict[str, tuple[Any, str]] = {}
    raw_defaults = top.get("defaults")
    if raw_defaults is not None:
        mapping = issues.mapping(raw_defaults, "defaults", "defaults: {upstream_timeout: 30s}")
        for name, value in (mapping or {}).items():
            path = join("defaults", str(name))
            if name in ("name", "match", "upstream"):
                issues.add(
                    path, f"{name} can only be set on a route, not under defaults", at_name=True
                )
            elif name not in _ROUTE_SETTINGS:
                issues.add(path, unknown_setting(str(name), sorted(_ROUTE_SETTINGS)), at_name=True)
            else:
                defaults[name] = (_ROUTE_SETTINGS[name](value, path, issues), path)
    raw_routes = top.get("routes")
    example = "routes: [{name: my-job, match: {path: /jobs/x}, upstream: http://127.0.0.1:5000}]"
    if raw_routes is None:
        issues.add("routes", f"at least one route is required; add {example}")
        return None
    items = issues.items_of(raw_routes, "routes", example)
    if items is None:
        return None
    if not items:
        issues.add("routes", f"at least one route is required; add {example}")
    routes: list[Route] = []
    first_seen: dict[str, int] = {}
    for i, raw in enumerate(items):
        route = _route(raw, f"routes[{i}]", defaults, issues)
        if route is not None:
            routes.append(route)
        given = raw.get("name") if isinstance(raw, dict) else None
        if not isinstance(given, str):
            continue
        if given in first_seen:
            issues.add(
                f"routes[{i}].name",
                f"duplicate route name {show(given)} (also routes[{first_seen[given]}]); "
                "give each route its own name",
            )
        first_seen.setdefault(given, i)
    _check_unused_reconcile(defaults, routes, issues)
    return tuple(routes) if len(routes) == len(items) else None


def _route(
    raw: object, path: str, defaults: dict[str, tuple[Any, str]], issues: Issues
) -> Route | None:
    route = issues.mapping(raw, path, "{name: my-job, match: {path: /jobs/x}, upstream: ...}")
    if route is None:
        return None
    ok = True
    for setting in route:
        if setting in ("methods", "path"):
            issues.add(
                join(path, setting),
                f"{setting} belongs under match:, e.g. match: {{{setting}: ...}}",
                at_name=True,
            )
            ok = False
        elif setting not in ("name", "match", "upstream") and setting not in _ROUTE_SETTINGS:
            valid = sorted(("name", "match", "upstream", *_ROUTE_SETTINGS))
            issues.add(join(path, str(setting)), unknown_setting(str(setting), valid), at_name=True)
            ok = False
    name = route_name(route.get("name"), f"{path}.name", issues)
    methods, pattern, params = _match(route.get("match"), f"{path}.match", issues)
    upstream = upstream_url(route.get("upstream"), f"{path}.upstream", issues)
    settings = dict(defaults)
    for setting, parse in _ROUTE_SETTINGS.items():
        if setting in route:
            where = f"{path}.{setting}"
            settings[setting] = (parse(route[setting], where, issues), where)
    if any(value is INVALID for value, _ in settings.values()):
        ok = False
    kwargs = {setting: value for setting, (value, _) in settings.items()}
    key = kwargs.pop("key", None)
    if key is not None and key is not INVALID:
        kwargs["key"] = key.spec
        if pattern is not None:
            ok = _check_path_params(key, pattern, params, issues) and ok
    ok = _check_timeouts(settings, issues) and ok
    ok = _check_reconcile(settings, kwargs, issues) and ok
    if not ok or name is None or pattern is None or upstream is None or methods is INVALID:
        return None
    return Route(name=name, path=pattern, upstream=upstream, methods=methods, **kwargs)


def _check_path_params(key: _ParsedKey, pattern: str, params: list[str], issues: Issues) -> bool:
    ok = True
    for param, where in key.path_params:
        if param not in params:
            have = ", ".join(f"{{path.{p}}}" for p in params) or "none"
            issues.add(
                where,
                f"{{path.{param}}}: the route's path {show(pattern)} has no {{{param}}} "
                f"parameter (available: {have})",
            )
            ok = False
    return ok


def _match(value: object, path: str, issues: Issues) -> tuple[Any, str | None, list[str]]:
    if value is None:
        issues.add(path, "every route needs match: {path: /jobs/...}")
        return None, None, []
    match = issues.mapping(value, path, "match: {methods: [POST], path: /jobs/x}")
    if match is None:
        return None, None, []
    issues.known(match, ("methods", "path"), path)
    methods: Any = None
    if match.get("methods") is not None:
        items = issues.items_of(match["methods"], f"{path}.methods", "[POST]")
        methods = INVALID
        if items is not None:
            methods = method_set(items, f"{path}.methods", issues)
    if "path" not in match or match["path"] is None:
        issues.add(f"{path}.path", "missing; write e.g. path: /jobs/send-reminder")
        return methods, None, []
    pattern = issues.text(match["path"], f"{path}.path")
    if pattern is None:
        return methods, None, []
    params, problems = scan_path_pattern(pattern)
    for problem in problems:
        issues.add(f"{path}.path", problem)
    return methods, None if problems else pattern, params


def _check_timeouts(settings: dict[str, tuple[Any, str]], issues: Issues) -> bool:
    ttl, ttl_path = settings.get("response_ttl", (_ROUTE_DEFAULTS["response_ttl"], ""))
    timeout, timeout_path = settings.get(
        "upstream_timeout", (_ROUTE_DEFAULTS["upstream_timeout"], "")
    )
    if ttl is INVALID or timeout is INVALID or ttl >= timeout:
        return True
    fmt = format_duration
    issues.add(
        ttl_path or timeout_path,
        f"response_ttl {fmt(ttl)} is shorter than upstream_timeout {fmt(timeout)}, so a "
        f"response could expire before its request finishes; make response_ttl at least "
        f"{fmt(timeout)} or upstream_timeout shorter",
    )
    return False


def _check_reconcile(
    settings: dict[str, tuple[Any, str]], kwargs: dict[str, Any], issues: Issues
) -> bool:
    policy, policy_path = settings.get("on_unknown_outcome", ("park", ""))
    block, block_path = settings.get("reconcile", (None, ""))
    if policy is INVALID or block is INVALID:
        return True
    if policy == "reconcile" and block is None:
        issues.add(
            policy_path,
            "reconcile needs a reconcile: block next to it; add e.g. reconcile: "
            "{url: 'http://127.0.0.1:5000/jobs/{key}/status', done: [200], not_done: [404]}",
        )
        return False
    if policy != "reconcile" and block is not None:
        if block_path.startswith("defaults."):
            # The route chose another policy than the shared default; the block is not its.
            kwargs["reconcile"] = None
            return True
        issues.add(
            block_path,
            f"reconcile is set but on_unknown_outcome is {policy}; add on_unknown_outcome: "
            "reconcile, or remove the reconcile block",
        )
        return False
    return True


def _check_unused_reconcile(
    defaults: dict[str, tuple[Any, str]], routes: list[Route], issues: Issues
) -> None:
    if defaults.get("reconcile", (None, ""))[0] in (None, INVALID) or not routes:
        return
    if not any(route.reconcile is not None for route in routes):
        issues.add(
            "defaults.reconcile",
            "no route uses it, since none has on_unknown_outcome: reconcile; set that "
            "policy, or remove the block",
        )
