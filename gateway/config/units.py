"""The units users write: durations ("30s"), sizes ("1MiB") and HTTP status sets
("2xx", "!408"), read and shown back the same way."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from gateway.config.issues import Problems
from gateway.config.text import show

DURATION_HINT = "write e.g. 500ms, 30s, 15m, 24h or 7d"
SIZE_HINT = "write e.g. 512KiB, 1MiB, 10MB or a number of bytes"
STATUS_HINT = 'write a code from 100 to 599, a class like "2xx", or "!408" to leave one out'

DURATION_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)?")
SIZE_RE = re.compile(r"(\d+)\s*([KMG]i?B|B)?", re.IGNORECASE)
STATUS_RE = re.compile(r"\s*!?\s*([1-5]xx|[1-5][0-9][0-9])\s*", re.IGNORECASE)
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
        match = DURATION_RE.fullmatch(text.strip())
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
        match = SIZE_RE.fullmatch(text.strip())
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


def parse_status(item: object) -> int | None:
    if isinstance(item, int) and not isinstance(item, bool):
        status = item
    elif isinstance(item, str) and item.strip().isdigit():
        status = int(item)
    else:
        return None
    return status if 100 <= status <= 599 else None


def parse_status_set(items: Iterable[object], default: frozenset[int]) -> frozenset[int]:
    """Statuses such as [200, "2xx", "!408"]; only exclusions means the default set minus
    them. A ValidationError names each item that is not a status."""
    included: set[int] = set()
    excluded: set[int] = set()
    problems = Problems()
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
