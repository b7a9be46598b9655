"""Value types of the config file: durations, sizes, status sets, names, time zones,
JMESPath expressions, IP networks and request parts."""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
import zoneinfo
from typing import Any

import jmespath

from gateway.config.issues import INVALID, Issues
from gateway.config.text import show

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

#: Request parts a `hash` key or a `fingerprint` may be computed from.
#: `header.<Name>` is accepted too.
REQUEST_PARTS = ("method", "path", "query", "body")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


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


def is_token(text: str) -> bool:
    return _TOKEN_RE.fullmatch(text) is not None


def is_identifier(text: str) -> bool:
    return _IDENT_RE.fullmatch(text) is not None


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


def jmespath_or_problem(expression: str) -> tuple[Any, str | None]:
    """The compiled expression, or None and what is wrong with it."""
    try:
        return jmespath.compile(expression), None
    except jmespath.exceptions.JMESPathError as exc:
        return None, f"not a valid JMESPath expression: {_jmespath_reason(exc)}"


def compile_jmespath(expression: str, path: str, issues: Issues) -> Any:
    compiled, problem = jmespath_or_problem(expression)
    if problem:
        issues.add(path, problem)
    return compiled


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
