"""The config as a whole, and its server and admin sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.config.addresses import listen_address
from gateway.config.issues import INVALID, Issues, section
from gateway.config.routes import Route
from gateway.config.store import StoreConfig
from gateway.config.text import secret_kind
from gateway.config.types import IPNetwork, duration_value, network_list, size_value

_SERVER_DURATIONS = (
    "header_timeout", "body_timeout", "write_timeout", "keep_alive", "upstream_keep_alive",
)  # fmt: skip


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
    #: open caller connections per process; more wait in the listen backlog
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
class Config:
    routes: tuple[Route, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    source: str = "<config>"  # the file it came from, for messages


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
