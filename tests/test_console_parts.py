"""gateway/console/session.py and csrf.py on their own: what a cookie and a form token
must be to count, and the words the console draws (timeline, wording, rendering).

The browser and process tests (tests/test_console.py) send forged cookies and posts
to real gateways; these check each rule alone, in microseconds, with a clock given.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request

from gateway.admin import create_admin_app
from gateway.app import Gateway
from gateway.console import csrf, session
from gateway.console.rendering import age, environment, key_url
from gateway.console.session import SESSION_TTL, Session, decode, encode, issue
from gateway.console.timeline import timeline
from gateway.console.wording import refusal_for
from gateway.errors import HeldByAnother, InvalidTransition, NotTheHolder, UnknownKey
from gateway.keys import record_digest
from gateway.records import KeyRef, Record, State
from gateway.store.memory import MemoryStore
from tests.conftest import config_for, unique

SECRET = b"s" * 40
NOW = 1_800_000_000


def test_a_session_round_trips_until_it_expires() -> None:
    made, value = issue(SECRET, "alice", now=NOW)
    assert made.expires_s == NOW + SESSION_TTL
    assert decode(SECRET, value, now=NOW) == made
    assert decode(SECRET, value, now=NOW + SESSION_TTL - 1) == made
    assert decode(SECRET, value, now=NOW + SESSION_TTL) is None
    # Issued in the future by more than the clock skew allowed: refused.
    assert decode(SECRET, value, now=NOW - session.CLOCK_SKEW) == made
    assert decode(SECRET, value, now=NOW - session.CLOCK_SKEW - 1) is None


def _payload(doc: list[object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda v: "", id="empty"),
        pytest.param(lambda v: v.split(".")[0], id="no-mac"),
        pytest.param(lambda v: v.split(".")[0] + ".", id="empty-mac"),
        pytest.param(lambda v: v[:-1] + ("A" if v[-1] != "A" else "B"), id="mac-changed"),
        pytest.param(lambda v: v + "A", id="mac-longer"),
        pytest.param(lambda v: v + "%%", id="mac-not-base64"),
        pytest.param(
            lambda v: _payload([1, "bob", NOW, NOW + 3600, "n"]) + "." + v.split(".")[1],
            id="payload-swapped",
        ),
        pytest.param(lambda v: encode(b"t" * 40, decode(SECRET, v, NOW)), id="other-secret"),  # type: ignore[arg-type]
    ],
)
def test_a_forged_or_altered_cookie_is_no_session(forge: object) -> None:
    _, value = issue(SECRET, "alice", now=NOW)
    assert callable(forge)
    assert decode(SECRET, forge(value), now=NOW) is None


def test_a_payload_is_read_only_once_its_mac_is_good() -> None:
    """Well signed but not a session (an old version, wrong types): refused too."""
    mac_of = session._mac
    for doc in ([2, "alice", NOW, NOW + 60, "n"], [1, 7, NOW, NOW + 60, "n"], ["x"], {}):
        payload = _payload(doc)  # type: ignore[arg-type]
        value = payload + "." + base64.urlsafe_b64encode(mac_of(SECRET, payload)).decode()
        assert decode(SECRET, value.rstrip("="), now=NOW) is None, doc


def test_the_cookie_is_httponly_strict_and_secure_over_tls() -> None:
    plain = session.cookie_header("v", secure=False)
    assert plain == "console_session=v; Path=/console/; Max-Age=28800; HttpOnly; SameSite=Strict"
    assert session.cookie_header("v", secure=True).endswith("; Secure")
    assert "Max-Age=0" in session.clearing_header(False)


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


def test_the_csrf_token_is_this_sessions_alone() -> None:
    mine = Session("alice", NOW, NOW + 60, "nonce-a")
    other = Session("alice", NOW, NOW + 60, "nonce-b")
    token = csrf.token_for(SECRET, mine)
    assert csrf.token_ok(SECRET, mine, token)
    assert not csrf.token_ok(SECRET, other, token)
    assert not csrf.token_ok(b"t" * 40, mine, token)
    for given in ("", None, token[:-1], token.upper(), ["x"]):
        assert not csrf.token_ok(SECRET, mine, given)


@pytest.mark.parametrize(
    ("origin", "ok"),
    [
        ("http://127.0.0.1:9090", True),
        ("HTTP://127.0.0.1:9090", True),
        ("https://127.0.0.1:9090", False),
        ("http://127.0.0.1:9091", False),
        ("http://evil.example", False),
        ("http://127.0.0.1:9090/console/", False),
        ("null", False),
        ("", False),
    ],
)
def test_the_origin_must_be_the_consoles_own(origin: str, ok: bool) -> None:
    headers = {"host": "127.0.0.1:9090"} | ({"origin": origin} if origin else {})
    assert csrf.origin_ok(_request(headers), "http") is ok


def test_autoescape_draws_hostile_text_as_text() -> None:
    env = environment()
    assert env.autoescape is True
    drawn = env.from_string("<p>{{ key }}</p>").render(key='"><img src=x onerror=alert(1)>')
    assert drawn == "<p>&#34;&gt;&lt;img src=x onerror=alert(1)&gt;</p>"


def test_a_key_url_carries_any_key_in_its_query() -> None:
    url = key_url("r", "../a/b?c#d e", "0f")
    assert url == "/console/key?route=r&key=..%2Fa%2Fb%3Fc%23d+e&digest=0f"


def test_ages_read_to_the_unit_that_matters() -> None:
    assert [age(s) for s in (0, 45, 192, 7500, 3 * 86400 + 4 * 3600)] == [
        "0s",
        "45s",
        "3m 12s",
        "2h 5m",
        "3d 4h",
    ]


def test_the_timeline_says_who_did_what_and_why() -> None:
    history = (
        {"at_ms": 2, "event": "unknown", "reason": "upstream timed out"},
        {"at_ms": 3, "event": "claimed", "operator": "alice"},
        {"at_ms": 4, "event": "claimed", "operator": "bob", "takeover_from": "alice"},
        {"at_ms": 5, "event": "resolved", "operator": "bob", "outcome": "done", "note": "ok"},
        {"at_ms": 6, "event": "brand_new", "via": "shared_token", "extra": {"a": 1}},
    )
    record = Record("d", "r", "k", State.COMPLETED, "run", "fp", 1, 9, history=history)
    entries = timeline(record)
    assert [(e.what, e.who) for e in entries] == [
        ("Forwarded to the upstream (run run)", ""),
        ("Outcome unknown: upstream timed out", ""),
        ("Claimed by alice", "alice"),
        ("Taken over by bob from alice", "bob"),
        ("Resolved done by bob: ok", "bob"),
        ("Brand_new (via=shared_token, extra={'a': 1})", ""),
    ]
    assert all(e.details == () for e in entries)
    parked = {"at_ms": 7, "event": "parked", "reason": "r", "attempt": {"status": 503}}
    assert timeline(replace(record, history=(parked,)))[1].details == (("attempt", "status 503"),)


def test_refusals_are_said_in_words() -> None:
    held = refusal_for(HeldByAnother("api words", holder="alice", holder_since_ms=1000))
    assert held.title == "Not claimed: alice holds this key"
    assert "alice holds it since 1970-01-01 00:00:01 UTC" in held.words
    late = refusal_for(NotTheHolder("api words", holder="bob"))
    assert "bob holds this key now" in late.title and "Nothing was changed" in late.words
    state = refusal_for(InvalidTransition("x", state="completed"))
    assert state.title == "Not done: the key is completed"
    assert "repeats get its stored response" in state.words
    gone = refusal_for(UnknownKey(route="r", key="k"))
    assert "Route r has no record of key k" in gone.words


# -- the console app in process: posts a browser test would take long to reach --------

TOKENS = {"alice": "alice-" + "a" * 24, "bob": "bob-" + "b" * 24, "carol": "carol-" + "c" * 24}
ORIGIN = "http://admin"
ROUTE = "charge"


@dataclass
class Console:
    gateway: Gateway
    app: Starlette

    def client(self, host: str = "127.0.0.1") -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app, client=(host, 40000))
        return httpx.AsyncClient(transport=transport, base_url=ORIGIN, headers={"Origin": ORIGIN})

    async def parked(self, key: str) -> KeyRef:
        ref = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
        assert await self.gateway.store.claim(ref, "run-1", "fp", lease=60) is None
        assert await self.gateway.store.mark_unresolved(ref, "run-1", "timed out", park=True)
        return ref

    async def record(self, ref: KeyRef) -> Record:
        record = await self.gateway.store.get(ref)
        assert record is not None
        return record


@pytest.fixture
async def console(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Console]:
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"{name.upper()}_TOKEN", token)
    monkeypatch.setenv("CONSOLE_SECRET", "s" * 40)
    admin = {
        "operators": [
            {"name": name, "role": "operator", "token_env": f"{name.upper()}_TOKEN"}
            for name in TOKENS
        ],
        "session_secret_env": "CONSOLE_SECRET",
        "identity_header": "X-Auth-Request-User",
        "trusted_proxies": ["10.0.0.0/8"],
    }
    routes = [{"name": ROUTE, "match": {"path": "/c"}, "key": {"body": "k"}}]
    config = config_for("http://127.0.0.1:9", routes, admin=admin)
    gateway = Gateway(config, store=MemoryStore(), sweep=False)
    await gateway.start()
    yield Console(gateway, create_admin_app(gateway))
    await gateway.close()


async def sign_in(client: httpx.AsyncClient, name: str) -> str:
    """Signs `client` in as `name`; the session's CSRF token."""
    answer = await client.post("/console/signin", data={"token": TOKENS[name]})
    assert answer.status_code == 303, answer.text
    page = await client.get("/console/")
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found, page.text
    return found.group(1)


def form(ref: KeyRef, token: str, **fields: str) -> dict[str, str]:
    return {"route": ref.route, "key": ref.key, "digest": ref.digest, "csrf": token, **fields}


@pytest.mark.anyio
async def test_the_identity_header_signs_in_from_a_trusted_proxy_alone(console: Console) -> None:
    header = {"X-Auth-Request-User": "bob"}
    async with console.client("10.1.2.3") as proxied, console.client("192.0.2.7") as direct:
        answer = await proxied.get("/console/signin?next=/console/keys", headers=header)
        assert answer.status_code == 303 and answer.headers["location"] == "/console/keys"
        page = await proxied.get("/console/keys")
        assert page.status_code == 200 and '<strong class="me">bob</strong>' in page.text
        # From an address that is no trusted proxy, the header is anyone's: ignored.
        ignored = await direct.get("/console/signin", headers=header)
        assert ignored.status_code == 200 and 'name="token"' in ignored.text
        assert "set-cookie" not in ignored.headers
    async with console.client("10.1.2.3") as proxied:
        stranger = await proxied.get("/console/signin", headers={"X-Auth-Request-User": "eve"})
        assert stranger.status_code == 200 and "set-cookie" not in stranger.headers


@pytest.mark.anyio
async def test_sign_out_ends_the_session_and_needs_its_token(console: Console) -> None:
    async with console.client() as client:
        token = await sign_in(client, "alice")
        refused = await client.post("/console/signout", data={})
        assert refused.status_code == 403
        assert (await client.get("/console/")).status_code == 200  # still signed in
        out = await client.post("/console/signout", data={"csrf": token})
        assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
        again = await client.get("/console/")
        assert again.status_code == 303 and again.headers["location"].startswith(
            "/console/signin?next="
        )


@pytest.mark.anyio
async def test_a_takeover_is_asked_again_when_the_holder_changed(console: Console) -> None:
    ref = await console.parked(unique("k"))
    assert (await console.gateway.store.operator_claim(ref, "carol", False)).ok
    async with console.client() as alice:
        token = await sign_in(alice, "alice")
        # alice confirmed taking it from bob; carol holds it now.
        asked = await alice.post("/console/claim", data=form(ref, token, force="1", holder="bob"))
        assert asked.status_code == 409
        assert "Not taken over: carol holds it now" in asked.text
        assert "Yes, take it over from carol" in asked.text
        assert (await console.record(ref)).holder == "carol"
        taken = await alice.post("/console/claim", data=form(ref, token, force="1", holder="carol"))
        assert taken.status_code == 303 and "notice=taken_over" in taken.headers["location"]
    record = await console.record(ref)
    assert record.holder == "alice" and record.history[-1]["takeover_from"] == "carol"


@pytest.mark.anyio
async def test_resolving_done_needs_a_note_and_a_replayable_response(console: Console) -> None:
    ref = await console.parked(unique("k"))
    async with console.client() as alice:
        token = await sign_in(alice, "alice")
        assert (await alice.post("/console/claim", data=form(ref, token))).status_code == 303
        before = await console.record(ref)
        cases = {
            "no note": ({"note": "  "}, 400, "A note is required to resolve done"),
            "status": ({"note": "n", "response_status": "abc"}, 400, "is not a number"),
            "header line": ({"note": "n", "response_headers": "no colon"}, 400, "line 1"),
            "framing": (
                {"note": "n", "response_headers": "Content-Length: 3"},
                400,
                "sets Content-Length itself",
            ),
        }
        for name, (fields, status, words) in cases.items():
            answer = await alice.post(
                "/console/resolve", data=form(ref, token, outcome="done", **fields)
            )
            assert answer.status_code == status, (name, answer.text)
            assert words in answer.text, (name, answer.text)
            after = await console.record(ref)
            assert after == replace(before, now_ms=after.now_ms), name
        done = await alice.post(
            "/console/resolve",
            data=form(
                ref,
                token,
                outcome="done",
                note="seen in the ledger",
                response_status="201",
                response_headers="Content-Type: text/plain\nX-Receipt: r-1",
                response_body="paid",
            ),
        )
        assert done.status_code == 303, done.text
    record = await console.record(ref)
    assert record.state is State.COMPLETED and record.response is not None
    assert record.response.status == 201 and record.response.body == b"paid"
    assert ("x-receipt", "r-1") in record.response.headers
    assert record.history[-1]["note"] == "seen in the ledger"


@pytest.mark.anyio
async def test_resolving_retry_releases_the_key(console: Console) -> None:
    ref = await console.parked(unique("k"))
    async with console.client() as alice:
        token = await sign_in(alice, "alice")
        await alice.post("/console/claim", data=form(ref, token))
        answer = await alice.post("/console/resolve", data=form(ref, token, outcome="retry"))
        assert answer.status_code == 303
        page = await alice.get(answer.headers["location"])
    assert "Resolved retry" in page.text
    assert (await console.record(ref)).state is State.RELEASED


@pytest.mark.anyio
async def test_without_a_secret_the_console_says_what_to_set(console: Console) -> None:
    config = console.gateway.config
    console.gateway.config = replace(config, admin=replace(config.admin, session_secret=""))
    async with console.client() as client:
        answer = await client.get("/console/signin")
    assert answer.status_code == 503
    assert "admin.session_secret_env" in answer.text


@pytest.mark.anyio
async def test_the_cookie_is_secure_when_a_trusted_proxy_says_https(console: Console) -> None:
    https = {"X-Forwarded-Proto": "https", "Origin": "https://admin"}
    data = {"token": TOKENS["alice"]}
    async with console.client("10.0.0.5") as proxied, console.client("192.0.2.7") as direct:
        behind_tls = await proxied.post("/console/signin", data=data, headers=https)
        assert behind_tls.status_code == 303, behind_tls.text
        assert behind_tls.headers["set-cookie"].endswith("; Secure")
        # The browser's Origin says http: through that proxy, the console is https.
        mixed = await proxied.post(
            "/console/signin", data=data, headers={"X-Forwarded-Proto": "https"}
        )
        assert mixed.status_code == 403
        # Anyone else's X-Forwarded-Proto is theirs: believed from no one but the proxies.
        plain = await direct.post(
            "/console/signin", data=data, headers={"X-Forwarded-Proto": "https"}
        )
        assert plain.status_code == 303 and "Secure" not in plain.headers["set-cookie"]
