"""The JSON Schema of the config file, for editors (`idempotency-gateway config-schema`).

Each setting's schema comes from its declared type (`Check(..., schema)` in
gateway.config.types), so it describes what the file holds ("30s", "1MiB", "2xx"),
not the parsed value. What the settings objects do not show, the file's shapes
(`match:`, `sentinel:`, the three forms of `key:`, `defaults:`), is assembled here;
tests/test_config_schema.py checks the two stay in step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import TypeAdapter

from gateway.config.admin import AdminConfig
from gateway.config.keys import KEY_OPTIONS, SOURCE_KINDS, KeySource, KeySpec
from gateway.config.model import SECTIONS, ServerConfig
from gateway.config.routes import SETTINGS, ReconcileConfig, Route
from gateway.config.sections import field_adapter
from gateway.config.store import StoreConfig, TLSConfig
from gateway.config.types import ENV, Json, TimeZone

_PERIOD = {"type": "string", "pattern": "^\\s*\\d+\\s*(mo|m|h|d|w)\\s*$"}


def _field(cls: Any, name: str) -> Json:
    return field_adapter(cls, name).json_schema()


def _mapping(
    properties: dict[str, Json], required: tuple[str, ...] = (), *, null: bool = True
) -> Json:
    schema: Json = {
        "type": ["object", "null"] if null else "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = list(required)
    return schema


def _section(cls: Any, *, skip: tuple[str, ...] = ()) -> dict[str, Json]:
    return {f.name: _field(cls, f.name) for f in dataclasses.fields(cls) if f.name not in skip}


def _source(kind: str) -> Json:
    if kind == "hash":
        value = _field(KeySource, "parts")
    else:
        value = {"anyOf": [{"type": "string", "minLength": 1}, ENV]}
    return _mapping({kind: value}, (kind,), null=False)


def _key() -> Json:
    source = {"oneOf": [_source(kind) for kind in SOURCE_KINDS]}
    options: dict[str, Json] = {
        "period": {"anyOf": [_PERIOD, ENV]},
        "timezone": TypeAdapter(TimeZone).json_schema(),
        **{name: _field(KeySpec, name) for name in ("on_missing", "scope", "max_length")},
    }
    assert set(options) == set(KEY_OPTIONS)
    sources = {"type": "array", "items": {"$ref": "#/$defs/source"}, "minItems": 1}
    kinds = {kind: _source(kind)["properties"][kind] for kind in SOURCE_KINDS}
    return {
        "source": source,
        "key": {
            "anyOf": [
                {"type": "null"},
                sources,
                _mapping({**kinds, "sources": sources, **options}, null=False),
            ]
        },
    }


def _store() -> dict[str, Json]:
    fields = _section(StoreConfig)
    nodes = fields["sentinel_nodes"]
    properties = {name: fields[name] for name in StoreConfig.yaml_names() if name in fields}
    properties["tls"] = {"$ref": "#/$defs/tls"}
    properties["sentinel"] = _mapping(
        {
            "master": fields["sentinel_master"],
            "nodes": nodes,
            "password": fields["sentinel_password"],
        },
        ("master", "nodes"),
        null=False,
    )
    properties["cluster"] = _mapping({"nodes": nodes}, ("nodes",), null=False)
    return properties


def _route_settings() -> dict[str, Json]:
    settings = {name: _field(Route, name) for name in SETTINGS}
    settings["key"] = {"$ref": "#/$defs/key"}
    settings["reconcile"] = {"anyOf": [{"$ref": "#/$defs/reconcile"}, {"type": "null"}]}
    return settings


def config_schema() -> Json:
    match = _mapping(
        {"methods": _field(Route, "methods"), "path": _field(Route, "path")}, ("path",)
    )
    route = _mapping(
        {
            "name": _field(Route, "name"),
            "match": {**match, "type": "object"},
            "upstream": _field(Route, "upstream"),
            **_route_settings(),
        },
        ("name", "match", "upstream"),
        null=False,
    )
    keys = _key()
    properties = {
        "server": _mapping(_section(ServerConfig)),
        "admin": _mapping(_section(AdminConfig, skip=("session_secret",))),
        "store": _mapping(_store()),
        "defaults": _mapping(_route_settings()),
        "routes": {"type": "array", "items": {"$ref": "#/$defs/route"}, "minItems": 1},
    }
    assert tuple(properties) == SECTIONS
    schema: Json = _shared(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "Idempotency Gateway config",
            "description": "A config file of idempotency-gateway; check one with "
            "`idempotency-gateway check-config FILE`. Any value may be a ${VAR} reference.",
            **_mapping(properties, ("routes",), null=False),
            "$defs": {
                "env": {**ENV, "description": "${VAR}, ${VAR:-default} or ${VAR:?message}"},
                "route": route,
                "key": keys["key"],
                "source": keys["source"],
                "reconcile": _mapping(_section(ReconcileConfig), ("url",), null=False),
                "tls": _mapping(_section(TLSConfig)),
            },
        }
    )
    return schema


def _shared(node: Any) -> Any:
    """Each setting's `${VAR}` alternative as one reference, not a copy."""
    if node == ENV:
        return {"$ref": "#/$defs/env"}
    if isinstance(node, dict):
        return {k: _shared(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_shared(v) for v in node]
    return node


def schema_text() -> str:
    """The schema as `config-schema` prints it and docs/config.schema.json holds it."""
    return json.dumps(config_schema(), indent=2, ensure_ascii=False) + "\n"
