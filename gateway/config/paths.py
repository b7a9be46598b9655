"""The route path pattern grammar: `/jobs/{name}`, `/files/{rest:path}`."""

from __future__ import annotations

from gateway.config.text import show
from gateway.config.types import is_identifier


def parse_path_pattern(path: str) -> tuple[list[str], list[str]]:
    """Returns the pattern's parameter names and what is wrong with it."""
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
