"""gateway/operators/text.py: text an operator gives is checked before anything keeps it.

A name given with the shared token, a note, a response body to replay: a lone
surrogate (which no UTF-8 store can hold), a NUL or another control character (which
PostgreSQL's text refuses, and which a log line or a terminal would act on), or text
longer than the field holds, is a 422 naming the field and the reason in words, on
the operator API and in the console, over every store: never a 500, never a 503 that
blames a store that is fine, never the driver's words. And when a store does fail, the
caller gets the gateway's words; the driver's go to the log.

In process: the admin app (console included) through httpx.ASGITransport, over a
MemoryStore, a redis-server and a PostgreSQL cluster of the tests' own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from starlette.applications import Starlette

from gateway.admin.api import create_admin_app
from gateway.assembly import COUNTS_TTL, Gateway
from gateway.config import StoreConfig
from gateway.errors import PROBLEM_BASE
from gateway.keying import record_digest
from gateway.records import KeyRef
from gateway.store.base import Store
from gateway.store.redis import RedisStore
from tests.conftest import config_for, unique
from tests.support.ledger import Ledger
from tests.support.servers import RedisServer

pytestmark = pytest.mark.anyio

STORES = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
SHARED = "txt-shared-" + "s" * 24
ALICE = "txt-alice-" + "a" * 24
ORIGIN = "http://admin"
ROUTE = "charge"
#: The longest note (gateway/operators/text.py's NOTE_LIMIT, checked by test_the_rules_alone).
NOTE_LIMIT = 4000


@dataclass
class Site:
    gateway: Gateway
    app: Starlette

    def api(self, token: str = ALICE) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app),
            base_url=ORIGIN,
            headers={"Authorization": f"Bearer {token}"},
        )

    def browser(self) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app, client=("127.0.0.1", 40000))
        return httpx.AsyncClient(transport=transport, base_url=ORIGIN, headers={"Origin": ORIGIN})

    async def parked(self) -> KeyRef:
        key = unique("txt")
        ref = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
        assert await self.gateway.store.claim(ref, "run-1", "fp", lease=60) is None
        assert await self.gateway.store.mark_unresolved(ref, "run-1", "timed out", park=True)
        return ref

    async def held(self, holder: str = "alice") -> KeyRef:
        ref = await self.parked()
        assert (await self.gateway.store.operator_claim(ref, holder, False)).ok
        return ref

    async def frozen(self, ref: KeyRef) -> dict[str, Any]:
        record = await self.gateway.store.get(ref)
        assert record is not None
        doc = record.to_json()
        return {k: v for k, v in doc.items() if k not in ("age_seconds", "state_age_seconds")}


@pytest.fixture
async def site(
    monkeypatch: pytest.MonkeyPatch, make_store: Callable[[], Store]
) -> AsyncIterator[Site]:
    monkeypatch.setenv("TXT_ALICE_TOKEN", ALICE)
    monkeypatch.setenv("TXT_SECRET", "x" * 40)
    admin = {
        "token": SHARED,
        "operators": [{"name": "alice", "role": "operator", "token_env": "TXT_ALICE_TOKEN"}],
        "session_secret_env": "TXT_SECRET",
    }
    routes = [{"name": ROUTE, "match": {"path": "/c"}, "key": {"body": "k"}}]
    config = config_for("http://127.0.0.1:9", routes, admin=admin)
    gateway = Gateway(config, store=make_store(), sweep=False)
    await gateway.start()
    yield Site(gateway, create_admin_app(gateway))
    await gateway.close()


def path(ref: KeyRef, action: str) -> str:
    return f"/admin/keys/{ref.route}/{ref.key}/{action}"


def raw_json(doc: dict[str, Any]) -> dict[str, Any]:
    """A body as bytes, with lone surrogates written as JSON's \\uXXXX escapes (as any
    client may send them: httpx's own encoder cannot encode one)."""
    body = json.dumps(doc, ensure_ascii=True).encode()
    return {"content": body, "headers": {"Content-Type": "application/json"}}


def assert_invalid_text(answer: httpx.Response, field: str, *words: str) -> None:
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    doc = answer.json()
    assert doc["type"] == PROBLEM_BASE + "invalid-text", doc
    assert doc["field"] == field, doc
    for word in words:
        assert word in doc["detail"], (word, doc)


#: (what is wrong, the action, the body, the field named, words of the reason)
REFUSED: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("name-nul", "claim", {"operator": "car\x00ol"}, "operator", "NUL"),
    ("name-surrogate", "claim", {"operator": "car\udc80ol"}, "operator", "lone surrogate"),
    ("name-newline", "claim", {"operator": "carol\nbob"}, "operator", "control character"),
    ("name-escape", "claim", {"operator": "carol\x1b[31m"}, "operator", "control character"),
    ("name-c1", "claim", {"operator": "carol\x9b"}, "operator", "control character"),
    ("name-bidi", "claim", {"operator": "\u202elorac"}, "operator", "RIGHT-TO-LEFT OVERRIDE"),
    ("name-bom", "claim", {"operator": "car\ufeffol"}, "operator", "ZERO WIDTH NO-BREAK SPACE"),
    ("name-zwsp", "claim", {"operator": "car\u200bol"}, "operator", "ZERO WIDTH SPACE"),
    ("name-line-sep", "claim", {"operator": "carol\u2028bob"}, "operator", "line separator"),
    ("name-para-sep", "claim", {"operator": "carol\u2029bob"}, "operator", "PARAGRAPH SEPARATOR"),
    ("name-soft-hyphen", "claim", {"operator": "car\xadol"}, "operator", "format character"),
    ("name-long", "claim", {"operator": "c" * 101}, "operator", "longer than 100"),
    (
        "note-nul",
        "resolve",
        {"operator": "carol", "outcome": "retry", "note": "checked\x00"},
        "note",
        "NUL",
    ),
    (
        "note-surrogate",
        "resolve",
        {"operator": "carol", "outcome": "done", "note": "paid \ud83d"},
        "note",
        "lone surrogate",
    ),
    (
        "note-bell",
        "resolve",
        {"operator": "carol", "outcome": "retry", "note": "ding\x07"},
        "note",
        "control character",
    ),
    (
        "note-long",
        "resolve",
        {"operator": "carol", "outcome": "retry", "note": "n" * (NOTE_LIMIT + 1)},
        "note",
        f"longer than {NOTE_LIMIT}",
    ),
    (
        "body-surrogate",
        "resolve",
        {"operator": "carol", "outcome": "done", "note": "ok", "response": {"body": "\udfff"}},
        "response.body",
        "lone surrogate",
    ),
]


@pytest.mark.parametrize("store_kind", STORES, indirect=False)
@pytest.mark.parametrize(
    ("action", "body", "field", "words"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
async def test_text_the_store_cannot_hold_is_a_422_naming_the_field(
    site: Site,
    store_kind: str,
    action: str,
    body: dict[str, Any],
    field: str,
    words: str,
    ledger: Ledger,
) -> None:
    ref = await site.held("carol (shared token)") if action == "resolve" else await site.parked()
    before = await site.frozen(ref)
    async with site.api(SHARED) as api:
        answer = await api.post(path(ref, action), **raw_json(body))
    ledger.record(
        "operator text",
        f"{field} on {store_kind}",
        requests=1,
        bad_inputs=1,
        detail=words,
    )
    assert_invalid_text(answer, field, words)
    assert "\\u" not in answer.json()["detail"]  # said in words, not escapes
    assert await site.frozen(ref) == before


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_note_keeps_its_line_breaks_and_tabs(site: Site, store_kind: str) -> None:
    ref = await site.held("carol (shared token)")
    note = "checked the ledger:\r\n\tpaid at 10:02\nreceipt r-1 ✓"
    body = {"operator": "carol", "outcome": "done", "note": note}
    async with site.api(SHARED) as api:
        answer = await api.post(path(ref, "resolve"), **raw_json(body))
    assert answer.status_code == 200, answer.text
    [resolved] = [e for e in answer.json()["history"] if e["event"] == "resolved"]
    assert resolved["note"] == note


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_header_name_that_is_no_header_is_refused_in_words(
    site: Site, store_kind: str
) -> None:
    """The refusal names the header it could not take: a name holding a lone surrogate
    is written in the answer as an escape, not a crash of the answer's own encoding."""
    ref = await site.held()
    response = {"headers": {"X-\udc80": "v"}, "body": "ok"}
    body = {"outcome": "done", "note": "ok", "response": response}
    async with site.api() as api:
        answer = await api.post(path(ref, "resolve"), **raw_json(body))
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"] == PROBLEM_BASE + "bad-response"


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_hostile_route_or_key_in_an_address_reaches_no_driver(
    site: Site, store_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A key's address with a NUL byte, a control character or U+FFFD in its route or
    key: 404 (no such key) or 400, in our words, and no store error logged."""
    caplog.set_level(logging.ERROR)
    async with site.api() as api:
        for route, key in (("%00", "k"), ("charge", "%00"), ("%ED%A0%80", "k"), ("c%0Ah", "k")):
            for url in (f"/admin/keys/{route}/{key}", f"/admin/key?route={route}&key={key}"):
                answer = await api.get(url)
                assert answer.status_code in (400, 404), (url, answer.text[:300])
                assert answer.headers["content-type"] == "application/problem+json"
                for word in ("asyncpg", "psycopg", "invalid byte", "0x00", "Traceback"):
                    assert word not in answer.text, (url, answer.text)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def cursor_of(text: str) -> str:
    """A cursor spelled as a listing spells one, holding `text`."""
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


#: (field, value as the query holds it): values each listing filter must refuse up
#: front, before the store sees them: NUL bytes, what decodes to U+FFFD, control
#: characters, huge numbers, malformed and forged cursors, sizes out of range.
HOSTILE_FILTERS: list[tuple[str, str]] = [
    ("state", "parked\x00"),
    ("state", "\x00"),
    ("state", "x" * 5000),
    ("route", "\x00"),
    ("route", "charge\x00x"),
    ("route", "\ud800"),
    ("route", "charge\u0085"),
    ("route", "ch arge"),
    ("route", "x" * 5000),
    ("route", "../charge"),
    ("older_than", "\x00"),
    ("older_than", "9" * 5000),
    ("older_than", "1e400s"),
    ("older_than", "-5m"),
    ("older_than", "99999999d"),
    ("older_than", "nan"),
    ("cursor", "\x00"),
    ("cursor", "!!!"),
    ("cursor", "a" * 5000),
    ("cursor", cursor_of("a:99999999999999999999999999:abc")),
    ("cursor", cursor_of("a:-1:abc")),
    ("cursor", cursor_of("a:1:\x00")),
    ("cursor", cursor_of("c:1:abc")),
    ("limit", "0"),
    ("limit", "-1"),
    ("limit", "1001"),
    ("limit", "9" * 5000),
    ("limit", "1\x00"),
    ("limit", "\u0662"),
    ("status", "\x00"),
    ("status", "5\x0003"),
    ("status", "\u0665\u0660\u0663"),
    ("status", "9" * 5000),
    ("status", "+503"),
    ("since", "\x00"),
    ("since", "9" * 5000),
    ("since", "2026-12-04T17:05\x00"),
    ("until", "\ud800"),
    ("until", "2026-12-04T25:00"),
    ("key_prefix", "x" * 5000),
]

#: Key prefixes that are text like any other: taken literally, never a pattern, and
#: never sent to the store (a NUL byte that PostgreSQL would refuse in text included).
LITERAL_PREFIXES = ["\x00", "%", "_", "*", "[a-z]", "\\", "\ud800", "'; --", "x" * 1024]


@pytest.mark.parametrize("store_kind", STORES)
async def test_every_listing_filter_refuses_hostile_values_up_front(
    site: Site, store_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each hostile value of each filter: 400 problem+json naming the field and why,
    from the operator API and the console's keys page alike; nothing of the store's
    driver in any answer, and no error logged (nothing reached the store)."""
    await site.parked()
    caplog.set_level(logging.ERROR)
    async with site.api() as api, site.browser() as browser:
        await console_session(browser)
        for field, value in HOSTILE_FILTERS:
            # A lone surrogate as the bytes a client can send: its UTF-8-like spelling.
            query = f"{field}=" + quote(value.encode("utf-8", "surrogatepass"), safe="")
            answer = await api.get("/admin/keys?" + query)
            assert answer.status_code == 400, (field, value, answer.text[:300])
            assert answer.headers["content-type"] == "application/problem+json"
            doc = answer.json()
            assert doc["field"] == field, (field, value, doc)
            assert doc["type"].endswith("/bad-filter"), doc
            for word in ("asyncpg", "psycopg", "redis", "Traceback", "invalid byte", "0x00"):
                assert word not in answer.text, (field, value, answer.text)
            if field == "limit":
                continue  # the console's pages are a fixed size
            page = await browser.get("/console/keys?" + query)
            assert page.status_code == 400, (field, value, page.text[:300])
            for word in ("asyncpg", "psycopg", "Traceback", "invalid byte"):
                assert word not in page.text
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.parametrize("store_kind", STORES)
async def test_a_key_prefix_is_text_never_a_pattern_on_every_store(
    site: Site, store_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Key prefixes of pattern characters, a NUL byte, a lone surrogate, SQL: each lists
    the keys that start with those characters (none here), 200 from the API and the
    console, and nothing of it reaches the store's driver."""
    ref = await site.parked()
    caplog.set_level(logging.ERROR)
    async with site.api() as api, site.browser() as browser:
        await console_session(browser)
        for prefix in LITERAL_PREFIXES:
            query = "key_prefix=" + quote(prefix.encode("utf-8", "surrogatepass"), safe="")
            answer = await api.get("/admin/keys?" + query)
            assert answer.status_code == 200, (prefix, answer.text[:300])
            assert answer.json()["keys"] == [], prefix
            page = await browser.get("/console/keys?" + query)
            assert page.status_code == 200, (prefix, page.text[:300])
            assert "<tr data-key=" not in page.text
        answer = await api.get("/admin/keys", params={"key_prefix": ref.key[:5]})
        assert [row["key"] for row in answer.json()["keys"]] == [ref.key]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def console_session(client: httpx.AsyncClient) -> str:
    answer = await client.post("/console/signin", data={"token": ALICE})
    assert answer.status_code == 303, answer.text
    found = re.search(r'name="csrf" value="([^"]+)"', (await client.get("/console/")).text)
    assert found
    return found.group(1)


@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"note": "checked\x00"}, "NUL"),
        ({"note": "n" * (NOTE_LIMIT + 1)}, f"longer than {NOTE_LIMIT}"),
        ({"note": "checked\x1b]0;pwned\x07"}, "control character"),
    ],
    ids=["nul", "long", "escape"],
)
async def test_the_console_says_which_field_it_cannot_keep(
    site: Site, store_kind: str, fields: dict[str, str], words: str
) -> None:
    ref = await site.held()
    before = await site.frozen(ref)
    async with site.browser() as browser:
        token = await console_session(browser)
        form = {"route": ref.route, "key": ref.key, "digest": ref.digest, "csrf": token}
        answer = await browser.post("/console/resolve", data=form | {"outcome": "done"} | fields)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("text/html")
    assert "The note" in answer.text and words in answer.text, answer.text
    assert "Nothing was changed" in answer.text
    assert "Traceback" not in answer.text and "asyncpg" not in answer.text
    assert await site.frozen(ref) == before


# -- a store that fails: the gateway's words, the driver's in the log -------------------


@pytest.fixture
def own_redis() -> Any:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.mark.redis
@pytest.mark.parametrize("store_kind", ["memory"])
async def test_a_store_that_fails_is_said_in_our_words_and_logged_in_its_own(
    monkeypatch: pytest.MonkeyPatch,
    own_redis: RedisServer,
    store_kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The driver's message (an address, a connection error's errno) goes to the log;
    the operator API, the console, the overview and readiness say what it means."""
    monkeypatch.setenv("TXT_ALICE_TOKEN", ALICE)
    monkeypatch.setenv("TXT_SECRET", "x" * 40)
    admin = {
        "operators": [{"name": "alice", "role": "operator", "token_env": "TXT_ALICE_TOKEN"}],
        "session_secret_env": "TXT_SECRET",
    }
    routes = [{"name": ROUTE, "match": {"path": "/c"}, "key": {"body": "k"}}]
    store = RedisStore(
        StoreConfig(
            url=own_redis.url, prefix=unique("t") + ":", socket_timeout=1, connect_timeout=1
        )
    )
    gateway = Gateway(
        config_for("http://127.0.0.1:9", routes, admin=admin), store=store, sweep=False
    )
    await gateway.start()
    site = Site(gateway, create_admin_app(gateway))
    try:
        ref = await site.parked()
        async with site.browser() as browser:
            token = await console_session(browser)
            own_redis.stop()
            caplog.set_level(logging.WARNING)
            form = {"route": ref.route, "key": ref.key, "digest": ref.digest, "csrf": token}
            answers = {
                "console claim": await browser.post("/console/claim", data=form),
                "console page": await browser.get("/console/keys"),
            }
        async with site.api() as api:
            answers["api claim"] = await api.post(path(ref, "claim"), json={})
            answers["api list"] = await api.get("/admin/keys")
            await asyncio.sleep(COUNTS_TTL)  # the console's counts, read before, are kept that long
            answers["overview"] = await api.get("/admin/overview")
            answers["readyz"] = await api.get("/readyz")
    finally:
        await gateway.close()
    port = str(own_redis.port)
    for name, answer in answers.items():
        assert answer.status_code in (200, 503), (name, answer.text)
        text = answer.text
        for driver in (port, "redis", "Errno", "Connection refused", "Traceback"):
            assert driver.lower() not in text.lower(), (name, driver, text)
    problem = answers["api claim"].json()
    assert problem["type"] == PROBLEM_BASE + "store-unavailable"
    assert "did not answer" in problem["detail"]
    assert "did not answer" in answers["console claim"].text
    assert "did not answer" in answers["overview"].json()["store"]["error"]
    assert answers["readyz"].json()["checks"]["store"] == "unreachable: the gateway's log says why"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert port in logged or "redis" in logged.lower(), logged


def test_the_rules_alone() -> None:
    from gateway.errors import InvalidText
    from gateway.operators import text as operator_text

    assert operator_text.NOTE_LIMIT == NOTE_LIMIT
    check = operator_text.check_note
    check("")
    check("paid\r\n\tok ✓ 支付")
    with pytest.raises(InvalidText) as nul:
        check("a\x00b")
    assert nul.value.extra["field"] == "note"
    assert "NUL (U+0000) at character 2" in nul.value.detail
    for bad in ("\x7f", "\x85", "\ud800", "\udfff"):
        with pytest.raises(InvalidText):
            check(bad)
    operator_text.check_name("José Núñez")
    operator_text.check_name("\u05e9\u05dc\u05d5\u05dd")  # right-to-left letters are text
    for bad in (
        *("a\tb", "a\nb", "a\rb", "\u202ekcatta", "bob\u2066x\u2069", "a\u200fb"),
        *("x\ufeffy", "x\u200by", "x\u200dy", "x\u2028y", "x\u2029y", "x\u2060y", "x\U000e0001"),
    ):
        with pytest.raises(InvalidText):
            operator_text.check_name(bad)
    check("\u05e9\u05dc\u05d5\u05dd \u200f(paid)")  # a note keeps right-to-left marks
    operator_text.check_body("\x00\x01 binary-ish text is a body's own business")
    with pytest.raises(InvalidText):
        operator_text.check_body("\ud800")


def test_a_shared_token_name_is_checked_as_given_not_after_unicode_trimming() -> None:
    from gateway.errors import InvalidText
    from gateway.operators.identity import Operator, Role

    shared = Operator("", Role.OPERATOR, "shared_token")
    assert shared.acting("  ann ").name == "ann"
    # str.strip() counts these as whitespace: a control or separator at either end of
    # a name is refused, as it is inside one, never trimmed away unseen.
    for bad in ("\x85ann", "ann\x85", "ann\u2029", "\x1cann", "\x85", "ann\t"):
        with pytest.raises(InvalidText) as refused:
            shared.acting(bad)
        assert refused.value.extra["field"] == "operator"
