"""The value types of the config's settings, as annotated types.

`Duration` is `Annotated[float, Check(...)]`: the check reads what the file says ("30s",
or 30 from Python) into the field's value, or raises a message that says what to
write; the JSON Schema beside it describes the same forms for editors, and `written`
names them for the configuration reference (docs/configuration.md), which shows a
default the way a file writes it (`show`). Every scalar's schema also takes a `${VAR}`
text, which the loader expands before validation.
"""

from __future__ import annotations

import difflib
import re
import zoneinfo
from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

import jmespath
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import CoreSchema, core_schema

from gateway.config import units
from gateway.config.text import kind, secret_kind, show
from gateway.digits import whole_number

# RFC 9110 token: what a header name or method may be made of.
#: RFC 9110's token (a header name, a method): the one spelling of it in the package.
HTTP_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


Json = dict[str, Any]
ENV = {"type": "string", "pattern": r"\$\{"}  # ${VAR}: any setting may come from one


class Check:
    """Annotated metadata: `read` turns the value as written into the field's value (a
    ValueError, or a ValidationError for items, says what is wrong); `schema` is the
    JSON Schema of what the file may hold there; `written` says the same in a few words
    for the configuration reference ("duration", "list of header names"); `show` writes
    a value back as a file would (30.0 as "30s"), where the plain value would not."""

    __slots__ = ("read", "schema", "show", "written")

    def __init__(
        self,
        read: Callable[[Any], Any],
        schema: Json,
        *,
        written: str,
        show: Callable[[Any], str] | None = None,
        env: bool = True,
    ) -> None:
        self.read = read
        self.schema = {"anyOf": [schema, ENV]} if env else schema
        self.written = written
        self.show = show

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self.read)

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> Json:
        return dict(self.schema)


class Whole(Check):
    """A whole number from `low` to `high`; digits in text count (${VAR} gives text)."""

    __slots__ = ()

    def __init__(self, low: int, high: int) -> None:
        def read(value: object) -> int:
            number: int | None = None
            if isinstance(value, int) and not isinstance(value, bool):
                number = value
            elif isinstance(value, str):
                number = whole_number(units.trim(value))
            if number is None or not low <= number <= high:
                raise ValueError(f"{show(value)} is not a whole number from {low} to {high}")
            return number

        number = {"type": "integer", "minimum": low, "maximum": high}
        digits = {"type": "string", "pattern": r"^ *[0-9]+ *$"}
        super().__init__(
            read, {"anyOf": [number, digits]}, written=f"whole number, {low} to {high}"
        )


class OneOf(Check):
    """One of a Literal type's values, with "did you mean" for a near miss."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(lambda value: value, {}, written="")

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        options: tuple[str, ...] = get_args(source)
        self.schema = {"anyOf": [{"enum": list(options)}, ENV]}
        self.written = either(options)

        def read(value: object) -> str:
            if isinstance(value, str) and value in options:
                return value
            message = f"{show(value)} is not one of {', '.join(options)}"
            close = difflib.get_close_matches(value, options, n=1) if isinstance(value, str) else []
            raise ValueError(message + (f'; did you mean "{close[0]}"?' if close else ""))

        return core_schema.no_info_plain_validator_function(read)


def either(options: tuple[str, ...] | list[str]) -> str:
    """`a`, `b` or `c`: the choices of a setting, as the reference lists them."""
    quoted = [f"`{option}`" for option in options]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def is_token(text: str) -> bool:
    return HTTP_TOKEN.fullmatch(text) is not None


def is_identifier(text: str) -> bool:
    return _IDENT_RE.fullmatch(text) is not None


def text(value: object, *, empty_ok: bool = False, secret: bool = False) -> str:
    """`secret`: a password or token; a wrong value is described, never shown."""
    if isinstance(value, str) and (value or empty_ok):
        return value
    if isinstance(value, str):
        raise ValueError("must not be empty")
    raise ValueError(f"expected text, got {secret_kind(value) if secret else kind(value)}")


def items(value: object, example: str) -> list[Any]:
    """A list as written (a YAML sequence), or the set or tuple a Python caller gave."""
    if isinstance(value, list | tuple | set | frozenset):
        return list(value)
    raise ValueError(f"expected a list, got {kind(value)}; write e.g. {example}")


def _flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{show(value)} is not true or false")


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


def _timezone(value: object) -> str:
    problem = timezone_problem(value)
    if problem:
        raise ValueError(problem)
    return str(value)


def jmespath_or_problem(expression: str) -> tuple[Any, str | None]:
    """The compiled expression, or None and what is wrong with it."""
    try:
        return jmespath.compile(expression), None
    except jmespath.exceptions.JMESPathError as exc:
        return None, f"not a valid JMESPath expression: {_jmespath_reason(exc)}"


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


def _route_name(value: object) -> str:
    if value is None:
        raise ValueError("every route needs a name, e.g. name: send-reminder")
    name = text(value)
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"{show(name)} is not a valid route name; use letters, digits, _ . and -, "
            "starting with a letter or digit, e.g. send-reminder"
        )
    return name


def _group_name(value: object) -> str:
    name = text(value)
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"{show(name)} is not a valid name; use letters, digits, _ . and -, starting "
            "with a letter or digit, e.g. billing"
        )
    return name


def _secret(value: object) -> str:
    return text(value, empty_ok=True, secret=True)


def _token(token: object) -> str:
    if token is None or isinstance(token, str):
        return token or ""
    raise ValueError(f"expected text, got {secret_kind(token)}; quote it")


def list_schema(item: Json, **extra: Any) -> Json:
    return {"type": "array", "items": {"anyOf": [item, ENV]}, **extra}


_STRING = {"type": "string"}
_DURATION = {"anyOf": [{"type": "number", "minimum": 0, "maximum": units.MAX_DURATION},
                       {"type": "string", "pattern": f"^ *{units.DURATION_RE.pattern} *$"}],
             "description": "a duration: 500ms, 30s, 15m, 24h, 7d, or seconds"}  # fmt: skip
_SIZE = {"anyOf": [{"type": "integer", "minimum": 1},
                   {"type": "string", "pattern": "^ *[0-9]+ *([KkMmGg][Ii]?[Bb]|[Bb])? *$"}],
         "description": "a size: 512KiB, 1MiB, 10MB, or bytes"}  # fmt: skip

Text = Annotated[str, Check(text, _STRING, written="text")]
OptionalText = Annotated[str, Check(lambda v: text(v, empty_ok=True), _STRING, written="text")]
Secret = Annotated[str, Check(_secret, _STRING, written="secret text")]
AdminToken = Annotated[str, Check(_token, {"type": ["string", "null"]}, written="secret text")]
_BOOLEAN_TEXT = "^([Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee])$"
Flag = Annotated[
    bool,
    Check(
        _flag,
        {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": _BOOLEAN_TEXT}]},
        written="`true` or `false`",
    ),
]
Duration = Annotated[
    float,
    Check(units.parse_duration, _DURATION, written="duration", show=units.format_duration),
]
GraceDuration = Annotated[  # may be 0: no grace
    float,
    Check(
        lambda v: units.parse_duration(v, allow_zero=True),
        _DURATION,
        written="duration, or `0`",
        show=units.format_duration,
    ),
]
Size = Annotated[int, Check(units.parse_size, _SIZE, written="size", show=units.write_size)]
TimeZone = Annotated[
    str,
    Check(_timezone, {"type": "string", "description": "an IANA zone"}, written="IANA time zone"),
]
RouteName = Annotated[
    str,
    Check(
        _route_name,
        {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        written="name: letters, digits, `_` `.` `-`",
    ),
]

GroupName = Annotated[
    str,
    Check(
        _group_name,
        {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        written="name: letters, digits, `_` `.` `-`",
    ),
]
Rate = Annotated[
    float,
    Check(
        units.parse_rate,
        {"type": "string", "pattern": f"^ *{units.RATE_RE.pattern} *$"},
        written="`N/s`, `N/m` or `N/h`",
        show=units.format_rate,
    ),
]

ConcurrentPolicy = Literal["wait", "reject"]
MissingKeyPolicy = Literal["reject", "forward"]
UnknownOutcomePolicy = Literal["park", "release", "reconcile"]
StoreErrorPolicy = Literal["fail_closed", "fail_open"]
LogFormat = Literal["auto", "json", "text"]
