"""The key template grammar, `reminder:{body.user_id}:{period}`: its one owner.

`scan_template` reads a template and says what is wrong with it, in the words config
errors use; `compile_template` turns an accepted one into a `Template` when the config
loads, and `gateway.keys` only renders that: a template the config accepted cannot
fail on a request. `{{` and `}}` are literal braces. The reconcile URL's `{key}`,
`{route}` and `{run_id}` are the same grammar: checked with `split_placeholders`,
filled in with `fill_placeholders`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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


def fill_placeholders(template: str, values: Mapping[str, str]) -> str:
    """A checked template (the reconcile URL) with each `{name}` replaced by its value
    and `{{`, `}}` written as braces: `{ key }` and `{{` read as the config read them."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        return match.group(0)[0] if name is None else values[name.strip()]

    return TEMPLATE_TOKEN_RE.sub(one, template)


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
