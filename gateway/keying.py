"""Idempotency keys: where a request's key comes from, and how it is stored.

`extract_key` turns a request into the caller's key (or None: the route's
`on_missing` policy applies). `record_digest` turns (route, scope, key) into the
fixed-size id the store uses, so user-chosen keys never reach a store key and
keys full of `:`, `*` or `../` cannot reach another record.

Everything here runs on every request. Templates and JMESPath expressions were
compiled when the config loaded (gateway.config.templates owns the template
grammar): this module only renders them. The JSON body is parsed at most once
per request.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from itertools import accumulate
from typing import Any
from urllib.parse import parse_qs, quote
from zoneinfo import ZoneInfo

import jmespath

from gateway.config import KeySource, KeySpec, Period
from gateway.config.templates import ESCAPE, Template
from gateway.errors import BadRequest

MAX_JSON_DEPTH = 64
#: The most digits of an integer in a JSON body (Python's own limit for int()).
MAX_JSON_DIGITS = 4300
_UNPARSED: Any = object()
# Unicode category Cc is exactly C0, DEL and C1.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SF_STRING = re.compile(r'"((?:[^"\\]|\\["\\])*)"')
_SF_ESCAPE = re.compile(r'\\(["\\])')
#: A JSON string, or what is left of one that never closes: it matches wherever a `"`
#: starts, never fails once it has, and has one way to match (each part is a run of
#: plain characters or one escape), so `sub` reads every character once. A pattern that
#: can fail past its `"` makes `sub` try again at every later `"`: quadratic.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\(?:.|\Z)[^"\\]*)*(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# Schedulers often send JSON without a JSON content type, so only media types
# that cannot hold a JSON document are refused.
_NON_JSON_TYPES = ("application/x-www-form-urlencoded", "application/xml", "text/xml")
_NON_JSON_PREFIXES = ("multipart/", "image/", "audio/", "video/", "font/")
_EPOCH = date(1970, 1, 1).toordinal()
_EPOCH_MONDAY = date(1969, 12, 29).toordinal()  # Monday of ISO week 1970-W01


@dataclass(slots=True)
class RequestParts:
    """The parts of a request keys are made from; parsed views are cached."""

    method: str
    path: str
    query: str  # raw, still percent-encoded
    headers: list[tuple[str, str]]  # lower-case names, repeats kept, in order
    body: bytes
    params: dict[str, str] = field(default_factory=dict)
    _json: Any = field(default=_UNPARSED, init=False, repr=False, compare=False)
    _query: dict[str, list[str]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.method = self.method.upper()

    def header_values(self, name: str) -> list[str]:
        # A scan, not a dict built once: a route reads one or two headers, and a
        # request has a dozen; building the dict cost more than the scans it saves.
        name = name.lower()
        return [value for key, value in self.headers if key == name]

    def header(self, name: str) -> str | None:
        values = self.header_values(name)
        return ", ".join(values) if values else None

    def query_value(self, name: str) -> str | None:
        """The first value of a query parameter, percent-decoded as UTF-8. Bytes that
        are not UTF-8 stay distinct (as lone surrogates, see `_text`), never U+FFFD:
        `?k=%FF` and `?k=%FE` must not become the same key."""
        if self._query is None:
            self._query = parse_qs(self.query, keep_blank_values=True, errors="surrogateescape")
        values = self._query.get(name)
        return values[0] if values else None

    def json_body(self) -> Any:
        """The body as JSON, parsed once; None for an empty body."""
        if self._json is _UNPARSED:
            self._json = _parse_json(self.body, self.header("content-type"))
        return self._json


def _parse_json(body: bytes, content_type: str | None) -> Any:
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media in _NON_JSON_TYPES or media.startswith(_NON_JSON_PREFIXES):
            raise BadRequest(f"this route reads its key from a JSON body, but the body is {media}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the body is not valid UTF-8, so it cannot be JSON") from None
    if not text.strip():
        return None
    # Checked before parsing: json.loads recurses per level and a hostile body
    # could otherwise reach the interpreter's recursion limit.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(text) > MAX_JSON_DEPTH:
        raise BadRequest(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(
            text, object_pairs_hook=_unique_object, parse_constant=_no_constant, parse_int=_int
        )
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


def _depth(text: str) -> int:
    """The deepest nesting of brackets outside strings, in time linear in `text`."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for name, value in pairs:
        if name in obj:
            # Parsers disagree on which duplicate wins, so the key would be ambiguous.
            raise BadRequest(f"the JSON body has the field {name!r} more than once")
        obj[name] = value
    return obj


def _int(text: str) -> int:
    """A JSON integer (json hands over its ASCII digits): at most MAX_JSON_DIGITS of
    them, the bound `int()` itself keeps against quadratic conversion, said in words."""
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_DIGITS:
        raise BadRequest(
            f"the JSON body holds a number of {digits} digits; the gateway reads numbers "
            f"of at most {MAX_JSON_DIGITS}"
        )
    return int(text)


def _no_constant(name: str) -> Any:
    raise BadRequest(f"the JSON body contains {name}, which is not JSON")


def _scalar_text(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        # 1e999 and 2e999 both parse to inf: they must not share the key "Infinity".
        raise BadRequest(f"{what} selects a number too large for a key")
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    raise BadRequest(f"{what} selects an object or array; select a string or number")


def _search(compiled: Any, parts: RequestParts, what: str) -> Any:
    try:
        return compiled.search(parts.json_body())
    except (jmespath.exceptions.JMESPathError, TypeError, ValueError) as exc:
        # A function given the wrong type (length(a) on a number) or values it cannot
        # compare (max_by over mixed types): this body cannot be keyed, which is the
        # caller's 400, not the gateway's 500.
        raise BadRequest(f"{what} cannot be evaluated on this body: {exc}") from None


def _escape(value: str, escapes: frozenset[str]) -> str:
    if not escapes or not any(c in escapes for c in value):
        return value
    return "".join(ESCAPE + c if c in escapes else c for c in value)


def _need_period(spec: KeySpec) -> Period:
    if spec.period is None:
        raise ValueError("a period key needs the key spec to define a period")
    return spec.period


def _render(spec: KeySpec, source: KeySource, parts: RequestParts, now: datetime) -> str | None:
    template: Template = source.compiled  # compiled when the config loaded
    pieces: list[str] = []
    escapes = template.escapes
    for piece in template.pieces:
        value: str | None
        if isinstance(piece, str):
            pieces.append(piece)
            continue
        if piece.kind == "period":
            value = window_start(_need_period(spec), now)
        elif piece.kind == "method":
            value = parts.method
        elif piece.kind == "path":
            value = parts.params.get(piece.arg) if piece.arg else parts.path
        elif piece.kind == "header":
            value = parts.header(piece.arg)
            value = None if value is None else _header_text(value)
        elif piece.kind == "query":
            value = parts.query_value(piece.arg)
        else:
            found = _search(piece.compiled, parts, f"the template part {{body.{piece.arg}}}")
            value = _scalar_text(found, f"the template part {{body.{piece.arg}}}")
        # A template with a hole would give unrelated requests the same key.
        if value is None or not value.strip():
            return None
        # The period is the gateway's own fixed-format text; client values are escaped.
        pieces.append(value if piece.kind == "period" else _escape(value, escapes))
    return "".join(pieces)


def _header_key(source: KeySource, parts: RequestParts) -> str | None:
    values = parts.header_values(source.name)
    if len(values) > 1:
        raise BadRequest(f"the {source.name} header was sent {len(values)} times; send it once")
    if not values:
        return None
    # Only HTTP's own whitespace: str.strip() would also drop U+00A0, U+0085 and
    # U+2028, and give "k\u00a0" the record of "k".
    value = _header_text(values[0]).strip(" \t")
    if not value.startswith('"'):
        return value
    # The Idempotency-Key draft makes the value a structured-field string, so
    # `"abc"` and a bare `abc` from a sloppier client must be the same key.
    m = _SF_STRING.fullmatch(value)
    if m is None:
        raise BadRequest(
            f'the {source.name} header is not a valid quoted string; escape only \\" and \\\\'
        )
    return _SF_ESCAPE.sub(r"\1", m.group(1))


def _header_text(value: str) -> str:
    """A header value (decoded latin-1 by the server, byte for byte) as UTF-8 text;
    bytes that are not UTF-8 become lone surrogates, which extract_key refuses."""
    if value.isascii():
        return value
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:
        return value  # already text: built in-process, not read off the wire
    return raw.decode("utf-8", "surrogateescape")


def _source_value(
    spec: KeySpec, source: KeySource, parts: RequestParts, now: datetime
) -> str | None:
    if source.kind == "header":
        return _header_key(source, parts)
    if source.kind == "query":
        return parts.query_value(source.name)
    if source.kind == "body":
        found = _search(source.compiled, parts, "the key expression")
        return _scalar_text(found, "the key expression")
    if source.kind == "template":
        return _render(spec, source, parts, now)
    if source.kind == "hash":
        return "sha256:" + _framed(source.parts, parts)
    return window_start(_need_period(spec), now)


def extract_key(spec: KeySpec, parts: RequestParts, now: datetime) -> str | None:
    """The request's key from the first source that has one; None when none has."""
    for source in spec.sources:
        key = _source_value(spec, source, parts, now)
        if key is None or not key.strip():
            continue
        if len(key) > spec.max_length:
            raise BadRequest(
                f"the idempotency key is {len(key)} characters; "
                f"this route accepts at most {spec.max_length}"
            )
        if _SURROGATE.search(key):
            # Bytes that were not UTF-8 (header, query) or a lone \ud800 escape (JSON):
            # not text, and not storable as a key.
            raise BadRequest("the idempotency key is not valid UTF-8 text")
        if _CONTROL.search(key):
            raise BadRequest("the idempotency key contains control characters")
        return key
    return None


def window_start(period: Period, now: datetime) -> str:
    """The start of the window holding `now`, as local text in period.timezone."""
    if now.tzinfo is None:
        raise ValueError("window_start needs an aware datetime")
    zone = ZoneInfo(period.timezone)
    local = now.astimezone(zone)
    day = local.date()
    if period.unit == "d":
        days = day.toordinal() - _EPOCH
        return date.fromordinal(_EPOCH + days - days % period.count).isoformat()
    if period.unit == "w":
        weeks = (day.toordinal() - _EPOCH_MONDAY) // 7
        monday = date.fromordinal(_EPOCH_MONDAY + 7 * (weeks - weeks % period.count))
        year, week, _ = monday.isocalendar()
        return f"{year}-W{week:02d}"
    if period.unit == "mo":
        months = (day.year - 1970) * 12 + day.month - 1
        months -= months % period.count
        return f"{1970 + months // 12:04d}-{months % 12 + 1:02d}"
    size = period.count * (60 if period.unit == "h" else 1)
    start = _sub_day_start(now.astimezone(UTC), zone, size)
    return start.astimezone(zone).isoformat(timespec="minutes")


_TICK = timedelta(microseconds=1)


def _sub_day_start(now: datetime, zone: ZoneInfo, size: int) -> datetime:
    """The start of the `size`-minute window holding `now` (in UTC).

    Windows start where the local clock shows a multiple of `size` minutes since
    local midnight, and where a spring-forward jump skips such a time (the window
    then starts at the jump). Each window is the stretch up to the next start, so
    windows never overlap or leave gaps, and the start names the window exactly.
    A fall-back jump starts no window of its own: the clock shows earlier times
    again, but the window under way goes on until the next aligned time.
    """
    offset = _offset(now, zone)
    wall = (now + offset).replace(tzinfo=None)
    minutes = wall.hour * 60 + wall.minute
    minutes -= minutes % size
    floor = datetime.combine(wall.date(), time(minutes // 60, minutes % 60))
    start = now - (wall - floor)
    if _offset(start, zone) == offset:
        return start  # no change of UTC offset in between: the usual case
    # The offset changed between the floored time and now: find when (the last
    # change before now), then decide from the jump.
    # Offsets change on whole seconds: search those.
    before, after = math.floor(start.timestamp()), math.ceil(now.timestamp())
    while after - before > 1:
        middle = (before + after) // 2
        if _offset(datetime.fromtimestamp(middle, UTC), zone) == offset:
            after = middle
        else:
            before = middle
    change = datetime.fromtimestamp(after, UTC)
    old_offset = _offset(datetime.fromtimestamp(before, UTC), zone)
    wall_before_change = (change + old_offset).replace(tzinfo=None)
    if offset > old_offset and floor >= wall_before_change:
        return change  # spring forward skipped the aligned time: the window starts here
    # Fall back (or the aligned time came before the jump): the window under way
    # before the change goes on.
    return _sub_day_start(change - _TICK, zone, size)


def _offset(instant: datetime, zone: ZoneInfo) -> timedelta:
    offset = instant.astimezone(zone).utcoffset()
    assert offset is not None  # a ZoneInfo always has one
    return offset


def _part_bytes(name: str, parts: RequestParts) -> bytes | None:
    if name == "method":
        return parts.method.encode()
    if name == "path":
        return parts.path.encode()
    if name == "query":
        return parts.query.encode()
    if name == "body":
        return parts.body
    kind, _, arg = name.partition(".")
    if kind == "header" and arg:
        value = parts.header(arg)
        return None if value is None else value.encode()
    if kind == "query" and arg:
        value = parts.query_value(arg)
        return None if value is None else value.encode("utf-8", "surrogateescape")
    raise ValueError(f"unknown request part {name!r}")


def _frame(chunks: Iterable[bytes | None]) -> str:
    # Each chunk is tagged present/absent and length-prefixed, so no two
    # different sequences of chunks can feed the hash the same bytes.
    h = hashlib.sha256()
    for chunk in chunks:
        if chunk is None:
            h.update(b"\x00")
        else:
            h.update(b"\x01" + len(chunk).to_bytes(8, "big"))
            h.update(chunk)
    return h.hexdigest()


def _framed(names: Iterable[str], parts: RequestParts) -> str:
    return _frame(_part_bytes(name, parts) for name in names)


def scope_value(spec: KeySpec, parts: RequestParts) -> str:
    """A hash of the scope values: tenants get disjoint key spaces, secrets stay unstored."""
    if not spec.scope:
        return ""
    # A missing scope value counts as empty, as documented for `scope`.
    return _frame(_part_bytes(name, parts) or b"" for name in spec.scope)


def fingerprint(fields: tuple[str, ...], parts: RequestParts) -> str:
    """What the request was, so a reused key with a different request is caught."""
    if not fields:
        return ""
    chunks: list[bytes | None] = []
    for name in fields:
        chunks += [name.encode(), _part_bytes(name, parts)]
    return _frame(chunks)[:32]


def key_header_value(key: str) -> str:
    """The key as the value of the route's `forward_key_header`, on every request the
    gateway sends for it: the forward, each delivery attempt, each reconcile check.

    A key of printable ASCII without `%`, `"` or `\\` and without a space at either
    end is sent as it is. Any other key is sent as its UTF-8 bytes percent-encoded,
    every byte but letters, digits and `-._~` (`café` is `caf%C3%A9`, `50%` is
    `50%25`, `"x"` is `%22x%22`): a header carries it unchanged through any server,
    and the spelling names one key, since a key sent as it is never holds a `%` and
    an encoded one always does; nor is a spelling ever a quoted string, which a
    reader of the Idempotency-Key draft (this gateway too) would unquote."""
    # As it is: printable ASCII (space to `~`) but `%` (the mark of the other spelling)
    # and `"` and `\` (a reader of the Idempotency-Key draft takes `"x"` for the
    # structured-field string `x`, as extract_key does), not empty, no space at either
    # end (HTTP trims it from a field value). String methods, not a pattern: every
    # forward asks, and they cost about half a regex's match.
    if (
        key != ""
        and key.isascii()
        and key.isprintable()
        and key[0] != " "
        and key[-1] != " "
        and "%" not in key
        and '"' not in key
        and "\\" not in key
    ):
        return key
    return quote(key, safe="")


def record_digest(route_name: str, scope: str, key: str) -> str:
    """The store's id for a record: fixed-size, and unique per (route, scope, key)."""
    return _frame(s.encode() for s in (route_name, scope, key))[:32]
