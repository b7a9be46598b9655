"""Property tests: key extraction, templates, period windows and config parsing.

Each property runs a fixed number of hypothesis examples with `derandomize=True` and
no example database, so CI runs the same examples every time. Every test records in
the ledger how many examples it ran (`requests`) and how many invalid inputs it tried
(`bad_inputs`), in a `finally`, so a failing run still reports what it saw.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, quote_plus

import jmespath
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import KeySource, KeySpec, Period
from gateway.errors import BadRequest
from gateway.keys import (
    RequestParts,
    extract_key,
    parse_template,
    record_digest,
    scope_value,
    window_start,
)
from gateway.records import KeyRef
from gateway.store.redis import BUCKETS, RedisStore
from tests.support.ledger import Ledger


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


@contextmanager
def tallied(ledger: Ledger, test: str, detail: str = "") -> Iterator[Tally]:
    tally = Tally()
    try:
        yield tally
    finally:
        ledger.record(
            "properties",
            test,
            requests=tally.examples,
            bad_inputs=tally.bad,
            detail=detail or f"{tally.examples} examples",
        )


NOW = datetime(2026, 11, 1, 12, 7, 30, tzinfo=UTC)


def req(
    *,
    method: str = "POST",
    path: str = "/jobs/run",
    query: str = "",
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    params: dict[str, str] | None = None,
) -> RequestParts:
    return RequestParts(method, path, query, headers or [], body, params or {})


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
                    headers=[("idempotency-key", header)],
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
            record(header, req(headers=[("idempotency-key", pad + sf_string(value) + pad)]))
            if not value.startswith('"'):
                record(header, req(headers=[("idempotency-key", pad + value + pad)]))
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
                parts = req(headers=[("idempotency-key", sf_string(key))])
                if tenant:
                    parts.headers.append(("authorization", tenant))
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
            assert all(k.startswith(tag) for k in keys) and channel.startswith(tag)
            assert member == f"{digest}/{route}"
            # Only hex digests and fixed names: a user's key never reaches a Redis name.
            indexes = [tag + "i:" + s for s in ("in_flight", "unresolved", "parked", "claimed")]
            assert keys == [tag + digest, *indexes] and channel == tag + "c"

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
        headers=[("x-c", values["header.X-C"])] if "header.X-C" in values else [],
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
    # Regression: parts were joined as they came, so these pairs shared one key.
    assert render(template, first) != render(template, second)


def test_template_keys_without_separators_in_values_are_unchanged() -> None:
    values = {"body.a": "user-42", "body.b": "day 3"}
    assert render("reminder:{body.a}:{body.b}", values) == "reminder:user-42:day 3"
    assert render("{body.a}:{body.b}", {"body.a": "a:b", "body.b": "c"}) == "a\\:b:c"
    assert render("r:{body.a}:{period}", {"body.a": "7"}) == "r:7:2026-11-01T13:00+01:00"


@pytest.mark.parametrize("template", ["{body.a}{body.b}", "x:{method}{path}", "{body.a}\\{body.b}"])
def test_templates_that_cannot_be_injective_are_refused(template: str) -> None:
    with pytest.raises(ValueError, match="separator"):
        parse_template(template)
