"""How a YAML mapping becomes a settings object.

The settings are frozen pydantic dataclasses (`settings`): one declaration gives the
fields, their types (gateway.config.types), defaults and descriptions (the docstring
under each field, which the JSON Schema and docs/configuration.md both show); slots
keep attribute reads on the request path as cheap as a plain dataclass's. Built in
Python (`Route(name=..., path=...)`) they validate like any pydantic dataclass. Read
from a file they go through `Section`'s validator, which adds what a file needs: the
mapping itself is checked, unknown settings get "did you mean", a section may be
written in another shape than its fields (`Section.from_yaml`), and checks that span
settings (`Section.check`) still run when another setting is wrong, so that every
problem of a file is reported in one pass.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, ClassVar, TypeVar, dataclass_transform

import pydantic
from pydantic import ConfigDict, TypeAdapter, ValidationError, model_validator
from pydantic_core import ArgsKwargs

from gateway.config.issues import Loc, Problems
from gateway.config.text import kind, unknown_setting

T = TypeVar("T")

#: A marker a route's data carries: the settings it inherits from `defaults`. YAML
#: cannot hold a NUL character, so no file can write it.
INHERITED = "\x00inherited"

_CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

#: Every settings class, in the order declared: tests/test_config_reference.py checks
#: that each field has a description.
DECLARED: list[type] = []


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def settings(cls: type[T]) -> type[T]:
    """A frozen, slotted pydantic dataclass that refuses unknown fields."""
    built = pydantic.dataclasses.dataclass(frozen=True, slots=True, config=_CONFIG)(cls)
    # slots=True makes a new class; validators are bound to the one before it.
    cls._built = built  # type: ignore[attr-defined]
    DECLARED.append(built)
    return built  # type: ignore[return-value]


def is_instance(data: object) -> bool:
    """A settings object already built. (Not isinstance(data, cls): a slotted dataclass
    is a new class, and validators see the one before it.)"""
    return dataclasses.is_dataclass(data) and not isinstance(data, type)


def description(cls: Any, name: str) -> str:
    """The docstring under a field: what the setting means, for users. Read from the
    class's source when asked (the schema and the reference ask; serving never does), so
    it costs the gateway's start nothing."""
    return _docstrings(getattr(cls, "_built", cls)).get(name, "")


@cache
def _docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring: the string that follows its annotated line."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}  # no source (a frozen build): nothing to describe with
    found: dict[str, str] = {}
    previous: ast.stmt | None = None
    for node in ast.parse(textwrap.dedent(source)).body[0].body:  # type: ignore[attr-defined]
        if (
            isinstance(previous, ast.AnnAssign)
            and isinstance(previous.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found[previous.target.id] = inspect.cleandoc(node.value.value)
        previous = node
    return found


@cache
def field_adapter(cls: Any, name: str) -> TypeAdapter[Any]:
    """Validates one field of a settings class alone, as the class would."""
    info = getattr(cls, "_built", cls).__pydantic_fields__[name]
    annotated: Any = Annotated
    return TypeAdapter(
        annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    )


class Section:
    """Base of the settings that are a mapping in the file."""

    __slots__ = ()

    #: shown when the YAML value is not a mapping
    example: ClassVar[str] = ""
    #: `server:` with nothing under it means the defaults
    none_is_empty: ClassVar[bool] = True
    #: fields written elsewhere in the file: a route's `path` is `match.path`
    written_at: ClassVar[dict[str, Loc]] = {}
    #: what each block of `written_at` (a `match:`, a `sentinel:`) is, for users
    blocks: ClassVar[dict[str, str]] = {}
    #: what the section is written as where a parent setting holds it
    written: ClassVar[str] = "mapping"

    @classmethod
    def yaml_names(cls) -> tuple[str, ...]:
        """The settings the mapping may hold."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def report_order(cls) -> tuple[str, ...]:
        """The order problems of settings are reported in."""
        return cls.yaml_names()

    @classmethod
    def unknown(cls, name: object, problems: Problems) -> None:
        problems.add((str(name),), unknown_setting(str(name), sorted(cls.yaml_names())), name=True)

    @classmethod
    def from_yaml(cls, given: dict[str, Any], problems: Problems) -> dict[str, Any]:
        """The fields' values from the settings written; problems of shape go to `problems`."""
        return given

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        """Checks across settings. `values` holds the fields that validated (all of
        them unless a problem was found); returns fields to change, if any."""
        return {}

    @classmethod
    def partial(cls, kwargs: dict[str, Any], problems: Problems) -> dict[str, Any]:
        """The fields that validate alone, after the whole failed, and the defaults of
        those not given: a field missing here was given and is wrong."""
        values: dict[str, Any] = {
            f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.name not in kwargs
            and (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
        }
        owner: Any = cls  # a class is hashable; mypy sees Section's instance __hash__
        for name, value in kwargs.items():
            try:
                values[name] = field_adapter(owner, name).validate_python(value)
            except ValidationError:
                pass
        return values

    @model_validator(mode="wrap")
    @classmethod
    def _validate(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        if isinstance(data, ArgsKwargs) or is_instance(data):
            return handler(data)  # built in Python
        if data is None and cls.none_is_empty:
            data = {}
        if not isinstance(data, dict):
            hint = f"; write e.g. {cls.example}" if cls.example else ""
            raise ValueError(f"expected a mapping (name: value), got {kind(data)}{hint}")
        problems = Problems()
        inherited: frozenset[str] = data.get(INHERITED, frozenset())
        names = cls.yaml_names()
        given: dict[str, Any] = {}
        for name, value in data.items():
            if isinstance(name, str) and name in names:
                given[name] = value
            elif name != INHERITED:
                cls.unknown(name, problems)
        found = Problems()
        kwargs = cls.from_yaml(given, found)
        result = None
        try:
            result = handler(kwargs)
        except ValidationError as exc:
            found.extend(exc, rename=cls.written_at)
        problems.merge(found.sorted(cls.report_order()))
        if result is not None:
            values = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        else:
            values = cls.partial(kwargs, problems)
        changes = cls.check(values, given, inherited, problems)
        problems.raise_if_any()
        if changes and result is not None:
            return dataclasses.replace(result, **changes)
        return result
