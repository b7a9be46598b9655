"""How config messages show values and name places: the wording users see in every
error, shared by all the config modules."""

from __future__ import annotations

import difflib
import json


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
