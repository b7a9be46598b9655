"""A caller's value never changes a URL's structure: `reconcile.url`'s placeholders are
filled by `gateway.config.templates.fill_url`, each value encoded for its place, and a
value that would still move the request (a dot-segment in any spelling, a separator,
an empty segment) is refused, so its check is not sent and counts as inconclusive.

The rule alone (examples and Hypothesis), the config's refusal and check-config's
warning, and an in-process gateway whose checks of such keys never leave it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.assembly import Gateway
from gateway.cli import main
from gateway.config.summary import config_warnings
from gateway.config.templates import UnplaceableValue, fill_url, url_template
from gateway.errors import ConfigError
from gateway.keying import record_digest
from gateway.records import KeyRef, State
from gateway.routes import remove_dot_segments
from gateway.store.base import Store
from tests.conftest import GatewayClient, config_for, unique
from tests.support.servers import Process

#: Where a value may go: whole segments, parts of one, next to a literal dot, two in one
#: segment, `;params`, the query.
TEMPLATES = [
    "http://jobs.test:8080/jobs/{key}/status",
    "http://jobs.test/jobs/{key}",
    "http://jobs.test/v1/{route}/{key}/runs/{run_id}",
    "https://jobs.test/jobs/x-{key}.json?verbose=1",
    "http://jobs.test/jobs/.{key}/status",
    "http://jobs.test/jobs/{key}{run_id}/status",
    "http://jobs.test/a;b/{key};v=1/status",
    "http://jobs.test/status?key={key}&route={route}",
    "http://jobs.test?key={key}",
    "http://jobs.test/jobs/{key}/status?again={key}",
    "/admin/keys/{route}/{key}",  # a path alone: the keys CLI's
]

#: Spellings of the dot-segments and separators, and what else a parser splits on.
HOSTILE = [
    ".", "..", "%2E", "%2e", "%2E%2E", "%2e%2E", ".%2E", "%2E.", "%252E%252e", "%25252E",
    "..;", ".;x", "..;jsessionid=1", "%2E%2E%3B", "", ";", ";x", "/", "\\", "%2F", "%2f",
    "%5C", "%5c", "%252F", "a/../b", "../..", "..\\..", "?", "?x=1", "#", "#f", "@evil",
    "user@host", ":8080", "//evil.test", "%", "%%", "%zz", " ", "\u2024\u2024", "\uff0e\uff0e",
]  # fmt: skip

VALUES = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(),
    st.text(alphabet=".%2eEfF5cC/\\;?#@: "),
    st.lists(st.sampled_from([".", "%2E", "%2e", "%25", "/", "%2F", ";", "a"])).map("".join),
)


def decodings(text: str) -> list[str]:
    """What a server may make of a segment: decoded once, twice, ... until it stays."""
    found = [text]
    while unquote(text) != text:
        text = unquote(text)
        found.append(text)
    return found


def shape(template: str) -> Any:
    return urlsplit(fill_url(template, {"key": "x", "route": "x", "run_id": "x"}))


@settings(max_examples=600)
@given(st.sampled_from(TEMPLATES), VALUES, VALUES)
@example("http://jobs.test/jobs/{key}/status", "..", "0")
@example("http://jobs.test/jobs/.{key}/status", ".", "0")
@example("http://jobs.test/jobs/{key}{run_id}/status", ".", ".")
@example("http://jobs.test/jobs/{key}{run_id}/status", "%2e", "%2E")
@example("http://jobs.test/a;b/{key};v=1/status", ".", "0")
def test_no_value_changes_where_the_url_goes(template: str, key: str, run_id: str) -> None:
    values = {"key": key, "route": "jobs", "run_id": run_id}
    try:
        url = fill_url(template, values)
    except UnplaceableValue as exc:
        assert exc.reason in ("separator", "dot_segment", "empty_segment")
        assert any(s.place == "path" and s.name == exc.name for s in url_template(template).slots)
        return
    want, got = shape(template), urlsplit(url)
    assert (got.scheme, got.netloc, got.fragment) == (want.scheme, want.netloc, "")
    segments = got.path.split("/")
    assert len(segments) == len(want.path.split("/"))
    # RFC 3986's normalisation (6.2.2) leaves it as it is ...
    assert remove_dot_segments(got.path) == got.path
    # ... and so does a server that decodes the path first, however often it decodes.
    for segment in segments[1:]:
        for text in decodings(segment):
            assert "/" not in text and "\\" not in text, (url, segment)
            assert text.split(";", 1)[0] not in ("", ".", ".."), (url, segment)
    assert len(parse_qsl(got.query, keep_blank_values=True)) == len(
        parse_qsl(want.query, keep_blank_values=True)
    )
    for name, value in parse_qsl(got.query, keep_blank_values=True):
        if name in values:
            assert value == values[name]  # the query carries the value itself


@given(VALUES)
def test_the_query_takes_any_value(key: str) -> None:
    url = fill_url("http://jobs.test/status?key={key}&route={route}", {"key": key, "route": "r"})
    assert dict(parse_qsl(urlsplit(url).query, keep_blank_values=True)) == {
        "key": key,
        "route": "r",
    }


@given(st.from_regex(r"[A-Za-z0-9_~-][A-Za-z0-9_.~-]{0,40}", fullmatch=True))
def test_plain_keys_go_anywhere(key: str) -> None:
    for template in TEMPLATES:
        url = fill_url(template, {"key": key, "route": "jobs", "run_id": "0a1b"})
        assert key in url


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("..", "dot_segment"),
        (".", "dot_segment"),
        ("%2E", "dot_segment"),
        ("%2e%2E", "dot_segment"),
        (".%2E", "dot_segment"),
        ("%252E%252E", "dot_segment"),
        ("..;", "dot_segment"),
        ("..;jsessionid=x", "dot_segment"),
        ("", "empty_segment"),
        (";x", "empty_segment"),
        ("a/b", "separator"),
        ("..%2F..", "separator"),
        ("a\\b", "separator"),
        ("%5C", "separator"),
        ("%252F", "separator"),
    ],
)
def test_a_value_that_would_move_the_check_is_refused(key: str, reason: str) -> None:
    with pytest.raises(UnplaceableValue) as refused:
        fill_url("http://jobs.test/jobs/{key}/status", {"key": key})
    assert refused.value.reason == reason
    assert refused.value.name == "key"
    # In the query the same value is placed, and reads back as it is.
    url = fill_url("http://jobs.test/jobs/status?key={key}", {"key": key})
    assert dict(parse_qsl(urlsplit(url).query, keep_blank_values=True)) == {"key": key}


def test_what_the_other_characters_become() -> None:
    url = fill_url("http://jobs.test/jobs/{key}/status", {"key": "a?b#c;d@e:f é%"})
    assert url == "http://jobs.test/jobs/a%3Fb%23c%3Bd%40e%3Af%20%C3%A9%25/status"


# -- the config ----------------------------------------------------------------------


def route_with(url: str) -> dict[str, Any]:
    return {
        "name": "jobs",
        "match": {"path": "/jobs/run"},
        "key": {"header": "Idempotency-Key"},
        "on_unknown_outcome": "reconcile",
        "reconcile": {"url": url},
    }


@pytest.mark.parametrize(
    "url",
    ["http://{key}.jobs.test/status", "http://jobs.test:{run_id}/status", "http://{route}/s"],
)
def test_a_placeholder_in_the_host_is_refused(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_for("http://127.0.0.1:1", [route_with(url)])
    assert "scheme, host or port" in str(refused.value)
    assert "?key={key}" in str(refused.value)


@pytest.mark.parametrize(
    ("url", "warned"),
    [
        ("http://jobs.test/jobs/{key}/status", "stands alone as a path segment"),
        ("http://jobs.test/jobs/{key}", "stands alone as a path segment"),
        ("http://jobs.test/jobs/key-{key}.json", "is in the path"),
        ("http://jobs.test/jobs/status?key={key}", None),
        ("http://jobs.test/{route}/{run_id}/status?key={key}", None),
        ("http://jobs.test/{route}/status", None),
    ],
)
def test_check_config_warns_of_a_key_in_the_path(url: str, warned: str | None) -> None:
    config = config_for("http://127.0.0.1:1", [route_with(url)])
    warnings = config_warnings(config)
    if warned is None:
        assert warnings == []
        return
    assert [w.path for w in warnings] == ["routes[0].reconcile.url"]
    assert warned in warnings[0].message
    assert "the query is the safe place" in warnings[0].message


def test_check_config_prints_the_warning_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "routes:\n"
        "  - name: jobs\n"
        "    match: {path: /jobs/run}\n"
        "    upstream: http://127.0.0.1:5000\n"
        "    key: {header: Idempotency-Key}\n"
        "    on_unknown_outcome: reconcile\n"
        "    reconcile:\n"
        '      url: "http://127.0.0.1:5000/jobs/{key}/status"\n'
    )
    assert main(["check-config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"{path}:8:12: warning: routes[0].reconcile.url: {{key}} stands alone" in err
    assert "the query is the safe place" in err
    assert out.rstrip().endswith("OK, 1 route(s), 1 warning(s)")


# -- a gateway's checks ----------------------------------------------------------------


@pytest.fixture
async def gateway_at(
    make_store: Callable[[], Store], job_service: Process
) -> AsyncIterator[Callable[..., Any]]:
    opened: list[GatewayClient] = []

    async def build(routes: list[dict[str, Any]]) -> GatewayClient:
        gateway = Gateway(config_for(job_service.url, routes), store=make_store(), sweep=True)
        await gateway.start()
        opened.append(GatewayClient(gateway))
        return opened[-1]

    yield build
    for client in opened:
        await client.http.aclose()
        await client.gateway.close()


@pytest.mark.anyio
async def test_a_check_that_cannot_be_placed_is_not_sent_and_parks(
    gateway_at: Callable[..., Any], job_service: Process, caplog: pytest.LogCaptureFixture
) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(job_service.url + "/_reset")
    route = {
        **route_with(job_service.url + "/jobs/{key}/status"),
        "match": {"methods": ["POST"], "path": "/jobs/run"},
        "fingerprint": ["method", "path", "body"],
        "upstream_timeout": "200ms",
        "reconcile": {
            "url": job_service.url + "/jobs/{key}/status",
            "every": "200ms",
            "park_after": "1s",
        },
    }
    gw = await gateway_at([route])
    tag = unique()
    keys = {"..": "dot_segment", f"{tag}/..": "separator", "%2e%2E": "dot_segment"}
    for key in keys:
        sent = {"headers": {"Idempotency-Key": key}, "json": {"job_key": key + tag}}
        assert (await gw.post("/jobs/run", params={"sleep": "0.4"}, **sent)).status_code == 504
    await asyncio.sleep(0.5)
    for key in keys:
        again = await gw.post(
            "/jobs/run", headers={"Idempotency-Key": key}, json={"job_key": key + tag}
        )
        assert again.status_code == 409, again.text
    store = gw.gateway.store
    deadline = time.monotonic() + 10
    for key in keys:
        ref = KeyRef(record_digest("jobs", "", key), "jobs", key)
        while (record := await store.get(ref)) is None or record.state is not State.PARKED:
            assert time.monotonic() < deadline, record
            await asyncio.sleep(0.05)
        assert "check not sent" in record.reconcile["error"]
    async with httpx.AsyncClient() as client:
        log = (await client.get(job_service.url + "/_log")).json()
    assert [r for r in log["requests"] if r["of"] != "run"] == [], "a check went out"
    registry = gw.gateway.metrics.registry
    for reason in set(keys.values()):
        sample = registry.get_sample_value(
            "idempotency_gateway_reconcile_unsent_total", {"route": "jobs", "reason": reason}
        )
        assert sample is not None and sample >= 1
    assert "check not sent" in caplog.text
