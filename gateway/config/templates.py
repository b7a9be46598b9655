"""The key template grammar, `reminder:{body.user_id}:{period}`: its one owner.

`scan_template` reads a template and says what is wrong with it, in the words config
errors use; `compile_template` turns an accepted one into a `Template` when the config
loads, and `gateway.keying` only renders that: a template the config accepted cannot
fail on a request. `{{` and `}}` are literal braces.

The reconcile URL's `{key}`, `{route}` and `{run_id}` are the same grammar, placed in a
URL: `url_slots` says where each placeholder sits (the config refuses any outside the
path and the query) and `fill_url` fills them in, so that no value changes where the
URL goes. A value is percent-encoded for its place, every byte but letters, digits
and `-._~`; in the path, a value that would still move the request is refused with
`UnplaceableValue`: one holding `/` or `\\` once decoded (servers such as nginx decode
`%2F` and then resolve the path), and a path segment that is `.`, `..` or empty once
decoded, however many times (`%2E`, `.%2e`, `%252E`), and cut at a `;` (Tomcat drops
`;params` before it resolves `..;`). The query takes any value.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, get_args
from urllib.parse import quote, unquote

from gateway.config.text import show
from gateway.config.types import is_identifier, is_token, jmespath_or_problem

TEMPLATE_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
#: Escapes separator characters inside template part values (see `Template.escapes`).
ESCAPE = "\\"
_KINDS = ["period", "method", "path", "header", "query", "body"]
_PLACEHOLDER_HINT = (
    "use {period}, {method}, {path}, {path.<param>}, {header.<Name>}, {query.<name>} "
    "or {body.<jmespath>}"
)
_NEEDS_PERIOD = "{period} needs a period; add e.g. period: 1d (or 15m, 1h, 1w) to the key"


@dataclass(frozen=True, slots=True)
class Placeholder:
    kind: str  # period, method, path, header, query, body
    arg: str = ""  # path: the parameter ("" for the whole path); header: lower-case name
    compiled: Any = None  # body: the JMESPath expression


@dataclass(frozen=True, slots=True)
class Template:
    """A compiled key template: literal text and placeholders, in order."""

    text: str
    pieces: tuple[str | Placeholder, ...]
    #: The characters escaped (with a backslash) in part values. Joined as they come,
    #: "{a}:{b}" would give "a:b"+"c" and "a"+"b:c" one key, and so one record. A
    #: value's own copy of the first character of any separator between two parts is
    #: escaped, and the escape character itself, so the first unescaped separator
    #: character always ends a part: one key per tuple of values. Values without those
    #: characters are unchanged, and a template with one part needs none.
    escapes: frozenset[str]
    uses_period: bool
    path_params: tuple[str, ...]  # the {path.<param>} names, in order


@dataclass(frozen=True, slots=True)
class TemplateScan:
    pieces: tuple[str | Placeholder, ...]
    problems: tuple[str, ...]  # empty: the template is accepted
    uses_period: bool
    path_params: tuple[str, ...]


class TemplateError(ValueError):
    def __init__(self, text: str, problems: tuple[str, ...]) -> None:
        super().__init__(f"template {show(text)}: " + "; and ".join(problems))
        self.problems = problems


def split_placeholders(template: str) -> tuple[list[str], list[str]]:
    """The `{...}` placeholder names of a template, and its unmatched braces."""
    found: list[str] = []
    problems: list[str] = []
    for match in TEMPLATE_TOKEN_RE.finditer(template):
        token = match.group(0)
        if match.group(1) is not None:
            found.append(match.group(1).strip())
        elif token in ("{", "}"):
            problems.append(
                f"{show(template)} has an unmatched {token}; placeholders look like "
                f"{{body.user_id}}, and {token * 2} writes a literal {token}"
            )
    return found, problems


def _separator_problem(template: str) -> str | None:
    """Two placeholders need a separator between them that does not start with the
    escape character, or no escaping could keep their values apart."""
    previous: re.Match[str] | None = None
    for match in TEMPLATE_TOKEN_RE.finditer(template):
        if match.group(1) is None:
            continue
        if previous is not None:
            between = template[previous.end() : match.start()]
            if not between or between.startswith(ESCAPE):
                a, b = previous.group(1).strip(), match.group(1).strip()
                where = "next to each other" if not between else "split by a backslash, the escape"
                return (
                    f"{{{a}}} and {{{b}}} are {where}, so two different requests could share "
                    f'one key ("ab"+"c" and "a"+"bc"); put a separator between them, e.g. '
                    f"{{{a}}}:{{{b}}}"
                )
        previous = match
    return None


def _placeholder(text: str, problems: list[str]) -> Placeholder | None:
    head, dot, rest = text.partition(".")
    if text in ("period", "method", "path"):
        return Placeholder(text)
    if dot and head == "path" and is_identifier(rest):
        return Placeholder("path", rest)
    if dot and head == "header" and is_token(rest):
        return Placeholder("header", rest.lower())
    if dot and head == "query" and rest:
        return Placeholder("query", rest)
    if dot and head == "body" and rest:
        compiled, problem = jmespath_or_problem(rest)
        if problem:
            problems.append(problem)
            return None
        return Placeholder("body", rest, compiled)
    close = difflib.get_close_matches(head, _KINDS, n=1)
    guess = f'; did you mean "{{{close[0]}{dot}{rest}}}"?' if close else ""
    problems.append(f"unknown placeholder {{{text}}}; {_PLACEHOLDER_HINT}{guess}")
    return None


def scan_template(template: str, *, has_period: bool = True) -> TemplateScan:
    """Reads a template; `has_period`: whether its key defines a period."""
    names, problems = split_placeholders(template)
    separator = _separator_problem(template)
    if separator:
        problems.append(separator)
    pieces: list[str | Placeholder] = []
    literal, pos, index = "", 0, 0
    for match in TEMPLATE_TOKEN_RE.finditer(template):
        literal += template[pos : match.start()]
        pos = match.end()
        if match.group(1) is None:
            literal += match.group(0)[0]  # {{ or }}; a lone brace is a problem already
            continue
        placeholder = _placeholder(names[index], problems)
        index += 1
        if placeholder is not None and placeholder.kind == "period" and not has_period:
            problems.append(_NEEDS_PERIOD)
        if literal:
            pieces.append(literal)
        if placeholder is not None:
            pieces.append(placeholder)
        literal = ""
    literal += template[pos:]
    if literal:
        pieces.append(literal)
    found = [p for p in pieces if isinstance(p, Placeholder)]
    return TemplateScan(
        pieces=tuple(pieces),
        problems=tuple(problems),
        uses_period=any(p.kind == "period" for p in found),
        path_params=tuple(p.arg for p in found if p.kind == "path" and p.arg),
    )


#: Where a placeholder sits in a URL template.
UrlPlace = Literal["authority", "path", "query", "fragment"]
#: Why a value was not placed: a metric's label.
Unplaceable = Literal["separator", "dot_segment", "empty_segment"]
UNPLACEABLE: tuple[Unplaceable, ...] = get_args(Unplaceable)


@dataclass(frozen=True, slots=True)
class UrlSlot:
    name: str
    place: UrlPlace
    #: in the path, with nothing else in its segment: `/jobs/{key}/status`
    whole_segment: bool = False


@dataclass(frozen=True, slots=True)
class UrlTemplate:
    """A URL template cut where values go: the literal scheme and authority, then the
    path's segments and the query, each a run of literal text and slots."""

    head: str
    segments: tuple[tuple[str | UrlSlot, ...], ...]  # each follows a "/"
    query: tuple[str | UrlSlot, ...] | None  # None: no "?"
    fragment: str  # literal, with its "#"; the config refuses one
    slots: tuple[UrlSlot, ...]


class UnplaceableValue(ValueError):
    """A value that would change where the URL goes, wherever it is encoded."""

    def __init__(self, name: str, reason: Unplaceable, detail: str) -> None:
        super().__init__(f"{{{name}}} {detail}")
        self.name = name
        self.reason: Unplaceable = reason


@lru_cache(maxsize=64)
def url_template(template: str) -> UrlTemplate:
    """Reads a URL template (literal braces as `{{`, `}}`) into its places; one that
    starts with `/` is a path (and query) alone."""
    head, fragment = "", ""
    segments: list[list[str | UrlSlot]] = []
    query: list[str | UrlSlot] | None = None
    elsewhere: list[UrlSlot] = []  # in the scheme, the authority or the fragment
    place: UrlPlace = "authority"
    relative = template.startswith("/")

    def literal(text: str) -> None:
        nonlocal head, fragment, place, query
        for char in text:
            if place == "fragment":
                fragment += char
            elif char == "#":
                place, fragment = "fragment", char
            elif place == "authority" and "://" not in head and not relative:
                head += char
            elif char == "?" and place != "query":
                place, query = "query", []
            elif char == "/" and place != "query":
                place = "path"
                segments.append([])
            elif place == "path":
                segments[-1].append(char)
            elif place == "query":
                assert query is not None
                query.append(char)
            else:
                head += char

    pos = 0
    for match in TEMPLATE_TOKEN_RE.finditer(template):
        literal(template[pos : match.start()])
        pos = match.end()
        if match.group(1) is None:
            literal(match.group(0)[0])  # {{ or }}
            continue
        slot = UrlSlot(match.group(1).strip(), place)
        if place == "path":
            segments[-1].append(slot)
        elif place == "query":
            assert query is not None
            query.append(slot)
        else:
            elsewhere.append(slot)
    literal(template[pos:])

    path = tuple(_whole(_joined(segment)) for segment in segments)
    in_query = () if query is None else _joined(query)
    return UrlTemplate(
        head=head,
        segments=path,
        query=None if query is None else in_query,
        fragment=fragment,
        slots=tuple(
            piece for run in (*path, in_query) for piece in run if isinstance(piece, UrlSlot)
        )
        + tuple(elsewhere),
    )


def _joined(pieces: list[str | UrlSlot]) -> tuple[str | UrlSlot, ...]:
    """Characters run together into text; slots as they are."""
    out: list[str | UrlSlot] = []
    for piece in pieces:
        if isinstance(piece, str) and out and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return tuple(out)


def _whole(segment: tuple[str | UrlSlot, ...]) -> tuple[str | UrlSlot, ...]:
    if len(segment) == 1 and isinstance(segment[0], UrlSlot):
        return (UrlSlot(segment[0].name, "path", whole_segment=True),)
    return segment


def fill_url(template: str, values: Mapping[str, str]) -> str:
    """The URL template with each `{name}` replaced by its value, encoded for its
    place; UnplaceableValue when a value would change where the URL goes (see the
    module docstring). A slot outside the path and the query (the config refuses
    those) is a ValueError."""
    parsed = url_template(template)
    out = [parsed.head]
    for segment in parsed.segments:
        text = "".join(
            piece if isinstance(piece, str) else _in_path(piece, values[piece.name])
            for piece in segment
        )
        slot = next((piece for piece in segment if isinstance(piece, UrlSlot)), None)
        if slot is not None:
            _check_segment(slot.name, text)
        out.append("/" + text)
    if parsed.query is not None:
        out.append("?")
        out.extend(
            piece if isinstance(piece, str) else quote(values[piece.name], safe="")
            for piece in parsed.query
        )
    if any(slot.place not in ("path", "query") for slot in parsed.slots):
        raise ValueError(f"{template!r} has a placeholder outside its path and query")
    out.append(parsed.fragment)
    return "".join(out)


def _decodings(text: str) -> list[str]:
    """The text, and what percent-decoding it gives, again and again until nothing
    changes (each round shortens it, so this ends)."""
    found = [text]
    while "%" in text:
        decoded = unquote(text)
        if decoded == text:
            break
        found.append(text := decoded)
    return found


def _in_path(slot: UrlSlot, value: str) -> str:
    for text in _decodings(value):
        if "/" in text or "\\" in text:
            raise UnplaceableValue(
                slot.name,
                "separator",
                "holds / or \\ (once percent-decoded), which servers that decode the "
                "path read as a separator, so the check would ask about another URL",
            )
    return quote(value, safe="")


def _check_segment(name: str, segment: str) -> None:
    for text in _decodings(segment):
        bare = text.split(";", 1)[0]
        if bare in (".", ".."):
            raise UnplaceableValue(
                name,
                "dot_segment",
                f"would make the path segment {segment!r}, which servers read as {bare!r} "
                "and resolve away, so the check would ask about another URL",
            )
        if not bare:
            raise UnplaceableValue(
                name,
                "empty_segment",
                f"would make the path segment {segment!r}, which servers merge away "
                "(// is /), so the check would ask about another URL",
            )


@lru_cache(maxsize=512)
def compile_template(template: str) -> Template:
    """The compiled template; TemplateError (a ValueError) says what is wrong."""
    scan = scan_template(template)
    if scan.problems:
        raise TemplateError(template, scan.problems)
    pieces = scan.pieces
    firsts = {
        piece[0]
        for before, piece, after in zip(pieces, pieces[1:], pieces[2:], strict=False)
        if isinstance(before, Placeholder) and isinstance(piece, str)
        if isinstance(after, Placeholder)
    }
    return Template(
        text=template,
        pieces=pieces,
        escapes=frozenset({ESCAPE, *firsts}) if firsts else frozenset(),
        uses_period=scan.uses_period,
        path_params=scan.path_params,
    )
