"""The config as a whole, and its server section (admin's is gateway.config.admin).

`Config` reads a whole file: its sections, the `defaults:` every route inherits, and
the checks that span sections (the operator API on the proxy's port, two routes of
one name, a shared reconcile block no route uses). Problems come out in the file's
order of sections, each route's after the defaults it inherits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field, replace
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationError, ValidationInfo, model_validator
from pydantic_core import ArgsKwargs

from gateway.config.addresses import ListenAddress, listen_clash, parse_listen
from gateway.config.admin import AdminConfig
from gateway.config.http import Networks
from gateway.config.issues import Loc, Problems, at_name, message_of
from gateway.config.routes import (
    Route,
    check_status_prefix,
    route_defaults,
    routes_list,
    with_defaults,
)
from gateway.config.sections import INHERITED, Section, is_instance, settings
from gateway.config.store import StoreConfig
from gateway.config.text import kind, show, unknown_setting
from gateway.config.types import (
    Check,
    Duration,
    Flag,
    GraceDuration,
    LogFormat,
    OneOf,
    Size,
    Whole,
    text,
)

SECTIONS = ("server", "admin", "store", "defaults", "routes")


def _status_prefix(value: object) -> str:
    prefix = text(value)
    example = "write e.g. /_idempotency"
    if not prefix.startswith("/"):
        raise ValueError(f"{show(prefix)} must start with /; {example}")
    if prefix.endswith("/"):
        raise ValueError(f"{show(prefix)} must not end with /; {example}")
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"{show(prefix)} is a fixed path, not a pattern; {example}")
    if any(c in prefix for c in "?#%\\") or any(c.isspace() for c in prefix):
        raise ValueError(f"{show(prefix)} must be a plain path, no ? # % \\ or spaces; {example}")
    if any(segment in ("", ".", "..") for segment in prefix[1:].split("/")):
        raise ValueError(f"{show(prefix)} must not hold empty, . or .. segments; {example}")
    return prefix


StatusPrefix = Annotated[
    str,
    Check(
        _status_prefix,
        {
            "type": "string",
            "pattern": "^(/[^/{}?#%\\\\\\s]+)+$",
            "description": "e.g. /_idempotency",
        },
    ),
]


@settings
class ServerConfig(Section):
    example = "server: {...}"

    listen: ListenAddress = "127.0.0.1:8080"
    #: the gateway's own paths on the proxy port (a 202's status URL lives under it);
    #: no route may match under it
    status_prefix: StatusPrefix = "/_idempotency"
    shutdown_grace: GraceDuration = 30.0
    max_header_bytes: Size = 16 * 1024
    access_log: Flag = True
    log_format: Annotated[LogFormat, OneOf()] = "auto"  # auto: text on a terminal
    #: addresses whose X-Forwarded-*/Forwarded/X-Real-IP are believed (default: none)
    trusted_proxies: Networks = ()
    #: deadline for a whole request head, from its first byte (or the connection's start)
    header_timeout: Duration = 20.0
    #: the longest a request body may go without a byte arriving
    body_timeout: Duration = 20.0
    #: the longest a response write may wait for a caller that stopped reading
    write_timeout: Duration = 30.0
    #: an idle kept-alive caller connection is closed after this long (nginx: 75 s)
    keep_alive: Duration = 75.0
    #: open caller connections per process; one more closes the oldest idle kept-alive
    #: connection, or, with none idle, is answered 503 with Retry-After and closed
    max_connections: Annotated[int, Whole(1, 1_000_000)] = 1024
    #: an idle upstream connection is retired after this long: below common upstream
    #: keep-alive timeouts (gunicorn 2 s, uvicorn and node 5 s), so the gateway lets go
    #: of a connection before the upstream closes it under a request
    upstream_keep_alive: Duration = 1.0
    #: response bytes the process holds in memory at once, over all requests
    max_buffered_responses: Size = 256 * 1024 * 1024
    #: delivery attempts under way at once in this process, over all async routes
    #: (each route also has its delivery.concurrency); 0: accept only, never deliver
    max_deliveries: Annotated[int, Whole(0, 10_000)] = 64

    @classmethod
    def report_order(cls) -> tuple[str, ...]:
        return (
            "listen", "shutdown_grace", "max_header_bytes", "header_timeout", "body_timeout",
            "status_prefix",
            "write_timeout", "keep_alive", "upstream_keep_alive", "max_connections",
            "max_buffered_responses", "max_deliveries", "trusted_proxies", "access_log",
            "log_format",
        )  # fmt: skip


@settings
class Config:
    routes: Annotated[tuple[Route, ...], BeforeValidator(routes_list)]
    server: ServerConfig = field(default_factory=ServerConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    source: str = "<config>"  # the file it came from, for messages

    @model_validator(mode="wrap")
    @classmethod
    def _validate(cls, data: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
        if isinstance(data, ArgsKwargs) or is_instance(data):
            return handler(data)  # built in Python
        if not isinstance(data, dict):
            example = "server: ..., routes: [...]"
            raise ValueError(
                f"expected a mapping (name: value), got {kind(data)}; write e.g. {example}"
            )
        config = _read(data, handler)
        source = (info.context or {}).get("source")
        return replace(config, source=source) if source else config


def _read(data: dict[Any, Any], handler: Callable[[Any], Any]) -> Config:
    problems = Problems()
    for name in data:
        if name not in SECTIONS:
            problems.add((str(name),), unknown_setting(str(name), sorted(SECTIONS)), name=True)
    defaults = Problems()
    inherit = route_defaults(data.get("defaults"), defaults)
    routes = with_defaults(data.get("routes"), inherit)
    kwargs = {name: data[name] for name in ("server", "admin", "store") if name in data}
    config: Config | None = None
    errors: list[Any] = []
    try:
        config = handler({**kwargs, "routes": routes})
    except ValidationError as exc:
        errors = exc.errors()
    sections: dict[str, list[tuple[Loc, Any]]] = {name: [] for name in SECTIONS}
    per_route: dict[int, list[tuple[Loc, Any]]] = {}
    for error in errors:
        loc: Loc = tuple(error["loc"])
        if len(loc) > 1 and loc[0] == "routes" and isinstance(loc[1], int):
            index = loc[1]
            raw = routes[index] if isinstance(routes, list) else None
            if len(loc) > 2 and isinstance(raw, dict) and loc[2] in raw.get(INHERITED, ()):
                loc = ("defaults", *loc[2:])  # where the inherited setting is written
            per_route.setdefault(index, []).append((loc, error))
        else:
            sections[str(loc[0]) if loc else "routes"].append((loc, error))
    for name in ("server", "admin", "store"):
        _take(problems, sections[name])
    _check_listeners(data, problems)
    problems.merge(defaults)
    _take(problems, sections["routes"])
    duplicates = _duplicate_names(data.get("routes"))
    for i in sorted({*per_route, *duplicates}):
        _take(problems, per_route.get(i, []))
        problems.merge(duplicates.get(i, Problems()))
    _check_unused_reconcile(routes, set(per_route), inherit, defaults, problems)
    if not problems.has(("server", "status_prefix")):
        check_status_prefix(routes, _status_prefix_of(data), set(per_route), problems)
    problems.raise_if_any()
    assert config is not None
    return config


def _take(problems: Problems, errors: list[tuple[Loc, Any]]) -> None:
    for loc, error in errors:
        problems.add(loc, message_of(error), name=at_name(error))


def _listen_text(section: object, default: str) -> str | None:
    """The section's listen address if it is valid; a bad one was reported already."""
    value = section.get("listen", default) if isinstance(section, dict) else default
    try:
        parse_listen(value)
    except (ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _status_prefix_of(data: dict[Any, Any]) -> str:
    server = data.get("server")
    given = server.get("status_prefix") if isinstance(server, dict) else None
    return given if isinstance(given, str) else ServerConfig().status_prefix


def _check_listeners(data: dict[Any, Any], problems: Problems) -> None:
    server = _listen_text(data.get("server"), ServerConfig().listen)
    admin = _listen_text(data.get("admin"), AdminConfig().listen)
    if server and admin and listen_clash(parse_listen(server), parse_listen(admin)):
        problems.add(
            ("admin", "listen"),
            f"{show(admin)} clashes with server.listen {show(server)}; give the "
            'operator API its own port, e.g. "127.0.0.1:9090"',
        )


def _duplicate_names(routes: object) -> dict[int, Problems]:
    found: dict[int, Problems] = {}
    first_seen: dict[str, int] = {}
    for i, raw in enumerate(routes if isinstance(routes, list) else ()):
        given = raw.get("name") if isinstance(raw, dict) else None
        if not isinstance(given, str):
            continue
        if given in first_seen:
            found[i] = Problems()
            found[i].add(
                ("routes", i, "name"),
                f"duplicate route name {show(given)} (also routes[{first_seen[given]}]); "
                "give each route its own name",
            )
        first_seen.setdefault(given, i)
    return found


def _check_unused_reconcile(
    routes: object,
    failed: set[int],
    inherit: dict[str, Any],
    defaults: Problems,
    problems: Problems,
) -> None:
    if inherit.get("reconcile") is None or defaults.has(("defaults", "reconcile")):
        return
    # Judged on the routes that are right: a route whose policy is reconcile has the
    # block (its own or this one), and one with another policy drops this one.
    valid = [
        raw
        for i, raw in enumerate(routes if isinstance(routes, list) else ())
        if isinstance(raw, dict) and i not in failed
    ]
    if valid and not any(raw.get("on_unknown_outcome") == "reconcile" for raw in valid):
        problems.add(
            ("defaults", "reconcile"),
            "no route uses it, since none has on_unknown_outcome: reconcile; set that "
            "policy, or remove the block",
        )
