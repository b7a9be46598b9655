"""gateway/console/session.py and csrf.py on their own: what a cookie and a form token
must be to count, and the words the console draws (timeline, wording, rendering).

The browser and process tests (tests/test_console.py) send forged cookies and posts
to real gateways; these check each rule alone, in microseconds, with a clock given.
"""

from __future__ import annotations

import base64
import json

import pytest
from starlette.requests import Request

from gateway.console import csrf, session
from gateway.console.rendering import age, environment, key_url
from gateway.console.session import SESSION_TTL, Session, decode, encode, issue
from gateway.console.timeline import timeline
from gateway.console.wording import refusal_for
from gateway.errors import HeldByAnother, InvalidTransition, NotTheHolder, UnknownKey
from gateway.records import Record, State

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
    assert [(e.what, e.who, e.why) for e in entries] == [
        ("Forwarded to the upstream", "", ""),
        ("Outcome unknown", "", "upstream timed out"),
        ("Claimed", "alice", ""),
        ("Taken over from alice", "bob", ""),
        ("Resolved done", "bob", "Note: ok"),
        ("Brand new", "", ""),
    ]
    assert entries[0].details == (("run id", "run"),)
    assert entries[-1].details == (
        ("via", "through the shared admin token"),
        ("extra", "a 1"),
    )


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
