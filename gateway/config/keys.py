"""Idempotency key settings: where a route's key comes from (`key:`), its period
window and options."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.config.issues import INVALID, Issues, choice_of
from gateway.config.templates import compile_template, scan_template
from gateway.config.text import kind, show
from gateway.config.types import (
    REQUEST_PARTS,
    compile_jmespath,
    is_token,
    jmespath_or_problem,
    request_parts,
    timezone_problem,
)

MissingKeyPolicy = Literal["reject", "forward"]
KeySourceKind = Literal["header", "query", "body", "template", "hash", "period"]

#: len("sha256:" + 64 hex digits): the key a `hash` source makes.
HASH_KEY_LENGTH = 71

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
    #: body: the compiled JMESPath; template: the compiled Template (gateway.keys renders it)
    compiled: Any = None

    def __post_init__(self) -> None:
        # Compiled here, when the config loads: a request never parses a source again.
        if self.compiled is None and self.kind in ("body", "template"):
            compiled = compile_template(self.name) if self.kind == "template" else None
            if self.kind == "body":
                compiled, problem = jmespath_or_problem(self.name)
                if problem:
                    raise ValueError(f"key body {show(self.name)}: {problem}")
            object.__setattr__(self, "compiled", compiled)


@dataclass(frozen=True, slots=True)
class KeySpec:
    sources: tuple[KeySource, ...]  # first one present wins
    period: Period | None = None
    on_missing: MissingKeyPolicy = "reject"
    scope: tuple[str, ...] = ()  # e.g. ("header.Authorization",)
    max_length: int = 255


@dataclass(frozen=True, slots=True)
class _ParsedKey:
    spec: KeySpec
    path_params: tuple[tuple[str, str], ...]  # ({path.<param>} name, where it was written)


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
        scan = scan_template(template, has_period=period is not None)
        for problem in scan.problems:
            issues.add(where, problem)
        uses_period = uses_period or scan.uses_period
        refs.extend((param, where) for param in scan.path_params)
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
            issues.add(
                f"{path}.{name}", f"set {name} on the key itself, next to sources:", at_name=True
            )
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
        scan = scan_template(text)
        if scan.problems:
            # Reported with the key's other template checks; the config is refused, so
            # the scan stands in for the compiled template that cannot be made.
            return KeySource(kind="template", name=text, compiled=scan)
    # source_kind is always one of _SOURCE_KINDS, which mypy cannot see through the loop.
    return KeySource(kind=source_kind, name=text)  # type: ignore[arg-type]
