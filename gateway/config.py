"""Configuration: YAML in, frozen dataclasses out, validated once.

`load_config(path)` is the way in (`parse_config(data, source)` for data already
loaded). Every error names the file, the YAML path (`routes[2].key.body`) and what
to do about it; all errors in a file are reported together so a user fixes them in
one pass. Value parsers and generic checks live in `gateway._parse`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import yaml

from gateway._parse import (
    INVALID,
    IPNetwork,
    Issues,
    UniqueKeyLoader,
    check_listen_clash,
    check_template,
    choice_of,
    compile_jmespath,
    duration_value,
    flag,
    format_duration,
    format_size,
    format_statuses,
    forward_header_name,
    header_name_set,
    interpolate,
    is_token,
    join,
    kind,
    listen_address,
    method_set,
    network_list,
    parse_listen,
    parse_path_pattern,
    parse_status_set,
    reconcile_url,
    request_parts,
    route_name,
    secret_kind,
    section,
    show,
    size_value,
    store_url_problem,
    timezone_problem,
    unknown_setting,
    upstream_url,
    yaml_message,
)
from gateway._parse import mask_url as mask_url
from gateway._parse import parse_duration as parse_duration
from gateway._parse import parse_size as parse_size
from gateway.errors import ConfigError, ConfigIssue
from gateway.sealing import key_id, parse_key

ConcurrentPolicy = Literal["wait", "reject"]
MissingKeyPolicy = Literal["reject", "forward"]
UnknownOutcomePolicy = Literal["park", "release", "reconcile"]
StoreErrorPolicy = Literal["fail_closed", "fail_open"]
KeySourceKind = Literal["header", "query", "body", "template", "hash", "period"]

#: Request parts a `hash` key or a `fingerprint` may be computed from.
#: `header.<Name>` is accepted too.
REQUEST_PARTS = ("method", "path", "query", "body")

DEFAULT_CACHE_STATUSES = frozenset(
    s for s in range(200, 500) if (s < 300 or s >= 400) and s not in (408, 429)
)


@dataclass(frozen=True, slots=True)
class Period:
    """A time window for `{period}`: `count` units of `unit`, in `timezone`."""

    count: int
    unit: Literal["m", "h", "d", "w", "mo"]
    timezone: str = "UTC"
    text: str = ""  # as written, for messages


@dataclass(frozen=True, slots=True)
class KeySource:
    """One place an idempotency key can come from.

    - header: `name` is the header name (matched case-insensitively)
    - query: `name` is the query parameter
    - body: `name` is a JMESPath expression, `compiled` its parsed form
    - template: `name` is the template text, e.g. "reminder:{body.user_id}:{period}"
    - hash: `parts` lists request parts (see REQUEST_PARTS, or header.<Name>)
    - period: the key is the window start alone (a cron run with no key at all)
    """

    kind: KeySourceKind
    name: str = ""
    parts: tuple[str, ...] = ()
    compiled: Any = None


#: len("sha256:" + 64 hex digits): the key a `hash` source makes.
HASH_KEY_LENGTH = 71


@dataclass(frozen=True, slots=True)
class KeySpec:
    sources: tuple[KeySource, ...]  # first one present wins
    period: Period | None = None
    on_missing: MissingKeyPolicy = "reject"
    scope: tuple[str, ...] = ()  # e.g. ("header.Authorization",)
    max_length: int = 255


@dataclass(frozen=True, slots=True)
class ReconcileConfig:
    url: str  # may hold {key}, {route}, {run_id}
    method: str = "GET"
    done: frozenset[int] = frozenset({200})
    not_done: frozenset[int] = frozenset({404})
    timeout: float = 5.0
    every: float = 30.0
    park_after: float = 3600.0


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


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: str = "127.0.0.1:8080"
    shutdown_grace: float = 30.0
    max_header_bytes: int = 16 * 1024
    access_log: bool = True
    log_format: Literal["auto", "json", "text"] = "auto"  # auto: text on a terminal
    #: addresses whose X-Forwarded-*/Forwarded/X-Real-IP are believed (default: none)
    trusted_proxies: tuple[IPNetwork, ...] = ()
    #: deadline for a whole request head, from its first byte (or the connection's start)
    header_timeout: float = 20.0
    #: the longest a request body may go without a byte arriving
    body_timeout: float = 20.0
    #: the longest a response write may wait for a caller that stopped reading
    write_timeout: float = 30.0
    #: an idle kept-alive caller connection is closed after this long (nginx: 75 s)
    keep_alive: float = 75.0
    #: open caller connections per process; one more closes the oldest idle kept-alive
    #: connection, or, with none idle, is answered 503 with Retry-After and closed
    max_connections: int = 1024
    #: an idle upstream connection is retired after this long: below common upstream
    #: keep-alive timeouts (gunicorn 2 s, uvicorn and node 5 s), so the gateway lets go
    #: of a connection before the upstream closes it under a request
    upstream_keep_alive: float = 1.0
    #: response bytes the process holds in memory at once, over all requests
    max_buffered_responses: int = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AdminConfig:
    listen: str = "127.0.0.1:9090"
    token: str = ""  # empty: the operator API is disabled


@dataclass(frozen=True, slots=True)
class TLSConfig:
    ca_file: str = ""
    cert_file: str = ""  # a client certificate, with key_file, for mutual TLS
    key_file: str = ""
    verify: bool = True  # false: encrypt but do not check the server's certificate


@dataclass(frozen=True, slots=True)
class StoreConfig:
    url: str = "memory://"  # memory://, redis://, rediss://, unix://; unused with sentinel/cluster
    prefix: str = "idem:"
    socket_timeout: float = 2.0
    connect_timeout: float = 2.0
    max_connections: int = 64  # per process; requests queue for a free one
    #: replicas that must confirm a claim (Redis WAIT) before the request is sent:
    #: with 1, a failover cannot lose a claim and let its key run twice
    wait_for_replicas: int = 0
    username: str = ""  # Redis ACL user; the URL's, if it has one, wins
    password: str = field(default="", repr=False)
    tls: TLSConfig | None = None
    sentinel_master: str = ""
    sentinel_nodes: tuple[tuple[str, int], ...] = ()
    sentinel_password: str = field(default="", repr=False)
    cluster_nodes: tuple[tuple[str, int], ...] = ()
    #: 32-byte AES-256-GCM key that seals new stored responses (b"": stored plain)
    encryption_key: bytes = field(default=b"", repr=False)
    #: older keys that still open responses they sealed, after a rotation
    previous_encryption_keys: tuple[bytes, ...] = field(default=(), repr=False)
    #: with an encryption key set, still read responses stored unencrypted (a
    #: migration setting: turn it off once the longest response_ttl has passed)
    read_unencrypted: bool = False
    #: start and report ready even if Redis may evict keys (maxmemory-policy other
    #: than noeviction): an evicted record is a key that runs again
    allow_eviction: bool = False

    @property
    def kind(self) -> str:
        if self.sentinel_nodes:
            return "sentinel"
        if self.cluster_nodes:
            return "cluster"
        return "memory" if self.url.startswith("memory://") else "redis"


@dataclass(frozen=True, slots=True)
class Config:
    routes: tuple[Route, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    source: str = "<config>"  # the file it came from, for messages


# -- parsing -------------------------------------------------------------------------

_SOURCE_KINDS = ("header", "query", "body", "template", "hash")
_KEY_OPTIONS = ("period", "timezone", "on_missing", "scope", "max_length")
_PERIOD_HINT = "write e.g. 15m, 1h, 6h, 1d, 1w or 1mo"
_PERIOD_RE = re.compile(r"(\d+)\s*(mo|m|h|d|w)")
# Maps the matched text onto Period.unit's Literal type without a cast.
_PERIOD_UNITS: dict[str, Literal["m", "h", "d", "w", "mo"]] = {
    "m": "m",
    "h": "h",
    "d": "d",
    "w": "w",
    "mo": "mo",
}
_RECONCILE_DEFAULTS = ReconcileConfig(url="")
_ROUTE_DEFAULTS = {f.name: f.default for f in fields(Route)}
_RECONCILE_FIELDS = ("url", "method", "done", "not_done", "timeout", "every", "park_after")


def parse_period(text: object, timezone: str = "UTC") -> Period:
    """A `{period}` window from "15m", "1h", "1d", "1w", "1mo"...; ValueError if bad."""
    problem = timezone_problem(timezone)
    if problem:
        raise ValueError(problem)
    match = _PERIOD_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or not isinstance(text, str):
        raise ValueError(f"{show(text)} is not a period; {_PERIOD_HINT}")
    count, unit = int(match.group(1)), match.group(2)
    # Windows must tile a day (or a week/month) exactly, so every run of the same
    # window computes the same start no matter when it fires.
    problem = None
    if count < 1:
        problem = "the count must be at least 1"
    elif unit == "m" and 60 % count != 0 and (count % 60 != 0 or 24 % (count // 60) != 0):
        problem = (
            "minutes must divide an hour evenly (e.g. 5m, 15m, 30m) or be whole hours "
            "that divide a day (e.g. 120m)"
        )
    elif unit == "h" and 24 % count != 0:
        problem = "hours must divide a day evenly (1h, 2h, 3h, 4h, 6h, 8h, 12h, 24h)"
    elif unit in ("w", "mo") and count != 1:
        problem = f"only 1{unit} is supported for weeks and months"
    if problem:
        raise ValueError(f"{show(text)} is not a usable period: {problem}")
    return Period(count=count, unit=_PERIOD_UNITS[unit], timezone=timezone, text=text.strip())


def load_config(path: str | os.PathLike[str]) -> Config:
    """Reads, interpolates and validates a YAML config; raises ConfigError listing every problem."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(
            source, [ConfigIssue("", "file not found; pass the path of a YAML config file")]
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(source, [ConfigIssue("", f"cannot read the file: {reason}")]) from None
    try:
        # UniqueKeyLoader is a SafeLoader: YAML tags cannot build arbitrary objects.
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [ConfigIssue("", yaml_message(exc))]) from None
    return parse_config(data, source)


def parse_config(data: object, source: str, env: Mapping[str, str] | None = None) -> Config:
    """Validates already-loaded YAML data; `env` defaults to os.environ for ${VAR}."""
    issues = Issues()
    if data is None:
        issues.add("", "the file is empty; it needs at least a routes: list")
        raise ConfigError(source, issues.items)
    data = interpolate(data, "", issues, dict(os.environ if env is None else env))
    top = issues.mapping(data, "", "server: ..., routes: [...]")
    if top is None:
        raise ConfigError(source, issues.items)
    issues.known(top, ("server", "admin", "store", "defaults", "routes"), "")
    server = _server(top.get("server", {}), issues)
    admin = _admin(top.get("admin", {}), issues)
    store = _store(top.get("store", {}), issues)
    server_listen = _listen_text(top.get("server"), ServerConfig().listen)
    admin_listen = _listen_text(top.get("admin"), AdminConfig().listen)
    if server_listen and admin_listen:
        check_listen_clash(server_listen, admin_listen, issues)
    routes = _routes(top, issues)
    if issues.items or server is None or admin is None or store is None or routes is None:
        raise ConfigError(source, issues.items)
    return Config(routes=routes, server=server, admin=admin, store=store, source=source)


def _listen_text(section: object, default: str) -> str | None:
    """The section's listen address if it is valid; a bad one was reported already."""
    value = section.get("listen", default) if isinstance(section, dict) else default
    try:
        parse_listen(value)
    except (ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


_SERVER_DURATIONS = (
    "header_timeout", "body_timeout", "write_timeout", "keep_alive", "upstream_keep_alive",
)  # fmt: skip


def _server(value: object, issues: Issues) -> ServerConfig | None:
    names = (
        "listen", "shutdown_grace", "max_header_bytes", "access_log", "log_format",
        "trusted_proxies", "max_connections", "max_buffered_responses", *_SERVER_DURATIONS,
    )  # fmt: skip
    raw = section(value, "server", issues, names)
    if raw is None:
        return None
    kwargs: dict[str, Any] = {}
    if "listen" in raw:
        kwargs["listen"] = listen_address(raw["listen"], "server.listen", issues)
    if "shutdown_grace" in raw:
        kwargs["shutdown_grace"] = duration_value(
            raw["shutdown_grace"], "server.shutdown_grace", issues, allow_zero=True
        )
    if "max_header_bytes" in raw:
        kwargs["max_header_bytes"] = size_value(
            raw["max_header_bytes"], "server.max_header_bytes", issues
        )
    for name in _SERVER_DURATIONS:
        if name in raw:
            kwargs[name] = duration_value(raw[name], f"server.{name}", issues)
    if "max_connections" in raw:
        number = issues.integer(raw["max_connections"], "server.max_connections", 1, 1_000_000)
        kwargs["max_connections"] = INVALID if number is None else number
    if "max_buffered_responses" in raw:
        kwargs["max_buffered_responses"] = size_value(
            raw["max_buffered_responses"], "server.max_buffered_responses", issues
        )
    if "trusted_proxies" in raw:
        kwargs["trusted_proxies"] = network_list(
            raw["trusted_proxies"], "server.trusted_proxies", issues
        )
    if "access_log" in raw:
        enabled = issues.boolean(raw["access_log"], "server.access_log")
        kwargs["access_log"] = INVALID if enabled is None else enabled
    if "log_format" in raw:
        fmt = issues.choice(raw["log_format"], "server.log_format", ("auto", "json", "text"))
        kwargs["log_format"] = INVALID if fmt is None else fmt
    return None if INVALID in kwargs.values() else ServerConfig(**kwargs)


def _admin(value: object, issues: Issues) -> AdminConfig | None:
    raw = section(value, "admin", issues, ("listen", "token"))
    if raw is None:
        return None
    kwargs: dict[str, Any] = {}
    if "listen" in raw:
        kwargs["listen"] = listen_address(raw["listen"], "admin.listen", issues)
    if "token" in raw:
        token = raw["token"]
        if token is None or isinstance(token, str):
            kwargs["token"] = token or ""
        else:
            issues.add("admin.token", f"expected text, got {secret_kind(token)}; quote it")
            kwargs["token"] = INVALID
    return None if INVALID in kwargs.values() else AdminConfig(**kwargs)


def _store(value: object, issues: Issues) -> StoreConfig | None:
    names = (
        "url", "prefix", "socket_timeout", "connect_timeout", "max_connections",
        "username", "password", "tls", "sentinel", "cluster", "wait_for_replicas",
        "encryption_key", "previous_encryption_keys", "read_unencrypted", "allow_eviction",
    )  # fmt: skip
    raw = section(value, "store", issues, names)
    if raw is None:
        return None
    kwargs: dict[str, Any] = {}
    if "url" in raw:
        url = issues.text(raw["url"], "store.url")
        problem = store_url_problem(url) if url is not None else None
        if problem:
            issues.add("store.url", problem)
        kwargs["url"] = INVALID if url is None or problem else url
    for name in ("prefix", "username", "password"):
        if name in raw:
            text = issues.text(raw[name], f"store.{name}", empty_ok=True, secret=name == "password")
            kwargs[name] = INVALID if text is None else text
    for name in ("socket_timeout", "connect_timeout"):
        if name in raw:
            kwargs[name] = duration_value(raw[name], f"store.{name}", issues)
    if "max_connections" in raw:
        number = issues.integer(raw["max_connections"], "store.max_connections", 1, 10000)
        kwargs["max_connections"] = INVALID if number is None else number
    if "wait_for_replicas" in raw:
        number = issues.integer(raw["wait_for_replicas"], "store.wait_for_replicas", 0, 16)
        kwargs["wait_for_replicas"] = INVALID if number is None else number
    for name in ("read_unencrypted", "allow_eviction"):
        if name in raw:
            enabled = issues.boolean(raw[name], f"store.{name}")
            kwargs[name] = INVALID if enabled is None else enabled
    if "tls" in raw:
        kwargs["tls"] = _tls(raw["tls"], issues)
    if "sentinel" in raw:
        sentinel = section(
            raw["sentinel"], "store.sentinel", issues, ("master", "nodes", "password")
        )
        if sentinel is not None:
            if "master" not in sentinel:
                issues.add("store.sentinel.master", "name the master, e.g. master: mymaster")
            master = issues.text(sentinel.get("master", ""), "store.sentinel.master")
            kwargs["sentinel_master"] = INVALID if master is None else master
            kwargs["sentinel_nodes"] = _nodes(sentinel.get("nodes"), "store.sentinel.nodes", issues)
            password = issues.text(
                sentinel.get("password", ""), "store.sentinel.password", empty_ok=True, secret=True
            )
            kwargs["sentinel_password"] = INVALID if password is None else password
    if "cluster" in raw:
        cluster = section(raw["cluster"], "store.cluster", issues, ("nodes",))
        if cluster is not None:
            kwargs["cluster_nodes"] = _nodes(cluster.get("nodes"), "store.cluster.nodes", issues)
    topologies = [name for name in ("url", "sentinel", "cluster") if name in raw]
    if len(topologies) > 1:
        issues.add("store", f"give one of url, sentinel or cluster, not {' and '.join(topologies)}")
    kwargs.update(_encryption_keys(raw, issues))
    return None if INVALID in kwargs.values() else StoreConfig(**kwargs)


def _encryption_keys(raw: dict[str, Any], issues: Issues) -> dict[str, Any]:
    """store.encryption_key and store.previous_encryption_keys. Messages never quote
    a key: they name its place, what is wrong, and how to make a good one."""
    found: list[tuple[str, bytes]] = []  # (YAML path, key)

    def one(value: object, path: str) -> Any:
        if not isinstance(value, str):
            what = "nothing (null)" if value is None else f"a {type(value).__name__}"
            issues.add(path, f'expected a key as text, got {what}; write e.g. "${{GATEWAY_KEY}}"')
            return INVALID
        try:
            key = parse_key(value)
        except ValueError as exc:
            issues.add(path, str(exc))
            return INVALID
        for other_path, other in found:
            if other == key:
                issues.add(path, f"is the same key as {other_path}; list each key once")
                return INVALID
            if key_id(other) == key_id(key):
                issues.add(path, f"has the same key id as {other_path}; generate a new key")
                return INVALID
        found.append((path, key))
        return key

    kwargs: dict[str, Any] = {}
    if "encryption_key" in raw:
        kwargs["encryption_key"] = one(raw["encryption_key"], "store.encryption_key")
    if "previous_encryption_keys" in raw:
        path = "store.previous_encryption_keys"
        value = raw["previous_encryption_keys"]
        if not isinstance(value, list):
            # Never kind(value): a key given without brackets would be quoted.
            issues.add(path, 'expected a list; write e.g. previous_encryption_keys: ["${OLD_KEY}"]')
            kwargs["previous_encryption_keys"] = INVALID
        else:
            keys = [one(item, f"{path}[{i}]") for i, item in enumerate(value)]
            kwargs["previous_encryption_keys"] = INVALID if INVALID in keys else tuple(keys)
    return kwargs


def _tls(value: object, issues: Issues) -> Any:
    raw = section(value, "store.tls", issues, ("ca_file", "cert_file", "key_file", "verify"))
    if raw is None:
        return INVALID
    kwargs: dict[str, Any] = {}
    for name in ("ca_file", "cert_file", "key_file"):
        if name in raw:
            path = issues.text(raw[name], f"store.tls.{name}")
            if path is not None and not os.path.isfile(path):
                issues.add(
                    f"store.tls.{name}", f"no file at {show(path)}; give the path of a PEM file"
                )
                path = None
            kwargs[name] = INVALID if path is None else path
    if ("cert_file" in raw) != ("key_file" in raw):
        issues.add(
            "store.tls", "cert_file and key_file go together (a client certificate and its key)"
        )
    if "verify" in raw:
        verify = issues.boolean(raw["verify"], "store.tls.verify")
        kwargs["verify"] = INVALID if verify is None else verify
    return INVALID if INVALID in kwargs.values() else TLSConfig(**kwargs)


def _nodes(value: object, path: str, issues: Issues) -> Any:
    example = '["10.0.0.1:26379", "10.0.0.2:26379"]'
    items = issues.items_of(value, path, example) if value is not None else None
    if value is None:
        issues.add(path, f"list the nodes, e.g. nodes: {example}")
    if not items:
        if items is not None:
            issues.add(path, f"list at least one node, e.g. nodes: {example}")
        return INVALID
    nodes: list[tuple[str, int]] = []
    for i, item in enumerate(items):
        text = issues.text(item, f"{path}[{i}]")
        if text is None:
            return INVALID
        try:
            nodes.append(parse_listen(text))
        except ValueError as exc:
            issues.add(f"{path}[{i}]", str(exc))
            return INVALID
    return tuple(nodes)


# -- routes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ParsedKey:
    spec: KeySpec
    path_params: tuple[tuple[str, str], ...]  # ({path.<param>} name, where it was written)


def _routes(top: dict[str, Any], issues: Issues) -> tuple[Route, ...] | None:
    defaults: dict[str, tuple[Any, str]] = {}
    raw_defaults = top.get("defaults")
    if raw_defaults is not None:
        mapping = issues.mapping(raw_defaults, "defaults", "defaults: {upstream_timeout: 30s}")
        for name, value in (mapping or {}).items():
            path = join("defaults", str(name))
            if name in ("name", "match", "upstream"):
                issues.add(path, f"{name} can only be set on a route, not under defaults")
            elif name not in _ROUTE_SETTINGS:
                issues.add(path, unknown_setting(str(name), sorted(_ROUTE_SETTINGS)))
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
            )
            ok = False
        elif setting not in ("name", "match", "upstream") and setting not in _ROUTE_SETTINGS:
            valid = sorted(("name", "match", "upstream", *_ROUTE_SETTINGS))
            issues.add(join(path, str(setting)), unknown_setting(str(setting), valid))
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
    params, problems = parse_path_pattern(pattern)
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


# -- route settings (each also allowed under `defaults`) --------------------------------


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


# -- keys --------------------------------------------------------------------------------


def _key(value: object, path: str, issues: Issues) -> Any:
    if value is None:
        return None
    example = "key: {header: Idempotency-Key}"
    if isinstance(value, list):
        raw: dict[str, Any] = {"sources": value}
        sources_path = path
    elif isinstance(value, dict):
        raw = value
        sources_path = f"{path}.sources"
        issues.known(raw, (*_SOURCE_KINDS, *_KEY_OPTIONS, "sources"), path)
    else:
        issues.add(path, f"expected a mapping or a list, got {kind(value)}; write e.g. {example}")
        return INVALID
    direct = [name for name in _SOURCE_KINDS if name in raw]
    several = "to try several in order, write sources: [{header: Idempotency-Key}, {body: id}]"
    sources: list[KeySource | None] = []
    templates: list[tuple[str, str]] = []  # (template text, where it was written)
    if "sources" in raw and direct:
        issues.add(path, f"give either sources: or {direct[0]}:, not both")
        return INVALID
    if len(direct) > 1:
        issues.add(
            path, f"{' and '.join(direct)} are both set, but a key has one source; {several}"
        )
        return INVALID
    if "sources" in raw:
        items = issues.items_of(raw["sources"], sources_path, "[{header: Idempotency-Key}]")
        if items is None:
            return INVALID
        if not items:
            issues.add(sources_path, f"list at least one source; {several}")
            return INVALID
        for i, item in enumerate(items):
            sources.append(_source_item(item, f"{sources_path}[{i}]", issues, templates))
    elif direct:
        sources.append(_source(direct[0], raw[direct[0]], f"{path}.{direct[0]}", issues, templates))
    kwargs: dict[str, Any] = {}
    if "on_missing" in raw:
        kwargs["on_missing"] = choice_of(("reject", "forward"))(
            raw["on_missing"], f"{path}.on_missing", issues
        )
    if "max_length" in raw:
        length = issues.integer(raw["max_length"], f"{path}.max_length", 1, 4096)
        kwargs["max_length"] = INVALID if length is None else length
        hashed = any(isinstance(s, KeySource) and s.kind == "hash" for s in sources)
        if length is not None and hashed and length < HASH_KEY_LENGTH:
            # Every request would be refused as "key too long".
            issues.add(
                f"{path}.max_length",
                f"a hash key is {HASH_KEY_LENGTH} characters (sha256:<hex>); "
                f"set max_length to at least {HASH_KEY_LENGTH} or leave it out",
            )
    if "scope" in raw:
        items = issues.items_of(raw["scope"], f"{path}.scope", "[header.Authorization]")
        scope = (
            request_parts(items, f"{path}.scope", issues, (), ("header.", "query."))
            if items
            else ()
        )
        kwargs["scope"] = INVALID if items is None or scope is None else scope
    period = _key_period(raw, path, issues)
    if period is not INVALID:
        kwargs["period"] = period
    refs: list[tuple[str, str]] = []
    uses_period = False
    for template, where in templates:
        uses, found = check_template(template, where, issues, has_period=period is not None)
        uses_period = uses_period or uses
        refs.extend((param, where) for param in found)
    if not sources and period is None:
        issues.add(path, f"no key source; write e.g. {example}, or period: 1d for a cron job")
        return INVALID
    if not sources and period not in (None, INVALID):
        sources.append(KeySource(kind="period"))
    elif period not in (None, INVALID) and not uses_period:
        issues.add(
            f"{path}.period",
            "period is set but no template uses {period}; add {period} to a template, e.g. "
            'template: "report:{period}", or remove period',
        )
        return INVALID
    if None in sources or INVALID in kwargs.values() or period is INVALID:
        return INVALID
    spec = KeySpec(sources=tuple(s for s in sources if s is not None), **kwargs)
    return _ParsedKey(spec, tuple(refs))


def _key_period(raw: dict[str, Any], path: str, issues: Issues) -> Any:
    timezone = raw.get("timezone", "UTC")
    if "timezone" in raw and "period" not in raw:
        issues.add(f"{path}.timezone", "timezone only matters with a period; add e.g. period: 1d")
        return INVALID
    if "period" not in raw:
        return None
    problem = timezone_problem(timezone)
    if problem:
        issues.add(f"{path}.timezone", problem)
        return INVALID
    try:
        return parse_period(raw["period"], timezone)
    except ValueError as exc:
        issues.add(f"{path}.period", str(exc))
        return INVALID


def _source_item(
    item: object, path: str, issues: Issues, templates: list[tuple[str, str]]
) -> KeySource | None:
    raw = issues.mapping(item, path, "{header: Idempotency-Key}")
    if raw is None:
        return None
    for name in raw:
        if name in (*_KEY_OPTIONS, "sources"):
            issues.add(f"{path}.{name}", f"set {name} on the key itself, next to sources:")
            return None
    issues.known(raw, _SOURCE_KINDS, path)
    kinds = [name for name in _SOURCE_KINDS if name in raw]
    if len(kinds) != 1:
        issues.add(
            path,
            "each source needs exactly one of header, query, body, template or hash; "
            "write e.g. {header: Idempotency-Key}",
        )
        return None
    return _source(kinds[0], raw[kinds[0]], f"{path}.{kinds[0]}", issues, templates)


def _source(
    source_kind: str, value: object, path: str, issues: Issues, templates: list[tuple[str, str]]
) -> KeySource | None:
    if source_kind == "hash":
        items = issues.items_of(value, path, "[method, path, body]")
        if items is not None and not items:
            issues.add(path, "list at least one request part, e.g. [method, path, body]")
            return None
        parts = request_parts(items, path, issues, REQUEST_PARTS, ("header.",)) if items else None
        return None if parts is None else KeySource(kind="hash", parts=parts)
    text = issues.text(value, path)
    if text is None:
        return None
    if source_kind == "header" and not is_token(text):
        issues.add(path, f"{show(text)} is not a header name; write e.g. Idempotency-Key")
        return None
    if source_kind == "body":
        compiled = compile_jmespath(text, path, issues)
        return None if compiled is None else KeySource(kind="body", name=text, compiled=compiled)
    if source_kind == "template":
        templates.append((text, path))
    # source_kind is always one of _SOURCE_KINDS, which mypy cannot see through the loop.
    return KeySource(kind=source_kind, name=text)  # type: ignore[arg-type]


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


# -- describe ------------------------------------------------------------------------


def _store_where(store: StoreConfig) -> str:
    def nodes(items: tuple[tuple[str, int], ...]) -> str:
        return ", ".join(f"{host}:{port}" for host, port in items)

    if store.kind == "sentinel":
        return f"sentinel master {show(store.sentinel_master)} via {nodes(store.sentinel_nodes)}"
    if store.kind == "cluster":
        return f"cluster via {nodes(store.cluster_nodes)}"
    return mask_url(store.url)


def describe(config: Config) -> str:
    """A stable, human-readable summary for `check-config`; never shows secrets."""
    server, admin, store = config.server, config.admin, config.store
    api = "operator API enabled (token set)" if admin.token else "operator API disabled (no token)"
    lines = [
        f"config: {config.source}",
        f"server: listen {server.listen}; shutdown grace {format_duration(server.shutdown_grace)}"
        f"; max header size {format_size(server.max_header_bytes)}",
        f"server limits: header timeout {format_duration(server.header_timeout)}; body timeout "
        f"{format_duration(server.body_timeout)}; write timeout "
        f"{format_duration(server.write_timeout)}; keep-alive {format_duration(server.keep_alive)}"
        f"; {server.max_connections} connections; upstream keep-alive "
        f"{format_duration(server.upstream_keep_alive)}; buffered responses up to "
        f"{format_size(server.max_buffered_responses)}",
        "trusted proxies: "
        + (", ".join(str(n) for n in server.trusted_proxies) or "none (X-Forwarded-* replaced)"),
        f"admin: listen {admin.listen}; {api}",
        f"store: {_store_where(store)}; prefix {show(store.prefix)}; socket timeout "
        f"{format_duration(store.socket_timeout)}; connect timeout "
        f"{format_duration(store.connect_timeout)}; {store.max_connections} connections"
        + ("; password set" if store.password else "")
        + (f"; TLS{' (no verify)' if not store.tls.verify else ''}" if store.tls else ""),
        f"encryption: {_describe_encryption(store)}",
        f"routes: {len(config.routes)}",
    ]
    for route in config.routes:
        lines.append("")
        lines.extend(_describe_route(route))
    return "\n".join(lines) + "\n"


def _describe_encryption(store: StoreConfig) -> str:
    """Key ids only: they name a key without revealing it."""
    old = ", ".join(key_id(k).hex() for k in store.previous_encryption_keys)
    reads = f"; also reads key id(s) {old}" if old else ""
    if store.encryption_key:
        return (
            f"AES-256-GCM, new responses sealed with key id {key_id(store.encryption_key).hex()}"
            + reads
        )
    if old:
        return f"off for new responses{reads}"
    return "off (responses stored unencrypted)"


def _describe_route(route: Route) -> list[str]:
    methods = ", ".join(sorted(route.methods)) if route.methods is not None else "any method"
    fmt = format_duration
    rows: list[tuple[str, str]] = [
        ("match", f"{methods} {route.path}"),
        ("upstream", mask_url(route.upstream)),
        ("key", _describe_key(route.key)),
    ]
    if route.key is not None:
        spec = route.key
        details = [f"on missing key: {spec.on_missing}", f"max length {spec.max_length}"]
        if spec.period is not None:
            details.append(
                f"period {spec.period.text or spec.period.count} in {spec.period.timezone}"
            )
        if spec.scope:
            details.append("scoped by " + ", ".join(spec.scope))
        rows.append(("key options", "; ".join(details)))
        rows.append(("fingerprint", ", ".join(route.fingerprint) or "none"))
    concurrent: str = route.concurrent
    if route.concurrent == "wait":
        concurrent += f" (up to {fmt(route.wait_timeout)})"
    rows += [
        ("concurrent", concurrent),
        (
            "timeouts",
            f"upstream {fmt(route.upstream_timeout)}; keep responses {fmt(route.response_ttl)}",
        ),
        ("cache statuses", format_statuses(route.cache_statuses)),
        (
            "body limits",
            f"request {format_size(route.max_request_body)}; "
            f"stored {format_size(route.max_stored_body)}; "
            f"read {format_size(route.max_response_body)}",
        ),
        ("unknown outcome", route.on_unknown_outcome),
    ]
    if route.reconcile is not None:
        rec = route.reconcile
        rows.append(
            (
                "reconcile",
                f"{rec.method} {mask_url(rec.url)}; done {format_statuses(rec.done)}; not done "
                f"{format_statuses(rec.not_done)}; timeout {fmt(rec.timeout)}; every "
                f"{fmt(rec.every)}; park after {fmt(rec.park_after)}",
            )
        )
    rows += [
        ("store errors", route.on_store_error),
        ("forward key as", route.forward_key_header or "(not forwarded)"),
        ("strip headers", ", ".join(sorted(route.strip_headers)) or "none"),
        ("sensitive keys", "yes (logs show a hash)" if route.sensitive_keys else "no"),
    ]
    width = max(len(label) for label, _ in rows) + 1
    return [f"route {route.name}", *(f"  {label + ':':<{width}} {text}" for label, text in rows)]


def _describe_key(spec: KeySpec | None) -> str:
    if spec is None:
        return "none (pass-through)"
    texts = [_describe_source(source) for source in spec.sources]
    return texts[0] if len(texts) == 1 else "first present of: " + "; ".join(texts)


def _describe_source(source: KeySource) -> str:
    if source.kind == "header":
        return f"header {source.name}"
    if source.kind == "query":
        return f"query parameter {source.name}"
    if source.kind == "body":
        return f"body {source.name} (JMESPath)"
    if source.kind == "template":
        return f"template {show(source.name)}"
    if source.kind == "hash":
        return "hash of " + ", ".join(source.parts)
    return "the period window alone"
