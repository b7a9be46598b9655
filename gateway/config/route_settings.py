"""Route settings (each also allowed under `defaults`) and their value parsers."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.config.addresses import check_http_url
from gateway.config.issues import INVALID, Issues, choice_of, flag
from gateway.config.keys import _key
from gateway.config.templates import TEMPLATE_TOKEN_RE, split_placeholders
from gateway.config.text import show
from gateway.config.types import (
    REQUEST_PARTS,
    duration_value,
    format_statuses,
    is_token,
    parse_status_set,
    request_parts,
    size_value,
)

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RECONCILE_FIELDS = ("url", "method", "done", "not_done", "timeout", "every", "park_after")


@dataclass(frozen=True, slots=True)
class ReconcileConfig:
    url: str  # may hold {key}, {route}, {run_id}
    method: str = "GET"
    done: frozenset[int] = frozenset({200})
    not_done: frozenset[int] = frozenset({404})
    timeout: float = 5.0
    every: float = 30.0
    park_after: float = 3600.0


_RECONCILE_DEFAULTS = ReconcileConfig(url="")

DEFAULT_CACHE_STATUSES = frozenset(
    s for s in range(200, 500) if (s < 300 or s >= 400) and s not in (408, 429)
)


def route_name(value: object, path: str, issues: Issues) -> str | None:
    if value is None:
        issues.add(path, "every route needs a name, e.g. name: send-reminder")
        return None
    name = issues.text(value, path)
    if name is not None and not _NAME_RE.fullmatch(name):
        issues.add(
            path,
            f"{show(name)} is not a valid route name; use letters, digits, _ . and -, "
            "starting with a letter or digit, e.g. send-reminder",
        )
        return None
    return name


def method_set(items: list[Any], path: str, issues: Issues) -> Any:
    if not items:
        issues.add(path, "an empty list matches nothing; list methods, or remove methods: for any")
        return INVALID
    found: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, str) and is_token(item):
            found.add(item.upper())
        else:
            issues.add(f"{path}[{i}]", f"{show(item)} is not an HTTP method; write e.g. POST")
            return INVALID
    return frozenset(found)


def upstream_url(value: object, path: str, issues: Issues) -> str | None:
    if value is None:
        issues.add(path, "every route needs an upstream, e.g. upstream: http://127.0.0.1:5000")
        return None
    url = issues.text(value, path)
    if url is None:
        return None
    problem = check_http_url(url, allow_query=False)
    if problem:
        issues.add(path, problem)
        return None
    return url.rstrip("/")


def forward_header_name(value: object, path: str, issues: Issues) -> Any:
    if value is None or value is False or value == "":
        return None
    if isinstance(value, str) and is_token(value):
        return value
    issues.add(
        path,
        f"{show(value)} is not a header name; write e.g. Idempotency-Key, or false to "
        "not forward the key",
    )
    return INVALID


def header_name_set(value: object, path: str, issues: Issues) -> Any:
    items = issues.items_of(value, path, "[Set-Cookie, X-Secret]")
    if items is None:
        return INVALID
    names: set[str] = set()
    for i, item in enumerate(items):
        if not (isinstance(item, str) and is_token(item)):
            issues.add(f"{path}[{i}]", f"{show(item)} is not a header name; write e.g. X-Secret")
            return INVALID
        names.add(item.lower())
    return frozenset(names)


def reconcile_url(value: object, path: str, issues: Issues) -> Any:
    url = issues.text(value, path)
    if url is None:
        return INVALID
    placeholders, problems = split_placeholders(url)
    for name in placeholders:
        if name not in ("key", "route", "run_id"):
            problems.append(f"unknown placeholder {{{name}}}; use {{key}}, {{route}} or {{run_id}}")
    problem = check_http_url(TEMPLATE_TOKEN_RE.sub("x", url), allow_query=True)
    for message in [*problems, *([problem] if problem else [])]:
        issues.add(path, message)
    return INVALID if problems or problem else url


def _fingerprint(value: object, path: str, issues: Issues) -> Any:
    if value == "none":
        return ()
    items = issues.items_of(value, path, "[method, path, body], or none")
    if items is None:
        return INVALID
    parts = request_parts(items, path, issues, REQUEST_PARTS, ("header.",))
    return INVALID if parts is None else parts


def _cache_statuses(value: object, path: str, issues: Issues) -> Any:
    items = issues.items_of(value, path, '["2xx", "4xx", "!408", "!429"]')
    if items is None:
        return INVALID
    statuses = parse_status_set(items, path, issues, DEFAULT_CACHE_STATUSES)
    return INVALID if statuses is None else statuses


def _reconcile(value: object, path: str, issues: Issues) -> Any:
    if value is None:
        return None
    example = "{url: 'http://127.0.0.1:5000/jobs/{key}/status', done: [200], not_done: [404]}"
    raw = issues.mapping(value, path, f"reconcile: {example}")
    if raw is None:
        return INVALID
    issues.known(raw, _RECONCILE_FIELDS, path)
    kwargs: dict[str, Any] = {}
    if raw.get("url") is None:
        issues.add(f"{path}.url", f"missing; write e.g. url: {example[6:41]}")
        kwargs["url"] = INVALID
    else:
        kwargs["url"] = reconcile_url(raw["url"], f"{path}.url", issues)
    if "method" in raw:
        method = raw["method"]
        if isinstance(method, str) and is_token(method):
            kwargs["method"] = method.upper()
        else:
            issues.add(f"{path}.method", f"{show(method)} is not an HTTP method; write GET")
            kwargs["method"] = INVALID
    for name in ("done", "not_done"):
        if name in raw:
            items = issues.items_of(raw[name], f"{path}.{name}", "[200]")
            codes = None
            if items is not None:
                codes = parse_status_set(items, f"{path}.{name}", issues, frozenset())
            if codes is not None and not codes:
                issues.add(f"{path}.{name}", "list at least one status, e.g. [200]")
                codes = None
            kwargs[name] = INVALID if codes is None else codes
    for name in ("timeout", "every", "park_after"):
        if name in raw:
            kwargs[name] = duration_value(raw[name], f"{path}.{name}", issues)
    done = kwargs.get("done", _RECONCILE_DEFAULTS.done)
    not_done = kwargs.get("not_done", _RECONCILE_DEFAULTS.not_done)
    if done is not INVALID and not_done is not INVALID and done & not_done:
        issues.add(
            f"{path}.not_done",
            f"{format_statuses(frozenset(done & not_done))} is in both done and not_done; "
            "a status must mean one thing",
        )
        return INVALID
    if INVALID in kwargs.values():
        return INVALID
    return ReconcileConfig(**kwargs)


_ROUTE_SETTINGS: dict[str, Callable[[object, str, Issues], Any]] = {
    "key": _key,
    "fingerprint": _fingerprint,
    "concurrent": choice_of(("wait", "reject")),
    "wait_timeout": duration_value,
    "cache_statuses": _cache_statuses,
    "max_request_body": size_value,
    "max_stored_body": size_value,
    "max_response_body": size_value,
    "forward_key_header": forward_header_name,
    "upstream_timeout": duration_value,
    "response_ttl": duration_value,
    "on_unknown_outcome": choice_of(("park", "release", "reconcile")),
    "reconcile": _reconcile,
    "on_store_error": choice_of(("fail_closed", "fail_open")),
    "strip_headers": header_name_set,
    "sensitive_keys": flag,
}
