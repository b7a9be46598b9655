"""The config file's JSON Schema (`idempotency-gateway config-schema`): editors check a
file with it as the user types, so it must accept every config the gateway accepts,
written the way users write it, and name every setting there is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gateway import cli
from gateway.config import parse_config
from gateway.config.admin import AdminConfig
from gateway.config.keys import KEY_OPTIONS, SOURCE_KINDS
from gateway.config.model import SECTIONS, ServerConfig
from gateway.config.routes import SETTINGS, ReconcileConfig, Route
from gateway.config.schema import config_schema, schema_text
from gateway.config.store import StoreConfig, TLSConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "docs" / "config.schema.json"
VALIDATOR = jsonschema.Draft202012Validator(config_schema())
KEY = "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWY="  # 32 bytes in base64
OLD_KEY = "MDEyMzQ1Njc4OWFiY2RlZmdoaWprbG1ub3BxcnN0dXY="


def configmap_config_text() -> str:
    """The config in deploy/kubernetes' ConfigMap."""
    for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text()):
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
            return str(doc["data"]["config.yaml"])
    raise AssertionError("no ConfigMap in deploy/kubernetes/configmap.yaml")


def problems(data: object) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(data)]


def route(**settings: Any) -> dict[str, Any]:
    return {"name": "a", "match": {"path": "/jobs/{name}"}, "upstream": "http://h", **settings}


def test_the_committed_schema_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["config-schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == schema_text()
    assert SCHEMA_FILE.read_text() == printed, (
        "docs/config.schema.json is stale: idempotency-gateway config-schema > "
        "docs/config.schema.json"
    )
    jsonschema.Draft202012Validator.check_schema(json.loads(printed))


def test_the_example_points_editors_at_the_schema() -> None:
    example = ROOT / "config.example.yaml"
    first = example.read_text().splitlines()[0]
    assert first == "# yaml-language-server: $schema=docs/config.schema.json"
    assert (example.parent / first.rpartition("=")[2]).is_file()


@pytest.mark.parametrize("name", ["config.example.yaml", "deploy/config.yaml", "configmap"])
def test_shipped_configs_match_the_schema(name: str) -> None:
    text = configmap_config_text() if name == "configmap" else (ROOT / name).read_text()
    assert problems(yaml.safe_load(text)) == []


def test_the_schema_accepts_settings_as_users_write_them() -> None:
    data = {
        "server": {
            "listen": "[::1]:8080", "shutdown_grace": 0, "max_header_bytes": "16KiB",
            "access_log": "false", "trusted_proxies": ["10.0.0.0/8"], "max_connections": "100",
            "log_format": "json", "header_timeout": "1.5s",
        },
        "admin": {"listen": "127.0.0.1:9090", "token": None},
        "store": {
            "sentinel": {"master": "m", "nodes": ["10.0.0.1:26379"], "password": "${PW}"},
            "tls": None, "encryption_key": KEY, "previous_encryption_keys": ["${OLD_KEY}"],
            "socket_timeout": "${TIMEOUT:-2s}",
        },
        "defaults": {"upstream_timeout": "30s", "cache_statuses": ["2xx", "!408", 404]},
        "routes": [
            route(
                match={"methods": ["POST"], "path": "/jobs/{name}"},
                key={
                    "sources": [{"header": "K"}, {"template": "r:{path.name}:{period}"}],
                    "period": "15m", "timezone": "Europe/Berlin", "scope": ["header.Authorization"],
                },
                fingerprint="none", forward_key_header=False, max_request_body="1MiB",
                on_unknown_outcome="reconcile",
                reconcile={"url": "http://h/{key}", "done": [200], "timeout": "3s"},
            ),
            route(name="b", key=[{"query": "k"}, {"hash": ["method", "header.X"]}]),
            route(name="c", key={"period": "1d"}, strip_headers=["Set-Cookie"]),
            route(name="d", key=None, sensitive_keys=True, wait_timeout=30),
            route(name="e", key={"header": "K"}, delivery="async"),
            route(name="f", key={"header": "K"}, delivery={"mode": "async", "concurrency": 2}),
        ],
    }  # fmt: skip
    parse_config(data, "t.yaml", {"OLD_KEY": OLD_KEY, "PW": "x"})  # the gateway takes it
    assert problems(data) == []


@pytest.mark.parametrize(
    "data",
    [
        {"servr": {}, "routes": [route()]},
        {"routes": []},
        {"routes": [route(wait_timeout="30 seconds")]},
        {"routes": [route(max_request_body="10 megs")]},
        {"routes": [route(cache_statuses=["6xx"])]},
        {"routes": [route(concurrent="wiat")]},
        {"routes": [route(key={"header": "K"}, delivery="asynk")]},
        {"routes": [route(kye={"header": "X"})]},
        {"routes": [route(key={"header": "A", "kye": 1})]},
        {"routes": [route(key={"sources": [{"header": "A", "query": "q"}]})]},
        {"routes": [route(fingerprint=["method", "bdy"])]},
        {"routes": [{"name": "a", "match": {"methods": ["POST"]}, "upstream": "http://h"}]},
        {"server": {"listen": "8080"}, "routes": [route()]},
        {"store": {"url": "mysql://db"}, "routes": [route()]},
        {"store": {"sentinel": {"nodes": ["h:1"]}}, "routes": [route()]},
        {"defaults": {"upstream": "http://h"}, "routes": [route()]},
    ],
)
def test_the_schema_refuses_what_the_gateway_refuses(data: dict[str, Any]) -> None:
    assert problems(data)


def properties(schema: dict[str, Any], *path: str) -> set[str]:
    node = schema
    for step in path:
        node = node[step]
    return set(node["properties"])


def test_the_schema_names_every_setting() -> None:
    schema = config_schema()
    fields = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    assert properties(schema) == set(SECTIONS)
    assert properties(schema, "properties", "server") == fields(ServerConfig)
    assert properties(schema, "properties", "admin") == set(AdminConfig.yaml_names())
    assert properties(schema, "properties", "store") == set(StoreConfig.yaml_names())
    assert properties(schema, "properties", "defaults") == set(SETTINGS)
    assert properties(schema, "$defs", "route") == set(Route.yaml_names())
    assert properties(schema, "$defs", "reconcile") == fields(ReconcileConfig)
    assert properties(schema, "$defs", "tls") == fields(TLSConfig)
    mapping = next(s for s in schema["$defs"]["key"]["anyOf"] if s.get("type") == "object")
    assert set(mapping["properties"]) == {*SOURCE_KINDS, *KEY_OPTIONS, "sources"}
