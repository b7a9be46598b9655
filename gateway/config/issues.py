"""The issue collector: every problem in a file is reported in one run."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

from gateway.config.text import join, kind, secret_kind, show, unknown_setting
from gateway.errors import ConfigIssue

INVALID: Any = object()  # a setting whose value was wrong; already reported


class Issues:
    """Collects every problem in a file so the user sees them all in one run."""

    def __init__(self) -> None:
        self.items: list[ConfigIssue] = []
        #: issues about a setting's name (unknown, misplaced), not its value: their
        #: position in the file is the name's
        self.at_names: set[ConfigIssue] = set()

    def add(self, path: str, message: str, *, at_name: bool = False) -> None:
        issue = ConfigIssue(path, message)
        # Settings inherited from `defaults` are checked once per route; one report is enough.
        if issue not in self.items:
            self.items.append(issue)
        if at_name:
            self.at_names.add(issue)

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
                self.add(join(path, str(name)), unknown_setting(str(name), names), at_name=True)

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


def section(
    value: object, path: str, issues: Issues, names: tuple[str, ...]
) -> dict[str, Any] | None:
    section = issues.mapping({} if value is None else value, path, f"{path}: {{...}}")
    if section is not None:
        issues.known(section, names, path)
    return section


def choice_of(options: tuple[str, ...]) -> Callable[[object, str, Issues], Any]:
    def parse(value: object, path: str, issues: Issues) -> Any:
        chosen = issues.choice(value, path, options)
        return INVALID if chosen is None else chosen

    return parse


def flag(value: object, path: str, issues: Issues) -> Any:
    flag = issues.boolean(value, path)
    return INVALID if flag is None else flag
