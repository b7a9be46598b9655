"""Config problems: how validators report them, at their place in the file's YAML tree,
and how pydantic's errors become the `ConfigIssue`s a user reads.

A validator raises `ValueError(message)` for a problem with the value it was given, or
collects several problems at deeper places (`methods[1]`) in `Problems` and raises them
together. Every message says what is wrong and what to write instead; pydantic's own
wording only shows up for objects built wrongly in Python, never for a file.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from gateway.config.text import join
from gateway.errors import ConfigIssue

#: A place in the YAML tree: ("routes", 2, "key", "body") is routes[2].key.body.
Loc = tuple[str | int, ...]

INVALID: Any = object()  # a value whose problems were reported


def message_of(error: Any) -> str:
    """The user's message of one of pydantic's line errors."""
    ctx = error.get("ctx") or {}
    if error["type"] == "config":
        return str(ctx["message"])
    if error["type"] == "value_error" and "error" in ctx:
        return str(ctx["error"])
    return str(error["msg"])


def at_name(error: Any) -> bool:
    """Whether the problem is the setting's name (unknown, misplaced), not its value."""
    return bool((error.get("ctx") or {}).get("at_name"))


class Problems:
    """A validator's problems at their places, raised together as one ValidationError."""

    def __init__(self) -> None:
        self.lines: list[InitErrorDetails] = []
        self._places: list[Loc] = []

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, loc: Loc, message: str, *, name: bool = False) -> None:
        ctx: dict[str, Any] = {"message": message}
        if name:
            ctx["at_name"] = True
        error = PydanticCustomError("config", "{message}", ctx)
        self.lines.append(InitErrorDetails(type=error, loc=loc, input=None))
        self._places.append(loc)

    def merge(self, other: Problems) -> None:
        self.lines += other.lines
        self._places += other._places

    def sorted(self, order: tuple[str, ...]) -> Problems:
        """The problems in the order of the settings they are about (stable)."""
        rank = {name: i for i, name in enumerate(order)}
        pairs = sorted(
            zip(self.lines, self._places, strict=True),
            key=lambda pair: rank.get(str(pair[1][0]), len(rank)) if pair[1] else len(rank),
        )
        out = Problems()
        out.lines, out._places = [line for line, _ in pairs], [place for _, place in pairs]
        return out

    def has(self, loc: Loc) -> bool:
        """A problem is reported at `loc` or inside it."""
        return any(p[: len(loc)] == loc for p in self._places)

    def covers(self, loc: Loc) -> bool:
        """A problem is reported at a place that holds `loc`: one report per place."""
        return any(len(p) < len(loc) and loc[: len(p)] == p for p in self._places)

    def extend(
        self, exc: ValidationError, prefix: Loc = (), rename: dict[str, Loc] | None = None
    ) -> None:
        """Takes over a nested validation's problems; `rename` maps a field to the
        place it is written in the file (a route's `path` is `match.path`)."""
        for error in exc.errors():
            loc: Loc = tuple(error["loc"])
            if rename and loc and isinstance(loc[0], str) and loc[0] in rename:
                loc = rename[loc[0]] + loc[1:]
            loc = prefix + loc
            if not self.covers(loc):
                self.add(loc, message_of(error), name=at_name(error))

    def check(self, adapter: TypeAdapter[Any], value: object, loc: Loc) -> Any:
        """The validated value, or INVALID with its problems taken over."""
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            self.extend(exc, loc)
            return INVALID

    def error(self) -> ValidationError:
        return ValidationError.from_exception_data("config", self.lines)

    def raise_if_any(self) -> None:
        if self.lines:
            raise self.error()


def raise_at(loc: Loc, message: str) -> None:
    problems = Problems()
    problems.add(loc, message)
    problems.raise_if_any()


def loc_path(loc: Loc) -> str:
    path = ""
    for part in loc:
        path = f"{path}[{part}]" if isinstance(part, int) else join(path, part)
    return path


class Issues:
    """Every problem in a file, in the order the user reads them, each once."""

    def __init__(self) -> None:
        self.items: list[ConfigIssue] = []
        self._seen: set[ConfigIssue] = set()  # items, looked up in constant time
        #: issues about a setting's name (unknown, misplaced), not its value: their
        #: position in the file is the name's
        self.at_names: set[ConfigIssue] = set()

    def add(self, path: str, message: str, *, name: bool = False) -> None:
        issue = ConfigIssue(path, message)
        # Settings inherited from `defaults` are checked once per route; one report is enough.
        if issue not in self._seen:
            self._seen.add(issue)
            self.items.append(issue)
        if name:
            self.at_names.add(issue)

    def extend(self, exc: ValidationError) -> None:
        for error in exc.errors():
            self.add(loc_path(tuple(error["loc"])), message_of(error), name=at_name(error))
