"""The units users write: durations ("30s"), sizes ("1MiB") and HTTP status sets
("2xx", "!408"), read and shown back the same way.

A space in them is the ASCII space alone: `str.strip()` and a pattern's `\\s` also take
U+3000, U+00A0 and U+2028, so "5\\u3000s" would read as five seconds in one place and
as text another program refuses in the next (an editor's schema, a linter).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from gateway.config.issues import Problems
from gateway.config.text import show
from gateway.digits import whole_number
from gateway.records import is_status

DURATION_HINT = "write e.g. 500ms, 30s, 15m, 24h or 7d"
SIZE_HINT = "write e.g. 512KiB, 1MiB, 10MB or a number of bytes"
STATUS_HINT = 'write a code from 100 to 599, a class like "2xx", or "!408" to leave one out'

#: The longest duration the gateway takes: 100 years. Every store keeps a record that
#: long (Redis's PEXPIRE takes milliseconds up to 2^63, and a script's Lua numbers
#: hold 2^53 exactly; PostgreSQL's bigint milliseconds), and every timer waits that
#: long; a response_ttl of 999999999999d is no longer than "for ever" and fits none.
MAX_DURATION = 36500 * 86400.0

# Digits are [0-9]: a str pattern's \d matches every script's digits, and float()
# reads them (gateway/digits.py). Spaces are " ": see the module docstring.
DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?|\.[0-9]+) *(ms|s|m|h|d)?")
SIZE_RE = re.compile(r"([0-9]+) *([KMG]i?B|B)?", re.IGNORECASE)
STATUS_RE = re.compile(r" *!? *([1-5]xx|[1-5][0-9][0-9]) *", re.IGNORECASE)
RATE_RE = re.compile(r"([0-9]+) */ *(s|m|h)")
RATE_HINT = "write e.g. 20/s, 600/m or 1000/h"
#: The most a rate limit takes: a token every microsecond.
MAX_RATE = 1_000_000
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_duration(text: object, *, allow_zero: bool = False) -> float:
    """Seconds from "500ms", "30s", "15m", "24h", "7d" or a plain number of seconds.

    Raises ValueError with a message that says what to write instead.
    """
    seconds: float | None = None
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    elif isinstance(text, str):
        match = DURATION_RE.fullmatch(trim(text))
        if match:
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds is None or not math.isfinite(seconds):
        hint = odd_space(text, "5s or 5 s") or DURATION_HINT
        raise ValueError(f"{show(text)} is not a duration; {hint}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        floor = "0 or more" if allow_zero else "more than 0"
        raise ValueError(f"{show(text)} is too short: it must be {floor}; {DURATION_HINT}")
    if seconds > MAX_DURATION:
        raise ValueError(
            f"{show(text)} is too long: the longest duration is "
            f"{format_duration(MAX_DURATION)} (100 years), what every store keeps a record "
            "for and every timer waits"
        )
    return seconds


def parse_rate(text: object) -> float:
    """Tokens a second from "20/s", "600/m" or "1000/h": a whole number, a slash, a unit.

    Raises ValueError with a message that says what to write instead.
    """
    match = RATE_RE.fullmatch(trim(text)) if isinstance(text, str) else None
    count = whole_number(match.group(1)) if match else None
    if match is None or count is None:
        hint = odd_space(text, "20/s or 20 / s") or RATE_HINT
        raise ValueError(f"{show(text)} is not a rate; {hint}")
    per_second = count / _RATE_UNITS[match.group(2)]
    if count == 0:
        raise ValueError(f"{show(text)} lets nothing through; {RATE_HINT}")
    if per_second > MAX_RATE:
        raise ValueError(f"{show(text)} is more than {MAX_RATE}/s, the most a limit takes")
    return per_second


def format_rate(per_second: float) -> str:
    """A rate as a file writes it, in the largest unit that keeps it whole."""
    for unit, size in (("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        count = per_second * size
        if abs(count - round(count)) < 1e-9:
            return f"{round(count)}/{unit}"
    return f"{per_second * 3600:g}/h"


def trim(text: str) -> str:
    """`text` without ASCII spaces at either end: the only space a unit is written with."""
    return text.strip(" ")


def odd_space(text: object, example: str) -> str:
    """What to write instead, if `text` holds a space other than the ASCII space."""
    if not isinstance(text, str):
        return ""
    odd = next((c for c in text if c.isspace() and c != " "), None)
    if odd is None:
        return ""
    return f"it holds U+{ord(odd):04X}, a space other than the ASCII space; write e.g. {example}"


def parse_size(text: object) -> int:
    """Bytes from "123B", "100KB", "10MB", "512KiB", "1MiB", "1GiB" or a plain integer."""
    size: int | None = None
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    elif isinstance(text, str):
        match = SIZE_RE.fullmatch(trim(text))
        count = whole_number(match.group(1)) if match else None
        if match and count is not None:
            size = count * _SIZE_UNITS[(match.group(2) or "b").lower()]
    if size is None:
        raise ValueError(f"{show(text)} is not a size; {odd_space(text, '1MiB') or SIZE_HINT}")
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


def write_size(size: int) -> str:
    """A size as a file writes it: "1MiB", not "1 MiB"."""
    return format_size(size).replace(" ", "")


def parse_status(item: object) -> int | None:
    status: int | None = None
    if isinstance(item, int) and not isinstance(item, bool):
        status = item
    elif isinstance(item, str):
        status = whole_number(trim(item), 3)
    return status if status is not None and is_status(status) else None


def parse_status_set(items: Iterable[object], default: frozenset[int]) -> frozenset[int]:
    """Statuses such as [200, "2xx", "!408"]; only exclusions means the default set minus
    them. A ValidationError names each item that is not a status."""
    included: set[int] = set()
    excluded: set[int] = set()
    problems = Problems()
    any_included = False
    for i, item in enumerate(items):
        text = trim(str(item)) if isinstance(item, str | int) else ""
        negate = text.startswith("!")
        body = trim(text[1:]) if negate else text
        codes: range | None = None
        single = parse_status(body) if not isinstance(item, bool) else None
        if single is not None:
            codes = range(single, single + 1)
        elif re.fullmatch(r"[1-5]xx", body, re.IGNORECASE):
            start = int(body[0]) * 100
            codes = range(start, start + 100)
        if codes is None:
            problems.add((i,), f"{show(item)} is not a status; {STATUS_HINT}")
        elif negate:
            excluded.update(codes)
        else:
            any_included = True
            included.update(codes)
    problems.raise_if_any()
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


def write_statuses(statuses: frozenset[int]) -> str:
    """A status set as a file writes it, so that `parse_status_set` reads it back: a
    class nearly whole as "4xx" with what it leaves out as "!408", other codes one by one.
    """
    items: list[str] = []
    left_out: list[str] = []
    for first in range(100, 600, 100):
        whole = set(range(first, first + 100))
        inside = whole & statuses
        if len(inside) >= 90:
            items.append(f'"{first // 100}xx"')
            left_out += [f'"!{status}"' for status in sorted(whole - inside)]
        else:
            items += [str(status) for status in sorted(inside)]
    return "[" + ", ".join(items + left_out) + "]"
