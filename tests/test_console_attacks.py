"""Attacks on the operator console and the operator API from outside, each one a hole
the code it names keeps shut.

In process: the admin app (console included) through httpx.ASGITransport, whose peer
address is set per client: a single-sign-on proxy of `admin.trusted_proxies` at
10.1.2.3, anyone else at 192.0.2.7. The store is a real redis-server (the tests'
own): a digest that is no digest crashed there, not in the memory store. What a
browser does is in tests/test_console.py; here are the requests an attacker's page or
script makes, sent as such.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.admin.api import create_admin_app
from gateway.assembly import Gateway
from gateway.config import StoreConfig
from gateway.console.rendering import CSP
from gateway.keying import record_digest
from gateway.records import KeyRef, Record
from gateway.store.redis import RedisStore
from tests.conftest import config_for, unique
from tests.support.servers import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

ROLES = {"alice": "operator", "bob": "operator", "vera": "viewer"}
TOKENS = {name: f"atk-{name}-" + name[0] * 24 for name in ROLES}
SHARED = "atk-shared-" + "s" * 24
#: The single-sign-on proxy (trusted), and anyone else.
PROXY, STRANGER = "10.1.2.3", "192.0.2.7"
USER = "X-Auth-Request-User"
ORIGIN = "http://admin"
ROUTE = "charge"


@dataclass
class Site:
    gateway: Gateway
    app: Starlette

    def client(
        self, host: str = STRANGER, headers: dict[str, str] | None = None
    ) -> httpx.AsyncClient:
        """A client at `host`, sending the console's Origin and `headers`."""
        transport = httpx.ASGITransport(app=self.app, client=(host, 40000))
        return httpx.AsyncClient(
            transport=transport, base_url=ORIGIN, headers={"Origin": ORIGIN, **(headers or {})}
        )

    async def parked(self) -> KeyRef:
        key = unique("atk")
        ref = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
        assert await self.gateway.store.claim(ref, "run-1", "fp", lease=60) is None
        assert await self.gateway.store.mark_unresolved(ref, "run-1", "timed out", park=True)
        return ref

    async def record(self, ref: KeyRef) -> Record:
        record = await self.gateway.store.get(ref)
        assert record is not None
        return record


@pytest.fixture
async def site(monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer) -> AsyncIterator[Site]:
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"ATK_{name.upper()}_TOKEN", token)
    monkeypatch.setenv("ATK_SECRET", "x" * 40)
    admin = {
        "token": SHARED,
        "operators": [
            {"name": name, "role": role, "token_env": f"ATK_{name.upper()}_TOKEN"}
            for name, role in ROLES.items()
        ],
        "session_secret_env": "ATK_SECRET",
        "identity_header": USER,
        "trusted_proxies": ["10.0.0.0/8"],
    }
    routes = [{"name": ROUTE, "match": {"path": "/c"}, "key": {"body": "k"}}]
    config = config_for("http://127.0.0.1:9", routes, admin=admin)
    store = RedisStore(
        StoreConfig(
            url=redis_server.url, prefix=unique("atk") + ":", socket_timeout=2, connect_timeout=2
        )
    )
    gateway = Gateway(config, store=store, sweep=False)
    await gateway.start()
    yield Site(gateway, create_admin_app(gateway))
    await gateway.close()


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


def frozen(record: Record) -> dict[str, Any]:
    doc = record.to_json()
    return {k: v for k, v in doc.items() if k not in ("age_seconds", "state_age_seconds")}


async def sign_in(client: httpx.AsyncClient, name: str) -> str:
    """Signs `client` in with `name`'s token; the session's CSRF token."""
    answer = await client.post("/console/signin", data={"token": TOKENS[name]})
    assert answer.status_code == 303, answer.text
    return csrf_of((await client.get("/console/")).text)


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


# -- a digest that is no digest --------------------------------------------------------

NOT_DIGESTS = ["../../x", "", "zz", "0" * 31, "A" * 32, "0" * 32 + "0", "0" * 31 + "g"]


@pytest.mark.parametrize("digest", NOT_DIGESTS, ids=repr)
async def test_a_digest_that_is_no_digest_is_a_bad_request_not_a_crash(
    site: Site, digest: str
) -> None:
    """`?digest=` is the caller's to write. One whose first characters were not hex
    crashed the Redis store's bucket lookup (`int(digest[:4], 16)`): a 500, the
    connection reset, a traceback in the log, on the API and the console alike."""
    ref = await site.parked()
    before = frozen(await site.record(ref))
    path = f"/admin/keys/{ROUTE}/{ref.key}"
    async with site.client(headers=bearer("alice")) as api:
        answers = [
            await api.get(path, params={"digest": digest}),
            await api.post(path + "/claim", params={"digest": digest}, json={}),
        ]
    for answer in answers:
        assert answer.status_code == 400, answer.text
        doc = answer.json()
        assert doc["field"] == "digest" and "32" in doc["detail"], doc
    async with site.client() as browser:
        token = await sign_in(browser, "alice")
        form = {"route": ROUTE, "key": ref.key, "digest": digest}
        page = await browser.get("/console/key", params=form)
        form["csrf"] = token
        post = await browser.post("/console/claim", data=form)
    for answer in (page, post):
        assert answer.status_code == 400, answer.text
        assert answer.headers["content-security-policy"] == CSP
        assert "not a record id" in answer.text
    assert frozen(await site.record(ref)) == before
    # The digest a listing gives still names the record.
    async with site.client(headers=bearer("vera")) as api:
        good = await api.get(path, params={"digest": ref.digest})
    assert good.status_code == 200 and good.json()["state"] == "parked"


# -- the operator API behind the single-sign-on proxy: a cross-site form -----------------

#: What another site's page can make a browser post without asking the server first (a
#: form's three encodings): each carries a body that parses as JSON.
CROSS_SITE_BODIES = {
    "text/plain": ("text/plain", b'{"force": true, "x": "="}'),
    "urlencoded": ("application/x-www-form-urlencoded", b'{"force":true}'),
    "multipart": ("multipart/form-data; boundary=b", b'{"force":true}'),
    "none": ("", b'{"force":true}'),
}


@pytest.mark.parametrize("kind", CROSS_SITE_BODIES, ids=CROSS_SITE_BODIES.keys())
async def test_a_cross_site_form_cannot_act_through_the_sso_proxy(site: Site, kind: str) -> None:
    """Behind oauth2-proxy the identity header is an ambient credential: the proxy adds
    it to whatever the signed-in browser sends, its cookie is sent on a cross-site
    form post (SameSite=Lax allows top-level posts for two minutes in Chromium; a
    sibling subdomain is same-site), and an HTML form can post `text/plain` whose body
    is JSON. The operator API read any body as JSON, whatever its Content-Type, so
    evil.example's page claimed and resolved keys as the operator. A body must say it
    is JSON: a type no cross-site form or no-cors fetch can send."""
    content_type, body = CROSS_SITE_BODIES[kind]
    ref = await site.parked()
    assert (await site.gateway.store.operator_claim(ref, "bob", False)).ok
    before = frozen(await site.record(ref))
    forged = {USER: "alice", "Origin": "http://evil.example"}
    if content_type:
        forged["Content-Type"] = content_type
    path = f"/admin/keys/{ROUTE}/{ref.key}"
    resolve = b'{"outcome": "retry", "x": "="}'
    async with site.client(PROXY, headers=forged) as proxied:
        answers = [
            await proxied.post(path + "/claim", content=body),
            await proxied.post(path + "/resolve", content=resolve),
        ]
    for answer in answers:
        assert answer.status_code == 400, answer.text
        assert answer.json()["type"].endswith("/not-a-json-object"), answer.text
        assert "Content-Type: application/json" in answer.json()["detail"]
    assert frozen(await site.record(ref)) == before
    # The same call that says it is JSON, as the CLI and every HTTP client send it.
    async with site.client(PROXY, headers={USER: "alice"}) as proxied:
        taken = await proxied.post(path + "/claim", json={"force": True})
    assert taken.status_code == 200, taken.text
    assert (await site.record(ref)).holder == "alice"


# -- a console session behind the single-sign-on proxy ---------------------------------


async def test_a_console_session_yields_to_the_user_the_sso_proxy_names(site: Site) -> None:
    """Behind the proxy, its header says who is at the browser on every request. bob
    signed in through it; then the browser is alice's (bob signed out of the proxy on
    a shared machine, or the proxy's session changed hands): the console cookie still
    said bob, and alice read and acted as bob until it expired. A session the proxy
    made lasts while the proxy names its operator; one the header names another
    operator than is over too: a post is refused, the next page signs in alice."""
    ref = await site.parked()
    async with site.client(PROXY, headers={USER: "bob"}) as browser:
        answer = await browser.get("/console/signin")
        assert answer.status_code == 303, answer.text
        token = csrf_of((await browser.get("/console/")).text)
        browser.headers[USER] = "alice"
        before = frozen(await site.record(ref))
        form = {"route": ROUTE, "key": ref.key, "digest": ref.digest, "csrf": token}
        post = await browser.post("/console/claim", data=form)
        assert post.status_code == 401, post.text
        assert "Nothing was changed" in post.text
        assert frozen(await site.record(ref)) == before
        page = await browser.get("/console/keys")
        assert page.status_code == 303 and page.headers["location"].startswith("/console/signin")
        again = await browser.get(page.headers["location"])
        assert again.status_code == 303 and again.headers["location"] == "/console/keys"
        mine = await browser.get("/console/keys")
        assert '<strong class="me">alice</strong>' in mine.text
        # A name the proxy sends that is nobody's: no session either.
        browser.headers[USER] = "mallory"
        assert (await browser.get("/console/")).status_code == 303
        assert (await browser.get("/console/keys/rows")).status_code == 401
    # A token made the session: the header vouches for nobody here, and while it names
    # no operator (a proxy user who is none signed in with their token), the session
    # is the token's. Once it names another operator, that operator is at the browser.
    async with site.client(PROXY, headers={USER: "oncall"}) as shared:
        await sign_in(shared, "bob")
        assert '<strong class="me">bob</strong>' in (await shared.get("/console/")).text
        shared.headers[USER] = "alice"
        assert (await shared.get("/console/")).status_code == 303
    # From an address that is no trusted proxy, the header is anyone's: ignored.
    async with site.client(STRANGER, headers={USER: "alice"}) as direct:
        await sign_in(direct, "bob")
        assert '<strong class="me">bob</strong>' in (await direct.get("/console/")).text


# -- guessing tokens -------------------------------------------------------------------


def refusals(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        getattr(r, "fields", {})
        for r in caplog.records
        if r.name == "gateway.operator" and getattr(r, "fields", {}).get("action") == "sign_in"
    ]


async def test_refused_sign_ins_and_tokens_are_logged_and_never_the_token(
    site: Site, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing throttles a guess (tokens are at least 16 characters; keygen's are 256
    bits), but a guess left no trace at all: a wrong token at the console's sign-in or
    the operator API answered 401 and the log said nothing, so nobody could see or
    alert on someone trying tokens. Each refusal is one warning now, from which
    address and why; a console sign-in is one info line. Never a token."""
    guesses = ["atk-alice-" + "x" * 24, "", SHARED]
    with caplog.at_level(logging.INFO, "gateway.operator"):
        async with site.client() as browser:
            for guess in guesses:
                answer = await browser.post("/console/signin", data={"token": guess})
                assert answer.status_code == 401, answer.text
            assert (
                await browser.post("/console/signin", data={"token": TOKENS["vera"]})
            ).status_code == 303
        async with site.client() as api:
            wrong = {"Authorization": "Bearer " + guesses[0]}
            assert (await api.get("/admin/me", headers=wrong)).status_code == 401
            assert (await api.get("/admin/me")).status_code == 401
        async with site.client(PROXY, headers={USER: "mallory"}) as proxied:
            assert (await proxied.get("/admin/me")).status_code == 401
    lines = refusals(caplog)
    assert [(f["client"], f["peer"], f.get("refused", ""), f["operator"]) for f in lines] == [
        ("console", STRANGER, "unauthorized", ""),
        ("console", STRANGER, "unauthorized", ""),
        ("console", STRANGER, "shared-token", ""),
        ("console", STRANGER, "", "vera"),
        ("api", STRANGER, "unauthorized", ""),
        ("api", STRANGER, "unauthorized", ""),
        ("api", PROXY, "unauthorized", ""),
    ], lines
    levels = [
        r.levelname for r in caplog.records if getattr(r, "fields", {}).get("action") == "sign_in"
    ]
    assert levels == ["WARNING"] * 3 + ["INFO"] + ["WARNING"] * 3
    assert "names no operator" in caplog.text and "mallory" not in caplog.text
    logged = caplog.text + repr([r.__dict__ for r in caplog.records])
    assert not any(token in logged for token in (*TOKENS.values(), SHARED, guesses[0]))
