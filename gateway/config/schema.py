"""The JSON Schema of the config file, for editors (`idempotency-gateway config-schema`).

Each setting's schema comes from its declared type (`Check(..., schema)` in
gateway.config.types), so it describes what the file holds ("30s", "1MiB", "2xx"),
not the parsed value, and its description is the docstring under the field (the one
docs/configuration.md shows). What the settings objects do not show, the file's shapes
(`match:`, `sentinel:`, the three forms of `key:`, `defaults:`), is assembled here,
with their descriptions from the same modules; tests/test_config_schema.py checks the
two stay in step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, get_args

from gateway.config.admin import OPERATOR_SCHEMA, AdminConfig, OperatorConfig
from gateway.config.delivery import DeliveryConfig, DeliveryMode, RetryConfig
from gateway.config.keys import KEY_OPTIONS, SOURCE_KINDS, SOURCES, KeySource, KeySpec, Period
from gateway.config.model import SECTIONS, Config, ServerConfig
from gateway.config.routes import DEFAULTS, SETTINGS, ReconcileConfig, Route
from gateway.config.sections import description, field_adapter
from gateway.config.store import StoreConfig, TLSConfig
from gateway.config.types import ENV, Json

_PERIOD = {"type": "string", "pattern": "^\\s*[0-9]+\\s*(mo|m|h|d|w)\\s*$"}


def _field(cls: Any, name: str) -> Json:
    return _about(field_adapter(cls, name).json_schema(), description(cls, name))


def _about(schema: Json, text: str) -> Json:
    return {**schema, "description": text} if text else schema


def _mapping(
    properties: dict[str, Json],
    required: tuple[str, ...] = (),
    *,
    null: bool = True,
    about: str = "",
) -> Json:
    schema: Json = {
        "type": ["object", "null"] if null else "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = list(required)
    return _about(schema, about)


def _section(cls: Any, *, skip: tuple[str, ...] = ()) -> dict[str, Json]:
    return {f.name: _field(cls, f.name) for f in dataclasses.fields(cls) if f.name not in skip}


def _described(node: Any, shape: Json, cls: Any) -> Any:
    """`node` with every copy of `shape`, a mapping of `cls`'s settings that a type's
    schema spells out, given those settings' descriptions."""
    if node == shape:
        properties = shape["properties"]
        return {
            **node,
            "properties": {n: _about(v, description(cls, n)) for n, v in properties.items()},
        }
    if isinstance(node, dict):
        return {k: _described(v, shape, cls) for k, v in node.items()}
    if isinstance(node, list):
        return [_described(v, shape, cls) for v in node]
    return node


def _source(kind: str) -> Json:
    if kind == "hash":
        value = field_adapter(KeySource, "parts").json_schema()
    else:
        value = {"anyOf": [{"type": "string", "minLength": 1}, ENV]}
    return _mapping({kind: _about(value, SOURCES[kind])}, (kind,), null=False)


def _key() -> Json:
    source = {"oneOf": [_source(kind) for kind in SOURCE_KINDS]}
    options: dict[str, Json] = {
        "period": _about({"anyOf": [_PERIOD, ENV]}, description(KeySpec, "period")),
        "timezone": _field(Period, "timezone"),
        **{name: _field(KeySpec, name) for name in ("on_missing", "scope", "max_length")},
    }
    assert set(options) == set(KEY_OPTIONS)
    sources = _about(
        {"type": "array", "items": {"$ref": "#/$defs/source"}, "minItems": 1},
        description(KeySpec, "sources"),
    )
    kinds = {kind: _source(kind)["properties"][kind] for kind in SOURCE_KINDS}
    return {
        "source": source,
        "key": {
            "anyOf": [
                {"type": "null"},
                sources,
                _mapping({**kinds, "sources": sources, **options}, null=False),
            ],
            "description": (KeySpec.__doc__ or "").strip(),
        },
    }


def _store() -> dict[str, Json]:
    fields = _section(StoreConfig)
    nodes = fields["sentinel_nodes"]
    properties = {name: fields[name] for name in StoreConfig.yaml_names() if name in fields}
    properties["tls"] = _about({"$ref": "#/$defs/tls"}, description(StoreConfig, "tls"))
    properties["sentinel"] = _mapping(
        {
            "master": fields["sentinel_master"],
            "nodes": nodes,
            "password": fields["sentinel_password"],
        },
        ("master", "nodes"),
        null=False,
        about=StoreConfig.blocks["sentinel"],
    )
    properties["cluster"] = _mapping(
        {"nodes": fields["cluster_nodes"]},
        ("nodes",),
        null=False,
        about=StoreConfig.blocks["cluster"],
    )
    properties["sqlite"] = _mapping(
        {"synchronous": fields["sqlite_synchronous"]},
        (),
        null=False,
        about=StoreConfig.blocks["sqlite"],
    )
    return properties


def _route_settings() -> dict[str, Json]:
    settings = {name: _field(Route, name) for name in SETTINGS}
    settings["key"] = _about({"$ref": "#/$defs/key"}, description(Route, "key"))
    settings["reconcile"] = _about(
        {"anyOf": [{"$ref": "#/$defs/reconcile"}, {"type": "null"}]},
        description(Route, "reconcile"),
    )
    # `delivery: async` is short for `delivery: {mode: async}`.
    mapping = _mapping(_section(DeliveryConfig), about=(DeliveryConfig.__doc__ or "").strip())
    settings["delivery"] = _about(
        {"anyOf": [{"enum": list(get_args(DeliveryMode))}, ENV, mapping]},
        description(Route, "delivery"),
    )
    settings["retry"] = _mapping(_section(RetryConfig), about=description(Route, "retry"))
    return settings


def config_schema() -> Json:
    match = _mapping(
        {"methods": _field(Route, "methods"), "path": _field(Route, "path")},
        ("path",),
        about=Route.blocks["match"],
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
        "server": _mapping(_section(ServerConfig), about=description(Config, "server")),
        "admin": _mapping(
            _described(
                _section(AdminConfig, skip=("session_secret",)), OPERATOR_SCHEMA, OperatorConfig
            ),
            about=description(Config, "admin"),
        ),
        "store": _mapping(_store(), about=description(Config, "store")),
        "defaults": _mapping(_route_settings(), about=DEFAULTS),
        "routes": _about(
            {"type": "array", "items": {"$ref": "#/$defs/route"}, "minItems": 1},
            description(Config, "routes"),
        ),
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
                "reconcile": _mapping(
                    _section(ReconcileConfig),
                    ("url",),
                    null=False,
                    about=(ReconcileConfig.__doc__ or "").strip(),
                ),
                "tls": _mapping(_section(TLSConfig), about=(TLSConfig.__doc__ or "").strip()),
            },
        }
    )
    return schema


def _shared(node: Any) -> Any:
    """Each setting's `${VAR}` alternative as one reference, not a copy; descriptions
    on one line, as editors show them."""
    if node == ENV:
        return {"$ref": "#/$defs/env"}
    if isinstance(node, dict):
        return {
            k: " ".join(v.split()) if k == "description" and isinstance(v, str) else _shared(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_shared(v) for v in node]
    return node


def schema_text() -> str:
    """The schema as `config-schema` prints it and docs/config.schema.json holds it."""
    return json.dumps(config_schema(), indent=2, ensure_ascii=False) + "\n"
