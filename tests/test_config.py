"""Config parsing: the YAML shape, value parsers, and the errors users see."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from gateway.config import (
    DEFAULT_CACHE_STATUSES,
    REQUEST_PARTS,
    Config,
    KeySource,
    Period,
    describe,
    load_config,
    mask_url,
    parse_config,
    parse_duration,
    parse_period,
    parse_size,
)
from gateway.config.issues import Issues
from gateway.config.loading import interpolate
from gateway.config.templates import fill_url
from gateway.config.units import MAX_DURATION, format_rate
from gateway.errors import ConfigError
from gateway.records import is_success
from tests.support.growth import assert_linear

EXAMPLE = """\
server: {listen: "127.0.0.1:8080", shutdown_grace: 30s, max_header_bytes: 16KiB}
admin:  {listen: "127.0.0.1:9090", token: "${GATEWAY_ADMIN_TOKEN}"}
store:  {url: "memory://", prefix: "idem:", socket_timeout: 2s, connect_timeout: 2s}
defaults:
  upstream_timeout: 30s
  response_ttl: 24h
routes:
  - name: send-reminder
    match: {methods: [POST], path: /jobs/send-reminder}
    upstream: http://127.0.0.1:5000
    key: {body: job_key}
  - name: daily-report
    match: {methods: [POST], path: /jobs/daily-report}
    upstream: http://127.0.0.1:5000
    key: {template: "daily-report:{period}", period: 1d, timezone: UTC}
"""


def route(**settings: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "job",
        "match": {"path": "/jobs/{name}"},
        "upstream": "http://127.0.0.1:5000",
    }
    base.update(settings)
    return base


def parse(data: object, env: dict[str, str] | None = None) -> Config:
    return parse_config(data, "test.yaml", env or {})


def errors(data: object, env: dict[str, str] | None = None) -> dict[str, str]:
    """Parses `data`, expecting a ConfigError; returns {path: messages joined by " | "}."""
    with pytest.raises(ConfigError) as caught:
        parse(data, env)
    assert caught.value.source == "test.yaml"
    found: dict[str, str] = {}
    for issue in caught.value.issues:
        found[issue.path] = (
            f"{found[issue.path]} | {issue.message}" if issue.path in found else issue.message
        )
    return found


def route_error(**settings: Any) -> dict[str, str]:
    return errors({"routes": [route(**settings)]})


# -- the example file ---------------------------------------------------------------


def test_example_file_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
    path = tmp_path / "gateway.yaml"
    path.write_text(EXAMPLE)
    config = load_config(path)
    assert config.source == str(path)
    assert config.server.listen == "127.0.0.1:8080"
    assert config.server.shutdown_grace == 30.0
    assert config.server.max_header_bytes == 16 * 1024
    assert config.admin.token == ""
    assert config.store.url == "memory://"
    assert config.store.socket_timeout == 2.0
    reminder, report = config.routes
    assert reminder.name == "send-reminder"
    assert reminder.methods == frozenset({"POST"})
    assert reminder.path == "/jobs/send-reminder"
    assert reminder.upstream == "http://127.0.0.1:5000"
    assert reminder.upstream_timeout == 30.0
    assert reminder.response_ttl == 86400.0
    assert reminder.key is not None
    (source,) = reminder.key.sources
    assert (source.kind, source.name) == ("body", "job_key")
    assert source.compiled.search({"job_key": "k1"}) == "k1"
    assert report.key is not None
    assert report.key.sources == (KeySource(kind="template", name="daily-report:{period}"),)
    assert report.key.period == Period(count=1, unit="d", timezone="UTC", text="1d")


def test_example_route_defaults() -> None:
    config = parse({"routes": [route()]})
    (only,) = config.routes
    assert only.methods is None
    assert only.key is None
    assert only.fingerprint == REQUEST_PARTS
    assert only.cache_statuses == DEFAULT_CACHE_STATUSES
    assert only.forward_key_header == "Idempotency-Key"


def test_no_store_url_is_sqlite_beside_the_config_file(tmp_path: Path) -> None:
    """Without store.url the file sits in the config file's directory, wherever the
    gateway starts from; Sentinel or Cluster given alone are not overridden."""
    folder = tmp_path / "etc gw"
    config = parse_config({"routes": [route()]}, str(folder / "gateway.yaml"), {})
    assert config.store.kind == "sqlite"
    assert config.store.url == f"sqlite://{folder}/idempotency-gateway.db"
    assert "(the default: no store.url)" in describe(config)
    prefixed = parse_config({"store": {"prefix": "a:"}, "routes": [route()]}, "rel/g.yaml", {})
    assert prefixed.store.url == f"sqlite://{Path.cwd()}/rel/idempotency-gateway.db"
    assert prefixed.store.prefix == "a:"
    sentinel = {"sentinel": {"master": "m", "nodes": ["127.0.0.1:26379"]}}
    assert parse({"store": sentinel, "routes": [route()]}).store.kind == "sentinel"
    named = parse({"store": {"url": "sqlite:///var/lib/gw.db"}, "routes": [route()]})
    assert "the default" not in describe(named)
    memory = describe(parse({"store": {"url": "memory://"}, "routes": [route()]}))
    assert "store: memory://; it keeps nothing" in memory


def test_the_default_cache_statuses_are_the_answers_that_mean_handled() -> None:
    """One rule (records.is_success): 2xx, 3xx and 4xx other than 408 and 429 mean the
    upstream handled the request; every other answer (5xx, 408, 429) may be tried again.
    The route's default cache_statuses is that rule, so a redirect is stored."""
    handled = {status for status in range(100, 600) if is_success(status)}
    assert handled == set(range(200, 500)) - {408, 429}
    assert DEFAULT_CACHE_STATUSES == handled
    assert {301, 302, 303, 304, 307, 308} <= DEFAULT_CACHE_STATUSES


def test_the_example_file_spells_out_the_default_cache_statuses() -> None:
    example = Path(__file__).resolve().parents[1] / "config.example.yaml"
    config = load_config(example)
    assert all(r.cache_statuses == DEFAULT_CACHE_STATUSES for r in config.routes)
    assert 'cache_statuses: ["2xx", "3xx", "4xx", "!408", "!429"]' in example.read_text()


def test_admin_token_from_environment() -> None:
    data = {"admin": {"token": "${GATEWAY_ADMIN_TOKEN}"}, "routes": [route()]}
    assert parse(data, {"GATEWAY_ADMIN_TOKEN": "s3cret"}).admin.token == "s3cret"


# -- value parsers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("15m", 900.0),
        ("24h", 86400.0),
        ("7d", 604800.0),
        ("1.5s", 1.5),
        ("45", 45.0),
        (45, 45.0),
        (0.25, 0.25),
    ],
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["30 seconds", "1y", "", "-5s", True, [1]])
def test_parse_duration_rejects(text: object) -> None:
    with pytest.raises(ValueError, match=r"write e\.g\. 500ms, 30s, 15m, 24h or 7d"):
        parse_duration(text)


WRITTEN = {
    "duration": (parse_duration, "5 s", 5.0),
    "size": (parse_size, "1 MiB", 1 << 20),
    "period": (lambda text: parse_period(text).count, "1 h", 1),
}


@pytest.mark.parametrize("unit", list(WRITTEN))
@pytest.mark.parametrize("space", ["\u3000", "\u00a0", "\u2003", "\u2028", "\t", "\x85"])
def test_a_unit_is_written_with_ascii_spaces_alone(unit: str, space: str) -> None:
    """`5 s`, ` 1 MiB `: the ASCII space. Any other (an ideographic or no-break space,
    a line separator, a tab), between the number and the unit or around them, is
    refused, naming it: str.strip() and `\\s` would have read `1\u3000s` as 1 s."""
    parse, written, value = WRITTEN[unit]
    assert parse(written) == value and parse(f" {written} ") == value
    for text in (written.replace(" ", space), space + written.replace(" ", ""), written + space):
        with pytest.raises(ValueError, match=f"U\\+{ord(space):04X}, a space other than the ASCII"):
            parse(text)


def test_whole_numbers_and_statuses_take_ascii_spaces_alone() -> None:
    assert (
        parse({"server": {"max_connections": " 20 "}, "routes": [route()]}).server.max_connections
        == 20
    )
    found = errors({"server": {"max_connections": "\u00a020"}, "routes": [route()]})
    assert "server.max_connections" in found, found
    ok = parse({"routes": [route(cache_statuses=[" 200 ", "! 201"])]}).routes[0]
    assert ok.cache_statuses == frozenset({200})
    found = errors({"routes": [route(cache_statuses=["\u2003200"])]})
    assert "routes[0].cache_statuses[0]" in found


def test_a_duration_is_at_most_100_years() -> None:
    """What every store keeps a record for (Redis's PEXPIRE, a script's Lua numbers,
    PostgreSQL's bigint milliseconds) and every timer waits: `response_ttl:
    999999999999d` passed, then every completion failed on Redis after it had half
    written the record."""
    assert parse_duration("36500d") == MAX_DURATION
    for text in ("36501d", "999999999999d", 1e300, str(MAX_DURATION + 1)):
        with pytest.raises(ValueError, match=r"too long: the longest duration is 36500d"):
            parse_duration(text)
    found = errors({"routes": [route(response_ttl="999999999999d")]})
    assert "too long" in found["routes[0].response_ttl"], found
    found = errors({"defaults": {"upstream_timeout": "99999999d"}, "routes": [route()]})
    assert "too long" in found["defaults.upstream_timeout"], found


def test_parse_duration_rejects_zero() -> None:
    with pytest.raises(ValueError, match="must be more than 0"):
        parse_duration("0s")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1MiB", 1 << 20),
        ("512KiB", 512 << 10),
        ("1GiB", 1 << 30),
        ("10MB", 10_000_000),
        ("100KB", 100_000),
        ("123B", 123),
        (4096, 4096),
        ("77", 77),
    ],
)
def test_parse_size(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["10 megs", "1.5MiB", "1TB", 0, True])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError, match=r"is not a size|more than 0"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "count", "unit"),
    [
        ("15m", 15, "m"),
        ("120m", 120, "m"),
        ("1h", 1, "h"),
        ("6h", 6, "h"),
        ("1d", 1, "d"),
        ("1w", 1, "w"),
        ("1mo", 1, "mo"),
    ],
)
def test_parse_period(text: str, count: int, unit: str) -> None:
    period = parse_period(text, "Europe/Berlin")
    assert (period.count, period.unit, period.timezone, period.text) == (
        count,
        unit,
        "Europe/Berlin",
        text,
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("7m", "minutes must divide"),
        ("90m", "minutes must divide an hour evenly"),
        ("300m", "or be whole hours that divide a day"),
        ("5h", "hours must divide a day"),
        ("2w", "only 1w"),
        ("3mo", "only 1mo"),
        ("0h", "at least 1"),
        ("daily", "is not a period"),
    ],
)
def test_parse_period_rejects(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_period(text, "UTC")


def test_parse_period_rejects_unknown_timezone() -> None:
    with pytest.raises(ValueError, match=r'"Europe/Berln" is not a known time zone.*Europe/Berlin'):
        parse_period("1d", "Europe/Berln")


# -- key forms ----------------------------------------------------------------------------


def key_of(key: object, **settings: Any) -> Any:
    return parse({"routes": [route(key=key, **settings)]}).routes[0].key


def test_key_header_query_hash_sources() -> None:
    assert key_of({"header": "Idempotency-Key"}).sources == (
        KeySource(kind="header", name="Idempotency-Key"),
    )
    assert key_of({"query": "run"}).sources == (KeySource(kind="query", name="run"),)
    spec = key_of({"hash": ["method", "path", "header.X-Tenant"]})
    assert spec.sources == (KeySource(kind="hash", parts=("method", "path", "header.X-Tenant")),)


def test_key_options() -> None:
    spec = key_of(
        {
            "header": "Idempotency-Key",
            "on_missing": "forward",
            "scope": ["header.Authorization", "query.tenant"],
            "max_length": 64,
        }
    )
    assert spec.on_missing == "forward"
    assert spec.scope == ("header.Authorization", "query.tenant")
    assert spec.max_length == 64
    assert spec.period is None


def test_key_period_alone_is_a_period_source() -> None:
    spec = key_of({"period": "1h", "timezone": "America/New_York"})
    assert spec.sources == (KeySource(kind="period"),)
    assert spec.period == Period(count=1, unit="h", timezone="America/New_York", text="1h")


def test_key_sources_list_first_present_wins() -> None:
    spec = key_of(
        {
            "sources": [{"header": "Idempotency-Key"}, {"template": "{path.name}:{period}"}],
            "period": "15m",
            "on_missing": "forward",
        }
    )
    assert [s.kind for s in spec.sources] == ["header", "template"]
    assert spec.period is not None and spec.period.count == 15
    assert spec.on_missing == "forward"


def test_key_bare_list_of_sources() -> None:
    spec = key_of([{"header": "Idempotency-Key"}, {"body": "data.id"}])
    assert [(s.kind, s.name) for s in spec.sources] == [
        ("header", "Idempotency-Key"),
        ("body", "data.id"),
    ]
    assert spec.sources[1].compiled.search({"data": {"id": 7}}) == 7


def test_key_template_placeholders_accepted() -> None:
    template = "{method}:{path}:{path.name}:{header.X-User}:{query.q}:{body.items[0].id}:{{x}}"
    spec = key_of({"template": template})
    assert spec.sources == (KeySource(kind="template", name=template),)


def test_key_null_is_pass_through_even_with_default_key() -> None:
    data = {"defaults": {"key": {"header": "Idempotency-Key"}}, "routes": [route(key=None)]}
    assert parse(data).routes[0].key is None


# -- route settings and defaults ----------------------------------------------------------


def test_all_route_settings() -> None:
    (parsed,) = parse(
        {
            "routes": [
                route(
                    match={"methods": ["post", "Put"], "path": "/jobs/{name}/{rest:path}"},
                    upstream="https://jobs.internal:8443/base/",
                    fingerprint=["method", "body", "header.X-Tenant"],
                    concurrent="reject",
                    wait_timeout="5s",
                    cache_statuses=["2xx", 404, "!204"],
                    max_request_body="512KiB",
                    max_stored_body=2048,
                    forward_key_header=False,
                    upstream_timeout="10s",
                    response_ttl="7d",
                    on_store_error="fail_open",
                    strip_headers=["Set-Cookie", "X-Secret"],
                    sensitive_keys=True,
                    on_unknown_outcome="release",
                )
            ]
        }
    ).routes
    assert parsed.methods == frozenset({"POST", "PUT"})
    assert parsed.path == "/jobs/{name}/{rest:path}"
    assert parsed.upstream == "https://jobs.internal:8443/base"
    assert parsed.fingerprint == ("method", "body", "header.X-Tenant")
    assert parsed.concurrent == "reject"
    assert parsed.wait_timeout == 5.0
    assert parsed.cache_statuses == frozenset(range(200, 300)) - {204} | {404}
    assert parsed.max_request_body == 512 * 1024
    assert parsed.max_stored_body == 2048
    assert parsed.forward_key_header is None
    assert (parsed.upstream_timeout, parsed.response_ttl) == (10.0, 7 * 86400.0)
    assert parsed.on_store_error == "fail_open"
    assert parsed.strip_headers == frozenset({"set-cookie", "x-secret"})
    assert parsed.sensitive_keys is True
    assert parsed.on_unknown_outcome == "release"


def test_fingerprint_none_and_exclusion_only_statuses() -> None:
    (parsed,) = parse({"routes": [route(fingerprint="none", cache_statuses=["!404"])]}).routes
    assert parsed.fingerprint == ()
    assert parsed.cache_statuses == DEFAULT_CACHE_STATUSES - {404}


def test_defaults_are_inherited_and_overridden() -> None:
    data = {
        "defaults": {
            "upstream_timeout": "20s",
            "concurrent": "reject",
            "key": {"header": "Idempotency-Key"},
        },
        "routes": [
            route(name="inherits"),
            route(name="overrides", concurrent="wait", upstream_timeout="1m", key={"query": "k"}),
        ],
    }
    inherits, overrides = parse(data).routes
    assert (inherits.upstream_timeout, inherits.concurrent) == (20.0, "reject")
    assert inherits.key is not None and inherits.key.sources[0].kind == "header"
    assert (overrides.upstream_timeout, overrides.concurrent) == (60.0, "wait")
    assert overrides.key is not None and overrides.key.sources[0].kind == "query"


def test_reconcile_block() -> None:
    (parsed,) = parse(
        {
            "routes": [
                route(
                    on_unknown_outcome="reconcile",
                    reconcile={
                        "url": "http://127.0.0.1:5000/status/{route}/{key}?run={run_id}",
                        "method": "post",
                        "done": [200, 201],
                        "not_done": ["404"],
                        "timeout": "3s",
                        "every": "1m",
                        "park_after": "2h",
                    },
                )
            ]
        }
    ).routes
    assert parsed.reconcile is not None
    assert parsed.reconcile.method == "POST"
    assert parsed.reconcile.done == frozenset({200, 201})
    assert parsed.reconcile.not_done == frozenset({404})
    assert (parsed.reconcile.timeout, parsed.reconcile.every) == (3.0, 60.0)
    assert parsed.reconcile.park_after == 7200.0


def test_reconcile_from_defaults_is_dropped_where_a_route_overrides_the_policy() -> None:
    data = {
        "defaults": {"on_unknown_outcome": "reconcile", "reconcile": {"url": "http://h/{key}"}},
        "routes": [route(name="a"), route(name="b", on_unknown_outcome="park")],
    }
    a, b = parse(data).routes
    assert a.reconcile is not None and a.reconcile.url == "http://h/{key}"
    assert b.reconcile is None


# -- env interpolation --------------------------------------------------------------------


def test_env_interpolation_forms() -> None:
    data = {
        "store": {"url": "redis://${REDIS_HOST}:${REDIS_PORT:-6379}/0", "prefix": "$${literal}"},
        "routes": [route(upstream="${UPSTREAM:-http://fallback:1}", wait_timeout="${WAIT:-9s}")],
    }
    config = parse(data, {"REDIS_HOST": "cache", "UPSTREAM": ""})
    assert config.store.url == "redis://cache:6379/0"
    assert config.store.prefix == "${literal}"
    assert config.routes[0].upstream == "http://fallback:1"
    assert config.routes[0].wait_timeout == 9.0


def test_env_unset_plain_reference_is_empty() -> None:
    data = {"admin": {"token": "${NOPE}"}, "routes": [route()]}
    assert parse(data, {}).admin.token == ""


def test_env_required_reference_names_the_path() -> None:
    found = errors(
        {"admin": {"token": "${ADMIN_TOKEN:?set it to the operator token}"}, "routes": [route()]},
        {"ADMIN_TOKEN": ""},
    )
    assert found["admin.token"] == (
        "environment variable ADMIN_TOKEN is not set: set it to the operator token"
    )


def test_env_malformed_reference() -> None:
    found = errors({"routes": [route(upstream="http://${1BAD}")]})
    assert "not a valid environment reference" in found["routes[0].upstream"]
    assert "$${ for a literal ${" in found["routes[0].upstream"]


def test_env_references_are_read_in_linear_time() -> None:
    """References that never close (`${${${...`): 8x the text, about 8x the time,
    and one problem said for it."""

    def expand(text: str) -> None:
        issues = Issues()
        interpolate(text, "x", issues, {})
        assert len(issues.items) == 1, issues.items

    assert_linear(expand, lambda n: "${" * n, 1000)
    assert (
        "not a valid environment reference"
        in errors({"routes": [route(upstream="http://${HOST")]})["routes[0].upstream"]
    )


def test_env_uses_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_TEST_UPSTREAM", "http://from-env:81")
    config = parse_config({"routes": [route(upstream="${GW_TEST_UPSTREAM}")]}, "x.yaml")
    assert config.routes[0].upstream == "http://from-env:81"


# -- file and YAML errors -----------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "nope.yaml")
    assert "file not found" in str(caught.value)
    assert str(tmp_path / "nope.yaml") in str(caught.value)


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("routes:\n  - name: a\n    match: {path: /x\n  upstream: [\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (issue,) = caught.value.issues
    assert issue.message.startswith("not valid YAML at line ")
    assert "column" in issue.message
    assert str(caught.value).startswith(f"{path}:{issue.line}:{issue.column}: not valid YAML")
    assert "Traceback" not in str(caught.value)


def test_yaml_brace_in_flow_mapping_hints_quoting(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("routes:\n  - match: {path: /jobs/{name}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (issue,) = caught.value.issues
    assert "line 2" in issue.message
    assert 'quote text holding { or }, e.g. path: "/jobs/{name}"' in issue.message


def test_yaml_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("routes:\n  - name: a\n    name: b\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "line 3" in caught.value.issues[0].message
    assert '"name" is given twice' in caught.value.issues[0].message


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "the file is empty" in str(caught.value)


# -- structure errors ---------------------------------------------------------------------


def test_unknown_settings_suggest_names() -> None:
    found = errors(
        {
            "servr": {},
            "store": {"urll": "memory://"},
            "routes": [route(kye={"header": "X"}, methods=["POST"]), route(name="b", zzz=1)],
        }
    )
    assert found["servr"] == 'unknown setting; did you mean "server"?'
    assert found["store.urll"] == 'unknown setting; did you mean "url"?'
    assert found["routes[0].kye"] == 'unknown setting; did you mean "key"?'
    assert "belongs under match:" in found["routes[0].methods"]
    assert found["routes[1].zzz"].startswith("unknown setting; valid settings here are ")
    assert "upstream_timeout" in found["routes[1].zzz"]


def test_wrong_types() -> None:
    found = errors({"server": ["127.0.0.1:8080"], "routes": [route(match=["/x"], key="X-Key")]})
    assert found["server"].startswith("expected a mapping (name: value), got a list")
    assert found["routes[0].match"].startswith("expected a mapping (name: value), got a list")
    assert "expected a mapping or a list" in found["routes[0].key"]
    assert "key: {header: Idempotency-Key}" in found["routes[0].key"]


def test_missing_required_fields() -> None:
    found = errors({"routes": [{"match": {"methods": ["POST"]}}]})
    assert "every route needs a name" in found["routes[0].name"]
    assert found["routes[0].match.path"] == "missing; write e.g. path: /jobs/send-reminder"
    assert "every route needs an upstream" in found["routes[0].upstream"]


def test_routes_required() -> None:
    assert "at least one route is required" in errors({"server": {}})["routes"]
    assert "at least one route is required" in errors({"routes": []})["routes"]


def test_duplicate_route_names() -> None:
    found = errors({"routes": [route(), route()]})
    assert found["routes[1].name"] == (
        'duplicate route name "job" (also routes[0]); give each route its own name'
    )


def test_bad_route_name_path_and_upstream() -> None:
    found = errors(
        {
            "routes": [
                route(name="-bad name"),
                route(name="b", match={"path": "jobs/x"}),
                route(name="c", match={"path": "/a/{1x}"}),
                route(name="d", match={"path": "/a/{x:path}/b"}),
                route(name="e", upstream="ftp://host"),
                route(name="f", upstream="http://host/?a=1"),
                route(name="g", match={"methods": "POST", "path": "/g"}),
            ]
        }
    )
    assert "is not a valid route name" in found["routes[0].name"]
    assert '"jobs/x" must start with /' in found["routes[1].match.path"]
    assert "parameter {1x} must be a name" in found["routes[2].match.path"]
    assert (
        "{x:path} takes the rest of the path, so it must come last"
        in (found["routes[3].match.path"])
    )
    assert '"ftp://host" is not an http or https URL' in found["routes[4].upstream"]
    assert "has a query string" in found["routes[5].upstream"]
    assert (
        found["routes[6].match.methods"]
        == 'expected a list, got the text "POST"; write e.g. [POST]'
    )


@pytest.mark.parametrize(
    ("setting", "value", "expected"),
    [
        ("upstream_timeout", "30 seconds", '"30 seconds" is not a duration; write e.g. 500ms'),
        ("wait_timeout", 0, "must be more than 0"),
        ("max_request_body", "10 megs", '"10 megs" is not a size; write e.g. 512KiB'),
        ("concurrent", "wiat", '"wiat" is not one of wait, reject; did you mean "wait"?'),
        ("on_store_error", "open", "is not one of fail_closed, fail_open"),
        ("cache_statuses", [200, "6xx"], None),
        ("fingerprint", ["method", "bdy"], None),
        ("forward_key_header", True, "is not a header name"),
        ("strip_headers", "X-Secret", "expected a list"),
        ("sensitive_keys", "maybe", '"maybe" is not true or false'),
    ],
)
def test_bad_route_settings(setting: str, value: object, expected: str | None) -> None:
    found = route_error(**{setting: value})
    if setting == "cache_statuses":
        assert 'a class like "2xx"' in found["routes[0].cache_statuses[1]"]
    elif setting == "fingerprint":
        assert found["routes[0].fingerprint[1]"].endswith('did you mean "body"?')
    else:
        assert expected is not None and expected in found[f"routes[0].{setting}"]


#: Numbers as nobody should write them: digits of other scripts (int() and float() read
#: them), superscripts (str.isdigit() says yes, int() refuses them), underscores.
ARABIC_20 = "\u0662\u0660"
FULLWIDTH_20 = "\uff12\uff10"


@pytest.mark.parametrize(
    ("where", "data"),
    [
        ("routes[0].wait_timeout", {"routes": [route(wait_timeout=ARABIC_20 + "s")]}),
        ("routes[0].wait_timeout", {"routes": [route(wait_timeout=FULLWIDTH_20)]}),
        ("routes[0].max_request_body", {"routes": [route(max_request_body=ARABIC_20 + "MiB")]}),
        ("routes[0].max_request_body", {"routes": [route(max_request_body="9" * 5000 + "B")]}),
        ("routes[0].max_request_body", {"routes": [route(max_request_body="1_000")]}),
        ("server.max_connections", {"server": {"max_connections": "²"}, "routes": [route()]}),
        ("server.max_connections", {"server": {"max_connections": ARABIC_20}, "routes": [route()]}),
        ("routes[0].cache_statuses[0]", {"routes": [route(cache_statuses=["²⁰⁰"])]}),
        ("routes[0].cache_statuses[0]", {"routes": [route(cache_statuses=["٢٠٠"])]}),
        ("server.listen", {"server": {"listen": "127.0.0.1:²"}, "routes": [route()]}),
        ("server.listen", {"server": {"listen": "127.0.0.1:٨٠٨٠"}, "routes": [route()]}),
        ("store.url", {"store": {"url": "redis://127.0.0.1:6379/²"}, "routes": [route()]}),
        ("store.url", {"store": {"url": "redis://127.0.0.1:6379/٢"}, "routes": [route()]}),
        (
            "routes[0].key.period",
            {"routes": [route(key={"template": "{period}", "period": ARABIC_20 + "d"})]},
        ),
    ],
)
def test_numbers_in_the_config_are_ascii_digits(where: str, data: dict[str, Any]) -> None:
    """Each is refused at its place with the setting's own words, never accepted as
    the number another script's digits make, and never Python's own message."""
    found = errors(data)
    assert where in found, found
    message = found[where]
    assert "is not" in message or "must be" in message, message
    for python in ("invalid literal", "Exceeds the limit", "int()", "sys."):
        assert python not in message, message


def test_bad_default_is_reported_once_at_defaults() -> None:
    found = errors(
        {
            "defaults": {"upstream_timeout": "soon", "timeout": 1},
            "routes": [route(), route(name="b")],
        }
    )
    assert found == {
        "defaults.upstream_timeout": '"soon" is not a duration; write e.g. 500ms, 30s, 15m, '
        "24h or 7d",
        "defaults.timeout": 'unknown setting; did you mean "wait_timeout"?',
    }


def test_defaults_reject_route_only_settings() -> None:
    found = errors({"defaults": {"upstream": "http://h"}, "routes": [route()]})
    assert found["defaults.upstream"] == "upstream can only be set on a route, not under defaults"


def test_response_ttl_shorter_than_upstream_timeout() -> None:
    found = route_error(upstream_timeout="2m", response_ttl="30s")
    assert "response_ttl 30s is shorter than upstream_timeout 2m" in found["routes[0].response_ttl"]


# -- key errors ---------------------------------------------------------------------------


def test_bad_jmespath() -> None:
    found = route_error(key={"body": "items[0"})
    assert found["routes[0].key.body"].startswith("not a valid JMESPath expression: ")
    assert "write e.g. job_key" in found["routes[0].key.body"]


def test_bad_template_placeholders() -> None:
    found = errors(
        {
            "routes": [
                route(key={"template": "x:{perod}"}),
                route(name="b", key={"template": "{path.missing}"}),
                route(name="c", key={"template": "{period}"}),
                route(name="d", key={"template": "{body.a[}"}),
                route(name="e", key={"template": "x{"}),
            ]
        }
    )
    assert found["routes[0].key.template"].startswith("unknown placeholder {perod}; use {period}")
    assert found["routes[0].key.template"].endswith('did you mean "{period}"?')
    assert (
        "has no {missing} parameter (available: {path.name})" in (found["routes[1].key.template"])
    )
    assert "{period} needs a period; add e.g. period: 1d" in found["routes[2].key.template"]
    assert "not a valid JMESPath expression" in found["routes[3].key.template"]
    assert "unmatched {" in found["routes[4].key.template"]


def test_period_without_template_use() -> None:
    found = route_error(key={"header": "Idempotency-Key", "period": "1d"})
    assert found["routes[0].key.period"].startswith("period is set but no template uses {period}")


def test_key_source_conflicts_and_absence() -> None:
    found = errors(
        {
            "routes": [
                route(key={"header": "A", "body": "b"}),
                route(name="b", key={"on_missing": "forward"}),
                route(name="c", key={"sources": [{"header": "A", "query": "q"}]}),
                route(name="d", key={"sources": [{"header": "A", "period": "1d"}]}),
                route(name="e", key={"header": "A", "timezone": "UTC"}),
                route(name="f", key={"period": "1d", "timezone": "Mars/Base"}),
                route(name="g", key={"period": "5h"}),
                route(name="h", key={"header": "A", "max_length": 5000, "on_missing": "drop"}),
                route(name="i", key={"header": "A", "scope": ["Authorization"]}),
            ]
        }
    )
    assert "header and body are both set, but a key has one source" in found["routes[0].key"]
    assert "no key source; write e.g. key: {header: Idempotency-Key}" in found["routes[1].key"]
    assert "each source needs exactly one of header" in found["routes[2].key.sources[0]"]
    assert found["routes[3].key.sources[0].period"] == (
        "set period on the key itself, next to sources:"
    )
    assert "timezone only matters with a period" in found["routes[4].key.timezone"]
    assert '"Mars/Base" is not a known time zone' in found["routes[5].key.timezone"]
    assert "hours must divide a day" in found["routes[6].key.period"]
    assert "is not a whole number from 1 to 4096" in found["routes[7].key.max_length"]
    assert '"drop" is not one of reject, forward' in found["routes[7].key.on_missing"]
    assert (
        '"Authorization" is not a request part; write header.<Name>, query.<Name>'
        in (found["routes[8].key.scope[0]"])
    )


# -- server, admin and store errors -------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("8080", "is not an address"),
        ("localhost:0", "port 0"),
        ("localhost:70000", "is not from 1 to 65535"),
        ("::1:8080", "IPv6 host without brackets"),
    ],
)
def test_bad_listen_addresses(listen: str, expected: str) -> None:
    found = errors({"server": {"listen": listen}, "routes": [route()]})
    assert expected in found["server.listen"]
    assert 'write host:port, e.g. "127.0.0.1:8080"' in found["server.listen"]


def test_ipv6_listen_is_accepted() -> None:
    assert parse({"server": {"listen": "[::1]:8080"}, "routes": [route()]}).server.listen == (
        "[::1]:8080"
    )


def test_server_and_admin_on_the_same_address() -> None:
    found = errors(
        {
            "server": {"listen": "0.0.0.0:8080"},
            "admin": {"listen": "127.0.0.1:8080"},
            "routes": [route()],
        }
    )
    assert "clashes with server.listen" in found["admin.listen"]
    assert "give the operator API its own port" in found["admin.listen"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "mysql://db",
            "the store URL must start with memory://, redis://, rediss://, unix://, "
            "postgresql://, postgres:// or sqlite://",
        ),
        ("sqlite://", "names no file"),
        ("sqlite:///var/lib/", "names no file"),
        ("sqlite:///var/lib/gw.db?mode=ro", "may not hold ?, # or control characters"),
        ("sqlite:///var/lib/gw\n.db", "may not hold ?, # or control characters"),
        ("sqlit:///gw.db", 'did you mean "sqlite://"?'),
        ("postgresq://db/gateway", 'did you mean "postgresql://"?'),
        ("postgresql:///gateway", "has no host"),
        ("postgres://db", "names no database"),
        ("reddis://h", 'did you mean "redis://"?'),
        ("redis://", "has no host"),
        ("redis://h/abc", "must be a database number"),
        ("unix://run/redis.sock", "three slashes"),
        ("SQLITE:///var/lib/gw.db", 'in lower case: "sqlite://"'),
        ("Memory://", 'in lower case: "memory://"'),
        ("PostgreSQL://db/gateway", 'in lower case: "postgresql://"'),
        ("sqlite://~/gw.db", "~ is not expanded"),
        ("sqlite:///:memory:", "a file called :memory:"),
        ("sqlite://data/:memory:", "a file called :memory:"),
    ],
)
def test_bad_store_url(url: str, expected: str) -> None:
    assert expected in errors({"store": {"url": url}, "routes": [route()]})["store.url"]


@pytest.mark.parametrize(
    "url",
    [
        "memory://",
        "redis://:pw@h:6379/1",
        "rediss://h",
        "unix:///s.sock",
        "postgresql://gateway:pw@db:5432/gateway?sslmode=require",
        "postgres:///gateway?host=/run/postgresql",
    ],
)
def test_good_store_urls(url: str) -> None:
    assert parse({"store": {"url": url}, "routes": [route()]}).store.url == url


# -- reconcile errors ---------------------------------------------------------------------


def test_reconcile_policy_without_block() -> None:
    found = route_error(on_unknown_outcome="reconcile")
    assert "needs a reconcile: block" in found["routes[0].on_unknown_outcome"]


def test_reconcile_block_without_policy() -> None:
    found = route_error(reconcile={"url": "http://h/{key}"})
    assert "reconcile is set but on_unknown_outcome is park" in found["routes[0].reconcile"]


def test_unused_reconcile_in_defaults() -> None:
    found = errors({"defaults": {"reconcile": {"url": "http://h/{key}"}}, "routes": [route()]})
    assert "no route uses it" in found["defaults.reconcile"]


def test_reconcile_block_errors() -> None:
    found = route_error(
        on_unknown_outcome="reconcile",
        reconcile={
            "url": "http://h/{key}/{job}",
            "done": [200],
            "not_done": [200, 404],
            "timeout": 0,
        },
    )
    assert found["routes[0].reconcile.url"] == (
        "unknown placeholder {job}; use {key}, {route} or {run_id}"
    )
    assert found["routes[0].reconcile.not_done"] == (
        "200 is in both done and not_done; a status must mean one thing"
    )
    assert "must be more than 0" in found["routes[0].reconcile.timeout"]


def test_reconcile_url_placeholders_are_filled_as_the_config_read_them() -> None:
    # The config accepts `{ key }` and reads `{{` as a brace; the check URL says the same.
    (parsed,) = parse(
        {
            "routes": [
                route(
                    on_unknown_outcome="reconcile",
                    reconcile={"url": "http://h/s/{ key }/{route}?run={run_id}&f={{x}}"},
                )
            ]
        }
    ).routes
    assert parsed.reconcile is not None
    values = {"key": "k 1", "route": "job", "run_id": "r1"}
    assert fill_url(parsed.reconcile.url, values) == "http://h/s/k%201/job?run=r1&f={x}"


def test_reconcile_url_required() -> None:
    found = route_error(on_unknown_outcome="reconcile", reconcile={"done": [200]})
    assert found["routes[0].reconcile.url"].startswith("missing; write e.g. url:")


# -- everything at once -------------------------------------------------------------------


def test_all_errors_are_reported_together(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "server: {shutdown_grace: 30 seconds}\n"
        "store: {url: 'mysql://x'}\n"
        "routes:\n"
        "  - name: a\n"
        "    match: {path: /a}\n"
        "    upstream: http://h\n"
        "    kye: {header: X}\n"
        "  - name: a\n"
        "    match: {path: /b}\n"
        "    upstream: http://h\n"
        "    key: {body: 'x['}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    paths = [issue.path for issue in caught.value.issues]
    assert paths == [
        "server.shutdown_grace",
        "store.url",
        "routes[0].kye",
        "routes[1].key.body",
        "routes[1].name",
    ]
    text = str(caught.value)
    assert [line.split(": ")[0] for line in text.splitlines()] == [
        f"{path}:1:26",
        f"{path}:2:14",
        f"{path}:7:5",
        f"{path}:11:17",
        f"{path}:8:11",
    ]
    assert f'{path}:7:5: routes[0].kye: unknown setting; did you mean "key"?' in text


def test_errors_name_the_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "server:\n"
        "  listen: '8080'\n"
        "routes:\n"
        "  - name: a\n"
        "    match:\n"
        "      methods: [POST, 'a b']\n"
        "    upstream: ${UP:?set UP}\n"
        "    defaults: {}\n"
        "    key:\n"
        "      sources:\n"
        "        - {header: A, period: 1d}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    where = {issue.path: (issue.line, issue.column) for issue in caught.value.issues}
    assert where == {
        "server.listen": (2, 11),  # the value
        "routes[0].upstream": (7, 15),
        "routes[0].defaults": (8, 5),  # an unknown setting: its name
        "routes[0].match.methods[1]": (6, 23),
        "routes[0].match.path": (6, 7),  # missing: the mapping it is missing from
        "routes[0].key.sources[0].period": (11, 23),
    }
    lines = str(caught.value).splitlines()
    assert any(line.startswith(f'{path}:2:11: server.listen: "8080" is not an') for line in lines)
    assert f"{path}:7:15: routes[0].upstream: environment variable UP is not set: set UP" in lines


def test_errors_without_a_file_have_no_position() -> None:
    with pytest.raises(ConfigError) as caught:
        parse({"routes": [route(wait_timeout="soon")]})
    (issue,) = caught.value.issues
    assert (issue.line, issue.column) == (0, 0)
    assert str(caught.value).startswith("test.yaml: routes[0].wait_timeout: ")


# -- describe -----------------------------------------------------------------------------


def test_describe_masks_secrets_and_is_stable() -> None:
    data = {
        "admin": {"token": "tok-very-secret"},
        "store": {"url": "redis://user:hunter2@cache:6379/0"},
        "routes": [
            route(
                match={"methods": ["POST"], "path": "/jobs/{name}"},
                upstream="https://svc:pw@api.internal",
                key={"sources": [{"header": "Idempotency-Key"}, {"body": "job_key"}]},
                wait_timeout="500ms",
                response_ttl="24h",
                max_request_body="1MiB",
            )
        ],
    }
    text = describe(parse(data))
    assert text == describe(parse(data))
    assert "tok-very-secret" not in text and "hunter2" not in text and ":pw@" not in text
    assert "redis://user:***@cache:6379/0" in text
    assert "https://svc:***@api.internal" in text
    assert "operator API: shared token set" in text
    assert "route job" in text
    assert "POST /jobs/{name}" in text
    assert "first present of: header Idempotency-Key; body job_key (JMESPath)" in text
    assert "wait (up to 500ms)" in text
    assert "keep responses 1d" in text
    assert "request 1 MiB" in text


def test_describe_says_which_answers_complete_a_key_and_which_run_it_again() -> None:
    keyed = route(key={"header": "Idempotency-Key"})
    queued = route(name="later", match={"path": "/later"}, key={"header": "K"}, delivery="async")
    narrow = route(name="narrow", match={"path": "/narrow"}, key={"header": "K"})
    narrow["cache_statuses"] = ["2xx"]
    text = describe(parse({"routes": [keyed, queued, narrow]}))
    handled = "200-407, 409-428, 430-499"
    assert (
        f"cache statuses:  {handled} complete the key (replayed); any other status, and a "
        "request never sent, release it"
    ) in text
    assert (
        f"cache statuses:  {handled} complete the delivery; any other status, and a request "
        "never sent, are attempted again"
    ) in text
    assert "cache statuses:  200-299 complete the key (replayed)" in text


def test_describe_masks_a_postgresql_password() -> None:
    data = {
        "store": {
            "url": "postgresql://gateway:hunter2@db:5432/gateway?sslmode=require",
            "password": "also-secret",
        },
        "routes": [route()],
    }
    text = describe(parse(data))
    assert "hunter2" not in text and "also-secret" not in text
    assert "store: postgresql://gateway:***@db:5432/gateway?sslmode=require" in text
    assert "password set" in text


def test_postgresql_store_refuses_wait_for_replicas() -> None:
    found = errors(
        {"store": {"url": "postgresql://db/gateway", "wait_for_replicas": 1}, "routes": [route()]}
    )
    assert "synchronous_standby_names" in found["store.wait_for_replicas"]


def test_sqlite_store_settings() -> None:
    """`sqlite://` names a file (absolute after three slashes, else relative); its
    block says how commits are synced (FULL unless told); the block belongs to it, and
    a file has no replicas to wait for."""
    default = parse({"store": {"url": "sqlite:///var/lib/gw/gateway.db"}, "routes": [route()]})
    assert (default.store.kind, default.store.sqlite_synchronous) == ("sqlite", "full")
    relaxed = parse(
        {
            "store": {"url": "sqlite://data/gateway.db", "sqlite": {"synchronous": "normal"}},
            "routes": [route()],
        }
    )
    assert relaxed.store.sqlite_synchronous == "normal"
    found = errors(
        {"store": {"url": "sqlite://g.db", "sqlite": {"synchronous": "off"}}, "routes": [route()]}
    )
    assert "full" in found["store.sqlite.synchronous"]
    alone = parse({"store": {"sqlite": {"synchronous": "normal"}}, "routes": [route()]})
    assert (alone.store.kind, alone.store.sqlite_synchronous) == ("sqlite", "normal")
    found = errors(
        {"store": {"url": "memory://", "sqlite": {"synchronous": "normal"}}, "routes": [route()]}
    )
    assert "sqlite:// url" in found["store.sqlite"]
    found = errors(
        {"store": {"url": "sqlite://g.db", "sqlite": {"sync": "normal"}}, "routes": [route()]}
    )
    assert "store.sqlite.sync" in found
    found = errors({"store": {"url": "sqlite://g.db", "wait_for_replicas": 1}, "routes": [route()]})
    assert "no replicas" in found["store.wait_for_replicas"]


@pytest.mark.parametrize("store", [{}, {"url": "memory://"}])
def test_memory_store_refuses_wait_for_replicas(store: dict[str, str]) -> None:
    """The memory store and the default SQLite file have no replicas to wait for: the
    setting would promise a confirmation that never happens, so it is refused, not
    ignored."""
    found = errors({"store": {**store, "wait_for_replicas": 1}, "routes": [route()]})
    assert "no replicas" in found["store.wait_for_replicas"]
    assert parse({"store": {"wait_for_replicas": 0}, "routes": [route()]})


def test_postgresql_store_without_its_driver_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Redis user never installs asyncpg; a PostgreSQL user who did not gets the
    command, at the setting that asks for it."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "asyncpg" else find_spec(name, *args),
    )
    found = errors({"store": {"url": "postgresql://db/gateway"}, "routes": [route()]})
    assert "pip install 'idempotency-gateway[postgres]'" in found["store.url"]
    assert parse({"store": {"url": "redis://h:6379/0"}, "routes": [route()]})


def test_mask_url() -> None:
    assert mask_url("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert mask_url("redis://:secret@host") == "redis://:***@host"
    assert mask_url("redis://host?password=pw&db=1") == "redis://host?password=***&db=1"
    assert mask_url("memory://") == "memory://"
    assert mask_url("redis://user@host") == "redis://user@host"


# -- delivery: async ----------------------------------------------------------------------

KEYED = {"key": {"header": "Idempotency-Key"}}


def test_async_delivery_shorthand_mapping_and_defaults() -> None:
    (short,) = parse({"routes": [route(delivery="async", **KEYED)]}).routes
    assert short.delivery.mode == "async"
    assert (short.delivery.concurrency, short.delivery.max_queued) == (4, 10_000)
    assert (short.retry.attempts, short.retry.backoff, short.retry.max_backoff) == (8, 2.0, 600.0)
    given = {"mode": "async", "concurrency": 2, "max_queued": 50, "drop_headers": ["Cookie"]}
    retry = {"attempts": 3, "backoff": "500ms", "max_backoff": "5s"}
    (full,) = parse({"routes": [route(delivery=given, retry=retry, **KEYED)]}).routes
    assert (full.delivery.concurrency, full.delivery.max_queued) == (2, 50)
    assert full.delivery.drop_headers == frozenset({"cookie"})
    assert (full.retry.attempts, full.retry.backoff, full.retry.max_backoff) == (3, 0.5, 5.0)
    (sync,) = parse({"routes": [route(**KEYED)]}).routes
    assert sync.delivery.mode == "sync"
    config = parse({"routes": [route(**KEYED)], "server": {"max_deliveries": 0}})
    assert config.server.max_deliveries == 0


def test_async_route_refusals_name_the_fix() -> None:
    assert route_error(delivery="async") == {
        "routes[0].delivery": "delivery: async needs a key, so repeats are deduplicated; "
        "add e.g. key: {header: Idempotency-Key}"
    }
    found = route_error(
        delivery="async",
        key={"header": "Idempotency-Key", "on_missing": "forward"},
        on_store_error="fail_open",
        on_unknown_outcome="release",
    )
    assert "use on_missing: reject" in found["routes[0].key.on_missing"]
    assert "use fail_closed" in found["routes[0].on_store_error"]
    release = found["routes[0].on_unknown_outcome"]
    assert "got 202 and will not retry" in release
    assert "never retried blind" in release
    assert release.endswith("use reconcile (with a reconcile: block) or park")


def test_retry_and_delivery_settings_need_async() -> None:
    assert route_error(retry={"attempts": 3}, **KEYED) == {
        "routes[0].retry": "retry applies to delivery: async routes; set delivery: async "
        "or remove it"
    }
    assert route_error(delivery={"concurrency": 2}, **KEYED) == {
        "routes[0].delivery.concurrency": "concurrency is set but delivery is sync; add mode: async"
    }
    # Inherited from defaults, retry is the async routes' and ignored on a sync one.
    data = {"defaults": {"retry": {"attempts": 2}}, "routes": [route(**KEYED)]}
    assert parse(data).routes[0].delivery.mode == "sync"


def test_bad_delivery_and_retry_values() -> None:
    assert route_error(delivery="asyn", **KEYED) == {
        "routes[0].delivery.mode": '"asyn" is not one of sync, async; did you mean "async"?'
    }
    found = route_error(delivery={"mode": "async", "concurency": 2}, **KEYED)
    assert found == {
        "routes[0].delivery.concurency": 'unknown setting; did you mean "concurrency"?'
    }
    found = route_error(delivery="async", retry={"backoff": "5s", "max_backoff": "1s"}, **KEYED)
    assert found == {
        "routes[0].retry.max_backoff": "max_backoff 1s is shorter than backoff 5s; make it at "
        "least 5s"
    }
    found = route_error(delivery="async", retry={"attempts": 0}, **KEYED)
    assert "not a whole number from 1 to 1000" in found["routes[0].retry.attempts"]
    found = errors({"routes": [route(**KEYED)], "server": {"max_deliveries": -1}})
    assert "from 0 to 10000" in found["server.max_deliveries"]


def test_delivery_delay_settings() -> None:
    (plain,) = parse({"routes": [route(delivery="async", **KEYED)]}).routes
    assert (plain.delivery.delay, plain.delivery.max_delay) == (0.0, 7 * 86400.0)
    assert plain.delivery.delay_header == "Delivery-Delay"
    assert plain.delivery.not_before_header == "Delivery-Not-Before"
    given = {
        "mode": "async",
        "delay": "90s",
        "max_delay": "2h",
        "delay_header": "X-Run-In",
        "not_before_header": False,
    }
    (own,) = parse({"routes": [route(delivery=given, **KEYED)]}).routes
    assert (own.delivery.delay, own.delivery.max_delay) == (90.0, 7200.0)
    assert (own.delivery.delay_header, own.delivery.not_before_header) == ("X-Run-In", None)
    off = {"mode": "async", "delay_header": ""}
    assert parse({"routes": [route(delivery=off, **KEYED)]}).routes[0].delivery.delay_header is None
    found = route_error(delivery={"mode": "async", "delay": "3h", "max_delay": "1h"}, **KEYED)
    assert found == {
        "routes[0].delivery.delay": "delay 3h is longer than max_delay 1h; make it at most 1h, "
        "or raise max_delay"
    }
    found = route_error(delivery={"mode": "async", "delay_header": "Run In"}, **KEYED)
    assert found == {
        "routes[0].delivery.delay_header": '"Run In" is not a header name; write e.g. '
        "Delivery-Delay, or false to read no such header"
    }
    found = route_error(delivery={"mode": "async", "delay": "-1s"}, **KEYED)
    assert "is not a duration" in found["routes[0].delivery.delay"]
    found = route_error(delivery={"mode": "async", "max_delay": "0s"}, **KEYED)
    assert "must be more than 0" in found["routes[0].delivery.max_delay"]
    for name in ("delay", "max_delay", "delay_header", "not_before_header"):
        value = "X-Later" if name.endswith("header") else "5s"
        assert route_error(delivery={name: value}, **KEYED) == {
            f"routes[0].delivery.{name}": f"{name} is set but delivery is sync; add mode: async"
        }


def test_delivery_time_headers_are_no_key_framing_or_each_others_header() -> None:
    """A delay or not-before header named as the key's header (a key `3600` would be
    read as an hour's delay), the forwarded key header, a hop-by-hop or framing header
    (`Content-Length` read as seconds), or the other delivery-time header: refused at
    the setting, with the fix."""
    at = "routes[0].delivery.delay_header"
    for name in ("idempotency-key", "Content-Length", "Host", "Connection", "Transfer-Encoding"):
        found = route_error(delivery={"mode": "async", "delay_header": name}, **KEYED)
        assert list(found) == [at], found
        assert "Delivery-Delay" in found[at], found[at]
    found = route_error(
        delivery={"mode": "async", "not_before_header": "X-Job"},
        key={"sources": [{"header": "Idempotency-Key"}, {"header": "X-Job"}]},
    )
    assert list(found) == ["routes[0].delivery.not_before_header"], found
    found = route_error(
        delivery={"mode": "async", "delay_header": "X-Forwarded-Key"},
        forward_key_header="X-Forwarded-Key",
        **KEYED,
    )
    assert list(found) == [at], found
    found = route_error(
        delivery={"mode": "async", "delay_header": "X-When", "not_before_header": "x-when"},
        **KEYED,
    )
    assert list(found) == ["routes[0].delivery.not_before_header"], found
    assert "delay_header" in found["routes[0].delivery.not_before_header"]


def test_delivery_delay_error_has_file_position(tmp_path: Path) -> None:
    path = tmp_path / "delay.yaml"
    path.write_text(
        "routes:\n  - name: a\n    match: {path: /a}\n    upstream: http://127.0.0.1:5000\n"
        "    key: {header: K}\n    on_unknown_outcome: park\n"
        "    delivery: {mode: async, max_delay: 1m, delay: 2m}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}:7:51: routes[0].delivery.delay: delay 2m")


def test_pause_settings_are_async_and_checked(tmp_path: Path) -> None:
    (short,) = parse({"routes": [route(delivery="async", **KEYED)]}).routes
    assert (short.delivery.pause_after, short.delivery.probe_every) == (0, 30.0)
    given = {"mode": "async", "pause_after": 3, "probe_every": "500ms"}
    (paused,) = parse({"routes": [route(delivery=given, **KEYED)]}).routes
    assert (paused.delivery.pause_after, paused.delivery.probe_every) == (3, 0.5)
    text = describe(parse({"routes": [route(delivery=given, **KEYED)]}))
    assert "after 3 refused attempts in a row; then one probe every 500ms" in text
    assert "refused attempts" not in describe(parse({"routes": [route(delivery="async", **KEYED)]}))
    assert route_error(delivery={"pause_after": 3}, **KEYED) == {
        "routes[0].delivery.pause_after": "pause_after is set but delivery is sync; add mode: async"
    }
    assert route_error(delivery={"probe_every": "5s"}, **KEYED) == {
        "routes[0].delivery.probe_every": "probe_every is set but delivery is sync; add mode: async"
    }
    found = route_error(delivery={"mode": "async", "pause_after": -1}, **KEYED)
    assert "not a whole number from 0 to 1000" in found["routes[0].delivery.pause_after"]
    found = route_error(delivery={"mode": "async", "pause_after": "3x"}, **KEYED)
    assert "routes[0].delivery.pause_after" in found
    found = route_error(delivery={"mode": "async", "probe_every": "0s"}, **KEYED)
    assert "it must be more than 0" in found["routes[0].delivery.probe_every"]
    path = tmp_path / "pause.yaml"
    path.write_text(
        "routes:\n  - name: a\n    match: {path: /a}\n    upstream: http://127.0.0.1:5000\n"
        "    key: {header: K}\n    delivery: {mode: async, probe_every: 0s}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}:6:42: routes[0].delivery.probe_every")


def test_async_route_error_has_file_position(tmp_path: Path) -> None:
    path = tmp_path / "async.yaml"
    path.write_text(
        "routes:\n  - name: a\n    match: {path: /a}\n    upstream: http://127.0.0.1:5000\n"
        "    delivery: async\n    key: {header: K}\n    on_unknown_outcome: release\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}:7:25: routes[0].on_unknown_outcome: release")


def test_delivery_rate_burst_and_group() -> None:
    rated = {"mode": "async", "rate": "20/s", "burst": 5, "rate_group": "billing"}
    (full,) = parse({"routes": [route(delivery=rated, **KEYED)]}).routes
    assert (full.delivery.rate, full.delivery.burst) == (20.0, 5)
    assert full.delivery.limit_name(full.name) == "group:billing"
    for written, per_second in (("600/m", 10.0), (" 36 / h ", 0.01), ("1/s", 1.0)):
        data = {"routes": [route(delivery={"mode": "async", "rate": written}, **KEYED)]}
        (one,) = parse(data).routes
        assert one.delivery.rate == pytest.approx(per_second) and one.delivery.burst == 1
        assert one.delivery.limit_name(one.name) == f"route:{one.name}"
    (plain,) = parse({"routes": [route(delivery="async", **KEYED)]}).routes
    assert plain.delivery.rate is None and plain.delivery.limit_name(plain.name) is None
    assert (format_rate(20.0), format_rate(10.0 / 60), format_rate(0.01)) == (
        "20/s",
        "10/m",
        "36/h",
    )


def test_delivery_rate_refusals_name_the_fix() -> None:
    def rate_error(**delivery: Any) -> dict[str, str]:
        return route_error(delivery={"mode": "async", **delivery}, **KEYED)

    for bad in ("20", "20/d", "-5/s", "twenty/s", "2.5/s", "20/s/s", 20):
        found = rate_error(rate=bad)
        assert "is not a rate; write e.g. 20/s, 600/m or 1000/h" in found["routes[0].delivery.rate"]
    assert "lets nothing through" in rate_error(rate="0/s")["routes[0].delivery.rate"]
    assert "the most a limit takes" in rate_error(rate="2000000/s")["routes[0].delivery.rate"]
    assert "U+00A0" in rate_error(rate="20\u00a0/s")["routes[0].delivery.rate"]
    assert rate_error(burst=5) == {
        "routes[0].delivery.burst": "burst needs a rate; add e.g. rate: 20/s"
    }
    assert rate_error(rate_group="billing") == {
        "routes[0].delivery.rate_group": "rate_group needs a rate; add e.g. rate: 20/s"
    }
    assert (
        "not a whole number from 1 to 100000"
        in rate_error(rate="1/s", burst=0)["routes[0].delivery.burst"]
    )
    assert (
        "not a valid name"
        in rate_error(rate="1/s", rate_group="a b")["routes[0].delivery.rate_group"]
    )
    assert route_error(delivery={"rate": "20/s"}, **KEYED) == {
        "routes[0].delivery.rate": "rate is set but delivery is sync; add mode: async"
    }


def test_a_rate_group_states_one_rate() -> None:
    def rated(name: str, rate: str, burst: int = 1) -> dict[str, Any]:
        delivery = {"mode": "async", "rate": rate, "burst": burst, "rate_group": "billing"}
        return route(name=name, match={"path": f"/{name}"}, delivery=delivery, **KEYED)

    config = parse({"routes": [rated("a", "20/s"), rated("b", "1200/m")]})
    assert {r.delivery.limit_name(r.name) for r in config.routes} == {"group:billing"}
    assert errors({"routes": [rated("a", "20/s"), rated("b", "10/s")]}) == {
        "routes[1].delivery.rate": 'rate_group "billing" has rate 20/s and burst 1 at '
        "routes[0] (a); give every route of the group the same rate and burst"
    }
    found = errors({"routes": [rated("a", "20/s"), rated("b", "20/s", burst=3)]})
    assert list(found) == ["routes[1].delivery.burst"]


def test_rate_error_has_file_position(tmp_path: Path) -> None:
    path = tmp_path / "rate.yaml"
    path.write_text(
        "routes:\n  - name: a\n    match: {path: /a}\n    upstream: http://127.0.0.1:5000\n"
        "    key: {header: K}\n    delivery: {mode: async, rate: 20/d}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f'{path}:6:35: routes[0].delivery.rate: "20/d"')


def test_describe_async_route() -> None:
    data = {"routes": [route(delivery={"mode": "async", "drop_headers": ["Cookie"]}, **KEYED)]}
    text = describe(parse(data))
    assert "async: 202 at once; 4 at a time per process; up to 10000 queued" in text
    assert "never stored: cookie" in text
    assert "at once, or as Delivery-Delay or Delivery-Not-Before asks; at most 7d later" in text
    later = {"mode": "async", "delay": "90s", "not_before_header": False}
    text = describe(parse({"routes": [route(delivery=later, **KEYED)]}))
    assert "90s after acceptance, or as Delivery-Delay asks; at most 7d later" in text
    assert "8 attempts; backoff 2s doubling, full jitter, at most 10m" in text
    assert "64 deliveries at once" in text
    rated = {"mode": "async", "rate": "600/m", "burst": 3, "rate_group": "billing"}
    text = describe(parse({"routes": [route(delivery=rated, **KEYED)]}))
    assert "at most 10/s over every replica, burst 3, shared by rate_group billing" in text
