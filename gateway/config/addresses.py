"""Addresses: the listen grammar (`host:port`, `[v6]:port`), its one owner (config
validation checks with it, gateway.serve binds with it), and the URLs of upstreams,
stores and reconcile checks, with passwords masked in anything shown."""

from __future__ import annotations

import difflib
import re
from typing import Annotated
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from gateway.config.issues import Problems, raise_at
from gateway.config.templates import TEMPLATE_TOKEN_RE, split_placeholders, url_template
from gateway.config.text import show
from gateway.config.types import Check, items, text
from gateway.digits import whole_number

_STORE_SCHEMES = ("memory", "redis", "rediss", "unix", "postgresql", "postgres", "sqlite")
_SECRET_PARAMS = {"password", "pass", "pwd", "secret", "token", "auth"}


def parse_listen(text: str) -> tuple[str, int]:
    """Splits "host:port" or "[v6]:port"; raises ValueError saying what to write."""
    hint = 'write host:port, e.g. "127.0.0.1:8080", "0.0.0.0:8080" or "[::1]:8080"'
    host, sep, port_text = text.rpartition(":")
    port = whole_number(port_text, 5)
    if not sep or not host or port is None:
        raise ValueError(f"{show(text)} is not an address; {hint}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{show(text)} is not an address; {hint}")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{show(text)} has an IPv6 host without brackets; {hint}")
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} in {show(text)} is not from 1 to 65535; {hint}")
    return host.lower(), port


def listen_clash(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """True when two sockets could not both bind (a wildcard host takes every address)."""
    wildcard = {"0.0.0.0", "::", ""}
    return a[1] == b[1] and (a[0] == b[0] or a[0] in wildcard or b[0] in wildcard)


def check_http_url(text: str, *, allow_query: bool) -> str | None:
    """Returns why `text` is not an http(s) URL the gateway can send to, or None."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 -- accessing it validates the port
    except ValueError as exc:
        return f"{show(text)} is not a URL ({exc}); write e.g. http://127.0.0.1:5000"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{show(text)} is not an http or https URL; write e.g. http://127.0.0.1:5000"
    if parts.fragment:
        return f"{show(text)} has a #fragment; remove it"
    if parts.query and not allow_query:
        return f"{show(text)} has a query string; the gateway forwards the caller's query"
    return None


_USERINFO_PASSWORD = re.compile(r"(//[^/@:]*):[^/@]*@")


def mask_url(url: str) -> str:
    """Hides the password in a URL (`redis://user:***@host`) and secret query values."""
    try:
        parts = urlsplit(url)
    except ValueError:
        # Not a URL urlsplit can read, but it may still hold `user:password@`.
        return _USERINFO_PASSWORD.sub(r"\1:***@", url)
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    changed = False
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}"
        changed = True
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            masked = [(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in pairs]
            query = urlencode(masked, safe="*", quote_via=quote)
            changed = True
    if not changed:
        # urlunsplit would turn "memory://" into "memory:".
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def store_url_problem(url: str) -> str | None:
    example = (
        "e.g. memory://, redis://127.0.0.1:6379/0, unix:///run/redis.sock, "
        "postgresql://gateway@127.0.0.1:5432/gateway or sqlite:///var/lib/gateway/gateway.db"
    )
    shown = show(mask_url(url))  # the message ends up in logs: never the password
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- accessing it validates the port
    except ValueError as exc:
        return f"{shown} is not a URL ({exc}); write {example}"
    written = url.partition("://")[0]
    if written != parts.scheme and written.lower() in _STORE_SCHEMES:
        # urlsplit lowers the scheme, but the store is chosen by the URL as written.
        return f'{shown}: write the scheme in lower case: "{written.lower()}://"'
    if parts.scheme not in _STORE_SCHEMES or "://" not in url:
        message = f"{shown}: the store URL must start with memory://, redis://, "
        message += f"rediss://, unix://, postgresql://, postgres:// or sqlite://; write {example}"
        close = difflib.get_close_matches(parts.scheme, _STORE_SCHEMES, n=1)
        return message + (f'; did you mean "{close[0]}://"?' if close and parts.scheme else "")
    if parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            return f"{shown} has no host; write e.g. {parts.scheme}://127.0.0.1:6379/0"
        if parts.path.strip("/") and whole_number(parts.path.strip("/")) is None:
            return f"{shown}: the path must be a database number, e.g. /0"
    if parts.scheme in ("postgresql", "postgres"):
        if not parts.hostname and "host=" not in parts.query:
            return (
                f"{shown} has no host; write e.g. {parts.scheme}://gateway@127.0.0.1:5432/gateway"
                " (or ?host=/run/postgresql for a unix socket)"
            )
        if not parts.path.strip("/"):
            return f"{shown} names no database; write e.g. {parts.scheme}://127.0.0.1/gateway"
    if parts.scheme == "sqlite":
        return _sqlite_problem(url, shown)
    if parts.scheme == "unix" and (parts.netloc.rpartition("@")[2] or not parts.path):
        return f"{shown}: write the socket path after three slashes: unix:///run/redis.sock"
    return None


def _sqlite_problem(url: str, shown: str) -> str | None:
    """A `sqlite://` URL is the file's path after the scheme, as written: absolute
    after three slashes, else relative to the working directory."""
    path = url.removeprefix("sqlite://")
    example = "sqlite:///var/lib/idempotency-gateway/gateway.db (or sqlite://gateway.db)"
    if not path or path.endswith("/"):
        return f"{shown} names no file; write e.g. {example}"
    if any(char in path for char in "?#") or any(ord(char) < 32 for char in path):
        return f"{shown}: the path may not hold ?, # or control characters; write e.g. {example}"
    if path.rsplit("/", 1)[-1] == ":memory:":
        return (
            f"{shown} would be a file called :memory:, not SQLite's in-memory database; "
            f"for records kept in memory write memory://, else a file, e.g. {example}"
        )
    if path == "~" or path.startswith("~/"):
        return (
            f"{shown}: ~ is not expanded (it would name a folder called ~); write the whole "
            "path, e.g. sqlite://${HOME}/gateway.db"
        )
    return None


def _listen(value: object) -> str:
    address = text(value)
    parse_listen(address)
    return address


def _nodes(value: object) -> tuple[tuple[str, int], ...]:
    example = '["10.0.0.1:26379", "10.0.0.2:26379"]'
    if value is None:
        raise ValueError(f"list the nodes, e.g. nodes: {example}")
    found = items(value, example)
    if not found:
        raise ValueError(f"list at least one node, e.g. nodes: {example}")
    nodes: list[tuple[str, int]] = []
    for i, item in enumerate(found):
        try:
            if isinstance(item, tuple):  # (host, port), from Python
                nodes.append((str(item[0]), int(item[1])))
            else:
                nodes.append(parse_listen(text(item)))
        except ValueError as exc:
            raise_at((i,), str(exc))
    return tuple(nodes)


def _upstream(value: object) -> str:
    if value is None:
        raise ValueError("every route needs an upstream, e.g. upstream: http://127.0.0.1:5000")
    url = text(value)
    problem = check_http_url(url, allow_query=False)
    if problem:
        raise ValueError(problem)
    return url.rstrip("/")


def _store_url(value: object) -> str:
    url = text(value)
    problem = store_url_problem(url)
    if problem:
        raise ValueError(problem)
    return url


RECONCILE_EXAMPLE = (
    "{url: 'http://127.0.0.1:5000/jobs/status?key={key}', done: [200], not_done: [404]}"
)
_RECONCILE_QUERY_FORM = "http://127.0.0.1:5000/jobs/status?key={key}"


def _reconcile_url(value: object) -> str:
    if value is None:
        raise ValueError(f"missing; write e.g. url: {_RECONCILE_QUERY_FORM}")
    url = text(value)
    names, found = split_placeholders(url)
    for name in names:
        if name not in ("key", "route", "run_id"):
            found.append(f"unknown placeholder {{{name}}}; use {{key}}, {{route}} or {{run_id}}")
    if not found:
        for slot in url_template(url).slots:
            if slot.place == "authority":
                found.append(
                    f"{{{slot.name}}} is in the URL's scheme, host or port, where a value "
                    "would choose where the check goes; put it in the path or the query, "
                    f"e.g. {_RECONCILE_QUERY_FORM}"
                )
    problem = None if found else check_http_url(TEMPLATE_TOKEN_RE.sub("x", url), allow_query=True)
    problems = Problems()
    for message in [*found, *([problem] if problem else [])]:
        problems.add((), message)
    problems.raise_if_any()
    return url


def reconcile_url_warning(url: str) -> str | None:
    """Why an accepted reconcile URL may leave keys unchecked, or None: `{key}` in the
    path, where a key that is `.` or `..` or holds `/` cannot be placed (see
    gateway.config.templates), so its check is never sent and it parks."""
    slot = next((s for s in url_template(url).slots if s.name == "key"), None)
    if slot is None or slot.place != "path":
        return None
    where = "stands alone as a path segment" if slot.whole_segment else "is in the path"
    return (
        f"{{key}} {where}: a key that is . or .. or holds / or \\ (in any spelling) "
        "would send the check to another URL, so such a key is never checked and parks "
        f"after park_after; the query is the safe place, e.g. {_RECONCILE_QUERY_FORM}"
    )


_ADDRESS = {"type": "string", "pattern": r"^(\[[0-9A-Fa-f:.]+\]|[^:\[\]]+):[0-9]{1,5}$"}
_HTTP = {"type": "string", "pattern": "^https?://"}
_STORE = {
    "type": "string",
    "pattern": "^(memory|redis|rediss|unix|postgresql|postgres|sqlite)://",
}

ListenAddress = Annotated[str, Check(_listen, _ADDRESS, written="`host:port`")]
HostPorts = Annotated[
    tuple[tuple[str, int], ...],
    Check(
        _nodes, {"type": "array", "items": _ADDRESS, "minItems": 1}, written="list of `host:port`"
    ),
]
UpstreamUrl = Annotated[str, Check(_upstream, _HTTP, written="http(s) URL")]
#: A store URL; the reference shows a bare `sqlite://` file as the loader places the
#: default one, in the config file's directory.
StoreUrl = Annotated[
    str,
    Check(
        _store_url,
        _STORE,
        written="URL",
        show=lambda url: re.sub(r"^sqlite://(?!/)", "sqlite://<config file's directory>/", url),
    ),
]
ReconcileUrl = Annotated[
    str, Check(_reconcile_url, _HTTP, written="http(s) URL with `{key}`, `{route}`, `{run_id}`")
]
