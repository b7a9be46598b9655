"""The configuration reference (`idempotency-gateway config-reference`,
docs/configuration.md): generated from the settings' declarations, so it names every
setting there is, each with the description the JSON Schema shows too."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway import cli
from gateway.config.http import DEFAULT_CACHE_STATUSES
from gateway.config.reference import reference_text
from gateway.config.schema import config_schema
from gateway.config.sections import DECLARED, description
from gateway.config.units import parse_status_set, write_statuses

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_FILE = ROOT / "docs" / "configuration.md"
DECLARED_BY_NAME = {cls.__name__: cls for cls in DECLARED}


def test_the_committed_reference_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["config-reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == reference_text()
    assert REFERENCE_FILE.read_text() == printed, (
        "docs/configuration.md is stale: idempotency-gateway config-reference > "
        "docs/configuration.md"
    )


def test_every_declared_setting_has_a_description() -> None:
    missing = [
        f"{cls.__name__}.{field.name}"
        for cls in DECLARED
        for field in dataclasses.fields(cls)
        if not description(cls, field.name).strip()
    ]
    assert not missing, f"add a docstring under each of these fields: {missing}"


def _properties(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (path, schema) under a `properties` of the JSON Schema."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        for name, value in node.get("properties", {}).items():
            found.append((f"{path}.{name}", value))
            found += _properties(value, f"{path}.{name}")
        for key, value in node.items():
            if key != "properties":
                found += _properties(value, path)
    elif isinstance(node, list):
        for value in node:
            found += _properties(value, path)
    return found


def test_every_setting_in_the_json_schema_has_a_description() -> None:
    found = _properties(config_schema())
    assert len(found) > 100
    missing = sorted({path for path, schema in found if not schema.get("description")})
    assert not missing, missing


def test_the_reference_names_every_setting_of_the_json_schema() -> None:
    page = reference_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    schema = config_schema()
    sections = {name for name in schema["properties"]}
    names = {path.rsplit(".", 1)[1] for path, _ in _properties(schema)} - sections
    # A row names a setting as a file writes it: `listen`, `match.path`, `sentinel.nodes`.
    shown = {row.rsplit(".", 1)[-1] for row in rows}
    assert names - shown == set()
    for name in sections:
        assert re.search(rf"^## {name}$", page, re.M), name


def test_the_schema_and_the_reference_give_one_description() -> None:
    schema = config_schema()
    page = reference_text()
    listen = schema["properties"]["server"]["properties"]["listen"]["description"]
    assert listen == " ".join(description(DECLARED_BY_NAME["ServerConfig"], "listen").split())
    assert listen in page


def test_defaults_are_shown_as_a_file_writes_them() -> None:
    page = reference_text()
    assert "| `upstream_timeout` | duration | `30s` |" in page
    assert "| `max_request_body` | size | `1MiB` |" in page
    assert (
        '| `cache_statuses` | list of statuses | `["2xx", "3xx", "4xx", "!408", "!429"]` |' in page
    )
    assert "| `sensitive_keys` | `true` or `false` | `false` |" in page
    assert "| `concurrent` | `wait` or `reject` | `wait` |" in page


@pytest.mark.parametrize(
    "statuses",
    [
        DEFAULT_CACHE_STATUSES,
        frozenset({200}),
        frozenset({200, 201, 404}),
        frozenset(range(200, 300)),
        frozenset(range(100, 600)) - {408, 429, 500},
        frozenset(),
    ],
)
def test_a_status_set_as_written_reads_back_the_same(statuses: frozenset[int]) -> None:
    written = json.loads(write_statuses(statuses))
    assert parse_status_set(written, frozenset()) == statuses
