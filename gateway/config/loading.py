"""Loading a config file: YAML (duplicate keys refused, each value's position kept),
${VAR} interpolation, then validation of the whole (gateway.config.model); all
problems are reported together, each with its line and column.

${VAR} is expanded here, over every text in the file, rather than by each value type:
it is a property of the file (a value of any setting, even a misspelt one, may come
from the environment), and a new setting cannot forget it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.config.issues import Issues
from gateway.config.model import Config
from gateway.config.summary import config_warnings
from gateway.config.text import join, show
from gateway.errors import ConfigError, ConfigIssue

#: `$${`, or a reference: `${` to its `}`, or to the end of the text when none comes (an
#: error). Never failing past its `${`, `sub` reads each character once; a pattern that
#: failed there was tried again at every later `${`, quadratic in a line of them.
_ENV_RE = re.compile(r"\$\$\{|\$\{([^}]*)\}?")
_MAX_POSITIONS = 100_000
_ENV_NAME_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::([-?])(.*))?", re.DOTALL)


def interpolate(data: object, path: str, issues: Issues, env: dict[str, str]) -> object:
    """Expands ${VAR}, ${VAR:-default} and ${VAR:?message} in every string scalar."""
    if isinstance(data, dict):
        return {k: interpolate(v, join(path, str(k)), issues, env) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate(v, f"{path}[{i}]", issues, env) for i, v in enumerate(data)]
    if isinstance(data, str) and "$" in data:
        return _expand(data, path, issues, env)
    return data


def _expand(text: str, path: str, issues: Issues, env: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        whole = match.group(0)
        if whole == "$${":
            return "${"
        ref = _ENV_NAME_RE.fullmatch(match.group(1)) if whole.endswith("}") else None
        if ref is None:
            issues.add(
                path,
                f"{show(whole)} is not a valid environment reference; write "
                "${NAME}, ${NAME:-default} or ${NAME:?message}, or $${ for a literal ${",
            )
            return ""
        name, op, arg = ref.groups()
        value = env.get(name)
        if op == "-":
            return value if value else arg
        if op == "?" and not value:
            why = arg or "it is required"
            issues.add(path, f"environment variable {name} is not set: {why}")
            return ""
        return value or ""

    return _ENV_RE.sub(replace, text)


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, which PyYAML would silently overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f'"{key}" is given twice in one mapping', key_node.start_mark
                )
            seen.add(key) if isinstance(key, str) else None
        return super().construct_mapping(node, deep=deep)


def yaml_message(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    if "'{'" in problem or "'}'" in problem:
        # Path patterns and templates are the usual cause: {name} opens a YAML mapping.
        what += '; quote text holding { or }, e.g. path: "/jobs/{name}"'
    if mark is None:
        return f"not valid YAML: {what}"
    return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {what}"


@dataclass(frozen=True, slots=True)
class Positions:
    """Where in the file each YAML path's value is, and each setting's name: errors
    name the line and column (`config.yaml:14:7`) as well as the path."""

    values: dict[str, tuple[int, int]]
    names: dict[str, tuple[int, int]]

    def of(self, path: str, *, at_name: bool = False) -> tuple[int, int]:
        """A setting that is missing points at the mapping it is missing from."""
        if at_name and path in self.names:
            return self.names[path]
        while path not in self.values and path:
            cut = max(path.rfind("."), path.rfind("["))
            path = path[: max(cut, 0)]
        return self.values.get(path, (0, 0))

    def locate(self, issues: Issues) -> list[ConfigIssue]:
        located = []
        for issue in issues.items:
            line, column = self.of(issue.path, at_name=issue in issues.at_names)
            located.append(replace(issue, line=line, column=column))
        return located


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _record(
    loader: UniqueKeyLoader, node: yaml.Node, path: str, found: Positions, seen: set[int]
) -> None:
    found.values[path] = _mark(node)
    # An alias may hold itself; and a file's positions are bounded like its size.
    if id(node) in seen or len(found.values) > _MAX_POSITIONS:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        # After construction: merge keys (<<) are flattened in, later entries win.
        for key_node, value_node in node.value:
            # The name as the data has it (`1:` is the number 1, `~:` is None).
            scalar = isinstance(key_node, yaml.ScalarNode)
            child = join(path, str(loader.construct_object(key_node) if scalar else key_node.value))
            found.names[child] = _mark(key_node)
            _record(loader, value_node, child, found, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record(loader, item, f"{path}[{i}]", found, seen)
    seen.discard(id(node))


def read_yaml(text: str, source: str) -> tuple[object, Positions]:
    """The file's data, and where each value is in it; ConfigError for bad YAML."""
    loader: UniqueKeyLoader | None = None
    try:
        # UniqueKeyLoader is a SafeLoader: YAML tags cannot build arbitrary objects.
        loader = UniqueKeyLoader(text)  # reads the first characters: may raise already
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
        found = Positions({}, {})
        if node is not None:
            _record(loader, node, "", found, set())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (0, 0)
        raise ConfigError(source, [ConfigIssue("", yaml_message(exc), line, column)]) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, found


def load_config(path: str | os.PathLike[str]) -> Config:
    """Reads, interpolates and validates a YAML config; raises ConfigError listing every problem."""
    return load_config_warnings(path)[0]


def load_config_warnings(path: str | os.PathLike[str]) -> tuple[Config, list[ConfigIssue]]:
    """load_config, and the config's warnings (summary.config_warnings) placed in the
    file: `check-config` prints them."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(
            source, [ConfigIssue("", "file not found; pass the path of a YAML config file")]
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(source, [ConfigIssue("", f"cannot read the file: {reason}")]) from None
    data, positions = read_yaml(text, source)
    config, issues = _validate(data, source, os.environ)
    if config is None:
        raise ConfigError(source, positions.locate(issues))
    warnings = Issues()
    for warning in config_warnings(config):
        warnings.add(warning.path, warning.message)
    return config, positions.locate(warnings)


def parse_config(data: object, source: str, env: Mapping[str, str] | None = None) -> Config:
    """Validates already-loaded YAML data; `env` defaults to os.environ for ${VAR}."""
    config, issues = _validate(data, source, os.environ if env is None else env)
    if config is None:
        raise ConfigError(source, issues.items)
    return config


@cache
def _adapter() -> TypeAdapter[Config]:
    return TypeAdapter(Config)


def _validate(data: object, source: str, env: Mapping[str, str]) -> tuple[Config | None, Issues]:
    issues = Issues()
    if data is None:
        issues.add("", "the file is empty; it needs at least a routes: list")
        return None, issues
    data = interpolate(data, "", issues, dict(env))
    try:
        config = _adapter().validate_python(data, context={"source": source})
    except ValidationError as exc:
        issues.extend(exc)
        return None, issues
    return (None if issues.items else config), issues
