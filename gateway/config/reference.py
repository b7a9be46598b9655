"""The configuration reference (`idempotency-gateway config-reference`, committed as
docs/configuration.md), generated from the same declarations as the settings and their
JSON Schema.

A row per setting: its name as a file writes it (`match.path`), what it is written as
(`Check.written`, or a section's `written`), its default as a file would write it
(`Check.show`) and what it means (the docstring under the field). A section held by a
setting (`tls`, `reconcile`, `delivery`, `retry`, `key`, an operator) gets a table of
its own below its parent's. tests/test_config_reference.py fails while the committed
page differs from what this prints.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, get_args, get_origin

from gateway.config.admin import AdminConfig
from gateway.config.keys import SOURCES, KeySpec, Period
from gateway.config.model import Config, ServerConfig
from gateway.config.routes import DEFAULTS, SETTINGS, Route
from gateway.config.sections import DECLARED, Section, description
from gateway.config.store import StoreConfig
from gateway.config.types import Check

_INTRO = """\
# Configuration reference

<!-- Generated from gateway/config/ by `idempotency-gateway config-reference`: edit the
docstring under a setting there, then regenerate this page (CONTRIBUTING.md). -->

A config file is YAML with five sections: `server`, `admin`, `store`, `defaults` and
`routes`; only `routes` is required. `config.example.yaml` is a commented example.
`idempotency-gateway check-config FILE` checks a file and prints every route as the
gateway understands it; every problem in it is reported at once, each with the file,
line and column, the YAML path and the fix
(`config.yaml:14:7: routes[2].key.body: ...`). `docs/config.schema.json`
(`idempotency-gateway config-schema`) describes the same settings for editors, so an
editor that reads it completes and checks a file as you type.

## How values are written

- **`${VAR}`**, `${VAR:-default}` and `${VAR:?message}` read the environment, in any
  value; write secrets this way.
- **Durations:** `500ms`, `30s`, `15m`, `24h`, `7d`, or a number of seconds; at most
  `36500d` (100 years), what every store keeps a record for.
- **Sizes:** `512KiB`, `1MiB`, `10MB`, or a number of bytes.
- **Spaces** in a duration, a size, a period or a number are ASCII spaces (`5 s`);
  another space (U+00A0, U+3000, a tab) is refused, named.
- **Statuses:** a code (`200`), a class (`"2xx"`), or `"!408"` to leave one out.
- **Request parts** (a fingerprint, a `hash` key, a scope): `method`, `path`, `query`,
  `body` and `header.<Name>`; a scope takes `header.<Name>` and `query.<name>`.
- **Path patterns:** exact (`/jobs/send-reminder`), `{name}` for one segment,
  `{rest:path}` for the rest of the path.
- **`true` and `false`**, also as text (what a `${VAR}` gives).
"""

_HEADER = "| setting | written as | default | meaning |\n|---|---|---|---|"


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def anchor(heading: str) -> str:
    """The fragment a Markdown renderer (GitHub's) gives a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def _fields(cls: Any) -> dict[str, Any]:
    return dict(getattr(cls, "_built", cls).__pydantic_fields__)


def _checks(annotation: Any) -> list[Check]:
    """The Check an annotation carries, also inside `X | None`."""
    found = [m for m in getattr(annotation, "__metadata__", ()) if isinstance(m, Check)]
    for arg in get_args(annotation) if get_origin(annotation) is not Annotated else ():
        found += _checks(arg)
    return found


def section_in(annotation: Any) -> Any:
    """The settings class a field holds (`TLSConfig | None`, a tuple of operators), or
    None."""
    if annotation in DECLARED:
        return annotation
    for arg in get_args(annotation):
        held = section_in(arg)
        if held is not None:
            return held
    return None


def _check(cls: Any, name: str) -> Check | None:
    info = _fields(cls)[name]
    found = [m for m in info.metadata if isinstance(m, Check)] + _checks(info.annotation)
    return found[0] if found else None


def written_as(cls: Any, name: str) -> str:
    """What a file writes for the setting, in a few words."""
    check = _check(cls, name)
    if check is not None:
        return check.written
    held = section_in(_fields(cls)[name].annotation)
    if held is None:
        raise LookupError(f"{cls.__name__}.{name}: no Check and no section: what is it written as?")
    return str(held.written)


def default_of(cls: Any, name: str) -> str:
    """The default as a file would write it; `required` when there is none."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        value: Any = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    check = _check(cls, name)
    if value is None or value == "" or value == b"":
        return "unset"
    if check is not None and check.show is not None:
        return f"`{check.show(value)}`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, int | float | str):
        return f"`{value}`"
    if isinstance(value, frozenset):
        return f"`[{', '.join(sorted(str(item) for item in value))}]`"
    if isinstance(value, tuple):
        return f"`[{', '.join(str(item) for item in value)}]`"
    return "the defaults below"


class _Page:
    def __init__(self) -> None:
        self.parts: list[str] = [_INTRO]

    def add(self, text: str) -> None:
        self.parts.append(text)

    def section(
        self, path: str, cls: Any, intro: str, names: tuple[str, ...], *, level: int = 2
    ) -> None:
        """A table of `cls`'s settings `names` under `path` (`store`, `routes[]`), then a
        table for each section one of them holds, one heading level down."""
        self.add(f"{'#' * level} {path.removesuffix('[]') if level == 2 else path}\n")
        if intro:
            self.add(_one_line(intro) + "\n")
        rows, held = self.rows(path, cls, names)
        self.add(_HEADER + "\n" + "\n".join(rows) + "\n")
        for where, section in held:
            if section is KeySpec:
                self.key(where, level + 1)
            else:
                doc = section.__doc__ or ""
                self.section(where, section, doc, section.yaml_names(), level=level + 1)

    def rows(
        self, path: str, cls: Any, names: tuple[str, ...]
    ) -> tuple[list[str], list[tuple[str, Any]]]:
        fields = _fields(cls)
        written_at: dict[str, tuple[str, ...]] = getattr(cls, "written_at", {})
        rows: list[str] = []
        held: list[tuple[str, Any]] = []
        for name in names:
            if name not in fields:  # a block of the file's own, e.g. `match:`
                blocks: dict[str, str] = cls.blocks
                rows.append(f"| `{name}` | mapping | unset | {_one_line(blocks[name])} |")
                under = [f for f, at in written_at.items() if at[0] == name]
                for field_name in sorted(under, key=lambda f: written_at[f]):
                    shown = ".".join(written_at[field_name])
                    rows.append(self.row(cls, field_name, shown, ""))
                continue
            section = section_in(fields[name].annotation)
            link = ""
            if section is not None:
                many = get_origin(fields[name].annotation) is tuple
                where = f"{path}.{name}" + ("[]" if many else "")
                link = f" ([below](#{anchor(where)}))"
                held.append((where, section))
            rows.append(self.row(cls, name, name, link))
        return rows, held

    @staticmethod
    def row(cls: Any, name: str, shown: str, link: str) -> str:
        meaning = _one_line(description(cls, name))
        if not meaning:
            raise LookupError(f"{cls.__name__}.{name} has no description: add a docstring under it")
        written = _one_line(written_as(cls, name))
        return f"| `{shown}` | {written}{link} | {default_of(cls, name)} | {meaning} |"

    def key(self, path: str, level: int) -> None:
        self.add(f"{'#' * level} {path}\n")
        self.add(_one_line(KeySpec.__doc__ or "") + "\n")
        self.add("| source | meaning |\n|---|---|")
        self.add("\n".join(f"| `{kind}` | {_one_line(text)} |" for kind, text in SOURCES.items()))
        self.add("\nAnd beside the source:\n")
        rows = [
            self.row(KeySpec, "sources", "sources", ""),
            self.row(KeySpec, "period", "period", ""),
            self.row(Period, "timezone", "timezone", ""),
            *(self.row(KeySpec, name, name, "") for name in ("on_missing", "scope", "max_length")),
        ]
        self.add(_HEADER + "\n" + "\n".join(rows) + "\n")


def reference_text() -> str:
    """docs/configuration.md, as `config-reference` prints it."""
    page = _Page()
    sections: tuple[tuple[str, type[Section]], ...] = (
        ("server", ServerConfig),
        ("admin", AdminConfig),
        ("store", StoreConfig),
    )
    for path, cls in sections:
        page.section(path, cls, description(Config, path), cls.yaml_names())
    page.add("## defaults\n")
    links = ", ".join(f"[`{name}`](#routes)" for name in SETTINGS)
    page.add(f"{_one_line(DEFAULTS)}\n\nThe settings it takes: {links}.\n")
    page.section("routes[]", Route, description(Config, "routes"), Route.yaml_names())
    return "\n".join(page.parts).rstrip("\n") + "\n"
