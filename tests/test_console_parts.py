"""gateway/console/session.py and csrf.py on their own: what a cookie and a form token
must be to count, and the words the console draws (timeline, wording, rendering).

The browser and process tests (tests/test_console.py) send forged cookies and posts
to real gateways; these check each rule alone, in microseconds, with a clock given.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request

from gateway.admin.api import create_admin_app
from gateway.assembly import Gateway
from gateway.config import Config, StoreConfig
from gateway.console import csrf, session
from gateway.console.rendering import age, environment, key_url
from gateway.console.session import SESSION_TTL, Session, decode, encode, issue
from gateway.console.timeline import timeline
from gateway.console.wording import refusal_for
from gateway.errors import HeldByAnother, InvalidTransition, NotTheHolder, UnknownKey
from gateway.keying import record_digest
from gateway.records import KeyRef, Record, State, StoredRequest, StoredResponse
from gateway.store.base import NewDelivery
from gateway.store.memory import MemoryStore
from gateway.store.pages import PAGE_SIZE, READ_ROUNDS
from gateway.store.redis import RedisStore
from gateway.store.route_pauses import PauseMove
from tests.conftest import config_for, unique
from tests.support.servers import RedisServer, wait_for_port

SECRET = b"s" * 40
NOW = 1_800_000_000
#: What Operators.credential gives for a token: its digest.
CREDENTIAL = b"\x01" * 32


def test_a_session_round_trips_until_it_expires() -> None:
    made, value = issue(SECRET, "alice", CREDENTIAL, now=NOW)
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
    _, value = issue(SECRET, "alice", CREDENTIAL, now=NOW)
    assert callable(forge)
    assert decode(SECRET, forge(value), now=NOW) is None


def test_a_session_holds_only_with_the_credential_it_was_signed_in_with() -> None:
    """The cookie carries a keyed fingerprint of the credential: the same credential
    holds it; another (a rotated token), none (a removed operator, an identity header
    no longer configured), another way in or another secret do not. The credential
    itself is nowhere in the cookie."""
    made, value = issue(SECRET, "alice", CREDENTIAL, now=NOW)
    got = decode(SECRET, value, now=NOW)
    assert got == made and session.holds(SECRET, got, CREDENTIAL)
    assert not session.holds(SECRET, got, b"\x02" * 32)
    assert not session.holds(SECRET, got, None)
    assert not session.holds(b"t" * 40, got, CREDENTIAL)
    assert not session.holds(SECRET, replace(got, made_by="identity_header"), CREDENTIAL)
    assert not session.holds(SECRET, replace(got, name="bob"), CREDENTIAL)
    assert not session.holds(SECRET, replace(got, credential=""), CREDENTIAL)
    doc = json.loads(base64.urlsafe_b64decode(value.split(".")[0] + "=="))
    assert CREDENTIAL.hex() not in value and len(doc[6]) == 22  # 128 bits, base64url


def test_a_payload_is_read_only_once_its_mac_is_good() -> None:
    """Well signed but not a session (an old version, wrong types): refused too. A
    cookie of the first version, which named no credential, is one of them."""
    mac_of = session._mac
    for doc in (
        [1, "alice", NOW, NOW + 60, "n", "token"],
        [2, "alice", NOW, NOW + 60, "n", "token"],
        [2, "alice", NOW, NOW + 60, "n", "token", 7],
        [1, 7, NOW, NOW + 60, "n"],
        ["x"],
        {},
    ):
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


#: A key whose characters show nothing of their own: a right-to-left override (the
#: rest would be drawn reversed), a zero-width space, U+FEFF, a line separator.
INVISIBLE_KEY = "inv-\u202eabc\u200bd\ufeffe\u2028f"
SPELLED = "inv-⟨U+202E⟩abc⟨U+200B⟩d⟨U+FEFF⟩e⟨U+2028⟩f"


def test_text_that_shows_nothing_is_spelled_out_and_posted_back_as_it_is() -> None:
    """Every value a template draws has its invisible characters spelled out, in its
    order; a hidden field that posts the key back takes it exactly. ASCII and
    right-to-left letters are drawn as they are."""
    env = environment()
    record = {"route": "charge", "key": INVISIBLE_KEY, "digest": "0f" * 16}
    fields = env.get_template("ref_fields.html").render(csrf="t", record=record)
    assert f'name="key" value="{INVISIBLE_KEY}"' in fields
    row = {
        "route": "charge", "key": INVISIBLE_KEY, "digest": "0f" * 16, "state": "parked",
        "state_age": 3.0, "holder": "", "holder_since_ms": 0, "reason": "timed out \u202e",
        "delivery": False, "since_ms": 1, "created_ms": 1, "upstream_status": None,
    }  # fmt: skip
    table = env.get_template("keys_table.html").render(
        rows=[row], read_ms=1, total=1, older_than="", first_url="", prev_url="", next_url=""
    )
    assert f"<bdi>{SPELLED}</bdi>" in table and "timed out ⟨U+202E⟩" in table
    assert not set(table) & set(INVISIBLE_KEY[4:]) - set("abcdef")
    drawn = env.from_string("{{ a }}|{{ b }}|{{ c }}").render(a="plain", b="שלום", c=7)
    assert drawn == "plain|שלום|7"


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


def console_config(
    roles: dict[str, str] | None = None, routes: list[dict[str, Any]] | None = None, **admin: Any
) -> Config:
    """The console's config: every one of TOKENS an operator (or `roles`), their
    tokens from the environment, behind a proxy at 10.0.0.0/8; `admin` changes it,
    `routes` are added to its route."""
    section = {
        "operators": [
            {"name": name, "role": role, "token_env": f"{name.upper()}_TOKEN"}
            for name, role in (roles or dict.fromkeys(TOKENS, "operator")).items()
        ],
        "session_secret_env": "CONSOLE_SECRET",
        "identity_header": "X-Auth-Request-User",
        "trusted_proxies": ["10.0.0.0/8"],
    } | admin
    routes = [{"name": ROUTE, "match": {"path": "/c"}, "key": {"body": "k"}}, *(routes or [])]
    return config_for("http://127.0.0.1:9", routes, admin=section)


@pytest.fixture
async def console(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Console]:
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"{name.upper()}_TOKEN", token)
    monkeypatch.setenv("CONSOLE_SECRET", "s" * 40)
    gateway = Gateway(console_config(), store=MemoryStore(), sweep=False)
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
async def test_a_session_ends_with_the_credential_it_stands_on(
    console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reloads that change what a session was signed in with end it, and only it:
    alice's token session when her token changes; bob's session, made by the proxy's
    header, when the proxies it is believed from change, or when his token does (a
    new token is how to end all of one person's sessions); carol's token session
    through all of that, and through a change of role."""
    header = {"X-Auth-Request-User": "bob"}

    async def status(client: httpx.AsyncClient) -> int:
        return (await client.get("/console/")).status_code

    async with (
        console.client("192.0.2.7") as alice,
        console.client("192.0.2.7") as carol,
        console.client("10.1.2.3") as proxy,
        console.client("192.0.2.7") as bob,  # bob's cookie, from outside the proxy
    ):
        await sign_in(alice, "alice")
        await sign_in(carol, "carol")

        async def sso() -> None:
            made = await proxy.get("/console/signin", headers=header)
            assert made.status_code == 303, made.text
            bob.cookies.set("console_session", proxy.cookies["console_session"])

        await sso()
        assert [await status(c) for c in (alice, carol, bob)] == [200, 200, 200]

        console.gateway.reload(console_config(trusted_proxies=["10.0.0.0/8", "192.168.0.0/16"]))
        assert [await status(c) for c in (alice, carol, bob)] == [200, 200, 303]
        await sso()  # through the proxy, a page signs bob in again at once
        assert await status(bob) == 200

        monkeypatch.setenv("ALICE_TOKEN", "alice-rotated-" + "a" * 20)
        console.gateway.reload(console_config())
        assert [await status(c) for c in (alice, carol)] == [303, 200]
        await sso()
        monkeypatch.setenv("BOB_TOKEN", "bob-rotated-" + "b" * 20)
        console.gateway.reload(console_config())
        assert [await status(c) for c in (carol, bob)] == [200, 303]
        await sso()
        assert await status(bob) == 200

        console.gateway.reload(console_config(identity_header="", trusted_proxies=[]))
        assert [await status(c) for c in (carol, bob)] == [200, 303]

        console.gateway.reload(console_config({"carol": "viewer"}))
        page = await carol.get("/console/")
        assert page.status_code == 200 and "(viewer)" in page.text


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
async def test_a_response_status_is_read_as_ascii_digits_alone(console: Console) -> None:
    """`²` passes str.isdigit() and int() then refuses it (a 500 with a traceback);
    int() reads `٢٠٠` as 200. The form's status is ASCII digits and nothing else: any
    other text is refused in words, and the key is left as it was."""
    ref = await console.parked(unique("k"))
    async with console.client() as alice:
        token = await sign_in(alice, "alice")
        assert (await alice.post("/console/claim", data=form(ref, token))).status_code == 303
        before = await console.record(ref)
        for given in ("²", "2²", "٢٠٠", "\uff12\uff10\uff10", "2_00", "+200", "2e2", "9" * 40):
            fields = {"note": "n", "response_status": given}
            answer = await alice.post(
                "/console/resolve", data=form(ref, token, outcome="done", **fields)
            )
            assert answer.status_code == 400, (given, answer.text)
            assert "is not a number" in answer.text, (given, answer.text)
            after = await console.record(ref)
            assert after == replace(before, now_ms=after.now_ms), given
        done = await alice.post(
            "/console/resolve",
            data=form(ref, token, outcome="done", note="n", response_status=" 202 "),
        )
        assert done.status_code == 303, done.text
    record = await console.record(ref)
    assert record.response is not None and record.response.status == 202


@pytest.mark.anyio
async def test_a_forms_declared_length_is_a_number_only_in_ascii_digits(
    console: Console,
) -> None:
    """A Content-Length that is no number (`²`) is not believed, never a 500: the form
    as it arrives decides, within the same limit."""
    ref = await console.parked(unique("k"))
    async with console.client() as alice:
        token = await sign_in(alice, "alice")
        body = urlencode(form(ref, token))
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": b"\xb2"}
        answer = await alice.post("/console/claim", content=body, headers=headers)
        assert answer.status_code == 303, answer.text
    assert (await console.record(ref)).holder == "alice"


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


@pytest.mark.anyio
@pytest.mark.redis
async def test_reloads_while_the_store_is_down_never_revive_a_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """alice is removed and added back with the same token while Redis is down. Her
    old cookie is never accepted: while the roster cannot be read the console answers
    503 (the cookie is kept: nothing says it is over); when Redis answers again both
    reloads are recorded, in order, so alice comes back with a new time, her old
    cookie is signed out and a new sign-in works. bob, on the list throughout, keeps
    his session."""
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"{name.upper()}_TOKEN", token)
    monkeypatch.setenv("CONSOLE_SECRET", "s" * 40)
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always").start()
    config = StoreConfig(
        url=server.url, prefix=unique("roster") + ":", socket_timeout=0.5, connect_timeout=0.5
    )
    gateway = Gateway(console_config(), store=RedisStore(config), sweep=False)
    await gateway.start()
    console = Console(gateway, create_admin_app(gateway))
    try:
        async with console.client() as alice, console.client() as bob:
            await sign_in(alice, "alice")
            await sign_in(bob, "bob")
            server.stop()
            gateway.reload(console_config({"bob": "operator", "carol": "operator"}))
            gateway.reload(console_config())
            # The sign-in page reads no key: only the session's check could refuse it.
            down = await alice.get("/console/signin")
            assert down.status_code == 503, down.text
            assert "The store is unreachable" in down.text and "set-cookie" not in down.headers
            server.start()
            wait_for_port(server.port)
            await gateway.roster.refresh()  # what Roster.run does within REFRESH seconds
            out = await alice.get("/console/")
            assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
            assert (await bob.get("/console/")).status_code == 200
            await sign_in(alice, "alice")
            assert (await alice.get("/console/")).status_code == 200
    finally:
        await gateway.close()
        server.stop()


@pytest.mark.anyio
async def test_a_replica_without_the_console_leaves_the_roster_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replicas share the store's roster. One whose config has no session secret (its
    console off) records nothing, at start or reload, so the others' sessions stand;
    one with the secret and no operators records an empty roster."""
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"{name.upper()}_TOKEN", token)
    monkeypatch.setenv("CONSOLE_SECRET", "s" * 40)
    store = MemoryStore()
    console = Gateway(console_config(), store=store, sweep=False)
    await console.start()
    recorded = await store.roster()
    assert {entry.partition(":")[2] for entry in recorded} == set(TOKENS)
    off = Gateway(console_config(session_secret_env=""), store=store, sweep=False)
    await off.start()
    off.reload(console_config(session_secret_env=""))
    await off.roster.refresh()
    assert await store.roster() == recorded
    config = console_config(operators=[], identity_header="", trusted_proxies=[])
    nobody = Gateway(config, store=store, sweep=False)
    await nobody.start()
    assert await store.roster() == {}
    for gateway in (console, off, nobody):
        await gateway.close()


@pytest.mark.anyio
async def test_the_live_refresh_asks_only_for_what_changed(console: Console) -> None:
    """The keys table comes with an ETag; asked again with it, an unchanged table is 304
    with no body (ages alone are counted on in the browser); a change is a new table."""
    refs = [await console.parked(f"k{i}") for i in range(3)]
    async with console.client() as client:
        await sign_in(client, "alice")
        first = await client.get("/console/keys/rows")
        tag = first.headers["etag"]
        assert first.status_code == 200 and tag.startswith('"')
        assert first.text.count("data-since-ms=") == 3 and "data-read-ms=" in first.text
        same = await client.get("/console/keys/rows", headers={"If-None-Match": tag})
        assert same.status_code == 304 and same.content == b""
        assert same.headers["etag"] == tag and same.headers["cache-control"] == "no-store"
        assert (await console.gateway.store.operator_claim(refs[0], "bob", False)).ok
        changed = await client.get("/console/keys/rows", headers={"If-None-Match": tag})
        assert changed.status_code == 200 and changed.headers["etag"] != tag
        assert '<td class="holder">bob</td>' in changed.text


@pytest.mark.anyio
async def test_the_keys_page_shows_a_page_with_links_and_the_count(console: Console) -> None:
    for i in range(130):
        await console.parked(f"many-{i}")
    async with console.client() as client:
        await sign_in(client, "alice")
        first = await client.get("/console/keys")
        assert first.status_code == 200
        assert first.text.count("<tr data-key=") == 100
        assert "130 keys in these states" in first.text
        found = re.search(r'<a href="([^"]+)" rel="next">Next</a>', first.text)
        assert found and 'rel="prev"' not in first.text
        second = await client.get(found.group(1).replace("&amp;", "&"))
        assert second.text.count("<tr data-key=") == 30
        assert 'rel="next"' not in second.text and 'rel="prev"' in second.text
        keys = re.findall(r'<tr data-key="([^"]+)">', first.text + second.text)
        assert sorted(keys) == sorted(f"many-{i}" for i in range(130))
        # The live refresh of the second page reads that page again, from its cursor.
        refresh = re.search(r'data-refresh="([^"]+)"', second.text)
        assert refresh and "cursor=" in refresh.group(1)
        rows = await client.get(refresh.group(1).replace("&amp;", "&"))
        assert rows.text.count("<tr data-key=") == 30
        bad = await client.get("/console/keys", params={"cursor": "made-up!"})
        assert bad.status_code == 400 and "cursor" in bad.text


@pytest.mark.anyio
async def test_an_empty_page_with_more_to_follow_says_so_and_links_on(console: Console) -> None:
    """In-flight keys too young for `older_than`, more than one page reads: the first
    page is empty, says more follow and links to them; the walk ends on the page that
    says no key waits."""
    store = console.gateway.store
    for i in range(READ_ROUNDS * (PAGE_SIZE + 1) + 20):
        key = f"young-{i}"
        assert (
            await store.claim(KeyRef(record_digest(ROUTE, "", key), ROUTE, key), "r", "fp", 60)
            is None
        )
    async with console.client() as client:
        await sign_in(client, "alice")
        first = await client.get("/console/keys", params={"state": "in_flight", "older_than": "1h"})
        assert first.status_code == 200 and "<tr data-key=" not in first.text
        assert "more follow on the next page" in first.text
        found = re.search(r'<a href="([^"]+)" rel="next">Next</a>', first.text)
        assert found, first.text
        last = await client.get(found.group(1).replace("&amp;", "&"))
        assert "<tr data-key=" not in last.text and 'rel="next"' not in last.text
        assert "No key waits in these states after the previous page." in last.text


async def delivered(console: Console, key: str, status: int, completed: bool = False) -> KeyRef:
    """A delivery of `key` after one attempt by replica-a that got `status`: completed,
    or parked (no attempt left)."""
    store = console.gateway.store
    ref = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
    request = StoredRequest("POST", "/c", (), b"{}")
    assert (await store.accept(NewDelivery(ref, "run-a", "fp", request, "T" * 22))).outcome
    assert (await store.pick(ROUTE, ref, "run-1", 60, 8, "replica-a")).record is not None
    if completed:
        attempt = {"result": "completed", "status": status}
        assert await store.complete(ref, "run-1", StoredResponse(status, (), b""), 60, attempt)
    else:
        attempt = {"result": "exhausted", "status": status, "error": f"upstream answered {status}"}
        assert await store.retry_later(ref, "run-1", None, attempt)
    await asyncio.sleep(0.002)  # each a place of its own
    return ref


@pytest.mark.anyio
async def test_the_keys_page_filters_the_run_log_and_a_key_shows_its_attempts(
    console: Console,
) -> None:
    """The keys form's run-log fields (a route's completed deliveries, the upstream
    status, a literal key prefix, a time range) narrow the table, and carry on to the
    next page and the live refresh; a delivery's page shows each attempt."""
    first = await delivered(console, "inv-1", 503)
    await delivered(console, "inv-2", 503)
    await delivered(console, "inv-3", 200, completed=True)
    await delivered(console, "other", 503)
    await delivered(console, "in%v", 503)
    states = [("state", "parked"), ("state", "completed"), ("route", ROUTE)]
    async with console.client() as client:
        await sign_in(client, "alice")

        async def keys(**fields: str) -> list[str]:
            page = await client.get("/console/keys?" + urlencode([*states, *fields.items()]))
            assert page.status_code == 200, page.text
            return re.findall(r'<tr data-key="([^"]+)">', page.text)

        assert await keys() == ["inv-1", "inv-2", "inv-3", "other", "in%v"]
        assert await keys(key_prefix="inv") == ["inv-1", "inv-2", "inv-3"]
        assert await keys(key_prefix="in%") == ["in%v"]
        assert await keys(key_prefix="in_") == []
        assert await keys(key_prefix="inv", status="503") == ["inv-1", "inv-2"]
        assert await keys(status="200") == ["inv-3"]
        placed = (await console.record(first)).since_ms
        assert await keys(until=str(placed)) == ["inv-1"]
        assert await keys(since=str(placed + 1), status="503") == ["inv-2", "other", "in%v"]
        page = await client.get("/console/keys?" + urlencode([*states, ("key_prefix", "inv")]))
        assert 'name="key_prefix" type="text" value="inv"' in page.text
        assert "in these states" not in page.text  # the counts know no key prefix
        refresh = re.search(r'data-refresh="([^"]+)"', page.text)
        assert refresh and "key_prefix=inv" in refresh.group(1)
        assert '<td class="num status">503</td>' in page.text
        hostile = await client.get("/console/keys", params={"key_prefix": '"><script>x'})
        assert hostile.status_code == 200 and "<script>x" not in hostile.text
        for name, value in (("status", "\u0665\u0660\u0663"), ("since", "soon")):
            bad = await client.get("/console/keys", params={name: value})
            assert bad.status_code == 400 and name in bad.text
        unrouted = await client.get("/console/keys", params={"state": "completed"})
        assert unrouted.status_code == 400 and "listed by route" in unrouted.text
        shown = await client.get(key_url(first.route, first.key, first.digest))
        assert shown.status_code == 200
        attempts = shown.text[shown.text.index("<h2>Attempts</h2>") :]
        row = re.search(r'<tr data-attempt="1">(.*?)</tr>', attempts, re.S)
        assert row is not None
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)
        assert cells[0] == "1" and cells[2] == "replica-a" and cells[3].endswith(" ms")
        assert cells[4:7] == ["parked", "503", "status: upstream answered 503"]


@pytest.mark.anyio
async def test_a_bulk_retry_is_counted_confirmed_and_said(console: Console) -> None:
    """The bulk page counts the route's parked deliveries its filters take and asks to
    confirm; the confirmed post retries each in the operator's name and says how many,
    and how many changed meanwhile; a key held meanwhile is left to its holder."""
    refs = [await delivered(console, f"b-{i}", 503) for i in range(3)]
    other = await delivered(console, "b-500", 500)
    async with console.client() as client:
        token = await sign_in(client, "alice")
        keys = await client.get("/console/keys", params={"route": ROUTE, "state": "parked"})
        assert 'id="bulk-link"' in keys.text
        counted = await client.get("/console/bulk", params={"route": ROUTE, "status": "503"})
        assert counted.status_code == 200
        assert "<strong>3</strong> parked deliveries of charge match" in counted.text
        assert "Yes, resolve these 3" in counted.text
        store = console.gateway.store
        assert (await store.operator_claim(refs[0], "bob", force=False)).ok  # after the count
        fields = {"csrf": token, "route": ROUTE, "status": "503", "reason": "", "older_than": ""}
        no_note = await client.post("/console/bulk", data={**fields, "outcome": "done"})
        assert no_note.status_code == 400 and "A note is required" in no_note.text
        done = await client.post(
            "/console/bulk", data={**fields, "outcome": "retry", "note": "provider back"}
        )
        assert done.status_code == 200, done.text
        assert "Retried: 2; skipped, as they changed meanwhile: 0." in done.text
        for ref in refs[1:]:
            record = await console.record(ref)
            assert record.state is State.QUEUED
            assert record.history[-1]["operator"] == "alice"
            assert record.history[-1]["note"] == "provider back"
        assert (await console.record(refs[0])).holder == "bob"
        assert (await console.record(other)).state is State.PARKED
        forged = await client.post("/console/bulk", data={**fields, "csrf": "", "outcome": "retry"})
        assert forged.status_code == 403
        unrouted = await client.get("/console/bulk")
        assert unrouted.status_code == 400 and "name it" in unrouted.text


@pytest.mark.anyio
async def test_the_overview_lists_paused_routes_with_who_and_why(console: Console) -> None:
    """A paused route is a line of its own on the overview, who and why escaped; an
    automatic pause says when the next probe goes out; none: no section."""
    async with console.client() as client:
        await sign_in(client, "alice")
        assert 'id="paused"' not in (await client.get("/console/")).text
        why = "<script>alert(1)</script> upstream maintenance"
        await console.gateway.store.change_pause(ROUTE, PauseMove("pause", by="bob", why=why))
        await asyncio.sleep(1.1)  # the overview's counts are shared for a second
        page = (await client.get("/console/")).text
        assert (
            'id="paused"' in page and f'<li data-route="{ROUTE}"><strong>{ROUTE}</strong>' in page
        )
        assert "by bob: &lt;script&gt;alert(1)&lt;/script&gt; upstream maintenance" in page
        assert "only a resume lifts it" in page and "<script>alert" not in page
        await console.gateway.store.change_pause(ROUTE, PauseMove("resume", by="bob", why="ok"))
        for _ in range(3):
            move = PauseMove("refused", why="connect refused", pause_after=3)
            await console.gateway.store.change_pause(ROUTE, move)
        await asyncio.sleep(1.1)
        page = (await client.get("/console/")).text
        assert "by the gateway: its upstream refused 3 attempts in a row (last: connect" in page
        assert "the next probe is at " in page


DELIVER = {
    "name": "deliver",
    "match": {"path": "/d"},
    "key": {"header": "Idempotency-Key"},
    "delivery": "async",
}


@pytest.mark.anyio
async def test_an_operator_pauses_and_resumes_a_route_from_the_overview(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The overview's forms: pause an async route with why, resume it; a viewer sees no
    form and is refused; a post without the session's CSRF token changes nothing; a
    pause without why is refused in words."""
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"{name.upper()}_TOKEN", token)
    monkeypatch.setenv("CONSOLE_SECRET", "s" * 40)
    roles = {"alice": "operator", "bob": "operator", "carol": "viewer"}
    config = console_config(roles, routes=[DELIVER])
    gateway = Gateway(config, store=MemoryStore(), sweep=False)
    await gateway.start()
    console = Console(gateway, create_admin_app(gateway))
    try:
        async with console.client() as alice, console.client() as carol:
            token = await sign_in(alice, "alice")
            page = (await alice.get("/console/")).text
            assert 'id="pause-route"' in page and "<option>deliver</option>" in page
            assert f"<option>{ROUTE}</option>" not in page  # a sync route does not pause

            fields = {"route": "deliver", "move": "pause", "why": "maintenance <b>"}
            forged = await alice.post("/console/route-pause", data=fields)
            assert forged.status_code == 403
            assert not (await gateway.store.route_pause("deliver")).paused
            unsaid = await alice.post(
                "/console/route-pause", data=fields | {"csrf": token, "why": ""}
            )
            assert unsaid.status_code == 400 and "Say why the route is to pause" in unsaid.text
            posted = await alice.post("/console/route-pause", data=fields | {"csrf": token})
            assert posted.status_code == 303
            assert posted.headers["location"] == "/console/?notice=route_paused"
            state = await gateway.store.route_pause("deliver")
            assert (state.paused, state.by, state.why) == (True, "alice", "maintenance <b>")

            viewer_token = await sign_in(carol, "carol")
            assert 'action="/console/route-pause"' not in (await carol.get("/console/")).text
            resume = {"route": "deliver", "move": "resume", "why": "done", "csrf": viewer_token}
            refused = await carol.post("/console/route-pause", data=resume)
            assert refused.status_code == 403
            assert (await gateway.store.route_pause("deliver")).paused

            await asyncio.sleep(1.1)  # the overview's counts are shared for a second
            page = (await alice.get("/console/?notice=route_paused")).text
            assert "Route paused: nothing is delivered" in page
            assert "by alice: maintenance &lt;b&gt;" in page and 'value="resume"' in page
            resumed = await alice.post("/console/route-pause", data=resume | {"csrf": token})
            assert resumed.status_code == 303
            state = await gateway.store.route_pause("deliver")
            assert (state.paused, state.by, state.why) == (False, "alice", "done")
    finally:
        await gateway.close()
