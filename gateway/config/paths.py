"""The route path pattern grammar, `/jobs/{name}` and `/files/{rest:path}`: its one owner.

`scan_path_pattern` says what is wrong with a pattern in the words config errors use;
`compile_path_pattern` gives the regex the router matches requests with. `{name}`
matches one path segment, `{name:path}` the rest of the path, slashes included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated

from gateway.config.issues import Problems
from gateway.config.text import show
from gateway.config.types import Check, is_identifier, text


@dataclass(frozen=True, slots=True)
class PathPattern:
    text: str
    params: tuple[str, ...]
    regex: re.Pattern[str]  # fullmatch it; its groups are the parameters


class PathPatternError(ValueError):
    def __init__(self, text: str, problems: list[str]) -> None:
        super().__init__(f"path {show(text)}: " + "; and ".join(problems))
        self.problems = problems


def scan_path_pattern(path: str) -> tuple[list[str], list[str]]:
    """The pattern's parameter names, and what is wrong with it."""
    problems: list[str] = []
    params: list[str] = []
    if not path.startswith("/"):
        problems.append(f"{show(path)} must start with /, e.g. /jobs/send-reminder")
        return params, problems
    if "?" in path or "#" in path:
        problems.append(f"{show(path)} must not hold a query or fragment; match the path only")
    segments = path[1:].split("/")
    for i, segment in enumerate(segments):
        if "{" not in segment and "}" not in segment:
            continue
        if not (segment.startswith("{") and segment.endswith("}")) or segment.count("{") > 1:
            problems.append(
                f"segment {show(segment)} mixes text and a parameter; "
                "a parameter must be a whole segment, e.g. /jobs/{name}"
            )
            continue
        name, _, converter = segment[1:-1].partition(":")
        if not is_identifier(name):
            problems.append(f"parameter {{{name}}} must be a name like {{job_id}}")
        elif name in params:
            problems.append(f"parameter {{{name}}} appears twice; give each a different name")
        elif converter and converter != "path":
            problems.append(
                f"{{{segment[1:-1]}}}: the only parameter type is :path (the rest of the path)"
            )
        elif converter and i != len(segments) - 1:
            problems.append(f"{{{name}:path}} takes the rest of the path, so it must come last")
        else:
            params.append(name)
    return params, problems


@lru_cache(maxsize=256)
def compile_path_pattern(path: str) -> PathPattern:
    """The pattern's regex; PathPatternError (a ValueError) says what is wrong."""
    params, problems = scan_path_pattern(path)
    if problems:
        raise PathPatternError(path, problems)
    parts = ["/"]
    for segment in path[1:].split("/"):
        if segment.startswith("{"):
            name, _, converter = segment[1:-1].partition(":")
            parts.append(f"(?P<{name}>.*)" if converter else f"(?P<{name}>[^/]+)")
        else:
            parts.append(re.escape(segment))
        parts.append("/")
    return PathPattern(path, tuple(params), re.compile("".join(parts[:-1])))


def _path(value: object) -> str:
    if value is None:
        raise ValueError("missing; write e.g. path: /jobs/send-reminder")
    pattern = text(value)
    problems = Problems()
    for problem in scan_path_pattern(pattern)[1]:
        problems.add((), problem)
    problems.raise_if_any()
    return pattern


PathPatternText = Annotated[
    str,
    Check(
        _path,
        {"type": "string", "pattern": "^/", "description": "e.g. /jobs/{name}"},
        written="path pattern",
    ),
]
