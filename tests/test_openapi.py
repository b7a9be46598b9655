"""The operator API's OpenAPI 3.1 document (gateway/openapi.yaml, served at
/admin/openapi.json): it names every route and every refusal there is, and a
schemathesis run against a real gateway process, with an operator's token, a
viewer's and the shared one, finds no 5xx and no response the document does not
describe (status, content type, body, headers).

The run by hand, against a gateway of your own:

    schemathesis run http://127.0.0.1:9090/admin/openapi.json \\
      -H "Authorization: Bearer $GATEWAY_OPERATOR_TOKEN" --checks \\
      not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,response_headers_conformance
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from starlette.routing import Route

from gateway.admin.api import create_admin_app, openapi_document
from gateway.assembly import Gateway
from gateway.errors import PROBLEM_BASE, OperatorRefusal, StoreUnavailable
from tests.conftest import config_for, unique
from tests.support.servers import ROOT, Process, free_port, gateway_process, wait_for_port

OPERATOR = "oa-alice-token-0123456789ab"
VIEWER = "oa-vera-token-0123456789abc"
SHARED = "oa-shared-token-0123456789a"
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance,response_headers_conformance"
)


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found | {sub for child in found for sub in _subclasses(child)}


def test_the_document_names_every_admin_route_and_method() -> None:
    """One place: a route added to the admin app without its entry here, or an entry
    for a route that is gone, fails."""
    config = config_for("http://127.0.0.1:9", [{"name": "r", "match": {"path": "/x"}}])
    app = create_admin_app(Gateway(config, sweep=False))
    served = {
        (re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path), method.lower())
        for route in app.routes
        if isinstance(route, Route) and not route.path.startswith("/console")
        for method in (route.methods or ()) - {"HEAD"}
    }
    doc = openapi_document()
    described = {
        (path, method)
        for path, item in doc["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }
    assert described == served
    assert doc["openapi"] == "3.1.0"


def test_every_operator_refusal_is_a_problem_type_of_the_document() -> None:
    types = openapi_document()["components"]["schemas"]["Problem"]["properties"]["type"]
    refusals = {PROBLEM_BASE + cls.slug for cls in _subclasses(OperatorRefusal)}
    assert set(types["enum"]) == refusals | {PROBLEM_BASE + StoreUnavailable.slug}


def test_the_served_document_is_the_package_file() -> None:
    text = (ROOT / "gateway" / "openapi.yaml").read_text()
    assert openapi_document() == yaml.safe_load(text)
    assert "openapi.yaml" in (ROOT / "pyproject.toml").read_text()  # shipped as package data


@dataclass
class Running:
    process: Process
    admin: str
    keys: list[str]
    deliveries: list[str]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory, upstream: Process) -> Iterator[Running]:
    """A gateway with parked keys and a parked delivery for the run to reach."""
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {
            "listen": f"127.0.0.1:{admin_port}",
            "token": SHARED,
            "operators": [
                {"name": "alice", "role": "operator", "token_env": "OA_ALICE"},
                {"name": "vera", "role": "viewer", "token_env": "OA_VERA"},
            ],
        },
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "jobs",
                "match": {"methods": ["POST"], "path": "/jobs/x"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "upstream_timeout": "200ms",
            },
            {
                "name": "deliver",
                "match": {"methods": ["POST"], "path": "/jobs/deliver"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "delivery": "async",
                "retry": {"attempts": 1},
            },
        ],
    }
    path = tmp_path_factory.mktemp("openapi") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port, env={"OA_ALICE": OPERATOR, "OA_VERA": VIEWER}).start()
    try:
        wait_for_port(admin_port)
        keys, deliveries = [], []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(4):
                key = unique("oa")
                answer = client.post("/jobs/x", json={"job_key": key}, params={"sleep": "0.4"})
                assert answer.status_code == 504
                keys.append(key)
            key = unique("oad")
            answer = client.post("/jobs/deliver", json={"job_key": key}, params={"fail_first": "1"})
            assert answer.status_code == 202
            deliveries.append(key)
        yield Running(process, f"http://127.0.0.1:{admin_port}", keys, deliveries)
    finally:
        process.stop()


def schemathesis_config(running: Running, directory: Path) -> Path:
    """Known routes and keys, most of the time, so the run reaches records and not only
    404s; the rest of the time, what schemathesis makes up."""
    keys = [*running.keys, *running.deliveries]
    text = (
        'headers = { Authorization = "Bearer ${OA_TOKEN}" }\n'
        f"[dictionaries.routes]\nvalues = {json.dumps(['jobs', 'deliver'])}\n"
        f"[dictionaries.keys]\nvalues = {json.dumps(keys)}\n"
        "[parameters]\n"
        '"path.route" = { dictionary = "routes", probability = 0.9 }\n'
        '"path.key" = { dictionary = "keys", probability = 0.8 }\n'
    )
    path = directory / "schemathesis.toml"
    path.write_text(text)
    return path


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("token", [OPERATOR, VIEWER, SHARED], ids=["operator", "viewer", "shared"])
def test_schemathesis_finds_no_5xx_and_nothing_outside_the_document(
    running: Running, tmp_path: Path, token: str
) -> None:
    config = schemathesis_config(running, tmp_path)
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "--config-file", str(config), "--no-color",
        "run", f"{running.admin}/admin/openapi.json",
        "--checks", CHECKS,
        "--max-examples", "25", "--seed", "15",
        "--generation-database", "none",
        "--request-timeout", "10",
        "--workers", "1",
    ]  # fmt: skip
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"OA_TOKEN": token, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=280,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    cases = re.search(r"Test cases:\s+(\d+) generated, (\d+) passed\n", out)
    assert cases and cases.group(1) == cases.group(2) and int(cases.group(1)) > 100, out[-3000:]
    tested = re.search(r"Tested: (\d+)", out)
    assert tested and int(tested.group(1)) == 16, out[-3000:]
    assert token not in running.process.output()
