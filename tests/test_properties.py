"""Property tests: key extraction, templates, period windows and config parsing.

Each property runs a fixed number of hypothesis examples with `derandomize=True` and
no example database, so CI runs the same examples every time. Every test records in
the ledger how many examples it ran (`requests`) and how many invalid inputs it tried
(`bad_inputs`), in a `finally`, so a failing run still reports what it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import string
import zoneinfo
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import jmespath
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import Config, KeySource, KeySpec, Period, load_config, parse_config
from gateway.config.templates import compile_template
from gateway.errors import BadRequest, ConfigError
from gateway.keying import (
    RequestParts,
    extract_key,
    record_digest,
    scope_value,
    window_start,
)
from gateway.records import KeyRef
from gateway.store.redis import BUCKETS, RedisStore
from tests.support.ledger import Ledger
from tests.support.request_parts import req


def profile(examples: int) -> settings:
    """Reproducible in CI: the same examples every run, nothing written to disk."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@dataclass
class Tally:
    examples: int = 0
    bad: int = 0
    detail: str = ""


@contextmanager
def tallied(ledger: Ledger, test: str) -> Iterator[Tally]:
    tally = Tally()
    try:
        yield tally
    finally:
        ledger.record(
            "properties",
            test,
            requests=tally.examples,
            bad_inputs=tally.bad,
            detail=tally.detail or f"{tally.examples} examples",
        )


NOW = datetime(2026, 11, 1, 12, 7, 30, tzinfo=UTC)


def spec_of(*sources: KeySource, **kw: Any) -> KeySpec:
    return KeySpec(sources=sources, **kw)


def body_source(expr: str) -> KeySource:
    return KeySource("body", expr, compiled=jmespath.compile(expr))


def outcome(call: Callable[[], str | None]) -> tuple[str, str | None]:
    """A key or the kind of refusal, so two runs can be compared whatever happens."""
    try:
        return ("key", call())
    except BadRequest as exc:
        return ("bad", str(exc))


# -- key extraction --------------------------------------------------------------------

#: Key text a client may send: printable, no control characters, not blank.
key_text = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp")),
    min_size=1,
    max_size=40,
).filter(lambda s: s.strip() == s and s.strip() != "")
any_text = st.text(max_size=40)


def wire(text: str) -> str:
    """A header value as the server hands it over: its UTF-8 bytes, decoded latin-1."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1")


def sf_string(value: str) -> str:
    """`value` as a structured-field string, the IETF draft's Idempotency-Key form."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def test_extraction_is_deterministic(ledger: Ledger) -> None:
    sources = [
        KeySource("header", "Idempotency-Key"),
        KeySource("query", "run"),
        body_source("job_key"),
        KeySource("template", "t:{header.Idempotency-Key}:{query.run}:{body.job_key}"),
        KeySource("hash", parts=("method", "path", "query", "body")),
    ]
    with tallied(ledger, "test_extraction_is_deterministic") as tally:

        @profile(300)
        @given(
            header=any_text,
            run=any_text,
            body=st.one_of(any_text.map(lambda v: json.dumps({"job_key": v})), any_text),
            source=st.sampled_from(sources),
        )
        def check(header: str, run: str, body: str, source: KeySource) -> None:
            tally.examples += 1
            spec = spec_of(source)

            def parts() -> RequestParts:
                return req(
                    headers=[("idempotency-key", wire(header))],
                    query="run=" + quote(run),
                    body=body.encode(),
                )

            first = outcome(lambda: extract_key(spec, parts(), NOW))
            tally.bad += first[0] == "bad"
            assert outcome(lambda: extract_key(spec, parts(), NOW)) == first
            if first[0] == "key" and first[1] is not None:
                key = first[1]
                assert record_digest("r", "", key) == record_digest("r", "", key)

        check()


def test_equivalent_requests_give_one_record(ledger: Ledger) -> None:
    with tallied(ledger, "test_equivalent_requests_give_one_record") as tally:

        @profile(300)
        @given(
            value=key_text,
            pad=st.sampled_from(["", " ", "  ", "\t"]),
            other=st.dictionaries(st.text(max_size=5), st.integers() | any_text, max_size=4),
            order=st.randoms(use_true_random=False),
            indent=st.sampled_from([None, 0, 2]),
            separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
        )
        def check(
            value: str,
            pad: str,
            other: dict[str, Any],
            order: Any,
            indent: int | None,
            separators: tuple[str, str],
        ) -> None:
            tally.examples += 1
            digests: set[str] = set()

            def record(source: KeySource, parts: RequestParts) -> None:
                key = extract_key(spec_of(source), parts, NOW)
                assert key == value, (source, parts, key)
                digests.add(record_digest("r", "", key))

            header = KeySource("header", "Idempotency-Key")
            # A quoted structured-field string and the bare value are the same key.
            record(header, req(headers=[("idempotency-key", wire(pad + sf_string(value) + pad))]))
            if not value.startswith('"'):
                record(header, req(headers=[("idempotency-key", wire(pad + value + pad))]))
            # Any percent-encoding of the query value.
            for encoded in (quote(value, safe=""), quote_plus(value), quote(value, safe="/:@")):
                if "&" not in encoded and "#" not in encoded:
                    record(KeySource("query", "run"), req(query=f"x=1&run={encoded}&run=2"))
            # Any field order and whitespace of the JSON body.
            fields = [("job_key", value), *((k, v) for k, v in other.items() if k != "job_key")]
            order.shuffle(fields)
            text = json.dumps(dict(fields), indent=indent, separators=separators)
            record(body_source("job_key"), req(body=text.encode()))
            assert len(digests) == 1

        check()


def test_different_keys_and_tenants_never_share_a_record(ledger: Ledger) -> None:
    scoped = spec_of(KeySource("header", "Idempotency-Key"), scope=("header.Authorization",))
    with tallied(ledger, "test_different_keys_and_tenants_never_share_a_record") as tally:

        @profile(300)
        @given(a=key_text, b=key_text, tenant_a=any_text, tenant_b=any_text)
        def check(a: str, b: str, tenant_a: str, tenant_b: str) -> None:
            tally.examples += 1

            def digest(key: str, tenant: str) -> str:
                parts = req(headers=[("idempotency-key", wire(sf_string(key)))])
                if tenant:
                    parts.headers.append(("authorization", wire(tenant)))
                extracted = extract_key(scoped, parts, NOW)
                assert extracted == key
                scope = scope_value(scoped, parts)
                # A hash of the tenant's value: the secret itself is never stored.
                assert len(scope) == 64 and all(c in "0123456789abcdef" for c in scope)
                return record_digest("route", scope, extracted)

            same_key, same_tenant = a == b, tenant_a == tenant_b
            assert (digest(a, tenant_a) == digest(b, tenant_b)) == (same_key and same_tenant)
            # Unscoped, two keys share a record exactly when they are equal.
            assert (record_digest("route", "", a) == record_digest("route", "", b)) == same_key

        check()


def test_record_names_are_hashed_and_tagged(ledger: Ledger) -> None:
    from gateway.config import StoreConfig

    # Never connects: the names are computed locally.
    store = RedisStore(StoreConfig(url="redis://127.0.0.1:9/0", prefix="idem:"))
    with tallied(ledger, "test_record_names_are_hashed_and_tagged") as tally:

        @profile(300)
        @given(route=st.text(min_size=1, max_size=20), scope=any_text, key=key_text)
        def check(route: str, scope: str, key: str) -> None:
            tally.examples += 1
            digest = record_digest(route, scope, key)
            assert len(digest) == 32 and all(c in string.hexdigits.lower() for c in digest)
            keys, (member, channel) = store._keys(KeyRef(digest, route, key))
            bucket = int(digest[:4], 16) % BUCKETS
            tag = f"idem:{{{bucket:02x}}}:"
            assert keys[0] == tag + digest
            # One slot for the record's keys; on one server, the route's admission
            # marks beside them (a Cluster keeps those apart: redis_admission.py).
            assert all(k.startswith(tag) for k in keys[:-1]) and channel.startswith(tag)
            assert member == f"{digest}/{route}"
            # Only hex digests, fixed names and the route's (config, not the caller's): a
            # user's key never reaches a Redis name.
            states = ("unresolved", "parked", "claimed", "queued", "retrying")
            indexes = [tag + "i:in_flight", *(f"{tag}i:{s}:{route}" for s in states)]
            rest = [tag + "n", tag + "rq:" + digest, tag + "ls", f"{tag}i:completed:{route}"]
            admitted = "idem:{q:" + route + "}:admitted"
            assert keys == [tag + digest, *indexes, *rest, admitted] and channel == tag + "c"

        try:
            check()
        finally:
            asyncio.run(store.close())


# -- templates --------------------------------------------------------------------------

#: Placeholders whose values the test sets freely, and how to put a value in a request.
PLACEHOLDERS = ("body.a", "body.b", "header.X-C", "query.d", "path.e", "method")
SEPARATOR_CHARS = ":-/|.\\ {}"


def render(template: str, values: dict[str, str], now: datetime = NOW) -> str | None:
    params = {"e": values["path.e"]} if "path.e" in values else {}
    parts = req(
        method=values.get("method", "POST"),
        headers=[("x-c", wire(values["header.X-C"]))] if "header.X-C" in values else [],
        query="d=" + quote(values["query.d"], safe="") if "query.d" in values else "",
        body=json.dumps({k[5:]: v for k, v in values.items() if k.startswith("body.")}).encode(),
        params=params,
    )
    spec = spec_of(KeySource("template", template), period=Period(1, "h", "Europe/Berlin"))
    return extract_key(spec, parts, now)


@st.composite
def templates(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    """A template of 2-3 placeholders with non-empty separators made of tricky characters."""
    names = draw(st.lists(st.sampled_from(PLACEHOLDERS), min_size=2, max_size=3, unique=True))
    literal = st.text(st.sampled_from(SEPARATOR_CHARS + "ab"), min_size=1, max_size=3)
    separators = [draw(literal) for _ in names[1:]]
    # The backslash is the escape character: a separator may not start with it.
    separators = ["-" + s if s.startswith("\\") else s for s in separators]
    head = draw(st.text(st.sampled_from("ab:"), max_size=2))
    tail = draw(st.text(st.sampled_from("ab:"), max_size=2))
    text = head
    for name, separator in itertools.zip_longest(names, separators, fillvalue=""):
        escaped = separator.replace("{", "{{").replace("}", "}}")
        text += "{" + name + "}" + escaped
    return text + tail, names, separators


def test_template_rendering_is_injective(ledger: Ledger) -> None:
    """For each random template, every assignment of short values over an alphabet of
    its own separator characters gives its own key: exhaustive, not sampled."""
    with tallied(ledger, "test_template_rendering_is_injective") as tally:

        @profile(60)
        @given(templates())
        def check(drawn: tuple[str, list[str], list[str]]) -> None:
            template, names, separators = drawn
            tally.examples += 1
            # The characters that could blur a boundary: separators' own, and the escape.
            tricky = sorted({c for s in separators for c in s[:2]} - {"a"})
            alphabet = sorted({"a", "\\", *tricky[: 3 if len(names) == 2 else 1]})
            longest = 2
            values = [
                "".join(chars)
                for n in range(1, longest + 1)
                for chars in itertools.product(alphabet, repeat=n)
            ]
            seen: dict[str, tuple[str, ...]] = {}
            for combo in itertools.product(values, repeat=len(names)):
                assignment = dict(zip(names, combo, strict=True))
                if "method" in assignment:
                    assignment["method"] = assignment["method"].upper()
                if any(not v.strip() for v in assignment.values()):
                    continue
                key = render(template, assignment)
                assert key is not None
                other = seen.setdefault(key, combo)
                assert other == combo, f"{template!r}: {other} and {combo} both give {key!r}"

        check()


@pytest.mark.parametrize(
    "template", ["{body.a}:{period}", "{period}:{body.a}", "{period}-{body.a}+"]
)
def test_template_with_period_stays_injective(ledger: Ledger, template: str) -> None:
    """{period} is written as the gateway formats it, unescaped: still one key per
    (value, window), with values made of the period's own characters."""
    # Instants around Berlin's fall-back hour: the repeated wall hour has two windows.
    start = datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    instants = [start + timedelta(hours=i) for i in range(4)]
    seen: dict[str, tuple[str, str]] = {}
    with tallied(ledger, f"test_template_with_period_stays_injective[{template}]") as tally:
        for n in (1, 2, 3):
            for chars in itertools.product(":-+0T", repeat=n):
                for now in instants:
                    tally.examples += 1
                    value = "".join(chars)
                    key = render(template, {"body.a": value}, now)
                    assert key is not None
                    window = window_start(Period(1, "h", "Europe/Berlin"), now)
                    other = seen.setdefault(key, (value, window))
                    assert other == (value, window), (template, key, other, value, window)
    assert len({w for _, w in seen.values()}) == 4


@pytest.mark.parametrize(
    ("template", "first", "second"),
    [
        ("{body.a}:{body.b}", {"body.a": "a:b", "body.b": "c"}, {"body.a": "a", "body.b": "b:c"}),
        ("x{body.a}-{body.b}", {"body.a": "1-2", "body.b": "3"}, {"body.a": "1", "body.b": "2-3"}),
        ("{body.a}:{body.b}", {"body.a": "a\\", "body.b": "b"}, {"body.a": "a", "body.b": "\\:b"}),
    ],
)
def test_template_parts_with_separators_do_not_collide(
    template: str, first: dict[str, str], second: dict[str, str]
) -> None:
    # Parts joined as they come, without separators, would give these pairs one key.
    assert render(template, first) != render(template, second)


def test_template_keys_without_separators_in_values_are_unchanged() -> None:
    values = {"body.a": "user-42", "body.b": "day 3"}
    assert render("reminder:{body.a}:{body.b}", values) == "reminder:user-42:day 3"
    assert render("{body.a}:{body.b}", {"body.a": "a:b", "body.b": "c"}) == "a\\:b:c"
    assert render("r:{body.a}:{period}", {"body.a": "7"}) == "r:7:2026-11-01T13:00+01:00"


@pytest.mark.parametrize("template", ["{body.a}{body.b}", "x:{method}{path}", "{body.a}\\{body.b}"])
def test_templates_that_cannot_be_injective_are_refused(template: str) -> None:
    with pytest.raises(ValueError, match="separator"):
        compile_template(template)


def test_config_refuses_templates_that_would_collide() -> None:
    data = {
        "routes": [
            {
                "name": name,
                "match": {"path": f"/{name}"},
                "upstream": "http://127.0.0.1:5000",
                "key": {"template": template},
            }
            for name, template in [
                ("glued", "{header.A}{query.b}"),
                ("slash", "r:{header.A}\\x{query.b}"),
                ("fine", "r:{header.A}:{query.b}"),
            ]
        ]
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "f.yaml")
    found = {issue.path: issue.message for issue in caught.value.issues}
    assert set(found) == {"routes[0].key.template", "routes[1].key.template"}
    assert (
        "put a separator between them, e.g. {header.A}:{query.b}" in found["routes[0].key.template"]
    )


#: Placeholders and text of templates, good and bad: the config decides which it accepts.
PLACEHOLDER_BITS = [
    "{period}", "{method}", "{path}", "{path.p}", "{header.X-A}", "{query.k}", "{body.a}",
    "{body.a.b}", "{body.a[0]}", "{ period }", "{body.length(a)}", "{body.abs(a)}",
    "{body.sort(a)}", "{body.max_by(a, &b)}", "{body.to_string(a)}", "{body.a || `1`}",
    "{body.*}", "{body.a[?b > `1`]}", "{body.sum(a)}",
]  # fmt: skip
TEXT_BITS = [":", "-", "a", " ", ":{{", "}}:", "\\", "", "{", "}", "{path.q}", "{perod}", "{x}"]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text("ab:\\", max_size=3)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("ab"), inner, max_size=2)
    ),
    max_leaves=6,
)


def test_templates_the_config_accepts_never_fail_on_a_request(ledger: Ledger) -> None:
    """A key the config accepted either renders or refuses the request (400): no other
    exception, which would be a 500, whatever the body holds."""
    with tallied(ledger, "test_templates_the_config_accepts_never_fail_on_a_request") as tally:

        @profile(600)
        @given(
            bits=st.lists(
                st.tuples(st.sampled_from(PLACEHOLDER_BITS), st.sampled_from(TEXT_BITS)),
                min_size=1,
                max_size=3,
            ),
            body=st.one_of(json_values.map(json.dumps), st.sampled_from(["", "x", "[1, 2]"])),
            as_source=st.booleans(),
        )
        def check(bits: list[tuple[str, str]], body: str, as_source: bool) -> None:
            tally.examples += 1
            template = "".join(placeholder + text for placeholder, text in bits)
            key: dict[str, Any] = {"template": template, "period": "1h"}
            if as_source and bits[0][0].startswith("{body."):
                key = {"body": bits[0][0][6:-1]}  # the same expression as a body: source
            route = {"name": "t", "match": {"path": "/t/{p}"}, "upstream": "http://h", "key": key}
            try:
                config = parse_config({"routes": [route]}, "t.yaml", {})
            except ConfigError:
                tally.bad += 1
                return
            spec = config.routes[0].key
            assert spec is not None
            parts = req(headers=[("x-a", "1")], query="k=2", body=body.encode(), params={"p": "3"})
            with contextlib.suppress(BadRequest):  # refused to the caller: the design
                extract_key(spec, parts, NOW)

        check()
        assert tally.bad < tally.examples


# -- period windows ----------------------------------------------------------------------

ALL_ZONES = sorted(zoneinfo.available_timezones())
SUB_DAY = [Period(15, "m"), Period(30, "m"), Period(1, "h"), Period(2, "h"), Period(3, "h")]
CALENDAR = [Period(1, "d"), Period(2, "d"), Period(1, "w"), Period(1, "mo"), Period(3, "mo")]
TICK = timedelta(microseconds=1)


def zoned(period: Period, zone: str) -> Period:
    return Period(period.count, period.unit, zone)


def check_window(period: Period, t: datetime) -> str:
    """The window holding `t` holds it, and its key names exactly where it starts."""
    key = window_start(period, t)
    local = t.astimezone(zoneinfo.ZoneInfo(period.timezone))
    if period.unit in ("m", "h"):
        start = datetime.fromisoformat(key)
        size = timedelta(minutes=period.count * (60 if period.unit == "h" else 1))
        assert start <= t, (period, t, key)
        # Wall-clock floors can stretch a window by a DST shift, never more than 2 hours,
        # and the local clock never shows a full window's length past its start.
        assert t - start < size + timedelta(hours=2), (period, t, key)
        wall = t.astimezone(local.tzinfo).replace(tzinfo=None)
        assert wall - start.astimezone(local.tzinfo).replace(tzinfo=None) < size, (period, t, key)
        assert window_start(period, start) == key, (period, t, key)  # its own start is in it
        assert window_start(period, start - TICK) != key, (period, t, key)  # and is the start
        middle = start + (t - start) / 2
        assert window_start(period, middle) == key, (period, t, key, middle)
    elif period.unit == "d":
        first = date.fromisoformat(key)
        assert first <= local.date() < first + timedelta(days=period.count), (period, t, key)
    elif period.unit == "w":
        year, week, _ = local.date().isocalendar()
        assert key == f"{year}-W{week:02d}", (period, t, key)
    else:
        year, month = (int(x) for x in key.split("-"))
        months = (local.year - year) * 12 + local.month - month
        assert 0 <= months < period.count, (period, t, key)
    return key


def check_sequence(period: Period, instants: list[datetime]) -> int:
    """Along increasing instants windows never overlap: a key, once left, never comes
    back, and keys only grow (so consecutive windows leave no gaps either)."""
    left: set[str] = set()
    previous = ""
    for t in instants:
        key = check_window(period, t)
        if key != previous:
            assert key not in left, (period, t, key, previous)
            if previous:
                if period.unit in ("m", "h"):
                    assert datetime.fromisoformat(key) > datetime.fromisoformat(previous)
                else:
                    assert key > previous, (period, t, key, previous)
                left.add(previous)
            previous = key
    return len(instants)


def transitions(zone: str, start: datetime, end: datetime) -> list[datetime]:
    """Instants (to the second) where the zone's UTC offset changes."""
    tz = zoneinfo.ZoneInfo(zone)
    found: list[datetime] = []
    step = timedelta(days=2)
    t = start
    while t < end:
        u = t + step
        if t.astimezone(tz).utcoffset() != u.astimezone(tz).utcoffset():
            lo, hi = t, u
            while hi - lo > timedelta(seconds=1):
                mid = lo + (hi - lo) / 2
                mid = mid.replace(microsecond=0)
                if mid.astimezone(tz).utcoffset() == lo.astimezone(tz).utcoffset():
                    lo = mid
                else:
                    hi = mid
            found.append(hi)
        t = u
    return found


def test_windows_around_every_offset_change_of_every_zone(ledger: Ledger) -> None:
    """Every zone in zoneinfo, every offset change (DST and others) from 2024 to 2026:
    instants from 2 hours before to 2 hours after, every 15 minutes and one second
    either side, for sub-day windows and days."""
    begin, end = datetime(2024, 1, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)
    changes = 0
    with tallied(ledger, "test_windows_around_every_offset_change_of_every_zone") as tally:
        for zone in ALL_ZONES:
            for change in transitions(zone, begin, end):
                changes += 1
                instants = sorted(
                    {change + timedelta(minutes=15 * k) for k in range(-8, 9)}
                    | {change - timedelta(seconds=1), change + timedelta(seconds=1)}
                )
                for period in [*SUB_DAY[:1], *SUB_DAY[2:], Period(1, "d")]:
                    tally.examples += check_sequence(zoned(period, zone), instants)
                tally.detail = f"{len(ALL_ZONES)} zones, {changes} offset changes"
    assert changes > 300  # the sweep really found the world's DST changes


def test_windows_at_calendar_edges_in_every_zone(ledger: Ledger) -> None:
    """Month ends, leap days and year ends, at local midnight and just before, in every zone."""
    edges = [
        (2024, 2, 28), (2024, 2, 29), (2024, 3, 1), (2025, 2, 28), (2025, 3, 1),
        (2026, 1, 31), (2026, 2, 1), (2026, 4, 30), (2026, 5, 1), (2026, 12, 31),
        (2027, 1, 1), (2027, 1, 4), (2028, 2, 29), (2028, 12, 31), (2029, 1, 1),
    ]  # fmt: skip
    with tallied(ledger, "test_windows_at_calendar_edges_in_every_zone") as tally:
        for zone in ALL_ZONES:
            tz = zoneinfo.ZoneInfo(zone)
            instants: set[datetime] = set()
            for y, m, d in edges:
                midnight = datetime(y, m, d, tzinfo=tz).astimezone(UTC)
                instants |= {midnight - TICK, midnight, midnight + timedelta(hours=12)}
            ordered = sorted(instants)
            for period in CALENDAR:
                tally.examples += check_sequence(zoned(period, zone), ordered)


def test_windows_at_random_instants_in_random_zones(ledger: Ledger) -> None:
    with tallied(ledger, "test_windows_at_random_instants_in_random_zones") as tally:

        @profile(400)
        @given(
            zone=st.sampled_from(ALL_ZONES),
            period=st.sampled_from([*SUB_DAY, *CALENDAR]),
            t=st.datetimes(
                min_value=datetime(1971, 1, 1),
                max_value=datetime(2099, 12, 31),
                timezones=st.just(UTC),
            ),
            later=st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=3)),
        )
        def check(zone: str, period: Period, t: datetime, later: timedelta) -> None:
            tally.examples += 1
            check_sequence(zoned(period, zone), [t, t + later / 3, t + later])

        check()


def test_fall_back_by_two_hours_keeps_windows_contiguous() -> None:
    # Antarctica/Troll falls back from +02 to +00 at 01:00 UTC. The 2h window 02:00+02
    # begins at 00:00 UTC; read from the wall clock alone, 01:00 UTC (01:00+00) would go
    # back to the window before it, 00:00+02, which ended an hour earlier, and a job
    # run at 22:30 UTC and one at 01:30 UTC would share a key.
    troll = Period(2, "h", "Antarctica/Troll")
    at = [datetime(2024, 10, 26, 22, 30, tzinfo=UTC) + timedelta(hours=h) for h in range(5)]
    assert [window_start(troll, t) for t in at] == [
        "2024-10-27T00:00+02:00",
        "2024-10-27T00:00+02:00",
        "2024-10-27T02:00+02:00",
        "2024-10-27T02:00+02:00",  # 01:30+00: the window under way goes on
        "2024-10-27T02:00+00:00",
    ]


# -- config parsing ----------------------------------------------------------------------

VALID = {
    "server": {"listen": "127.0.0.1:8080", "shutdown_grace": "30s"},
    "admin": {"listen": "127.0.0.1:9090", "token": "t"},
    "store": {"url": "memory://", "prefix": "idem:"},
    "defaults": {"upstream_timeout": "30s", "cache_statuses": ["2xx", "!408"]},
    "routes": [
        {
            "name": "send-reminder",
            "match": {"methods": ["POST"], "path": "/jobs/{name}"},
            "upstream": "http://127.0.0.1:5000",
            "key": {"sources": [{"header": "Idempotency-Key"}, {"body": "job_key"}]},
            "on_unknown_outcome": "reconcile",
            "reconcile": {"url": "http://127.0.0.1:5000/status/{key}", "done": [200]},
        },
        {
            "name": "report",
            "match": {"path": "/report/{x}"},
            "upstream": "http://127.0.0.1:5000",
            "key": {"template": "r:{path.x}:{period}", "period": "1d", "timezone": "UTC"},
        },
    ],
}
TOP = ("server", "admin", "store", "defaults", "routes")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["30s", "0", "-1s", "1MiB", "${X}", "${X:?gone}", "$${X}", "2xx", "!408",
                     "/jobs/{a}", "{body.a}{x}", "http://[::1", "memory://", "redis://h:99999"]),
)  # fmt: skip
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.one_of(st.text(max_size=8), st.integers(), st.none()), inner, max_size=3
        ),
    ),
    max_leaves=8,
)


def paths(data: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from paths(v, (*prefix, i))


def replaced(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(data, dict):
        return {**data, head: replaced(data[head], rest, value)}
    copy = list(data)
    copy[head] = replaced(copy[head], rest, value)
    return copy


@st.composite
def configs(draw: st.DrawFn) -> Any:
    """The valid config with one to three subtrees replaced, removed or added at random."""
    data: Any = VALID
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(data))))
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if action == "remove" and where and isinstance(data, dict):
            parent = where[:-1]
            node = data
            for step in parent:
                node = node[step]
            if isinstance(node, dict):
                data = replaced(data, parent, {k: v for k, v in node.items() if k != where[-1]})
                continue
        if action == "add":
            value = draw(junk)
            node = data
            for step in where:
                node = node[step]
            if isinstance(node, dict):
                name = draw(st.sampled_from(["key", "period", "scope", "extra", "url", "tls"]))
                data = replaced(data, where, {**node, name: value})
                continue
        data = replaced(data, where, draw(junk))
    return data


def check_config_answer(call: Callable[[], Any], tally: Tally) -> None:
    try:
        call()
    except ConfigError as exc:
        tally.bad += 1
        text = str(exc)
        assert exc.issues, text
        assert "Traceback" not in text and 'File "' not in text, text
        for issue in exc.issues:
            # Every problem names where it is: a YAML path under a known section, or
            # the whole file ("") when the file itself is the problem.
            head = issue.path.split(".")[0].split("[")[0]
            unknown_name = issue.message.startswith("unknown setting")
            assert head in TOP or issue.path == "" or unknown_name, issue
            assert issue.message.strip(), issue


def test_config_parsing_answers_config_or_config_error(ledger: Ledger) -> None:
    env = {"X": "30s"}
    with tallied(ledger, "test_config_parsing_answers_config_or_config_error") as tally:

        @profile(500)
        @given(st.one_of(configs(), junk))
        def check(data: Any) -> None:
            tally.examples += 1
            check_config_answer(lambda: parse_config(data, "gateway.yaml", env), tally)

        assert isinstance(parse_config(VALID, "gateway.yaml", env), Config)
        check()
        assert tally.bad < tally.examples  # some random changes still make a valid config


def test_config_files_answer_config_or_config_error(ledger: Ledger, tmp_path: Path) -> None:
    text = yaml.safe_dump(VALID, sort_keys=False)
    file = tmp_path / "gateway.yaml"
    with tallied(ledger, "test_config_files_answer_config_or_config_error") as tally:

        @profile(300)
        @given(
            st.one_of(
                configs().map(lambda d: yaml.safe_dump(d, sort_keys=False)),
                st.tuples(st.integers(0, len(text)), st.integers(0, 8), st.text(max_size=6)).map(
                    lambda cut: text[: cut[0]] + cut[2] + text[cut[0] + cut[1] :]
                ),
                st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
            )
        )
        def check(content: str) -> None:
            tally.examples += 1
            file.write_bytes(content.encode("utf-8", "surrogatepass"))
            check_config_answer(lambda: load_config(file), tally)

        check()
        assert tally.bad < tally.examples
