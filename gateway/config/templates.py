"""The key template grammar: `reminder:{body.user_id}:{period}`."""

from __future__ import annotations

import difflib
import re

from gateway.config.issues import Issues
from gateway.config.text import show
from gateway.config.types import compile_jmespath, is_identifier, is_token

# The same grammar as gateway.keys: {{ and }} are literal braces.
TEMPLATE_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_PLACEHOLDER_HINT = (
    "use {period}, {method}, {path}, {path.<param>}, {header.<Name>}, {query.<name>} "
    "or {body.<jmespath>}"
)


def template_placeholders(template: str) -> tuple[list[str], list[str]]:
    """Splits out the `{...}` placeholders of a template; also returns brace problems."""
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


def _template_separator_problem(template: str) -> str | None:
    """Two placeholders need a separator between them that does not start with the
    backslash, which escapes separator characters inside values (gateway.keys)."""
    previous: re.Match[str] | None = None
    for match in TEMPLATE_TOKEN_RE.finditer(template):
        if match.group(1) is None:
            continue
        if previous is not None:
            between = template[previous.end() : match.start()]
            if not between or between.startswith("\\"):
                a, b = previous.group(1).strip(), match.group(1).strip()
                where = "next to each other" if not between else "split by a backslash, the escape"
                return (
                    f"{{{a}}} and {{{b}}} are {where}, so two different requests could share "
                    f'one key ("ab"+"c" and "a"+"bc"); put a separator between them, e.g. '
                    f"{{{a}}}:{{{b}}}"
                )
        previous = match
    return None


def check_template(
    template: str, path: str, issues: Issues, *, has_period: bool
) -> tuple[bool, list[str]]:
    """Checks placeholders; returns whether {period} is used and the {path.<p>} names."""
    placeholders, problems = template_placeholders(template)
    for problem in problems:
        issues.add(path, problem)
    separator = _template_separator_problem(template)
    if separator:
        issues.add(path, separator)
    uses_period = False
    params: list[str] = []
    for text in placeholders:
        head, dot, rest = text.partition(".")
        if text == "period":
            uses_period = True
            if not has_period:
                issues.add(
                    path, "{period} needs a period; add e.g. period: 1d (or 15m, 1h, 1w) to the key"
                )
        elif text in ("method", "path"):
            pass
        elif dot and head == "path" and is_identifier(rest):
            params.append(rest)
        elif dot and head == "header" and is_token(rest):
            pass
        elif dot and head == "query" and rest:
            pass
        elif dot and head == "body" and rest:
            compile_jmespath(rest, path, issues)
        else:
            close = difflib.get_close_matches(
                head, ["period", "method", "path", "header", "query", "body"], n=1
            )
            guess = f'; did you mean "{{{close[0]}{dot}{rest}}}"?' if close else ""
            issues.add(path, f"unknown placeholder {{{text}}}; {_PLACEHOLDER_HINT}{guess}")
    return uses_period, params
