"""Route matching: which configured route a request belongs to.

Routes are tried in config order and the first one whose methods and path match
wins, exactly as a reader of the config file would expect. Exact paths are
looked up in a dict, so a config with many fixed paths does not pay a regex per
route per request; pattern routes are only tried when they come *before* the
best exact hit, which keeps the order semantics intact.

Patterns: `{name}` matches one path segment, `{name:path}` matches the rest of
the path including slashes. Trailing slashes are significant.

A path is matched after its dot-segments are removed (`remove_dot_segments`), and
the gateway forwards that same path: /jobs/x/../../admin is /admin, matched as
/admin and sent upstream as /admin, never matched as one route and sent to another
path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.config import Route
from gateway.config.paths import compile_path_pattern

#: Segments that are dot-segments, lower-cased: `.` and `..`, with either dot sent as
#: %2E (RFC 3986 6.2.2.2: an encoded unreserved character is the character).
_DOTS = {".": 1, "%2e": 1, "..": 2, ".%2e": 2, "%2e.": 2, "%2e%2e": 2}


def remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4 on an absolute path still percent-encoded: `.` segments go,
    `..` ones take the segment before with them, and none climbs above the root
    (/../x is /x). Every other segment is kept byte for byte. A path that cannot hold
    a dot-segment (none starts with `.` or `%`) is returned as it is, without a split."""
    if not path.startswith("/") or ("/." not in path and "/%" not in path):
        return path
    segments = path[1:].split("/")
    out: list[str] = []
    dot = 0
    for segment in segments:
        dot = _DOTS.get(segment.lower(), 0) if len(segment) <= 6 else 0
        if not dot:
            out.append(segment)
        elif dot == 2 and out:
            out.pop()
    if dot:
        out.append("")  # a path ending in a dot-segment names a directory: "/a/b/.." is "/a/"
    elif len(out) == len(segments):
        return path  # nothing removed
    return "/" + "/".join(out)


@dataclass(frozen=True, slots=True)
class RouteMatch:
    route: Route
    params: dict[str, str]


def compile_path(pattern: str) -> re.Pattern[str]:
    """Compile a path pattern to a regex; raise ValueError when it is malformed."""
    return compile_path_pattern(pattern).regex


def _allows(route: Route, method: str) -> bool:
    return route.methods is None or method in route.methods


class Router:
    def __init__(self, routes: tuple[Route, ...]) -> None:
        self._exact: dict[str, list[tuple[int, Route]]] = {}
        self._patterns: list[tuple[int, Route, re.Pattern[str]]] = []
        self._count = len(routes)
        for index, route in enumerate(routes):
            if "{" in route.path or "}" in route.path:
                self._patterns.append((index, route, compile_path(route.path)))
            else:
                self._exact.setdefault(route.path, []).append((index, route))

    def match(self, method: str, path: str) -> RouteMatch | None:
        method = method.upper()
        exact_index = self._count
        exact: Route | None = None
        for index, route in self._exact.get(path, ()):
            if _allows(route, method):
                exact_index, exact = index, route
                break
        # Only patterns declared before the exact hit can take precedence over it.
        for index, route, regex in self._patterns:
            if index > exact_index:
                break
            if not _allows(route, method):
                continue
            m = regex.fullmatch(path)
            if m is not None:
                return RouteMatch(route, m.groupdict())
        return RouteMatch(exact, {}) if exact is not None else None
