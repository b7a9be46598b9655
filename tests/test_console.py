"""The operator console in a real browser, against real gateway processes.

Two gateway replicas on one redis-server of the tests' own, in front of the test
upstream; operators with tokens of their own (alice and bob: operators, vera: a
viewer). Each person is a browser context of their own in one headless Chromium
(Debian's, tests/support/browser.py). Parked keys are made the way production makes
them: a request whose upstream outlives the route's upstream_timeout (504, parked),
or a delivery the upstream keeps refusing (parked after its attempts).

Forged posts are sent with httpx to the same processes: what a browser would never
send is the point there. Waiting is on the page (Playwright's `expect` retries until
the page shows it) or on the store's answer, never a sleep that asserts a time.
"""

from __future__ import annotations

import html.parser
import itertools
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from playwright.sync_api import expect

from gateway.console import csrf
from gateway.console.rendering import CSP, key_url
from gateway.console.session import COOKIE, Session, encode
from gateway.keying import record_digest
from tests.conftest import unique
from tests.support.browser import PHONE, WAIT_MS, Tab
from tests.support.console_site import (
    HOSTILE,
    HOSTILE_NOTE,
    SECRET,
    TOKENS,
    Replica,
    Site,
    config,
    key_row,
    running_site,
    sign_in,
    start_replica,
)
from tests.support.servers import Process
from tests.support.sso_proxy import sso_front

pytestmark = [pytest.mark.browser, pytest.mark.process, pytest.mark.redis]

expect.set_options(timeout=WAIT_MS)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, upstream: Process) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("console"), upstream) as running:
        yield running


def frozen(doc: dict[str, Any]) -> dict[str, Any]:
    """A record's JSON without the ages, which move while a test runs."""
    return {k: v for k, v in doc.items() if k not in ("age_seconds", "state_age_seconds")}


# -- signing in, in a browser -----------------------------------------------------------


def assert_clean(*tabs: Tab) -> None:
    """No dialog opened (an injected alert() would be one), no script error, no
    console error (a CSP violation is one: the console's own pages must cause none)."""
    for tab in tabs:
        assert tab.dialogs == [], tab.dialogs
        assert tab.errors == [], tab.errors


def test_two_operators_on_two_replicas_hand_a_parked_key_over(
    site: Site, tabs: Callable[..., Tab]
) -> None:
    key = unique("charge")
    site.park(key)
    a, b = site.replicas
    alice_tab, bob_tab = tabs(), tabs()
    alice, bob = sign_in(alice_tab.page, a, "alice"), sign_in(bob_tab.page, b, "bob")

    # Bob watches the list on replica B; it is never reloaded from here on.
    bob.goto(b.admin + "/console/keys?route=charge")
    row = key_row(bob, key)
    expect(row).to_contain_text("parked")
    expect(row.locator(".holder")).to_have_text("")
    bob.evaluate("window.notReloaded = true")

    # Alice claims it on replica A.
    alice.goto(a.admin + "/console/keys?route=charge")
    key_row(alice, key).get_by_role("link", name=key, exact=True).click()
    expect(alice.locator("#key-name")).to_have_text(key)
    alice.get_by_role("button", name="Claim").click()
    expect(alice.get_by_role("status")).to_contain_text("You hold this key")
    expect(alice.locator("#key-holder")).to_have_text("alice")

    # Bob's list shows it held by alice, by name, within a few refreshes.
    expect(row.locator(".holder")).to_have_text("alice")
    expect(row).to_contain_text("claimed")
    assert bob.evaluate("window.notReloaded") is True

    # Bob takes it over: the page names the holder and since when, and asks first.
    row.get_by_role("link", name=key, exact=True).click()
    expect(bob.locator("#key-holder")).to_have_text("alice")
    bob.get_by_role("link", name="Take over from alice").click()
    question = bob.locator("#takeover-question")
    expect(question).to_contain_text("alice holds this key since")
    held = site.record("charge", key)
    assert held["holder"] == "alice" and held["state"] == "claimed"  # asking changed nothing
    bob.get_by_role("button", name="Yes, take it over from alice").click()
    expect(bob.get_by_role("status")).to_contain_text("You took this key over")
    expect(bob.locator("#key-holder")).to_have_text("bob")

    # Alice's page is stale: her resolve is refused, with why, and nothing changes.
    alice.get_by_label("Note (required: what you checked)").fill("paid, seen in the ledger")
    with alice.expect_response(lambda r: r.url.endswith("/console/resolve")) as refused:
        alice.get_by_role("button", name="Resolve done").click()
    assert refused.value.status == 409
    expect(alice.get_by_role("alert")).to_contain_text("bob holds this key now")
    expect(alice.locator("#key-holder")).to_have_text("bob")
    expect(alice.get_by_role("button", name="Resolve done")).to_have_count(0)
    assert site.record("charge", key)["holder"] == "bob"

    # Bob resolves it done, with a note.
    bob.get_by_label("Note (required: what you checked)").fill(HOSTILE_NOTE)
    bob.get_by_role("button", name="Resolve done").click()
    expect(bob.get_by_role("status")).to_contain_text("Resolved done")
    expect(bob.locator("#key-state")).to_have_text("completed")

    # A repeat of the request gets the replay, saying who resolved it.
    repeat = httpx.post(b.proxy + "/jobs/charge", json={"job_key": key}, timeout=10)
    assert repeat.status_code == 200, repeat.text
    assert repeat.headers["idempotent-replayed"] == "true"
    assert repeat.json()["resolved_by"] == "bob"

    # The timeline shows every step, with the right names.
    steps = bob.locator("ol.timeline li")
    events = [li.get_attribute("data-event") for li in steps.all()]
    assert events == ["forwarded", "unknown", "parked", "claimed", "claimed", "resolved"], events
    texts = steps.all_inner_texts()
    assert "Claimed by alice" in texts[3]
    assert "Taken over by bob from alice" in texts[4]
    assert f"Resolved done by bob: {HOSTILE_NOTE}" in texts[5]
    assert "Outcome unknown: no complete answer within 0.5s" in texts[1]
    by = [li.get_attribute("data-by") for li in steps.all()]
    assert by == ["", "", "", "alice", "bob", "bob"], by
    assert_clean(alice_tab, bob_tab)


def test_the_live_refresh_gets_304_while_nothing_changes_and_counts_ages_on(
    site: Site, tabs: Callable[..., Tab]
) -> None:
    """The keys list sends its table's ETag back: while nothing changes, the gateway
    answers 304 with no body, the rows stay, the ages go on counting in the browser, and
    no error is shown; a change is drawn at the next refresh."""
    key = unique("charge")
    site.park(key)
    a, _ = site.replicas
    tab = tabs()
    page = sign_in(tab.page, a, "alice")
    statuses: list[int] = []
    page.on(
        "response", lambda r: statuses.append(r.status) if "/console/keys/rows" in r.url else None
    )
    page.goto(a.admin + "/console/keys?route=charge")
    age = key_row(page, key).locator("[data-since-ms]")
    first = age.inner_text()
    with page.expect_response(lambda r: "/console/keys/rows" in r.url and r.status == 304):
        pass
    expect(age).not_to_have_text(first)  # counted on in the browser
    assert re.fullmatch(r"\d+[smhd]( \d+[smh])?", age.inner_text()), age.inner_text()
    expect(page.locator("#refresh-note")).to_have_text("")
    assert set(statuses) == {304}, statuses  # nothing changed: no table was drawn again
    # Another operator claims it: the next refresh draws the table, held.
    claimed = httpx.post(
        a.admin + f"/admin/keys/charge/{quote(key, safe='')}/claim",
        json={},
        headers={"Authorization": f"Bearer {TOKENS['bob']}"},
        timeout=10,
    )
    assert claimed.status_code == 200, claimed.text
    expect(key_row(page, key).locator(".holder")).to_have_text("bob")
    assert 200 in statuses
    assert_clean(tab)


def test_a_viewer_sees_everything_and_has_no_action_buttons(
    site: Site, tabs: Callable[..., Tab]
) -> None:
    parked, held = unique("viewer-parked"), unique("viewer-held")
    site.park(parked)
    site.park(held)
    with site.api("alice") as api:
        assert api.post(f"/admin/keys/charge/{held}/claim", json={}).status_code == 200
    tab = tabs()
    page = sign_in(tab.page, site.replicas[1], "vera")
    expect(page.locator(".who")).to_contain_text("(viewer)")
    page.goto(site.replicas[1].admin + "/console/keys?route=charge")
    expect(key_row(page, parked)).to_contain_text("parked")
    expect(key_row(page, held).locator(".holder")).to_have_text("alice")
    for key in (parked, held):
        key_row(page, key).get_by_role("link", name=key, exact=True).click()
        expect(page.locator("#key-name")).to_have_text(key)
        expect(page.locator("ol.timeline li")).not_to_have_count(0)
        expect(page.locator("#actions")).to_contain_text("You are signed in as a viewer")
        for action in ("claim", "resolve", "takeover"):
            assert (
                page.locator(f"[action*='/console/{action}'], [href*='/console/{action}']").count()
                == 0
            )
        expect(
            page.get_by_role("button", name=re.compile("Claim|Resolve|take it over"))
        ).to_have_count(0)
        page.go_back()
    # Her session is good and her form would be well made: the post is still refused.
    before = frozen(site.record("charge", parked))
    with signed_in_client(site.replicas[1], "vera") as client:
        token = csrf_of(client, "charge", parked)
        answer = client.post("/console/claim", data=ref_form("charge", parked, token))
    assert answer.status_code == 403, answer.text
    assert "viewer" in answer.text
    assert frozen(site.record("charge", parked)) == before
    assert_clean(tab)


def test_a_hostile_key_note_and_header_show_as_text_and_run_nothing(
    site: Site, tabs: Callable[..., Tab]
) -> None:
    site.park(HOSTILE) if site_has_not(site, "charge", HOSTILE) else None
    delivery = f"{HOSTILE}-{unique('d')}"
    site.park_delivery(
        delivery,
        {
            "Authorization": "Bearer caller-secret-token",
            "X-Api-Key": "sk_live_caller_secret_key",
            "User-Agent": HOSTILE,  # a header whose value is shown
        },
    )
    tab = tabs()
    page = sign_in(tab.page, site.replicas[0], "alice")
    page.goto(site.replicas[0].admin + "/console/keys?state=parked")
    link = page.get_by_role("link", name=HOSTILE, exact=True)
    expect(link).to_have_count(1)
    link.click()
    expect(page.locator("#key-name")).to_have_text(HOSTILE)
    assert page.locator("img").count() == 0
    page.get_by_role("button", name="Claim").click()
    expect(page.locator("#key-holder")).to_have_text("alice")
    page.get_by_label("Note (required: what you checked)").fill(HOSTILE_NOTE)
    page.get_by_label("Status").fill("201")
    page.get_by_label("Headers, one Name: value a line").fill(
        f"Content-Language: {HOSTILE}\nX-Receipt: {HOSTILE}"
    )
    page.get_by_label("Body").fill(HOSTILE)
    page.get_by_role("button", name="Resolve done").click()
    expect(page.locator("#key-state")).to_have_text("completed")
    expect(page.locator("ol.timeline")).to_contain_text(f"Resolved done by alice: {HOSTILE_NOTE}")
    responses = page.locator("table.headers")
    expect(responses.last).to_contain_text(HOSTILE)  # a stored response's harmless header
    receipt = responses.last.locator("tr", has_text="x-receipt")  # any other: its length
    expect(receipt).to_contain_text(f"hidden, {len(HOSTILE)} characters")

    # The delivery's request: method, path and headers, never a credential's value.
    page.goto(site.replicas[0].admin + "/console/keys?state=parked&route=deliver")
    page.get_by_role("link", name=delivery, exact=True).click()
    expect(page.locator("#key-name")).to_have_text(delivery)
    request = page.locator("section", has=page.get_by_role("heading", name="Request"))
    expect(request).to_contain_text("POST")
    expect(request.locator("dd", has_text="/jobs/")).to_have_text("/jobs/deliver")
    query = request.locator("#query tr", has_text="status")
    expect(query).to_contain_text("hidden, 3 characters")  # not in admin.show_query
    headers = request.locator("table.headers").last
    expect(headers).to_contain_text(HOSTILE)
    assert "caller-secret-token" not in page.content()
    assert "sk_live_caller_secret_key" not in page.content()
    expect(headers.locator("tr", has_text="authorization")).to_contain_text("hidden, 26 characters")
    expect(headers.locator("tr", has_text="x-api-key")).to_contain_text("hidden, 25 characters")
    assert page.locator("img, script:not([src])").count() == 0
    assert_clean(tab)


#: The page position of each drawn character of an element, in text order:
#: [top, left] of each one that takes room.
POSITIONS = """(element) => {
  const found = [];
  const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (let i = 0; i < node.length; i += 1) {
      const range = document.createRange();
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      const box = range.getBoundingClientRect();
      if (box.width > 0) found.push([box.top, box.left]);
    }
  }
  return found;
}"""


def drawn_in_text_order(element: Any) -> bool:
    """Whether each character is drawn after the one before it: to its right on the same
    line, or on a later line (the left-to-right reading order of a key)."""
    places = element.evaluate(POSITIONS)
    assert len(places) > 4, places
    return all(
        top > above + 1 or (abs(top - above) <= 1 and left > before)
        for (above, before), (top, left) in itertools.pairwise(places)
    )


def test_a_key_with_a_right_to_left_override_is_drawn_in_its_order(
    site: Site, tabs: Callable[..., Tab]
) -> None:
    """A caller's key may hold U+202E, which draws the text after it right to left: the
    key `...-\u202eabc` would read `...-cba` in the list, a key it is not. The console
    spells such a character out, so the list, the key's page and its title draw the
    key in its own order, and claiming it acts on that very key."""
    key = f"rtl-{unique()}-\u202eabc"
    site.park(key)
    tab = tabs()
    page = sign_in(tab.page, site.replicas[0], "alice")
    page.goto(site.replicas[0].admin + "/console/keys?route=charge")
    link = page.locator(f"a[href='{key_url('charge', key, record_digest('charge', '', key))}']")
    expect(link).to_have_count(1)
    assert drawn_in_text_order(link), link.evaluate(POSITIONS)
    spelled = key.replace("\u202e", "⟨U+202E⟩")
    expect(link).to_have_text(spelled)
    link.click()
    name = page.locator("#key-name")
    expect(name).to_have_text(spelled)
    assert drawn_in_text_order(name), name.evaluate(POSITIONS)
    assert "\u202e" not in page.title() and spelled in page.title()
    page.get_by_role("button", name="Claim").click()
    expect(page.locator("#key-holder")).to_have_text("alice")
    assert site.record("charge", key)["holder"] == "alice"
    assert_clean(tab)


def site_has_not(site: Site, route: str, key: str) -> bool:
    with site.api() as client:
        return client.get(f"/admin/keys/{route}/{quote(key, safe='')}").status_code == 404


def test_the_console_fits_a_phone_and_a_desktop(site: Site, tabs: Callable[..., Tab]) -> None:
    key = unique("phone")
    site.park(key)
    for viewport in (None, PHONE):
        tab = tabs(viewport)
        page = sign_in(tab.page, site.replicas[0], "alice")
        for path in ("/console/", "/console/keys", None):
            if path is None:
                page.get_by_role("link", name=key, exact=True).click()
            else:
                page.goto(site.replicas[0].admin + path)
            # Nothing wider than the screen but a table, which scrolls in its own box.
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), (
                viewport,
                path,
            )
            # Tables have headings; every field a person fills in has a label.
            unlabelled = page.evaluate(
                """Array.from(document.querySelectorAll('input, select, textarea'))
                   .filter(e => e.type !== 'hidden' && e.labels.length === 0)
                   .map(e => e.name)"""
            )
            assert unlabelled == [], (path, unlabelled)
            for table in page.locator("table").all():
                assert table.locator("th").count() > 0
        expect(page.get_by_role("button", name="Claim")).to_be_in_viewport()
        assert_clean(tab)


# -- forged posts, with httpx ---------------------------------------------------------


class _Forms(html.parser.HTMLParser):
    """Every inline script, style and event handler of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.inline: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = {name for name, _ in attrs}
        if tag == "script" and "src" not in names:
            self.inline.append("script without src")
        if tag == "style":
            self.inline.append("style element")
        self.inline += [f"{tag} {n}=" for n in names if n == "style" or n.startswith("on")]


@contextmanager
def signed_in_client(replica: Replica, name: str) -> Iterator[httpx.Client]:
    """An httpx client with `name`'s session cookie, sending the console's Origin."""
    headers = {"Origin": replica.admin}
    with httpx.Client(base_url=replica.admin, headers=headers, timeout=10) as client:
        answer = client.post("/console/signin", data={"token": TOKENS[name], "next": "/console/"})
        assert answer.status_code == 303, answer.text
        assert answer.headers["location"] == "/console/"
        assert COOKIE in client.cookies
        yield client


def csrf_of(client: httpx.Client, route: str, key: str) -> str:
    answer = client.get("/console/key", params={"route": route, "key": key})
    assert answer.status_code == 200, answer.text
    found = re.search(r'name="csrf" value="([^"]+)"', answer.text)
    assert found, answer.text
    return found.group(1)


def ref_form(route: str, key: str, token: str | None, **more: str) -> dict[str, str]:
    form = {"route": route, "key": key, **more}
    if token is not None:
        form["csrf"] = token
    return form


def test_every_page_sends_the_strict_csp_and_has_no_inline_script_or_style(site: Site) -> None:
    key = unique("csp")
    site.park(key)
    replica = site.replicas[0]
    with signed_in_client(replica, "alice") as client:
        pages = {
            "overview": client.get("/console/"),
            "keys": client.get("/console/keys", params={"state": ["parked", "claimed"]}),
            "rows": client.get("/console/keys/rows"),
            "key": client.get("/console/key", params={"route": "charge", "key": key}),
            "unknown key": client.get("/console/key", params={"route": "charge", "key": "nope"}),
            "bad filter": client.get("/console/keys", params={"older_than": "soon"}),
        }
        token = csrf_of(client, "charge", key)
        client.post("/console/claim", data=ref_form("charge", key, token))
        with signed_in_client(site.replicas[1], "bob") as bob:
            pages["takeover"] = bob.get("/console/takeover", params={"route": "charge", "key": key})
    with httpx.Client(base_url=replica.admin) as anonymous:
        pages["sign in"] = anonymous.get("/console/signin")
        pages["forged"] = anonymous.post("/console/claim", data={})
    expected = {"unknown key": 404, "bad filter": 400, "forged": 403}
    for name, answer in pages.items():
        assert answer.status_code == expected.get(name, 200), (name, answer.text)
        assert answer.headers["content-security-policy"] == CSP, name
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["cache-control"] == "no-store"
        parser = _Forms()
        parser.feed(answer.text)
        assert parser.inline == [], (name, parser.inline)
    assert "script-src 'self'" in CSP and "style-src 'self'" in CSP and "unsafe" not in CSP
    assert "/admin/openapi.json" in pages["overview"].text


def forged_cases(
    replica: Replica, good: httpx.Client, key: str
) -> dict[str, Callable[[], httpx.Response]]:
    """Claims of `key` by alice (signed in on `good`), each with one thing wrong."""
    token = csrf_of(good, "charge", key)
    cookie = good.cookies[COOKIE]
    session_of = good.get("/console/")  # the session is good: the page shows alice
    assert session_of.status_code == 200 and ">alice<" in session_of.text
    now = int(time.time())
    secret = SECRET.encode()
    payload, mac = cookie.split(".")
    nonce = "n" * 22
    expired = Session("alice", now - 9 * 3600, now - 3600, nonce)
    bob_payload = encode(secret, Session("bob", now, now + 3600, nonce)).split(".")[0]

    def post(form: dict[str, str], origin: str | None = replica.admin, value: str = cookie) -> Any:
        headers = {"Cookie": f"{COOKIE}={value}"}
        if origin is not None:
            headers["Origin"] = origin
        with httpx.Client(base_url=replica.admin, timeout=10) as client:
            return client.post("/console/claim", data=form, headers=headers)

    return {
        "no csrf token": lambda: post(ref_form("charge", key, None)),
        "another session's csrf token": lambda: post(
            ref_form("charge", key, csrf.token_for(secret, expired))
        ),
        "wrong origin": lambda: post(ref_form("charge", key, token), "http://evil.example"),
        "origin of another port": lambda: post(
            ref_form("charge", key, token), "http://127.0.0.1:1"
        ),
        "no origin": lambda: post(ref_form("charge", key, token), None),
        "null origin": lambda: post(ref_form("charge", key, token), "null"),
        "expired cookie": lambda: post(
            ref_form("charge", key, csrf.token_for(secret, expired)),
            value=encode(secret, expired),
        ),
        "tampered cookie (name)": lambda: post(
            ref_form("charge", key, token), value=f"{bob_payload}.{mac}"
        ),
        "tampered cookie (mac)": lambda: post(
            ref_form("charge", key, token), value=f"{payload}.{mac[:-2]}AA"
        ),
        "cookie signed with another secret": lambda: post(
            ref_form("charge", key, token),
            value=encode(b"x" * 40, Session("alice", now, now + 3600, nonce)),
        ),
        "the good post": lambda: post(ref_form("charge", key, token)),
    }


def test_forged_posts_are_refused_and_change_nothing(site: Site) -> None:
    key = unique("forged")
    site.park(key)
    replica = site.replicas[0]
    with signed_in_client(replica, "alice") as alice:
        cases = forged_cases(replica, alice, key)
    good = cases.pop("the good post")
    before = frozen(site.record("charge", key))
    statuses = {}
    for name, send in cases.items():
        answer = send()
        statuses[name] = answer.status_code
        assert "Nothing was changed" in answer.text, (name, answer.text)
        assert frozen(site.record("charge", key)) == before, name
    signed_out = {"expired cookie", "tampered cookie (name)", "tampered cookie (mac)"}
    signed_out.add("cookie signed with another secret")
    assert statuses == {name: 401 if name in signed_out else 403 for name in cases}, statuses
    # A sign-in has no session to be tied to: its Origin is what it is checked by.
    for origin in ({}, {"Origin": "http://evil.example"}):
        with httpx.Client(base_url=replica.admin, headers=origin, timeout=10) as client:
            answer = client.post("/console/signin", data={"token": TOKENS["alice"]})
        assert answer.status_code == 403, answer.text
        assert "set-cookie" not in answer.headers
    # The same post with nothing wrong is taken: the refusals above were the forgery's.
    answer = good()
    assert answer.status_code == 303, answer.text
    after = site.record("charge", key)
    assert after["state"] == "claimed" and after["holder"] == "alice"
    assert after["history"][-1]["event"] == "claimed"


def test_removing_an_operator_signs_them_out(site: Site, upstream: Process) -> None:
    """Carol signed in; the config drops her and is reloaded (SIGHUP): her cookie is
    still well signed and unexpired, and it no longer opens anything. The same reload
    makes alice, signed in as an operator, a viewer: her session stays, and her next
    claim is refused (the cookie names her; her role is the current config's)."""
    key = unique("removed")
    site.park(key)
    replica = start_replica(site.tmp, config(site.redis, upstream, ["alice", "carol"], 0))
    try:
        with (
            signed_in_client(replica, "carol") as carol,
            signed_in_client(replica, "alice") as demoted,
        ):
            token = csrf_of(carol, "charge", key)
            alice_token = csrf_of(demoted, "charge", key)
            cookie = {"Cookie": f"{COOKIE}={carol.cookies[COOKIE]}"}
            carol.cookies.clear()
            before = frozen(site.record("charge", key))
            doc = replica.doc
            operators = doc["admin"]["operators"]
            doc["admin"]["operators"] = [o for o in operators if o["name"] != "carol"]
            doc["admin"]["operators"][0]["role"] = "viewer"  # alice
            replica.write(doc)
            replica.process.signal(signal.SIGHUP)
            replica.process.wait_for_output("config reloaded")
            form = ref_form("charge", key, token)
            answer = carol.post("/console/claim", data=form, headers=cookie)
            assert answer.status_code == 401, answer.text
            assert "carol is no longer an operator" in answer.text
            assert "Nothing was changed" in answer.text
            assert frozen(site.record("charge", key)) == before
            page = carol.get("/console/", headers=cookie)
            assert page.status_code == 303 and "/console/signin" in page.headers["location"]
            assert "Max-Age=0" in page.headers["set-cookie"]  # the dead cookie is removed
            refresh = carol.get("/console/keys/rows", headers=cookie)
            assert refresh.status_code == 401  # the live refresh stops, and says so
            refused = demoted.post("/console/claim", data=ref_form("charge", key, alice_token))
            assert refused.status_code == 403 and "alice is a viewer" in refused.text
            assert frozen(site.record("charge", key)) == before
            assert "(viewer)" in demoted.get("/console/").text
        # alice, still listed, is not signed out by it
        with signed_in_client(replica, "alice") as alice:
            assert alice.get("/console/").status_code == 200
    finally:
        replica.process.stop()


def test_a_rotated_token_signs_its_browser_out(
    site: Site, upstream: Process, tabs: Callable[..., Tab]
) -> None:
    """alice signed in with the token in her token_file and opened a parked key. The
    file gets a new token and the gateway reloads (SIGHUP). Her page is still drawn, and
    her cookie well signed and unexpired: her Claim lands on the sign-in form, saying
    why, and the key is not claimed. Signing in with the new token, she claims it."""
    key = unique("rotated")
    site.park(key)
    token_file = site.tmp / f"alice-{key}.token"
    token_file.write_text(TOKENS["alice"] + "\n")
    doc = config(site.redis, upstream, ["alice", "bob"], 0)
    doc["admin"]["operators"][0] = {
        "name": "alice",
        "role": "operator",
        "token_file": str(token_file),
    }
    replica = start_replica(site.tmp, doc)
    try:
        tab = tabs()
        page = sign_in(tab.page, replica, "alice")
        page.goto(replica.admin + f"/console/key?route=charge&key={quote(key, safe='')}")
        expect(page.locator("#key-name")).to_have_text(key)

        rotated = "alice-rotated-" + unique("t")
        token_file.write_text(rotated + "\n")
        replica.process.signal(signal.SIGHUP)
        replica.process.wait_for_output("config reloaded")
        before = frozen(site.record("charge", key))
        with page.expect_response(lambda r: r.url.endswith("/console/claim")) as claimed:
            page.get_by_role("button", name="Claim").click()
        assert claimed.value.status == 401
        expect(page.get_by_role("alert")).to_contain_text("Signed out")
        expect(page.get_by_role("alert")).to_contain_text("has changed since")
        expect(page.get_by_label("Operator token")).to_be_visible()
        assert frozen(site.record("charge", key)) == before

        page.get_by_label("Operator token").fill(rotated)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator(".me")).to_have_text("alice")
        page.goto(replica.admin + f"/console/key?route=charge&key={quote(key, safe='')}")
        page.get_by_role("button", name="Claim").click()
        expect(page.locator("#key-holder")).to_have_text("alice")
        assert_clean(tab)
    finally:
        replica.process.stop()


def test_the_console_behind_the_documented_single_sign_on_proxy(
    site: Site, upstream: Process, tabs: Callable[..., Tab]
) -> None:
    """docs/operator-api.md's nginx block, verbatim, with a stand-in for oauth2-proxy
    that signs in whoever the browser's `sso_user` cookie names, in front of a gateway
    trusting nginx's address. Nobody types a token: the header signs alice in, and her claim is
    taken (a block that sends nginx's own Host makes every post's Origin look forged:
    403). Another site's page (same site: another port of this host, so the
    proxy's Lax cookie goes along) posts a text/plain form whose body is JSON to the
    operator API: refused, nothing changes. Then the browser changes hands at the
    proxy: the next page is bob's, not alice's session."""
    doc = config(site.redis, upstream, ["alice", "bob"], 0)
    doc["admin"] |= {"identity_header": "X-Auth-Request-User", "trusted_proxies": ["127.0.0.1"]}
    replica = start_replica(site.tmp, doc)
    mine, forged = unique("sso"), unique("sso-forged")
    site.park(mine)
    site.park(forged)
    try:
        with sso_front(site.tmp, replica.admin) as front:
            tab = tabs()
            person = {"name": "sso_user", "url": front.url, "sameSite": "Lax"}
            tab.context.add_cookies([person | {"value": "alice"}])  # type: ignore[list-item]
            page = tab.page
            page.goto(front.url + "/console/keys?route=charge")
            expect(page.locator(".me")).to_have_text("alice")
            key_row(page, mine).get_by_role("link", name=mine, exact=True).click()
            page.get_by_role("button", name="Claim").click()
            expect(page.get_by_role("status")).to_contain_text("You hold this key")
            assert site.record("charge", mine)["holder"] == "alice"

            before = frozen(site.record("charge", forged))
            other = tab.context.new_page()
            target = quote(f"{front.url}/admin/keys/charge/{forged}/claim", safe="")
            other.goto(f"{front.other_site}/evil?target={target}")
            with other.expect_response(lambda r: "/admin/keys/" in r.url) as answer:
                other.get_by_role("button", name="Win a prize").click()
            assert answer.value.status == 400, answer.value.text()
            assert "application/json" in answer.value.json()["detail"]
            assert frozen(site.record("charge", forged)) == before
            other.close()

            tab.context.add_cookies([person | {"value": "bob"}])  # type: ignore[list-item]
            page.goto(front.url + "/console/")
            expect(page.locator(".me")).to_have_text("bob")
            assert_clean(tab)
    finally:
        replica.process.stop()
