"""Building blocks for `gateway.config`: value parsers, ${VAR} interpolation, the
issue collector and checks that need none of the config dataclasses.

This module must not import gateway.config (which imports it), so that config.py
can stay a readable description of the settings without an import cycle.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import re
import zoneinfo
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import jmespath
import yaml

from gateway.errors import ConfigIssue

DURATION_HINT = "write e.g. 500ms, 30s, 15m, 24h or 7d"
SIZE_HINT = "write e.g. 512KiB, 1MiB, 10MB or a number of bytes"

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE_RE = re.compile(r"(\d+)\s*([KMG]i?B|B)?", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
# RFC 9110 token: what a header name or method may be made of.
_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_RE = re.compile(r"\$\$\{|\$\{([^}]*)\}|\$\{")
_ENV_NAME_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::([-?])(.*))?", re.DOTALL)
# The same grammar as gateway.keys: {{ and }} are literal braces.
TEMPLATE_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_PLACEHOLDER_HINT = (
    "use {period}, {method}, {path}, {path.<param>}, {header.<Name>}, {query.<name>} "
    "or {body.<jmespath>}"
)
_STORE_SCHEMES = ("memory", "redis", "rediss", "unix")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SECRET_PARAMS = {"password", "pass", "pwd", "secret", "token", "auth"}


class Issues:
    """Collects every problem in a file so the user sees them all in one run."""

    def __init__(self) -> None:
        self.items: list[ConfigIssue] = []

    def add(self, path: str, message: str) -> None:
        issue = ConfigIssue(path, message)
        # Settings inherited from `defaults` are checked once per route; one report is enough.
        if issue not in self.items:
            self.items.append(issue)

    def mapping(self, value: object, path: str, example: str = "") -> dict[str, Any] | None:
        if isinstance(value, dict):
            return value
        hint = f"; write e.g. {example}" if example else ""
        self.add(path, f"expected a mapping (name: value), got {kind(value)}{hint}")
        return None

    def known(self, data: dict[str, Any], valid: Iterable[str], path: str) -> None:
        """Reports settings not in `valid`, with the closest valid name as a hint."""
        names = sorted(valid)
        for name in data:
            if name not in names:
                self.add(join(path, str(name)), unknown_setting(str(name), names))

    def text(
        self, value: object, path: str, *, empty_ok: bool = False, secret: bool = False
    ) -> str | None:
        """`secret`: a password or token; a wrong value is described, never shown."""
        if isinstance(value, str) and (value or empty_ok):
            return value
        if isinstance(value, str):
            self.add(path, "must not be empty")
        else:
            self.add(path, f"expected text, got {secret_kind(value) if secret else kind(value)}")
        return None

    def integer(self, value: object, path: str, low: int, high: int) -> int | None:
        number: int | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and value.strip().isdigit():
            # An ${ENV} reference always yields text; accept digits so it can set a number.
            number = int(value)
        if number is None or not low <= number <= high:
            self.add(path, f"{show(value)} is not a whole number from {low} to {high}")
            return None
        return number

    def boolean(self, value: object, path: str) -> bool | None:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        self.add(path, f"{show(value)} is not true or false")
        return None

    def choice(self, value: object, path: str, options: tuple[str, ...]) -> str | None:
        if isinstance(value, str) and value in options:
            return value
        listed = ", ".join(options)
        message = f"{show(value)} is not one of {listed}"
        if isinstance(value, str):
            close = difflib.get_close_matches(value, options, n=1)
            if close:
                message += f'; did you mean "{close[0]}"?'
        self.add(path, message)
        return None

    def items_of(self, value: object, path: str, example: str) -> list[Any] | None:
        if isinstance(value, list):
            return value
        self.add(path, f"expected a list, got {kind(value)}; write e.g. {example}")
        return None


def kind(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the text {show(value)}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def secret_kind(value: object) -> str:
    """Like `kind`, without the value: for passwords and tokens, which errors (and so
    logs) must never repeat."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    if isinstance(value, str):
        return "text"
    return kind(value)


def show(value: object) -> str:
    """Quotes a value the way the user would recognise it from their file."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return kind(value)


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def unknown_setting(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        return f'unknown setting; did you mean "{close[0]}"?'
    return "unknown setting; valid settings here are " + ", ".join(valid)


# -- ${VAR} interpolation --------------------------------------------------------


def interpolate(data: object, path: str, issues: Issues, env: dict[str, str]) -> object:
    """Expands ${VAR}, ${VAR:-default} and ${VAR:?message} in every string scalar."""
    if isinstance(data, dict):
        return {k: interpolate(v, join(path, str(k)), issues, env) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate(v, f"{path}[{i}]", issues, env) for i, v in enumerate(data)]
    if isinstance(data, str) and "$" in data:
        return _expand(data, path, issues, env)
    return data


def _expand(text: str, path: str, issues: Issues, env: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        inner = match.group(1)
        ref = _ENV_NAME_RE.fullmatch(inner) if inner is not None else None
        if ref is None:
            issues.add(
                path,
                f"{show(match.group(0))} is not a valid environment reference; write "
                "${NAME}, ${NAME:-default} or ${NAME:?message}, or $${ for a literal ${",
            )
            return ""
        name, op, arg = ref.groups()
        value = env.get(name)
        if op == "-":
            return value if value else arg
        if op == "?" and not value:
            why = arg or "it is required"
            issues.add(path, f"environment variable {name} is not set: {why}")
            return ""
        return value or ""

    return _ENV_RE.sub(replace, text)


# -- durations and sizes ----------------------------------------------------------


def parse_duration(text: object, *, allow_zero: bool = False) -> float:
    """Seconds from "500ms", "30s", "15m", "24h", "7d" or a plain number of seconds.

    Raises ValueError with a message that says what to write instead.
    """
    seconds: float | None = None
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    elif isinstance(text, str):
        match = _DURATION_RE.fullmatch(text.strip())
        if match:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"{show(text)} is not a duration; {DURATION_HINT}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        floor = "0 or more" if allow_zero else "more than 0"
        raise ValueError(f"{show(text)} is too short: it must be {floor}; {DURATION_HINT}")
    return seconds


def parse_size(text: object) -> int:
    """Bytes from "123B", "100KB", "10MB", "512KiB", "1MiB", "1GiB" or a plain integer."""
    size: int | None = None
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    elif isinstance(text, str):
        match = _SIZE_RE.fullmatch(text.strip())
        if match:
            size = int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "b").lower()]
    if size is None:
        raise ValueError(f"{show(text)} is not a size; {SIZE_HINT}")
    if size <= 0:
        raise ValueError(f"{show(text)} must be more than 0 bytes")
    return size


def format_duration(seconds: float) -> str:
    if seconds < 1 and seconds * 1000 == int(seconds * 1000):
        return f"{int(seconds * 1000)}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def format_size(size: int) -> str:
    for unit, step in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= step and size % step == 0:
            return f"{size // step} {unit}"
    for unit, step in (("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if size >= step and size % step == 0:
            return f"{size // step} {unit}"
    return f"{size} B"


# -- names, addresses and URLs ------------------------------------------------------


def is_token(text: str) -> bool:
    return _TOKEN_RE.fullmatch(text) is not None


def is_identifier(text: str) -> bool:
    return _IDENT_RE.fullmatch(text) is not None


def parse_listen(text: str) -> tuple[str, int]:
    """Splits "host:port" or "[v6]:port"; raises ValueError saying what to write."""
    hint = 'write host:port, e.g. "127.0.0.1:8080", "0.0.0.0:8080" or "[::1]:8080"'
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{show(text)} is not an address; {hint}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{show(text)} is not an address; {hint}")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{show(text)} has an IPv6 host without brackets; {hint}")
    port = int(port_text)
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


# -- route paths, templates and status codes ------------------------------------------


def parse_path_pattern(path: str) -> tuple[list[str], list[str]]:
    """Returns the pattern's parameter names and what is wrong with it."""
    problems: list[str] = []
    params: list[str] = []
    if not path.startswith("/"):
        problems.append(f"{show(path)} must start with /, e.g. /jobs/send-reminder")
        return params, problems
    if "?" in path or "#" in path:
        problems.append(f"{show(path)} must not hold a query or fragment; match the path only")
    segments = path[1:].split("/")
    for i, segment in enumerate(segments):
        if "{" not in segment and "}" not in segment:
            continue
        if not (segment.startswith("{") and segment.endswith("}")) or segment.count("{") > 1:
            problems.append(
                f"segment {show(segment)} mixes text and a parameter; "
                "a parameter must be a whole segment, e.g. /jobs/{name}"
            )
            continue
        name, _, converter = segment[1:-1].partition(":")
        if not is_identifier(name):
            problems.append(f"parameter {{{name}}} must be a name like {{job_id}}")
        elif name in params:
            problems.append(f"parameter {{{name}}} appears twice; give each a different name")
        elif converter and converter != "path":
            problems.append(
                f"{{{segment[1:-1]}}}: the only parameter type is :path (the rest of the path)"
            )
        elif converter and i != len(segments) - 1:
            problems.append(f"{{{name}:path}} takes the rest of the path, so it must come last")
        else:
            params.append(name)
    return params, problems


def template_placeholders(template: str) -> tuple[list[str], list[str]]:
    """Splits out the `{...}` placeholders of a template; also returns brace problems."""
    found: list[str] = []
    problems: list[str] = []
    for match in TEMPLATE_TOKEN_RE.finditer(template):
        token = match.group(0)
        if match.group(1) is not None:
            found.append(match.group(1).strip())
        elif token in ("{", "}"):
            problems.append(
                f"{show(template)} has an unmatched {token}; placeholders look like "
                f"{{body.user_id}}, and {token * 2} writes a literal {token}"
            )
    return found, problems


def parse_status(item: object) -> int | None:
    if isinstance(item, int) and not isinstance(item, bool):
        status = item
    elif isinstance(item, str) and item.strip().isdigit():
        status = int(item)
    else:
        return None
    return status if 100 <= status <= 599 else None


def parse_status_set(
    items: list[Any], path: str, issues: Issues, default: frozenset[int]
) -> frozenset[int] | None:
    """Statuses such as [200, "2xx", "!408"]; only exclusions means the default set minus them."""
    included: set[int] = set()
    excluded: set[int] = set()
    ok = True
    any_included = False
    for i, item in enumerate(items):
        text = str(item).strip() if isinstance(item, str | int) else ""
        negate = text.startswith("!")
        body = text[1:].strip() if negate else text
        codes: range | None = None
        single = parse_status(body) if not isinstance(item, bool) else None
        if single is not None:
            codes = range(single, single + 1)
        elif re.fullmatch(r"[1-5]xx", body, re.IGNORECASE):
            start = int(body[0]) * 100
            codes = range(start, start + 100)
        if codes is None:
            issues.add(
                f"{path}[{i}]",
                f"{show(item)} is not a status; write a code from 100 to 599, a class "
                'like "2xx", or "!408" to leave one out',
            )
            ok = False
        elif negate:
            excluded.update(codes)
        else:
            any_included = True
            included.update(codes)
    if not ok:
        return None
    return frozenset((included if any_included else set(default)) - excluded)


def format_statuses(statuses: frozenset[int]) -> str:
    if not statuses:
        return "none"
    ordered = sorted(statuses)
    spans: list[str] = []
    start = prev = ordered[0]
    for status in [*ordered[1:], -1]:
        if status == prev + 1:
            prev = status
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = status
    return ", ".join(spans)


# -- checks that need no config types -----------------------------------------------


def timezone_problem(name: object) -> str | None:
    if isinstance(name, str) and name:
        try:
            zoneinfo.ZoneInfo(name)
            return None
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            pass
    message = f"{show(name)} is not a known time zone; write an IANA name such as UTC"
    if isinstance(name, str):
        close = difflib.get_close_matches(name, sorted(zoneinfo.available_timezones()), n=1)
        if close:
            return f'{message}; did you mean "{close[0]}"?'
    return message + ", Europe/Berlin or America/New_York"


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, which PyYAML would silently overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f'"{key}" is given twice in one mapping', key_node.start_mark
                )
            seen.add(key) if isinstance(key, str) else None
        return super().construct_mapping(node, deep=deep)


def yaml_message(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    if "'{'" in problem or "'}'" in problem:
        # Path patterns and templates are the usual cause: {name} opens a YAML mapping.
        what += '; quote text holding { or }, e.g. path: "/jobs/{name}"'
    if mark is None:
        return f"not valid YAML: {what}"
    return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {what}"


def store_url_problem(url: str) -> str | None:
    example = "e.g. memory://, redis://127.0.0.1:6379/0 or unix:///run/redis.sock"
    shown = show(mask_url(url))  # the message ends up in logs: never the password
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- accessing it validates the port
    except ValueError as exc:
        return f"{shown} is not a URL ({exc}); write {example}"
    if parts.scheme not in _STORE_SCHEMES or "://" not in url:
        message = f"{shown}: the store URL must start with memory://, redis://, "
        message += f"rediss:// or unix://; write {example}"
        close = difflib.get_close_matches(parts.scheme, _STORE_SCHEMES, n=1)
        return message + (f'; did you mean "{close[0]}://"?' if close and parts.scheme else "")
    if parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            return f"{shown} has no host; write e.g. {parts.scheme}://127.0.0.1:6379/0"
        if parts.path.strip("/") and not parts.path.strip("/").isdigit():
            return f"{shown}: the path must be a database number, e.g. /0"
    if parts.scheme == "unix" and (parts.netloc.rpartition("@")[2] or not parts.path):
        return f"{shown}: write the socket path after three slashes: unix:///run/redis.sock"
    return None


def compile_jmespath(expression: str, path: str, issues: Issues) -> Any:
    try:
        return jmespath.compile(expression)
    except jmespath.exceptions.JMESPathError as exc:
        issues.add(path, f"not a valid JMESPath expression: {_jmespath_reason(exc)}")
        return None


def _jmespath_reason(exc: jmespath.exceptions.JMESPathError) -> str:
    # str(exc) is a multi-line drawing of the expression; one line reads better.
    if isinstance(exc, jmespath.exceptions.IncompleteExpressionError):
        reason = "the expression ends too early"
    elif isinstance(exc, jmespath.exceptions.LexerError):
        reason = str(getattr(exc, "message", "") or "it cannot be read")
    else:
        reason = str(getattr(exc, "msg", "") or type(exc).__name__)
    position = getattr(exc, "lex_position", None)
    if isinstance(position, int):
        reason += f" (at character {position + 1})"
    return reason + "; write e.g. job_key, data.id or items[0].id"


def _template_separator_problem(template: str) -> str | None:
    """Two placeholders need a separator between them that does not start with the
    backslash, which escapes separator characters inside values (gateway.keys)."""
    previous: re.Match[str] | None = None
    for match in TEMPLATE_TOKEN_RE.finditer(template):
        if match.group(1) is None:
            continue
        if previous is not None:
            between = template[previous.end() : match.start()]
            if not between or between.startswith("\\"):
                a, b = previous.group(1).strip(), match.group(1).strip()
                where = "next to each other" if not between else "split by a backslash, the escape"
                return (
                    f"{{{a}}} and {{{b}}} are {where}, so two different requests could share "
                    f'one key ("ab"+"c" and "a"+"bc"); put a separator between them, e.g. '
                    f"{{{a}}}:{{{b}}}"
                )
        previous = match
    return None


def check_template(
    template: str, path: str, issues: Issues, *, has_period: bool
) -> tuple[bool, list[str]]:
    """Checks placeholders; returns whether {period} is used and the {path.<p>} names."""
    placeholders, problems = template_placeholders(template)
    for problem in problems:
        issues.add(path, problem)
    separator = _template_separator_problem(template)
    if separator:
        issues.add(path, separator)
    uses_period = False
    params: list[str] = []
    for text in placeholders:
        head, dot, rest = text.partition(".")
        if text == "period":
            uses_period = True
            if not has_period:
                issues.add(
                    path, "{period} needs a period; add e.g. period: 1d (or 15m, 1h, 1w) to the key"
                )
        elif text in ("method", "path"):
            pass
        elif dot and head == "path" and is_identifier(rest):
            params.append(rest)
        elif dot and head == "header" and is_token(rest):
            pass
        elif dot and head == "query" and rest:
            pass
        elif dot and head == "body" and rest:
            compile_jmespath(rest, path, issues)
        else:
            close = difflib.get_close_matches(
                head, ["period", "method", "path", "header", "query", "body"], n=1
            )
            guess = f'; did you mean "{{{close[0]}{dot}{rest}}}"?' if close else ""
            issues.add(path, f"unknown placeholder {{{text}}}; {_PLACEHOLDER_HINT}{guess}")
    return uses_period, params


# -- setting parsers: each returns the parsed value, or INVALID once it is reported ---


INVALID: Any = object()  # a setting whose value was wrong; already reported


def section(
    value: object, path: str, issues: Issues, names: tuple[str, ...]
) -> dict[str, Any] | None:
    section = issues.mapping({} if value is None else value, path, f"{path}: {{...}}")
    if section is not None:
        issues.known(section, names, path)
    return section


def listen_address(value: object, path: str, issues: Issues) -> Any:
    text = issues.text(value, path)
    if text is None:
        return INVALID
    try:
        parse_listen(text)
    except ValueError as exc:
        issues.add(path, str(exc))
        return INVALID
    return text


def check_listen_clash(server: str, admin: str, issues: Issues) -> None:
    if listen_clash(parse_listen(server), parse_listen(admin)):
        issues.add(
            "admin.listen",
            f"{show(admin)} clashes with server.listen {show(server)}; give the "
            'operator API its own port, e.g. "127.0.0.1:9090"',
        )


def duration_value(value: object, path: str, issues: Issues, *, allow_zero: bool = False) -> Any:
    try:
        return parse_duration(value, allow_zero=allow_zero)
    except ValueError as exc:
        issues.add(path, str(exc))
        return INVALID


def size_value(value: object, path: str, issues: Issues) -> Any:
    try:
        return parse_size(value)
    except ValueError as exc:
        issues.add(path, str(exc))
        return INVALID


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def network_list(value: object, path: str, issues: Issues) -> Any:
    """Addresses or CIDR blocks: `127.0.0.1`, `10.0.0.0/8`, `::1`."""
    items = issues.items_of([] if value is None else value, path, '["127.0.0.1", "10.0.0.0/8"]')
    if items is None:
        return INVALID
    out: list[IPNetwork] = []
    for i, item in enumerate(items):
        try:
            out.append(ipaddress.ip_network(str(item).strip(), strict=False))
        except ValueError:
            issues.add(
                f"{path}[{i}]",
                f"{show(item)} is not an IP address or CIDR block; write e.g. "
                '"127.0.0.1", "10.0.0.0/8" or "::1"',
            )
            return INVALID
    return tuple(out)


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


def request_parts(
    items: list[Any], path: str, issues: Issues, plain: tuple[str, ...], prefixes: tuple[str, ...]
) -> tuple[str, ...] | None:
    found: list[str] = []
    hint = ", ".join((*plain, *(f"{p}<Name>" for p in prefixes)))
    for i, item in enumerate(items):
        where = f"{path}[{i}]"
        prefix = next((p for p in prefixes if isinstance(item, str) and item.startswith(p)), "")
        if isinstance(item, str) and (item in plain or (prefix and is_token(item[len(prefix) :]))):
            if item in found:
                issues.add(where, f"{show(item)} is listed twice")
                return None
            found.append(item)
            continue
        message = f"{show(item)} is not a request part; write {hint}"
        close = difflib.get_close_matches(str(item), plain, n=1) if isinstance(item, str) else []
        issues.add(where, message + (f'; did you mean "{close[0]}"?' if close else ""))
        return None
    return tuple(found)


def choice_of(options: tuple[str, ...]) -> Callable[[object, str, Issues], Any]:
    def parse(value: object, path: str, issues: Issues) -> Any:
        chosen = issues.choice(value, path, options)
        return INVALID if chosen is None else chosen

    return parse


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


def flag(value: object, path: str, issues: Issues) -> Any:
    flag = issues.boolean(value, path)
    return INVALID if flag is None else flag


def reconcile_url(value: object, path: str, issues: Issues) -> Any:
    url = issues.text(value, path)
    if url is None:
        return INVALID
    placeholders, problems = template_placeholders(url)
    for name in placeholders:
        if name not in ("key", "route", "run_id"):
            problems.append(f"unknown placeholder {{{name}}}; use {{key}}, {{route}} or {{run_id}}")
    problem = check_http_url(TEMPLATE_TOKEN_RE.sub("x", url), allow_query=True)
    for message in [*problems, *([problem] if problem else [])]:
        issues.add(path, message)
    return INVALID if problems or problem else url
