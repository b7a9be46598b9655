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
from gateway.config.store import StoreConfig, default_store_url
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
from gateway.config.units import format_rate

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
        written="path",
    ),
]


@settings
class ServerConfig(Section):
    """`server:`, the proxy listener's settings (described at `Config.server`). The
    request limits and deadlines (`max_header_bytes`, `header_timeout`, `body_timeout`,
    `write_timeout`, `keep_alive`, `max_connections`) hold for the admin listener too,
    its connections counted apart."""

    example = "server: {...}"

    listen: ListenAddress = "127.0.0.1:8080"
    """The proxy listener's address (`[::1]:8080` for IPv6). In a container, bind
    `0.0.0.0`: the container's own loopback is reachable from nowhere else."""
    status_prefix: StatusPrefix = "/_idempotency"
    """Where the gateway's own paths live on the proxy port: the status URLs of async
    routes, `{status_prefix}/status/{route}/{record}/{token}`. Paths under it are the
    gateway's whatever the routes match, and a route that matches only under it is a
    config error."""
    shutdown_grace: GraceDuration = 30.0
    """On SIGTERM, how long forwards and delivery attempts under way may still finish;
    those still running after it are marked unresolved, with the reason, before the
    process exits."""
    max_header_bytes: Size = 16 * 1024
    """The request target, and the headers together (a chunked body's trailers count
    too); over it 414 or 431, cut off while they arrive. On the admin listener too."""
    access_log: Flag = True
    """An access line per request: route, key (a hash of it on `sensitive_keys`
    routes), outcome, run id, upstream status and duration. Bodies, tokens,
    Authorization headers and store passwords never appear."""
    log_format: Annotated[LogFormat, OneOf()] = "auto"
    """`json` lines, `text`, or `auto`: text on a terminal, JSON otherwise."""
    trusted_proxies: Networks = ()
    """Addresses or CIDR blocks (`["10.0.0.0/8", "::1"]`) believed about whom they
    forward for: their `X-Forwarded-*`, `Forwarded` and `X-Real-IP` are kept and
    extended; from any other caller they are replaced. Reloadable with SIGHUP."""
    header_timeout: Duration = 20.0
    """A request head must be complete this long after its first byte (the first
    request's: after the connection opens); else 408 and the connection closes. A
    connection on which no request has begun by then (no byte but the empty lines a
    server ignores: a pool's spare connection, a browser's preconnect) is closed
    without an answer, as an idle kept-alive connection is. On the admin listener too."""
    body_timeout: Duration = 20.0
    """The longest a request body may go without a byte arriving; else 408, and nothing
    is forwarded (on the admin listener: nothing is done). On both listeners."""
    write_timeout: Duration = 30.0
    """A caller that takes nothing of its response for this long (while more than
    about 64 KiB waits for it) has its connection reset and its buffered bytes dropped;
    a caller that reads, however slowly, keeps it. The key's outcome never depends on
    it."""
    keep_alive: Duration = 75.0
    """An idle kept-alive caller connection is closed after this long (nginx's
    default). Keep clients' own idle expiry below it (httpx and most clients use 5s),
    so the client, not the gateway, closes an idle connection: a request written just
    as the other side closes is the one that gets lost. The gateway never closes a
    connection on which request bytes wait to be read."""
    max_connections: Annotated[int, Whole(1, 1_000_000)] = 1024
    """Open caller connections per process (per worker). One over it first closes the
    oldest idle kept-alive connection; with none idle it gets 503 with `Retry-After: 1`
    and is closed. The admin listener has as many of its own. Raise the file-descriptor
    limit (`ulimit -n`) above twice it."""
    upstream_keep_alive: Duration = 1.0
    """An idle upstream connection is retired after this long. Keep it below the
    upstream's own keep-alive timeout (gunicorn 2s, uvicorn and node 5s), so the
    gateway lets go of a connection before the upstream closes it under a request."""
    max_buffered_responses: Size = 256 * 1024 * 1024
    """Response bytes the process holds in memory at once, over all requests (bodies
    read whole, streamed parts not yet written). At the limit a response that would be
    read whole is streamed instead (on a keyed route repeats then get headers only,
    `Idempotent-Body-Omitted: true`), and streams pause their upstream until memory
    frees; nothing waits on a body being read whole, so it cannot deadlock."""
    max_deliveries: Annotated[int, Whole(0, 10_000)] = 64
    """Delivery attempts under way at once in this process, over all async routes
    (each route also has its `delivery.concurrency`). `0`: this process accepts and
    answers status URLs but never delivers; another replica must."""

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
    """A whole config file: its sections, and the routes after the defaults they
    inherit."""

    routes: Annotated[tuple[Route, ...], BeforeValidator(routes_list)]
    """Which requests the gateway takes, where it sends them, and where each one's
    idempotency key comes from; the first route that matches a request takes it. At
    least one."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """The proxy listener: where it listens, its deadlines and limits on callers, the
    upstream connections it keeps, logging, and the deliveries each process makes."""
    admin: AdminConfig = field(default_factory=AdminConfig)
    """The admin listener (`/healthz`, `/readyz`, `/metrics`, the operator API and the
    console) and who may use the operator API."""
    store: StoreConfig = field(default_factory=StoreConfig)
    """Where records live (memory, Redis, Sentinel, Cluster, PostgreSQL or SQLite), how
    to reach it, and the keys that encrypt what it stores."""
    source: str = "<config>"
    """The file the config came from, named in messages; never written in a file."""

    def route(self, name: str) -> Route | None:
        """The route named `name`, or None: the one lookup by name."""
        return next((route for route in self.routes if route.name == name), None)

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
        source = (info.context or {}).get("source")
        store = data.get("store")
        if source and (store is None or isinstance(store, dict)):
            if not (store and {"url", "sentinel", "cluster"} & store.keys()):
                # No store named: SQLite beside the config file, so a config without
                # one is durable whatever directory the gateway starts in.
                data = {**data, "store": {**(store or {}), "url": default_store_url(source)}}
        config = _read(data, handler)
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
    if config is not None:
        _check_rate_groups(config, problems)
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


def _check_rate_groups(config: Config, problems: Problems) -> None:
    """The routes of one `rate_group` share one limit, so they state it alike."""
    first: dict[str, tuple[int, Route]] = {}
    for i, route in enumerate(config.routes):
        group = route.delivery.rate_group
        if group is None or route.delivery.rate is None:
            continue
        seen = first.setdefault(group, (i, route))
        if seen[1] is route:
            continue
        j, other = seen
        ours, theirs = route.delivery, other.delivery
        if (ours.rate, ours.burst) != (theirs.rate, theirs.burst):
            assert theirs.rate is not None
            problems.add(
                ("routes", i, "delivery", "rate" if ours.rate != theirs.rate else "burst"),
                f"rate_group {show(group)} has rate {format_rate(theirs.rate)} and burst "
                f"{theirs.burst} at routes[{j}] ({other.name}); give every route of the "
                "group the same rate and burst",
            )
