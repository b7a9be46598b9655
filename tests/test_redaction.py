"""gateway/operators/redaction.py: what an operator sees of a delivery's stored request, and of
a stored response.

A delivery keeps the caller's request to send it again, credentials and all: an
upstream that authenticates by `X-Api-Key`, `X-Auth-Token`, a signature header or an
`?api_key=` in the query needs them, so `delivery.drop_headers` cannot drop them.
Every surface that shows the request (the console's key page, `GET
/admin/keys/{route}/{key}`, `keys show`) shows a header's value only for
content-type, content-length, user-agent, the route's key header and
`admin.show_headers`, and a query parameter's only for the route's key parameter and
`admin.show_query`; every other value is hidden, with its length, for every role,
with and without `store.encryption_key`. A stored response's headers (the console's
key page) follow the same rule: an upstream may answer with a token in a header.

The surfaces are real: a gateway process, a delivery parked the production way (its
one attempt answered 503), the console signed into with httpx, the CLI as a process;
each answer is searched as raw bytes.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import httpx
import pytest
import yaml

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.records import StoredRequest
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.servers import ROOT, Process, free_port, gateway_process, wait_for_port

ROLES = {"alice": "operator", "vera": "viewer"}
TOKENS = {name: f"red-{name}-{secrets.token_urlsafe(18)}" for name in ROLES}
SHARED = "red-shared-" + secrets.token_urlsafe(18)
SECRET = secrets.token_urlsafe(32)
ROUTE = "deliver"
#: What the caller's request carries that no operator may read.
HIDDEN = {
    "x-api-key": "sk_live_" + secrets.token_hex(16),
    "x-auth-token": "tok_" + secrets.token_urlsafe(20),
    "x-signature": f"t=1712345678,v1={secrets.token_hex(32)}",
    "authorization": "Bearer " + secrets.token_urlsafe(24),
    "cookie": "session=" + secrets.token_urlsafe(16),
    "x-empty-secret": "",
}
#: What an operator sees as it is: the default list, the key header, admin.show_headers.
SHOWN = {"user-agent": "billing-cron/4.2", "x-trace-id": "trace-0042"}
#: The request's query, in order: `status` and `page` are in admin.show_query (the test
#: upstream answers `status`), the rest are secrets, one of them written encoded.
QUERY = {
    "status": "503",
    "api_key": "sk_live_q" + secrets.token_hex(16),
    "page": "2",
    "signature": "t=1712345678,v1=" + secrets.token_hex(24),
    "pass": "p@ss w/rd+" + secrets.token_urlsafe(12),
    "empty": "",
}
SHOWN_QUERY = ("status", "page")
HIDDEN_QUERY = {name: value for name, value in QUERY.items() if name not in SHOWN_QUERY}


@dataclass
class Gateway:
    process: Process
    admin: str
    proxy: str


def start(tmp: Path, upstream: Process, encrypted: bool) -> Gateway:
    port, admin_port = free_port(), free_port()
    store: dict[str, Any] = {"url": "memory://"}
    if encrypted:
        store["encryption_key"] = base64.b64encode(os.urandom(32)).decode()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {
            "listen": f"127.0.0.1:{admin_port}",
            "token": SHARED,
            "operators": [
                {"name": name, "role": role, "token_env": f"RED_{name.upper()}_TOKEN"}
                for name, role in ROLES.items()
            ],
            "session_secret_env": "RED_SECRET",
            "show_headers": ["X-Trace-Id"],
            "show_query": list(SHOWN_QUERY),
        },
        "store": store,
        "routes": [
            {
                "name": ROUTE,
                "match": {"methods": ["POST"], "path": "/jobs/deliver"},
                "upstream": upstream.url,
                "key": {"header": "X-Job-Key"},
                "delivery": "async",
                "retry": {"attempts": 1},
            }
        ],
    }
    path = tmp / f"redaction-{'sealed' if encrypted else 'plain'}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {f"RED_{name.upper()}_TOKEN": token for name, token in TOKENS.items()}
    process = gateway_process(path, port, env=env | {"RED_SECRET": SECRET}).start()
    wait_for_port(admin_port)
    return Gateway(process, f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module", params=["plain", "encrypted"])
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, upstream: Process
) -> Iterator[Gateway]:
    running = start(tmp_path_factory.mktemp("redaction"), upstream, request.param == "encrypted")
    try:
        yield running
    finally:
        running.process.stop()


def parked_delivery(gateway: Gateway) -> str:
    """A delivery whose one attempt got 503, carrying every header above."""
    key = unique("red")
    headers = {**HIDDEN, **SHOWN, "X-Job-Key": key, "Content-Type": "application/json"}
    with httpx.Client(base_url=gateway.proxy, timeout=10) as client:
        answer = client.post("/jobs/deliver", params=QUERY, content=b'{"n": 1}', headers=headers)
        assert answer.status_code == 202, answer.text
        deadline = time.monotonic() + 10
        while client.get(answer.headers["location"]).json()["state"] != "parked":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    return key


def assert_no_secret(raw: bytes, where: str, ledger: Ledger) -> None:
    ledger.record(
        "redaction",
        where,
        requests=2,  # the delivery, the surface
        bad_inputs=len(HIDDEN),
        detail="secret headers of a stored request, searched for in the bytes shown",
    )
    for name, value in (HIDDEN | HIDDEN_QUERY).items():
        # The value, written plain and encoded, and its distinctive tail: no part of it
        # is shown.
        for part in (value, quote(value), quote_plus(value), value[-12:]) if value else ():
            assert part.encode() not in raw, (where, name)


def expected_shown(key: str) -> dict[str, str]:
    return {**SHOWN, "x-job-key": key, "content-type": "application/json"}


def expected_query() -> list[dict[str, Any]]:
    """The API's `request.query`: every parameter in order, a value for admin.show_query's."""
    return [
        {
            "name": name,
            "value": value if name in SHOWN_QUERY else None,
            "hidden": name not in SHOWN_QUERY,
            "length": len(value),
        }
        for name, value in QUERY.items()
    ]


def query_line() -> str:
    """How `keys show` writes the request's query."""
    return "&".join(
        f"{name}={value}" if name in SHOWN_QUERY else f"{name}=(hidden, {len(value)} characters)"
        for name, value in QUERY.items()
    )


@pytest.mark.process
@pytest.mark.parametrize("who", ["alice", "vera", "shared"])
def test_the_api_shows_harmless_values_and_the_length_of_the_rest(
    gateway: Gateway, who: str, ledger: Ledger
) -> None:
    key = parked_delivery(gateway)
    token = SHARED if who == "shared" else TOKENS[who]
    answer = httpx.get(
        f"{gateway.admin}/admin/keys/{ROUTE}/{key}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    assert_no_secret(answer.content, f"api as {who}", ledger)
    request = answer.json()["request"]
    assert (request["method"], request["path"]) == ("POST", "/jobs/deliver")
    assert request["query"] == expected_query() and "target" not in request
    headers = {h["name"]: h for h in request["headers"]}
    for name, value in HIDDEN.items():
        assert headers[name] == {"name": name, "value": None, "hidden": True, "length": len(value)}
    for name, value in expected_shown(key).items():
        assert headers[name] == {
            "name": name,
            "value": value,
            "hidden": False,
            "length": len(value),
        }


def console_page(gateway: Gateway, who: str, key: str) -> httpx.Response:
    headers = {"Origin": gateway.admin}
    with httpx.Client(base_url=gateway.admin, headers=headers, timeout=10) as client:
        signed = client.post("/console/signin", data={"token": TOKENS[who]})
        assert signed.status_code == 303, signed.text
        return client.get("/console/key", params={"route": ROUTE, "key": key})


@pytest.mark.process
@pytest.mark.parametrize("who", ["alice", "vera"])
def test_the_console_shows_harmless_values_and_the_length_of_the_rest(
    gateway: Gateway, who: str, ledger: Ledger
) -> None:
    key = parked_delivery(gateway)
    page = console_page(gateway, who, key)
    assert page.status_code == 200, page.text
    assert_no_secret(page.content, f"console as {who}", ledger)
    rows = dict(
        re.findall(
            r'<tr><td class="mono">([^<]+)</td><td class="mono[^"]*">([^<]*)</td></tr>', page.text
        )
    )
    for name, value in HIDDEN.items():
        assert rows[name] == f"hidden, {len(value)} characters", (name, rows)
    for name, value in expected_shown(key).items():
        assert rows[name] == value, (name, rows)
    path = re.search(r'<dt>Path</dt><dd class="mono">([^<]*)</dd>', page.text)
    assert path and path.group(1) == "/jobs/deliver", page.text
    query = re.findall(
        r'<tr><td class="mono">([^<]+)</td><td class="mono( hidden)?">([^<]*)</td></tr>',
        page.text[page.text.index('id="query"') :].split("</table>")[0],
    )
    assert [(n, v) for n, _, v in query] == [
        (name, value if name in SHOWN_QUERY else f"hidden, {len(value)} characters")
        for name, value in QUERY.items()
    ]


@pytest.mark.process
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_keys_show_prints_harmless_values_and_the_length_of_the_rest(
    gateway: Gateway, as_json: bool, ledger: Ledger
) -> None:
    key = parked_delivery(gateway)
    env = {
        **os.environ,
        "GATEWAY_OPERATOR_TOKEN": TOKENS["vera"],
        "GATEWAY_ADMIN_URL": gateway.admin,
    }
    env.pop("GATEWAY_ADMIN_TOKEN", None)
    argv = ["keys", "show", ROUTE, key] + (["--json"] if as_json else [])
    result = subprocess.run(
        [sys.executable, "-m", "gateway", *argv], capture_output=True, cwd=ROOT, env=env, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert_no_secret(result.stdout + result.stderr, "keys show", ledger)
    out = result.stdout.decode()
    if as_json:
        request = json.loads(out)["request"]
        shown = {h["name"]: h["length"] for h in request["headers"]}
        assert all(shown[name] == len(value) for name, value in HIDDEN.items()), shown
        assert request["query"] == expected_query()
        return
    assert f"request:  POST /jobs/deliver?{query_line()}\n" in out, out
    for name, value in HIDDEN.items():
        assert f"  {name}: (hidden, {len(value)} characters)\n" in out, out
    for name, value in expected_shown(key).items():
        assert f"  {name}: {value}\n" in out, out


#: What the upstream answers with, beside its own headers: a token meant for the caller.
ANSWERED = {"x-access-token": "at_" + secrets.token_urlsafe(24)}


@pytest.mark.process
def test_a_stored_response_shows_harmless_header_values_and_the_length_of_the_rest(
    gateway: Gateway, ledger: Ledger
) -> None:
    """A delivery that completed: its stored response (replayed to the caller's
    repeats) is on the key page with the same rule as the request's headers; the API
    and `keys show` give its status alone."""
    key = unique("red")
    answer_headers = [f"{name}:{value}" for name, value in ANSWERED.items()]
    with httpx.Client(base_url=gateway.proxy, timeout=10) as client:
        accepted = client.post(
            "/jobs/deliver",
            params={"answer_header": answer_headers},
            content=b"{}",
            headers={"X-Job-Key": key, "X-Trace-Id": "trace-7"},
        )
        assert accepted.status_code == 202, accepted.text
        deadline = time.monotonic() + 10
        while client.get(accepted.headers["location"]).json()["state"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    page = console_page(gateway, "vera", key)
    api = httpx.get(
        f"{gateway.admin}/admin/keys/{ROUTE}/{key}",
        headers={"Authorization": f"Bearer {TOKENS['vera']}"},
        timeout=10,
    )
    ledger.record(
        "redaction",
        "a stored response's headers",
        requests=3,
        bad_inputs=len(ANSWERED),
        detail="an upstream's token in a response header, searched for in the bytes shown",
    )
    for raw in (page.content, api.content):
        for value in ANSWERED.values():
            assert value.encode() not in raw and value[-12:].encode() not in raw
    section = page.text[page.text.index("<h2>Stored response</h2>") :]
    rows = dict(
        re.findall(
            r'<tr><td class="mono">([^<]+)</td><td class="mono[^"]*">([^<]*)</td></tr>', section
        )
    )
    for name, value in ANSWERED.items():
        assert rows[name] == f"hidden, {len(value)} characters", rows
    assert rows["content-type"] == "application/json", rows
    assert rows["x-run"] == "hidden, 1 characters", rows  # not on the list: its length


# -- the rule alone, and its setting -----------------------------------------------------


ROUTES = [
    {
        "name": "r",
        "match": {"path": "/x"},
        "upstream": "http://127.0.0.1:9",
        "key": {"sources": [{"header": "X-Job-Key"}, {"body": "id"}]},
        "delivery": "async",
    }
]


def test_one_function_draws_every_header() -> None:
    from gateway.operators.redaction import shown_names, shown_request

    config = parse_config({"routes": ROUTES, "admin": {"show_headers": ["X-Tenant"]}}, "t")
    names = shown_names(config.routes[0], config.admin)
    assert names == {"content-type", "content-length", "user-agent", "x-job-key", "x-tenant"}
    stored = StoredRequest(
        "POST",
        "/x",
        (("content-type", "text/plain"), ("x-api-key", "sk_live_abc"), ("x-tenant", "t1"),
         ("x-empty", "")),
        b"",
    )  # fmt: skip
    shown = shown_request(stored, names)
    assert [(h.name, h.value, h.length) for h in shown.headers] == [
        ("content-type", "text/plain", 10),
        ("x-api-key", None, 11),
        ("x-tenant", "t1", 2),
        ("x-empty", None, 0),
    ]
    # Credentials never, not even as a route's key header.
    keyed = parse_config({"routes": [{**ROUTES[0], "key": {"header": "Authorization"}}]}, "t")
    assert "authorization" not in shown_names(keyed.routes[0], keyed.admin)
    # A route a reload removed: the default list alone.
    assert shown_names(None, config.admin) == {
        "content-type", "content-length", "user-agent", "x-tenant"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("given", "words"),
    [
        (["Authorization"], "authorization carries credentials and is always hidden"),
        (["cookie"], "cookie carries credentials and is always hidden"),
        (["Proxy-Authorization"], "is always hidden"),
        (["X Bad"], "is not a header name"),
    ],
)
def test_show_headers_never_shows_credentials(given: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"routes": ROUTES, "admin": {"show_headers": given}}, "t")
    assert "admin.show_headers" in str(refused.value) and words in str(refused.value)


def test_one_function_draws_every_query_parameter() -> None:
    """A query is read as the key's templates read it (split on `&`, then at the first
    `=`, `+` a space, percent-decoded; bytes that are no UTF-8 drawn as U+FFFD), every
    parameter kept in order, repeats included; a value is shown for the route's key
    parameter and admin.show_query, by name as written (case counts)."""
    from gateway.operators.redaction import query_line, shown_parameters, shown_request

    route = {**ROUTES[0], "key": {"sources": [{"query": "job"}, {"header": "X-Job-Key"}]}}
    config = parse_config({"routes": [route], "admin": {"show_query": ["page", "a b"]}}, "t")
    parameters = shown_parameters(config.routes[0], config.admin)
    assert parameters == {"job", "page", "a b"}
    assert shown_parameters(None, config.admin) == {"page", "a b"}
    target = "/x/%2Fy?api_key=sk%5Flive&&job=j-1&page=2&Page=3&flag&a+b=c+d&sig=%FF%3D&api_key="
    shown = shown_request(StoredRequest("POST", target, (), b""), frozenset(), parameters)
    assert shown.path == "/x/%2Fy"
    assert [(p.name, p.value, p.length) for p in shown.query] == [
        ("api_key", None, 7),
        ("job", "j-1", 3),
        ("page", "2", 1),
        ("Page", None, 1),
        ("flag", None, 0),
        ("a b", "c d", 3),
        ("sig", None, 2),
        ("api_key", None, 0),
    ]
    assert query_line(shown.query) == (
        "api_key=(hidden, 7 characters)&job=j-1&page=2&Page=(hidden, 1 characters)&"
        "flag=(hidden, 0 characters)&a b=c d&sig=(hidden, 2 characters)&"
        "api_key=(hidden, 0 characters)"
    )
    assert shown_request(StoredRequest("GET", "/x", (), b""), frozenset()).query == ()


def test_one_function_draws_a_stored_response() -> None:
    from gateway.operators.redaction import shown_response

    config = parse_config({"routes": ROUTES, "admin": {"show_headers": ["X-Receipt"]}}, "t")
    headers = (
        ("content-type", "application/json"), ("x-access-token", "at_123"),
        ("Location", "https://bucket/o?X-Amz-Signature=abc"), ("x-receipt", "r-1"),
        ("ETag", '"v1"'),
    )  # fmt: skip
    assert [(h.name, h.value, h.length) for h in shown_response(headers, config.admin)] == [
        ("content-type", "application/json", 16),
        ("x-access-token", None, 6),
        ("Location", None, 36),
        ("x-receipt", "r-1", 3),
        ("ETag", '"v1"', 4),
    ]


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ([""], "is not a query parameter's name"),
        (["a\nb"], "is not a query parameter's name"),
        ([7], "is not a query parameter's name"),
        ("page", "expected a list"),
    ],
)
def test_show_query_takes_names_as_they_read(given: object, words: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"routes": ROUTES, "admin": {"show_query": given}}, "t")
    assert "admin.show_query" in str(refused.value) and words in str(refused.value)
