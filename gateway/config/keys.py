"""Idempotency key settings: where a route's key comes from (`key:`), its period
window and options.

A key is written in one of three forms, `key: {header: Idempotency-Key}`, `key:
{sources: [...], ...options}` or a bare list of sources, so `KeySpec` reads the file
itself (`key_from_yaml`); its options are typed fields like any other setting.
Templates are checked with their key's context (is there a period?) and compiled
once, when the config loads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import model_validator
from pydantic_core import ArgsKwargs

from gateway.config.http import HashParts, ScopeParts
from gateway.config.issues import INVALID, Loc, Problems
from gateway.config.sections import field_adapter, is_instance, settings
from gateway.config.templates import compile_template, scan_template
from gateway.config.text import kind, show, unknown_setting
from gateway.config.types import (
    MissingKeyPolicy,
    OneOf,
    TimeZone,
    Whole,
    is_token,
    jmespath_or_problem,
    text,
    timezone_problem,
)
from gateway.config.units import odd_space, trim
from gateway.digits import whole_number

KeySourceKind = Literal["header", "query", "body", "template", "hash", "period"]

#: len("sha256:" + 64 hex digits): the key a `hash` source makes.
HASH_KEY_LENGTH = 71

#: Where a key may come from, and what each source reads, for users (the JSON Schema
#: and docs/configuration.md).
SOURCES = {
    "header": "`{header: Idempotency-Key}`: a request header (its name matched "
    'case-insensitively). The IETF draft\'s structured-field string `"abc"` and bare '
    "`abc` are the same key; only spaces and tabs around the value are trimmed, and it "
    "must be valid UTF-8.",
    "query": "`{query: run}`: a query parameter's first value, valid UTF-8.",
    "body": "`{body: job_key}`: a JMESPath expression into the JSON body; a number "
    "becomes its JSON text. A body with duplicate fields is refused (parsers disagree on "
    "which one wins).",
    "template": '`{template: "reminder:{body.user_id}:{period}"}`: text with parts '
    "`{period}`, `{method}`, `{path}`, `{path.<param>}`, `{header.<Name>}`, "
    "`{query.<name>}`, `{body.<jmespath>}`; a missing part means no key. Parts need a "
    "separator between them (`{a}:{b}`, not `{a}{b}`); a value's own copy of a "
    "separator's first character, and any backslash, is escaped with a backslash, so "
    "different values never make one key.",
    "hash": "`{hash: [method, path, query, body]}`: a key computed from request parts "
    "(`header.<Name>` too), `sha256:` and 64 hex digits.",
}
SOURCE_KINDS = tuple(SOURCES)
KEY_OPTIONS = ("period", "timezone", "on_missing", "scope", "max_length")
_EXAMPLE = "key: {header: Idempotency-Key}"
_SEVERAL = "to try several in order, write sources: [{header: Idempotency-Key}, {body: id}]"
_PERIOD_HINT = "write e.g. 15m, 1h, 6h, 1d, 1w or 1mo"
_PERIOD_RE = re.compile(r"([0-9]+) *(mo|m|h|d|w)")
# Maps the matched text onto Period.unit's Literal type without a cast.
_PERIOD_UNITS: dict[str, Literal["m", "h", "d", "w", "mo"]] = {
    "m": "m",
    "h": "h",
    "d": "d",
    "w": "w",
    "mo": "mo",
}


@settings
class Period:
    """A time window for `{period}`: `count` units of `unit`, in `timezone`."""

    written = "`15m`, `1h`, `1d`, `1w`, `1mo` ..."

    count: int
    """How many units a window spans."""
    unit: Literal["m", "h", "d", "w", "mo"]
    """Minutes, hours, days, weeks or months."""
    timezone: TimeZone = "UTC"
    """The time zone windows follow, an IANA name such as `Europe/Berlin`; only with
    `period`."""
    text: str = ""
    """The period as written, for messages."""


@settings
class KeySource:
    """One place an idempotency key can come from.

    - header: `name` is the header name (matched case-insensitively)
    - query: `name` is the query parameter
    - body: `name` is a JMESPath expression, `compiled` its parsed form
    - template: `name` is the template text, e.g. "reminder:{body.user_id}:{period}"
    - hash: `parts` lists request parts (see REQUEST_PARTS, or header.<Name>)
    - period: the key is the window start alone (a cron run with no key at all)
    """

    written = "list of sources"  # as `key.sources` holds them

    kind: KeySourceKind
    """Which part of the request the key is read from."""
    name: str = ""
    """The header name, query parameter, JMESPath expression or template text."""
    parts: HashParts = ()
    """A `hash` source's request parts."""
    compiled: Any = None
    """body: the compiled JMESPath; template: the compiled Template (gateway.keying
    renders it)."""

    def __post_init__(self) -> None:
        # Compiled here, when the config loads: a request never parses a source again.
        if self.compiled is None and self.kind in ("body", "template"):
            compiled = compile_template(self.name) if self.kind == "template" else None
            if self.kind == "body":
                compiled, problem = jmespath_or_problem(self.name)
                if problem:
                    raise ValueError(f"key body {show(self.name)}: {problem}")
            object.__setattr__(self, "compiled", compiled)


@settings
class KeySpec:
    """Where a route's idempotency key comes from: one source (`key: {header:
    Idempotency-Key}`), several tried in order (`key: {sources: [...]}`, or the list
    alone), or a `period` alone, and the options beside them. `{path}` and the `path`
    part of hashes and fingerprints are the path as matched: as sent, still
    percent-encoded, with dot-segments removed. A key with control characters is
    refused with 400."""

    written = "a mapping, or a list of sources"

    sources: tuple[KeySource, ...]
    """Sources tried in order, the first present wins:
    `sources: [{header: Idempotency-Key}, {body: job_key}]`."""
    period: Period | None = None
    """Puts the start of the current window into a template's `{period}`: `2026-11-01`
    for days, `2026-W44` for weeks, `2026-11` for months, `2026-11-01T13:15+01:00` for
    hours and minutes (the UTC offset keeps a DST change's repeated hour apart). With
    no source, the window alone is the key: once per run for a cron job that sends
    none. Minutes divide an hour (or are whole hours that divide a day), hours divide a
    day; weeks and months are 1 only."""
    on_missing: Annotated[MissingKeyPolicy, OneOf()] = "reject"
    """A request without a key: `reject` it with 400, or `forward` it without dedupe
    (counted `missing_key_forwarded`). Async routes take `reject`."""
    scope: ScopeParts = ()
    """Request parts (`header.Authorization`, `query.tenant`) each of whose values keeps
    a key space of its own on the route: the values are hashed, never stored, so one
    client is never replayed another's response."""
    max_length: Annotated[int, Whole(1, 4096)] = 255
    """The longest key accepted; a longer one gets 400. A `hash` key is 71
    characters."""

    @model_validator(mode="wrap")
    @classmethod
    def _validate(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        if isinstance(data, ArgsKwargs) or is_instance(data):
            return handler(data)  # built in Python
        return key_from_yaml(data)


def parse_period(text: object, timezone: str = "UTC") -> Period:
    """A `{period}` window from "15m", "1h", "1d", "1w", "1mo"...; ValueError if bad."""
    problem = timezone_problem(timezone)
    if problem:
        raise ValueError(problem)
    match = _PERIOD_RE.fullmatch(trim(text)) if isinstance(text, str) else None
    count, unit = (whole_number(match[1]), match[2]) if match is not None else (None, "")
    if count is None:
        raise ValueError(f"{show(text)} is not a period; {odd_space(text, '1h') or _PERIOD_HINT}")
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
    return Period(count=count, unit=_PERIOD_UNITS[unit], timezone=timezone, text=trim(str(text)))


def templates_in(value: object) -> list[tuple[Loc, str]]:
    """The templates a key as written holds, each with its place under `key`."""
    if isinstance(value, dict) and isinstance(value.get("template"), str):
        return [(("template",), value["template"])]
    at: Loc = ()
    items = value if isinstance(value, list) else None
    if isinstance(value, dict) and isinstance(value.get("sources"), list):
        items, at = value["sources"], ("sources",)
    return [
        ((*at, i, "template"), item["template"])
        for i, item in enumerate(items or ())
        if isinstance(item, dict) and isinstance(item.get("template"), str)
    ]


def key_from_yaml(value: object) -> KeySpec:
    problems = Problems()
    if isinstance(value, list):
        raw: dict[Any, Any] = {"sources": value}
        at: Loc = ()  # a bare list: the sources are key[0], key[1]...
    elif isinstance(value, dict):
        raw, at = value, ("sources",)
        names = (*SOURCE_KINDS, *KEY_OPTIONS, "sources")
        for name in raw:
            if name not in names:
                problems.add((str(name),), unknown_setting(str(name), sorted(names)), name=True)
    else:
        raise ValueError(f"expected a mapping or a list, got {kind(value)}; write e.g. {_EXAMPLE}")
    direct = [name for name in SOURCE_KINDS if name in raw]
    if "sources" in raw and direct:
        problems.add((), f"give either sources: or {direct[0]}:, not both")
    elif len(direct) > 1:
        problems.add(
            (), f"{' and '.join(direct)} are both set, but a key has one source; {_SEVERAL}"
        )
    elif "sources" in raw and not isinstance(raw["sources"], list):
        found = kind(raw["sources"])
        problems.add(at, f"expected a list, got {found}; write e.g. [{{header: Idempotency-Key}}]")
    elif "sources" in raw and not raw["sources"]:
        problems.add(at, f"list at least one source; {_SEVERAL}")
    else:
        return _key(raw, at, problems)
    raise problems.error()


def _key(raw: dict[Any, Any], at: Loc, problems: Problems) -> KeySpec:
    sources: list[KeySource | None] = []
    templates: list[tuple[Loc, str]] = []
    if "sources" in raw:
        for i, item in enumerate(raw["sources"]):
            sources.append(_source_item(item, (*at, i), problems, templates))
    elif direct := [name for name in SOURCE_KINDS if name in raw]:
        sources.append(_source(direct[0], raw[direct[0]], (direct[0],), problems, templates))
    options = {
        name: problems.check(field_adapter(KeySpec, name), raw[name], (name,))
        for name in ("on_missing", "max_length", "scope")
        if name in raw
    }
    length = options.get("max_length", INVALID)
    hashed = any(source is not None and source.kind == "hash" for source in sources)
    if length is not INVALID and hashed and length < HASH_KEY_LENGTH:
        # Every request would be refused as "key too long".
        problems.add(
            ("max_length",),
            f"a hash key is {HASH_KEY_LENGTH} characters (sha256:<hex>); "
            f"set max_length to at least {HASH_KEY_LENGTH} or leave it out",
        )
    period = _period(raw, problems)
    uses_period = False
    for loc, template in templates:
        scan = scan_template(template, has_period=period is not None)
        for problem in scan.problems:
            problems.add(loc, problem)
        uses_period = uses_period or scan.uses_period
    if not sources and period is None:
        problems.add((), f"no key source; write e.g. {_EXAMPLE}, or period: 1d for a cron job")
    elif not sources and period is not INVALID:
        sources.append(KeySource(kind="period"))
    elif period not in (None, INVALID) and not uses_period:
        problems.add(
            ("period",),
            "period is set but no template uses {period}; add {period} to a template, e.g. "
            'template: "report:{period}", or remove period',
        )
    problems.raise_if_any()
    return KeySpec(sources=tuple(s for s in sources if s is not None), period=period, **options)


def _period(raw: dict[Any, Any], problems: Problems) -> Any:
    timezone = raw.get("timezone", "UTC")
    if "timezone" in raw and "period" not in raw:
        problems.add(("timezone",), "timezone only matters with a period; add e.g. period: 1d")
        return INVALID
    if "period" not in raw:
        return None
    problem = timezone_problem(timezone)
    if problem:
        problems.add(("timezone",), problem)
        return INVALID
    try:
        return parse_period(raw["period"], timezone)
    except ValueError as exc:
        problems.add(("period",), str(exc))
        return INVALID


def _source_item(
    item: object, loc: Loc, problems: Problems, templates: list[tuple[Loc, str]]
) -> KeySource | None:
    if not isinstance(item, dict):
        example = "{header: Idempotency-Key}"
        problems.add(
            loc, f"expected a mapping (name: value), got {kind(item)}; write e.g. {example}"
        )
        return None
    for name in item:
        if name in (*KEY_OPTIONS, "sources"):
            problems.add((*loc, name), f"set {name} on the key itself, next to sources:", name=True)
            return None
    for name in item:
        if name not in SOURCE_KINDS:
            unknown = unknown_setting(str(name), sorted(SOURCE_KINDS))
            problems.add((*loc, str(name)), unknown, name=True)
    kinds = [name for name in SOURCE_KINDS if name in item]
    if len(kinds) != 1:
        problems.add(
            loc,
            "each source needs exactly one of header, query, body, template or hash; "
            "write e.g. {header: Idempotency-Key}",
        )
        return None
    return _source(kinds[0], item[kinds[0]], (*loc, kinds[0]), problems, templates)


def _source(
    source_kind: str, value: object, loc: Loc, problems: Problems, templates: list[tuple[Loc, str]]
) -> KeySource | None:
    if source_kind == "hash":
        parts = problems.check(field_adapter(KeySource, "parts"), value, loc)
        return None if parts is INVALID else KeySource(kind="hash", parts=parts)
    try:
        name = text(value)
    except ValueError as exc:
        problems.add(loc, str(exc))
        return None
    if source_kind == "header" and not is_token(name):
        problems.add(loc, f"{show(name)} is not a header name; write e.g. Idempotency-Key")
        return None
    if source_kind == "body":
        compiled, problem = jmespath_or_problem(name)
        if problem:
            problems.add(loc, problem)
            return None
        return KeySource(kind="body", name=name, compiled=compiled)
    if source_kind == "template":
        templates.append((loc, name))
        if scan_template(name).problems:
            return None  # reported with the key's other template checks
        return KeySource(kind="template", name=name)
    return KeySource(kind="header" if source_kind == "header" else "query", name=name)
