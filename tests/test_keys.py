from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import jmespath
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import KeySource, KeySpec, Period
from gateway.config.templates import compile_template
from gateway.errors import BadRequest
from gateway.keying import (
    MAX_JSON_DEPTH,
    RequestParts,
    extract_key,
    fingerprint,
    record_digest,
    scope_value,
    window_start,
)
from tests.support.growth import assert_linear
from tests.support.request_parts import req

NOW = datetime(2026, 11, 1, 12, 7, 30, tzinfo=UTC)
DAY = Period(1, "d")

# Keep hypothesis from writing an example database into the working tree.
no_db = settings(database=None, deadline=None)


def header(name: str) -> KeySource:
    return KeySource("header", name)


def query(name: str) -> KeySource:
    return KeySource("query", name)


def body(expr: str) -> KeySource:
    return KeySource("body", expr, compiled=jmespath.compile(expr))


def template(text: str) -> KeySource:
    return KeySource("template", text)


def spec(*sources: KeySource, **kw: Any) -> KeySpec:
    return KeySpec(sources=sources, **kw)


def key(s: KeySpec | KeySource, parts: RequestParts, now: datetime = NOW) -> str | None:
    return extract_key(s if isinstance(s, KeySpec) else spec(s, period=DAY), parts, now)


# --- request parts -----------------------------------------------------------


def test_request_parts_normalise_method_and_join_repeated_headers() -> None:
    parts = req(method="post", headers=[("x-a", "1"), ("x-b", "2"), ("x-a", "3")])
    assert parts.method == "POST"
    assert parts.header("X-A") == "1, 3"
    assert parts.header("x-b") == "2"
    assert parts.header("x-c") is None


def test_json_body_is_parsed_once() -> None:
    parts = req(body=b'{"a": {"b": 1}}')
    assert parts.json_body() == {"a": {"b": 1}}
    assert parts.json_body() is parts.json_body()


# --- header source -----------------------------------------------------------


def test_header_source_is_case_insensitive() -> None:
    assert key(header("Idempotency-Key"), req(headers=[("idempotency-key", "abc")])) == "abc"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("abc", "abc"),
        ('"abc"', "abc"),
        (r'"a\"b"', 'a"b'),
        (r'"a\\b"', "a\\b"),
        (r'"\\\""', '\\"'),
    ],
)
def test_header_sf_string_quoted_equals_bare(raw: str, expected: str) -> None:
    assert key(header("Idempotency-Key"), req(headers=[("idempotency-key", raw)])) == expected


@pytest.mark.parametrize("raw", [r'"a\b"', '"abc', '"a"b"', '"abc";p=1', '"a\\"'])
def test_header_sf_string_with_bad_quoting_is_refused(raw: str) -> None:
    with pytest.raises(BadRequest, match="quoted string"):
        key(header("Idempotency-Key"), req(headers=[("idempotency-key", raw)]))


def test_repeated_key_header_is_refused() -> None:
    parts = req(headers=[("idempotency-key", "a"), ("idempotency-key", "b")])
    with pytest.raises(BadRequest, match="2 times"):
        key(header("Idempotency-Key"), parts)


@pytest.mark.parametrize("raw", ["", "   ", '""'])
def test_empty_header_is_missing(raw: str) -> None:
    assert key(header("K"), req(headers=[("k", raw)])) is None
    assert key(header("K"), req()) is None


# --- query source ------------------------------------------------------------


def test_query_source_takes_first_decoded_value() -> None:
    assert key(query("run"), req(query="x=1&run=a%2Fb+c&run=second")) == "a/b c"


def test_query_source_blank_or_absent_is_missing() -> None:
    assert key(query("run"), req(query="run=&x=1")) is None
    assert key(query("run"), req(query="x=1")) is None
    # The first value counts even when blank: a later one is not promoted.
    assert key(query("run"), req(query="run=&run=x")) is None


# --- body source -------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"job": {"id": "abc"}}', "abc"),
        (b'{"job": {"id": 42}}', "42"),
        (b'{"job": {"id": 1.5}}', "1.5"),
        (b'{"job": {"id": true}}', "true"),
        (b'{"job": {"id": null}}', None),
        (b'{"job": {}}', None),
        (b'["not", "an", "object"]', None),
        (b"", None),
    ],
)
def test_body_source_values(payload: bytes, expected: str | None) -> None:
    assert key(body("job.id"), req(body=payload)) == expected


@pytest.mark.parametrize("payload", [b'{"job": {"id": {"x": 1}}}', b'{"job": {"id": [1]}}'])
def test_body_source_selecting_a_container_is_refused(payload: bytes) -> None:
    with pytest.raises(BadRequest, match="select a string or number"):
        key(body("job.id"), req(body=payload))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b'{"id": ', "not valid JSON"),
        (b'{"id": "a"} trailing', "not valid JSON"),
        (b'{"id": "\xff"}', "UTF-8"),
        (b'{"id": NaN}', "NaN"),
        (b'{"id": "a", "id": "b"}', "'id' more than once"),
        (b'{"id": "a", "x": {"y": 1, "y": 2}}', "'y' more than once"),
    ],
)
def test_bad_json_bodies_are_refused(payload: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        key(body("id"), req(body=payload))


def test_a_number_too_long_to_read_is_refused_in_words() -> None:
    """A JSON number of more digits than the gateway reads is refused saying so, never
    with Python's own advice (`sys.set_int_max_str_digits()`); one of 4,300 digits is
    read, as any valid number."""
    long = b"7" * 5000
    for payload in (b'{"id": ' + long + b"}", b'{"id": "a", "n": -' + long + b"}"):
        with pytest.raises(BadRequest) as refused:
            key(body("id"), req(body=payload))
        detail = str(refused.value.detail)
        assert "5000 digits" in detail and "4300" in detail, detail
        assert "sys." not in detail and "int_max_str_digits" not in detail, detail
    assert key(body("id"), req(body=b'{"id": "a", "n": ' + b"7" * 4300 + b"}")) == "a"


def nested(depth: int) -> bytes:
    return (b'{"a":' * (depth - 1)) + b'{"id": "deep"}' + b"}" * (depth - 1)


def test_json_depth_limit() -> None:
    path = ".".join(["a"] * (MAX_JSON_DEPTH - 1) + ["id"])
    assert key(body(path), req(body=nested(MAX_JSON_DEPTH))) == "deep"
    with pytest.raises(BadRequest, match="deeper than 64"):
        key(body("id"), req(body=nested(MAX_JSON_DEPTH + 1)))


def test_hostile_depth_is_a_bad_request_not_a_crash() -> None:
    with pytest.raises(BadRequest, match="deeper"):
        key(body("id"), req(body=b"[" * 200_000 + b"]" * 200_000))


#: Bodies past the depth check's threshold (more than MAX_JSON_DEPTH brackets) that
#: a backtracking string pattern reads in quadratic time, by the count `n` of their
#: repeated part: the attack (an unterminated string of escaped quotes), the same
#: ending in a lone backslash, strings that never close, closed strings, and brackets.
HOSTILE_BODIES = {
    "escaped-quotes": lambda n: b"[" * 65 + b'"' + b'\\"' * n,
    "escaped-quotes-then-backslash": lambda n: b"[" * 65 + b'"' + b'\\"' * n + b"\\",
    "quote-backslash": lambda n: b"[" * 65 + b'"\\' * n,
    "closed-strings": lambda n: b"[" * 65 + b'"a\\"b",' * n,
    "brackets-in-strings": lambda n: b'{"id": "x", "s": [' + b'"[{",' * n + b'"\\"]}',
    "shallow-brackets": lambda n: b"[" + b"[]," * n + b"[]]",
}


@pytest.mark.parametrize("shape", list(HOSTILE_BODIES))
def test_no_body_takes_more_than_linear_time_to_parse(shape: str) -> None:
    """Reading a key from a body (its depth check, then the parse) takes time in
    proportion to the body, whatever it holds: 8x the body, about 8x the time. A
    quadratic parse held the event loop 20 s for 80 KB of escaped quotes."""

    def parse(payload: bytes) -> None:
        try:
            req(body=payload).json_body()
        except BadRequest:
            pass  # most of them are no JSON: refused, which is the point

    assert_linear(parse, HOSTILE_BODIES[shape], 1000)


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    payload = b'{"id": "x", "s": "' + b"[{" * 100 + b'\\" [[["}'
    assert key(body("id"), req(body=payload)) == "x"


@pytest.mark.parametrize(
    "ctype", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_body_source_refuses_non_json_content_type(ctype: str) -> None:
    parts = req(headers=[("content-type", ctype)], body=b'{"id": "a"}')
    with pytest.raises(BadRequest, match="reads its key from a JSON body"):
        key(body("id"), parts)


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "text/plain", "x/unknown"])
def test_body_source_tolerates_sloppy_content_types(ctype: str) -> None:
    parts = req(headers=[("content-type", ctype)], body=b'{"id": "a"}')
    assert key(body("id"), parts) == "a"


# --- template source ---------------------------------------------------------


def test_template_with_all_placeholder_kinds() -> None:
    parts = req(
        method="put",
        path="/t/acme/jobs",
        query="q=9",
        headers=[("x-trial-day", "3")],
        body=b'{"user_id": 7, "u": {"name": "ann"}}',
        params={"tenant": "acme"},
    )
    text = "r:{body.user_id}:{header.X-Trial-Day}:{period}:{method}:{path}:{path.tenant}:{query.q}"
    assert key(template(text), parts) == "r:7:3:2026-11-01:PUT:/t/acme/jobs:acme:9"
    assert key(template("{body.u.name}"), parts) == "ann"


@pytest.mark.parametrize(
    "text", ["a:{header.X-Absent}", "a:{query.absent}", "a:{body.absent}", "a:{path.absent}"]
)
def test_template_with_a_missing_part_is_missing(text: str) -> None:
    assert key(template(text), req(body=b"{}")) is None


def test_template_literal_braces() -> None:
    assert key(template("{{job}}:{method}"), req()) == "{job}:POST"
    assert key(template("a }} b {{"), req()) == "a } b {"


@pytest.mark.parametrize("text", ["{method", "method}", "{unknown}", "{header}", "{body.[}"])
def test_malformed_templates_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        compile_template(text)


def test_template_is_compiled_once() -> None:
    assert compile_template("x:{method}:{body.a}") is compile_template("x:{method}:{body.a}")


def test_an_expression_that_cannot_evaluate_on_the_body_is_refused() -> None:
    # JMESPath functions raise on values of the wrong type: the caller's 400, not a 500.
    with pytest.raises(BadRequest, match="cannot be evaluated on this body"):
        key(body("length(a)"), req(body=b'{"a": 5}'))
    with pytest.raises(BadRequest, match=r"\{body.max_by\(a, &b\)\} cannot be evaluated"):
        key(template("x:{body.max_by(a, &b)}"), req(body=b'{"a": [{"b": 1}, {"b": "x"}]}'))


def test_template_part_selecting_an_object_is_refused() -> None:
    with pytest.raises(BadRequest, match="select a string or number"):
        key(template("{body.a}"), req(body=b'{"a": {"b": 1}}'))


# --- hash and period sources -------------------------------------------------


def hashed(parts: RequestParts, *names: str) -> str | None:
    return key(KeySource("hash", parts=names), parts)


def test_hash_is_deterministic_and_shaped() -> None:
    a = hashed(req(body=b"x", headers=[("x-run", "1")]), "method", "path", "body", "header.X-Run")
    b = hashed(req(body=b"x", headers=[("x-run", "1")]), "method", "path", "body", "header.X-Run")
    assert a == b
    assert a is not None and a.startswith("sha256:") and len(a) == 7 + 64


@pytest.mark.parametrize(
    "changed",
    [
        {"method": "PUT"},
        {"path": "/jobs/other"},
        {"query": "a=2"},
        {"body": b"{}"},
        {"headers": [("x-run", "2")]},
        {"headers": [("x-run", "")]},
    ],
)
def test_hash_changes_with_each_listed_part(changed: dict[str, Any]) -> None:
    names = ("method", "path", "query", "body", "header.X-Run")
    base: dict[str, Any] = {"query": "a=1", "headers": [("x-run", "1")]}
    assert hashed(req(**base), *names) != hashed(req(**{**base, **changed}), *names)


def test_hash_ignores_unlisted_parts_and_frames_parts() -> None:
    assert hashed(req(body=b"a"), "method") == hashed(req(body=b"b"), "method")
    assert hashed(req(query="a", body=b"bc"), "query", "body") != hashed(
        req(query="ab", body=b"c"), "query", "body"
    )
    assert hashed(req(), "header.X") != hashed(req(headers=[("x", "")]), "header.X")


def test_period_source_is_the_window() -> None:
    s = spec(KeySource("period"), period=Period(15, "m"))
    assert key(s, req()) == "2026-11-01T12:00+00:00"


# --- several sources, validation ---------------------------------------------


def test_first_present_source_wins() -> None:
    s = spec(header("Idempotency-Key"), query("run"), body("id"), KeySource("period"), period=DAY)
    full = req(headers=[("idempotency-key", "h")], query="run=q", body=b'{"id": "b"}')
    assert key(s, full) == "h"
    assert key(s, req(headers=[("idempotency-key", " ")], query="run=q")) == "q"
    assert key(s, req(query="run=", body=b'{"id": "b"}')) == "b"
    assert key(s, req(body=b'{"id": null}')) == "2026-11-01"
    assert key(spec(header("A"), query("b")), req()) is None


def wire(text: str) -> str:
    """A header value as the server hands it over: UTF-8 bytes decoded as latin-1."""
    return text.encode().decode("latin-1")


def test_key_length_limit_counts_characters() -> None:
    s = spec(header("K"), max_length=5)
    assert key(s, req(headers=[("k", wire("ééééé"))])) == "ééééé"
    with pytest.raises(BadRequest, match="6 characters; this route accepts at most 5"):
        key(s, req(headers=[("k", "abcdef")]))


@pytest.mark.parametrize("raw", ["a\x00b", "a\tb", "a\x7fb", wire("a\x85b"), '"a\x01"'])
def test_control_characters_are_refused(raw: str) -> None:
    with pytest.raises(BadRequest, match="control characters"):
        key(header("K"), req(headers=[("k", raw)]))


@pytest.mark.parametrize("raw", ["a\xffb", "\xe9\xe9", "a\x85b"])
def test_header_bytes_that_are_not_utf8_are_refused(raw: str) -> None:
    # Read as latin-1 they would be valid text, and a UTF-8 key like "…" would
    # instead read as control characters.
    with pytest.raises(BadRequest, match="not valid UTF-8"):
        key(header("K"), req(headers=[("k", raw)]))


def test_printable_unicode_and_punctuation_are_fine() -> None:
    for raw in ["ключ-1", "../../*:{tag}", "a b"]:
        assert key(header("K"), req(headers=[("k", raw)])) == raw


# --- windows -----------------------------------------------------------------


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


@pytest.mark.parametrize(
    ("period", "instant", "expected"),
    [
        (Period(15, "m"), "2026-11-01T13:29:59+00:00", "2026-11-01T13:15+00:00"),
        (Period(15, "m"), "2026-11-01T13:30:00+00:00", "2026-11-01T13:30+00:00"),
        (Period(1, "h"), "2026-11-01T13:59:59+00:00", "2026-11-01T13:00+00:00"),
        (Period(6, "h"), "2026-11-01T13:00:00+00:00", "2026-11-01T12:00+00:00"),
        (Period(1, "d"), "2026-11-01T23:59:59+00:00", "2026-11-01"),
        (Period(2, "d"), "1970-01-02T10:00:00+00:00", "1970-01-01"),
        (Period(2, "d"), "1970-01-03T10:00:00+00:00", "1970-01-03"),
        (Period(1, "w"), "2026-11-01T12:00:00+00:00", "2026-W44"),
        (Period(1, "w"), "2026-12-31T12:00:00+00:00", "2026-W53"),
        (Period(1, "w"), "2027-01-03T23:59:00+00:00", "2026-W53"),
        (Period(1, "w"), "2027-01-04T00:00:00+00:00", "2027-W01"),
        (Period(1, "w"), "2024-12-31T12:00:00+00:00", "2025-W01"),
        (Period(2, "w"), "1970-01-05T00:00:00+00:00", "1970-W01"),
        (Period(1, "mo"), "2026-01-31T23:59:59+00:00", "2026-01"),
        (Period(1, "mo"), "2026-02-28T23:59:59+00:00", "2026-02"),
        (Period(1, "mo"), "2028-02-29T12:00:00+00:00", "2028-02"),
        (Period(1, "mo"), "2026-12-31T23:59:59+00:00", "2026-12"),
        (Period(1, "mo"), "2027-01-01T00:00:00+00:00", "2027-01"),
        (Period(3, "mo"), "2026-11-15T00:00:00+00:00", "2026-10"),
        (Period(3, "mo"), "2026-03-31T00:00:00+00:00", "2026-01"),
        (Period(1, "d"), "2026-12-31T23:59:59+00:00", "2026-12-31"),
    ],
)
def test_windows_in_utc(period: Period, instant: str, expected: str) -> None:
    assert window_start(period, at(instant)) == expected


BERLIN = "Europe/Berlin"


@pytest.mark.parametrize(
    ("period", "instant", "expected"),
    [
        # Local midnight is 23:00 UTC in winter: the local date and month decide.
        (Period(1, "d", BERLIN), "2026-10-31T23:30:00+00:00", "2026-11-01"),
        (Period(1, "mo", BERLIN), "2026-01-31T23:30:00+00:00", "2026-02"),
        (Period(1, "mo", BERLIN), "2026-12-31T23:30:00+00:00", "2027-01"),
        (Period(1, "w", BERLIN), "2027-01-03T23:30:00+00:00", "2027-W01"),
        (Period(1, "h", BERLIN), "2026-11-01T12:30:00+00:00", "2026-11-01T13:00+01:00"),
        (Period(1, "h", "Asia/Kolkata"), "2026-11-01T12:10:00+00:00", "2026-11-01T17:00+05:30"),
    ],
)
def test_windows_follow_the_local_calendar(period: Period, instant: str, expected: str) -> None:
    assert window_start(period, at(instant)) == expected


def test_fall_back_repeated_wall_times_get_distinct_windows() -> None:
    # 2026-10-25: Berlin goes from 03:00 CEST back to 02:00 CET at 01:00 UTC.
    first, second = at("2026-10-25T00:15:00+00:00"), at("2026-10-25T01:15:00+00:00")
    assert window_start(Period(15, "m", BERLIN), first) == "2026-10-25T02:15+02:00"
    assert window_start(Period(15, "m", BERLIN), second) == "2026-10-25T02:15+01:00"
    assert window_start(Period(1, "h", BERLIN), first) == "2026-10-25T02:00+02:00"
    assert window_start(Period(1, "h", BERLIN), second) == "2026-10-25T02:00+01:00"
    assert window_start(Period(1, "d", BERLIN), first) == window_start(
        Period(1, "d", BERLIN), second
    )


def test_fall_back_multi_hour_window_stays_contiguous() -> None:
    # 2h windows start at even wall hours; 02:00 happens twice. Instants on
    # either side of the second 02:00 must not share a window with the first.
    p = Period(2, "h", BERLIN)
    assert window_start(p, at("2026-10-25T00:30:00+00:00")) == "2026-10-25T02:00+02:00"
    assert window_start(p, at("2026-10-25T01:30:00+00:00")) == "2026-10-25T02:00+01:00"
    assert window_start(p, at("2026-10-25T02:30:00+00:00")) == "2026-10-25T02:00+01:00"


def test_spring_forward_gap() -> None:
    # 2026-03-29: Berlin jumps from 02:00 CET to 03:00 CEST at 01:00 UTC.
    assert window_start(Period(1, "h", BERLIN), at("2026-03-29T00:59:00+00:00")) == (
        "2026-03-29T01:00+01:00"
    )
    assert window_start(Period(1, "h", BERLIN), at("2026-03-29T01:00:00+00:00")) == (
        "2026-03-29T03:00+02:00"
    )
    # The 2h window that would start at the missing 02:00 starts at the jump.
    assert window_start(Period(2, "h", BERLIN), at("2026-03-29T01:30:00+00:00")) == (
        "2026-03-29T03:00+02:00"
    )
    assert window_start(Period(15, "m", BERLIN), at("2026-03-29T01:20:00+00:00")) == (
        "2026-03-29T03:15+02:00"
    )


def test_window_start_needs_an_aware_datetime() -> None:
    with pytest.raises(ValueError):
        window_start(DAY, datetime(2026, 1, 1))


ZONES = [
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "America/Santiago",
    "Australia/Lord_Howe",
    "Asia/Kolkata",
    "Pacific/Chatham",
]
SHORT_PERIODS = [Period(15, "m"), Period(1, "h"), Period(2, "h"), Period(5, "h"), Period(1, "d")]
LENGTH = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1)}
instants = st.datetimes(
    min_value=datetime(1971, 1, 1), max_value=datetime(2099, 12, 31), timezones=st.just(UTC)
)


def in_zone(p: Period, zone: str) -> Period:
    return Period(p.count, p.unit, zone)


@no_db
@given(instants, st.integers(0, 24 * 60 - 1))
def test_utc_day_is_shared_within_the_day(t: datetime, minutes: int) -> None:
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    later = start + timedelta(minutes=minutes)
    assert window_start(DAY, later) == window_start(DAY, start) == start.date().isoformat()


# These zones shift by at most an hour, so no window outgrows its period by more.
@no_db
@given(instants, st.sampled_from(SHORT_PERIODS), st.sampled_from(ZONES))
def test_instants_a_period_and_an_hour_apart_never_share(
    t: datetime, period: Period, zone: str
) -> None:
    p = in_zone(period, zone)
    gap = LENGTH[p.unit] * p.count + timedelta(hours=1)
    assert window_start(p, t) != window_start(p, t + gap)


@no_db
@given(
    instants, st.integers(0, 6 * 3600), st.sampled_from(SHORT_PERIODS[:4]), st.sampled_from(ZONES)
)
def test_short_windows_name_their_start_and_are_monotonic(
    t: datetime, seconds: int, period: Period, zone: str
) -> None:
    p = in_zone(period, zone)
    u = t + timedelta(seconds=seconds)
    start_t, start_u = at(window_start(p, t)), at(window_start(p, u))
    assert start_t <= t and start_u <= u
    assert start_t <= start_u  # so every window is one contiguous stretch of time
    assert window_start(p, start_t) == window_start(p, t)


# --- scope, digest, fingerprint ------------------------------------------------


def test_scope_separates_tenants_without_storing_secrets() -> None:
    s = spec(header("K"), scope=("header.Authorization",))
    alice = scope_value(s, req(headers=[("authorization", "Bearer alice")]))
    bob = scope_value(s, req(headers=[("authorization", "Bearer bob")]))
    assert alice != bob and len(alice) == 64
    assert "alice" not in alice
    assert scope_value(s, req()) == scope_value(s, req(headers=[("authorization", "")]))
    assert scope_value(spec(header("K")), req(headers=[("authorization", "x")])) == ""


def test_scope_values_are_framed() -> None:
    s = spec(header("K"), scope=("header.A", "query.t"))
    assert scope_value(s, req(headers=[("a", "xy")])) != scope_value(
        s, req(headers=[("a", "x")], query="t=y")
    )


def test_record_digest_separates_routes_scopes_and_keys() -> None:
    d = record_digest("r", "s", "k")
    assert len(d) == 32 and int(d, 16) >= 0
    assert d == record_digest("r", "s", "k")
    others = {
        record_digest("r2", "s", "k"),
        record_digest("r", "s2", "k"),
        record_digest("r", "s", "k2"),
    }
    assert d not in others and len(others) == 3
    # Concatenation tricks must not collide.
    assert record_digest("a:b", "", "c") != record_digest("a", "", "b:c")
    assert record_digest("a", "b", "c") != record_digest("ab", "", "c")
    assert record_digest("r", "", "../../*") != record_digest("r", "", "../..")


@no_db
@given(st.tuples(st.text(), st.text(), st.text()), st.tuples(st.text(), st.text(), st.text()))
def test_record_digest_is_injective(a: tuple[str, str, str], b: tuple[str, str, str]) -> None:
    assert (record_digest(*a) == record_digest(*b)) == (a == b)


FIELDS = ("method", "path", "query", "body", "header.X-Run")


def test_fingerprint_none_is_empty() -> None:
    assert fingerprint((), req(body=b"x")) == ""


@pytest.mark.parametrize(
    ("field", "changed"),
    [
        ("method", {"method": "PUT"}),
        ("path", {"path": "/other"}),
        ("query", {"query": "a=2"}),
        ("body", {"body": b"y"}),
        ("header.X-Run", {"headers": [("x-run", "2")]}),
    ],
)
def test_fingerprint_tracks_each_field(field: str, changed: dict[str, Any]) -> None:
    base: dict[str, Any] = {"query": "a=1", "body": b"x", "headers": [("x-run", "1")]}
    a, b = req(**base), req(**{**base, **changed})
    assert len(fingerprint(FIELDS, a)) == 32
    assert fingerprint(FIELDS, a) != fingerprint(FIELDS, b)
    assert fingerprint((field,), a) != fingerprint((field,), b)
    rest = tuple(f for f in FIELDS if f != field)
    assert fingerprint(rest, a) == fingerprint(rest, b)


def test_fingerprint_is_framed() -> None:
    fields = ("query", "body")
    assert fingerprint(fields, req(query="a", body=b"bc")) != fingerprint(
        fields, req(query="ab", body=b"c")
    )
