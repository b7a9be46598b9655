"""gateway/admin/api.py: every handler and every refusal of the admin listener, in process.

The admin app runs through httpx.ASGITransport over a real store: a MemoryStore, and
a redis-server of the tests' own where what the store answers is the point (claims,
refusals, listings, a store that goes down). Records are put in the state a test
needs through the store's own operations, so no upstream is involved.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from gateway.admin import api as admin
from gateway.admin.api import authenticate, create_admin_app, problem_response, summary
from gateway.assembly import Gateway
from gateway.config import StoreConfig
from gateway.errors import (
    PROBLEM_BASE,
    BadFilter,
    BadOperatorRequest,
    BadOutcome,
    BadResponse,
    DigestRequired,
    HeldByAnother,
    InvalidTransition,
    NotJsonObject,
    NotTheHolder,
    NotYourName,
    OperatorApiDisabled,
    OperatorBodyTooLarge,
    OperatorRefusal,
    OperatorRequired,
    ProblemError,
    Unauthorized,
    UnknownKey,
    ViewerCannotAct,
)
from gateway.keying import record_digest
from gateway.logs import JsonFormatter, shown_key
from gateway.operators.identity import Operator, Role
from gateway.operators.response import check_response, operator_response
from gateway.records import KeyRef, Record, State, StoredRequest, StoredResponse
from gateway.store.base import NewDelivery, Store
from gateway.store.memory import MemoryStore
from gateway.store.pages import Page
from gateway.store.redis import RedisStore
from tests.conftest import config_for, unique
from tests.support.servers import RedisServer

pytestmark = pytest.mark.anyio

TOKEN = "adm-test-admin-token"
#: Named operators (admin.operators): their tokens come from the environment.
OPERATORS = {
    "alice": ("operator", "adm-alice-token-0123456789"),
    "bob": ("operator", "adm-bob-token-0123456789ab"),
    "vera": ("viewer", "adm-vera-token-0123456789a"),
}
ROUTE = "send-invoices"
OTHER = "send-reminders"
SCOPED = "tenant-jobs"
SECRET = "card-charges"  # sensitive_keys: logs show a hash of its keys
#: Nothing listens here: no test in this file forwards a request.
NOWHERE = "http://127.0.0.1:9"
MEMORY = pytest.mark.parametrize("store_kind", ["memory"])

ROUTES = [
    {"name": ROUTE, "match": {"methods": ["POST"], "path": "/jobs/i"}, "key": {"body": "k"}},
    {"name": OTHER, "match": {"methods": ["POST"], "path": "/jobs/r"}, "key": {"body": "k"}},
    {
        "name": SCOPED,
        "match": {"methods": ["POST"], "path": "/jobs/t"},
        "key": {"body": "k", "scope": ["header.X-Tenant"]},
    },
    {
        "name": SECRET,
        "match": {"methods": ["POST"], "path": "/jobs/c"},
        "key": {"body": "k"},
        "sensitive_keys": True,
    },
]

#: Ways to ask without the token (only `Authorization: Bearer <token>` counts).
BAD_AUTH: dict[str, dict[str, Any]] = {
    "none": {},
    "wrong": {"headers": {"Authorization": "Bearer not-the-token"}},
    "prefix": {"headers": {"Authorization": f"Bearer {TOKEN[:-1]}"}},
    "named-prefix": {"headers": {"Authorization": "Bearer adm-alice-token-012345678"}},
    # No admin.identity_header configured: nobody's header is believed.
    "identity-header": {"headers": {"X-Auth-Request-User": "alice"}},
    "no-scheme": {"headers": {"Authorization": TOKEN}},
    "basic-scheme": {"headers": {"Authorization": f"Basic {TOKEN}"}},
    "query": {"params": {"token": TOKEN, "access_token": TOKEN}},
}


@dataclass
class Admin:
    """A started gateway, its admin app, and a client that sends the token."""

    gateway: Gateway
    app: Starlette
    clients: list[httpx.AsyncClient] = field(default_factory=list)
    #: alice's (a named operator's) client
    http: httpx.AsyncClient = field(init=False)

    @property
    def store(self) -> Store:
        return self.gateway.store

    def anonymous(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://a")

    def with_token(self, token: str) -> httpx.AsyncClient:
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app),
            base_url="http://admin",
            headers={"Authorization": f"Bearer {token}"},
        )
        self.clients.append(client)
        return client

    def as_(self, name: str) -> httpx.AsyncClient:
        """A client with `name`'s own token (OPERATORS)."""
        return self.with_token(OPERATORS[name][1])

    @property
    def shared(self) -> httpx.AsyncClient:
        """A client with the shared admin.token."""
        return self.with_token(TOKEN)

    async def seed(
        self, state: State, route: str = ROUTE, scope: str = "", key: str = ""
    ) -> KeyRef:
        """A record in `state`, reached the way the engine and an operator would."""
        key = key or unique("inv")
        ref = KeyRef(record_digest(route, scope, key), route, key)
        run = uuid.uuid4().hex
        assert await self.store.claim(ref, run, "fp", lease=60) is None
        if state is State.IN_FLIGHT:
            return ref
        if state is State.COMPLETED:
            assert await self.store.complete(ref, run, StoredResponse(200, (), b"ok"), ttl=60)
            return ref
        park = state in (State.PARKED, State.CLAIMED)
        assert await self.store.mark_unresolved(ref, run, "upstream timed out", park=park)
        if state is State.CLAIMED:
            assert (await self.store.operator_claim(ref, "alice", False)).ok
        return ref

    async def record(self, ref: KeyRef) -> Record:
        record = await self.store.get(ref)
        assert record is not None
        return record


def path(ref: KeyRef, action: str = "") -> str:
    return f"/admin/keys/{ref.route}/{ref.key}" + (f"/{action}" if action else "")


def frozen(record: Record) -> dict[str, Any]:
    """A record's JSON without the ages, which move while a test runs."""
    doc = record.to_json()
    doc.pop("age_seconds")
    doc.pop("state_age_seconds")
    return doc


def assert_problem(response: httpx.Response, refusal: type[ProblemError], **members: Any) -> None:
    assert response.status_code == refusal.status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["type"] == PROBLEM_BASE + refusal.slug, doc
    assert doc["title"] == refusal.title and doc["status"] == refusal.status, doc
    for name, value in members.items():
        assert doc[name] == value, (name, doc)


def operators_config(names: tuple[str, ...] = tuple(OPERATORS)) -> list[dict[str, str]]:
    return [
        {"name": name, "role": OPERATORS[name][0], "token_env": f"ADM_{name.upper()}_TOKEN"}
        for name in names
    ]


@pytest.fixture
def operator_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, (_, token) in OPERATORS.items():
        monkeypatch.setenv(f"ADM_{name.upper()}_TOKEN", token)


@pytest.fixture
async def admin_for(
    make_store: Callable[[], Store], operator_tokens: None
) -> AsyncIterator[Callable[..., Any]]:
    """`await admin_for(token=TOKEN, store=None, operators=True)`: an Admin on a
    started gateway, with the shared token and the named OPERATORS."""
    opened: list[Admin] = []

    async def build(
        token: str = TOKEN, store: Store | None = None, operators: bool = True
    ) -> Admin:
        # max_deliveries 0: deliveries seeded below stay in the state a test put them in.
        server = {"max_deliveries": 0}
        admin: dict[str, Any] = {"token": token} if token else {}
        if operators:
            admin["operators"] = operators_config()
        config = config_for(NOWHERE, ROUTES, admin=admin, server=server)
        gateway = Gateway(config, store=store or make_store(), sweep=False)
        await gateway.start()
        app = create_admin_app(gateway)
        api = Admin(gateway, app)
        api.http = api.as_("alice")
        opened.append(api)
        return api

    yield build
    for each in opened:
        for client in each.clients:
            await client.aclose()
        await each.gateway.close()


# -- the token ------------------------------------------------------------------------


@MEMORY
@pytest.mark.parametrize("auth", BAD_AUTH.values(), ids=BAD_AUTH.keys())
async def test_every_operator_call_without_the_token_is_unauthorized(
    admin_for: Callable[..., Any], auth: dict[str, Any]
) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.CLAIMED)
    before = frozen(await api.record(ref))
    done = {"operator": "alice", "outcome": "done", "token": TOKEN}
    async with api.anonymous() as client:
        answers = [
            await client.get("/admin/keys", **auth),
            await client.get(path(ref), **auth),
            await client.post(path(ref, "claim"), json={"operator": "eve", "force": True}, **auth),
            await client.post(path(ref, "resolve"), json=done, **auth),
        ]
    for answer in answers:
        assert_problem(
            answer, Unauthorized, detail="Send Authorization: Bearer <your operator token>."
        )
    assert frozen(await api.record(ref)) == before


@MEMORY
async def test_a_token_is_decided_by_compare_digest_alone(
    admin_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`authenticate` on its own: with compare_digest saying no, every right token is
    refused; a plain `==` would let it through. A token given is compared with every
    configured one (alice's, bob's, vera's, the shared one), each as SHA-256 digests
    of one length, whichever matches: the time taken says nothing of which it was."""
    api: Admin = await admin_for()
    calls: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return False

    def request(token: str) -> Request:
        return Request(
            {
                "type": "http",
                "app": api.app,
                "method": "GET",
                "path": "/admin/keys",
                "query_string": b"",
                "headers": [(b"authorization", f"Bearer {token}".encode())],
                "client": ("127.0.0.1", 5000),
            }
        )

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for token in (OPERATORS["alice"][1], TOKEN):
        calls.clear()
        with pytest.raises(Unauthorized):
            authenticate(request(token))
        assert len(calls) == 4, calls
        given = hashlib.sha256(token.encode()).digest()
        assert all(a == given and len(b) == len(given) for a, b in calls)
        assert given in [b for _, b in calls]
    monkeypatch.undo()
    assert authenticate(request(OPERATORS["alice"][1])) == (
        api.gateway,
        Operator("alice", Role.OPERATOR, "token"),
    )
    assert authenticate(request(TOKEN)) == (
        api.gateway,
        Operator("", Role.OPERATOR, "shared_token"),
    )


@MEMORY
async def test_without_a_token_the_operator_api_is_disabled_and_probes_stay_on(
    admin_for: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "gateway.admin"):
        api: Admin = await admin_for(token="", operators=False)
    assert "operator API is disabled" in caplog.text
    ref = await api.seed(State.PARKED)
    answers = [
        await api.http.get("/admin/keys"),
        await api.http.get(path(ref)),
        await api.http.post(path(ref, "claim"), json={"operator": "alice"}),
    ]
    for answer in answers:
        assert_problem(answer, OperatorApiDisabled)
        assert "admin.operators or admin.token" in answer.json()["detail"]
    assert (await api.http.get("/healthz")).status_code == 200
    assert (await api.http.get("/metrics")).status_code == 200
    # The operators are the current config's: a reload that sets a token turns it on.
    config = api.gateway.config
    api.gateway.reload(replace(config, admin=replace(config.admin, token=TOKEN)))
    assert (await api.shared.get(path(ref))).status_code == 200


# -- who: named operators, roles, the shared token ----------------------------------


async def test_me_says_who_and_how(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    assert (await api.http.get("/admin/me")).json() == {
        "name": "alice",
        "role": "operator",
        "via": "token",
    }
    assert (await api.as_("vera").get("/admin/me")).json()["role"] == "viewer"
    assert (await api.shared.get("/admin/me")).json() == {
        "name": "",
        "role": "operator",
        "via": "shared_token",
    }


@MEMORY
async def test_a_viewer_reads_everything_and_changes_nothing(
    admin_for: Callable[..., Any],
) -> None:
    api: Admin = await admin_for()
    vera = api.as_("vera")
    parked, held = await api.seed(State.PARKED), await api.seed(State.CLAIMED)
    before = {ref.key: frozen(await api.record(ref)) for ref in (parked, held)}
    assert (await vera.get("/admin/keys")).json()["count"] == 2
    assert (await vera.get(path(parked))).json()["state"] == "parked"
    assert (await vera.get("/admin/overview")).status_code == 200
    refused = [
        await vera.post(path(parked, "claim"), json={}),
        await vera.post(path(held, "claim"), json={"force": True}),
        await vera.post(path(held, "resolve"), json={"outcome": "done", "note": "x"}),
        await vera.post(path(held, "resolve"), json={"outcome": "retry"}),
        # Refused for the role before the body is read: whatever it says.
        await vera.post(path(held, "resolve"), content=b"not json"),
        await vera.post(path(held, "claim"), json={"operator": "alice"}),
    ]
    for answer in refused:
        assert_problem(answer, ViewerCannotAct)
        assert "vera is a viewer" in answer.json()["detail"]
    assert {ref.key: frozen(await api.record(ref)) for ref in (parked, held)} == before
    for action in ("claim", "resolve_done", "resolve_retry"):
        for role in ("operator", "viewer"):
            labels = {"action": action, "role": role}
            count = api.gateway.metrics.registry.get_sample_value(
                "idempotency_gateway_operator_actions_total", labels
            )
            assert not count, labels


@MEMORY
async def test_an_operator_field_that_is_not_yours_is_forbidden(
    admin_for: Callable[..., Any],
) -> None:
    """The recorded name is the authenticated one: a named operator may leave
    "operator" out or give their own; another name is refused, and nothing changes."""
    api: Admin = await admin_for()
    parked, held = await api.seed(State.PARKED), await api.seed(State.CLAIMED)  # alice's
    before = {ref.key: frozen(await api.record(ref)) for ref in (parked, held)}
    bob = api.as_("bob")
    refused = [
        await bob.post(path(parked, "claim"), json={"operator": "alice"}),
        await bob.post(path(held, "claim"), json={"operator": "alice", "force": True}),
        await api.http.post(path(held, "resolve"), json={"operator": "bob", "outcome": "done"}),
        await api.http.post(path(held, "resolve"), json={"operator": 7, "outcome": "retry"}),
    ]
    for answer in refused:
        assert_problem(answer, NotYourName)
        assert "You are authenticated as" in answer.json()["detail"]
    assert {ref.key: frozen(await api.record(ref)) for ref in (parked, held)} == before
    mine = await bob.post(path(parked, "claim"), json={"operator": "bob"})
    assert mine.status_code == 200 and mine.json()["holder"] == "bob"
    done = await api.http.post(path(held, "resolve"), json={"outcome": "done"})
    assert done.status_code == 200 and done.json()["history"][-1]["operator"] == "alice"


async def test_the_shared_token_is_recorded_as_such(admin_for: Callable[..., Any]) -> None:
    """The shared token proves no name: its actions keep the name given, marked, so
    they are never taken for that operator's own."""
    api: Admin = await admin_for()
    ref = await api.seed(State.PARKED)
    nameless = await api.shared.post(path(ref, "claim"), json={})
    assert_problem(nameless, OperatorRequired)
    assert "(shared token)" in nameless.json()["detail"]
    claimed = await api.shared.post(path(ref, "claim"), json={"operator": "alice"})
    assert claimed.status_code == 200 and claimed.json()["holder"] == "alice (shared token)"
    # alice's own token is someone else to the record: the shared token's alice holds it.
    own = await api.http.post(path(ref, "resolve"), json={"outcome": "done"})
    assert_problem(own, NotTheHolder, holder="alice (shared token)")
    done = await api.shared.post(
        path(ref, "resolve"), json={"operator": "alice", "outcome": "done", "note": "checked"}
    )
    assert done.status_code == 200, done.text
    events = done.json()["history"]
    assert [(e["event"], e.get("operator")) for e in events[-2:]] == [
        ("claimed", "alice (shared token)"),
        ("resolved", "alice (shared token)"),
    ]
    stored = (await api.record(ref)).response
    assert stored is not None and json.loads(stored.body)["resolved_by"] == "alice (shared token)"


@MEMORY
async def test_a_removed_operator_is_refused_after_a_reload(
    admin_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    api: Admin = await admin_for()
    bob = api.as_("bob")
    assert (await bob.get("/admin/keys")).status_code == 200
    config = api.gateway.config
    kept = tuple(op for op in config.admin.operators if op.name != "bob")
    api.gateway.reload(replace(config, admin=replace(config.admin, operators=kept)))
    assert_problem(await bob.get("/admin/keys"), Unauthorized)
    assert (await api.http.get("/admin/keys")).status_code == 200
    assert api.gateway.operators.by_name("bob") is None


@MEMORY
async def test_each_action_is_one_log_line_and_never_a_token(
    admin_for: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Who, role, what, route, key (hashed on a sensitive_keys route), which client;
    a refusal's line says it was refused. No token in any line."""
    api: Admin = await admin_for()
    parked, secret = await api.seed(State.PARKED), await api.seed(State.PARKED, route=SECRET)
    cli = {"User-Agent": "idempotency-gateway-cli/1"}
    with caplog.at_level(logging.INFO, "gateway.operator"):
        await api.http.post(path(parked, "claim"), json={}, headers=cli)
        await api.as_("bob").post(path(parked, "claim"), json={"force": True})
        await api.as_("bob").post(path(parked, "resolve"), json={"outcome": "retry"})
        await api.as_("vera").post(path(secret, "claim"), json={})
        await api.shared.post(path(secret, "claim"), json={"operator": "carol"})
        await api.http.post(path(secret, "claim"), json={})  # carol holds it: refused
        await api.http.post(path(secret, "claim"), json={"operator": "carol", "force": True})
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    hashed = shown_key(secret.key, True)
    assert hashed.startswith("sha256:") and hashed != secret.key
    common = ("operator", "role", "via", "action", "route", "key", "client")
    assert [tuple(line.get(name) for name in common) for line in lines] == [
        ("alice", "operator", "token", "claim", ROUTE, parked.key, "cli"),
        ("bob", "operator", "token", "claim", ROUTE, parked.key, "api"),
        ("bob", "operator", "token", "resolve_retry", ROUTE, parked.key, "api"),
        ("vera", "viewer", "token", "claim", SECRET, hashed, "api"),
        ("carol (shared token)", "operator", "shared_token", "claim", SECRET, hashed, "api"),
        ("alice", "operator", "token", "claim", SECRET, hashed, "api"),
        ("alice", "operator", "token", "claim", SECRET, hashed, "api"),
    ]
    assert [line.get("refused") for line in lines] == [
        None, None, None, ViewerCannotAct.slug, None, HeldByAnother.slug, NotYourName.slug,
    ]  # fmt: skip
    assert lines[1]["takeover_from"] == "alice"
    assert all(line["logger"] == "gateway.operator" and line["level"] == "info" for line in lines)
    text = caplog.text + "".join(map(json.dumps, lines))
    assert secret.key not in text
    assert not any(token in text for token in (TOKEN, *(t for _, t in OPERATORS.values())))


async def test_overview_has_the_gauges_figures(admin_for: Callable[..., Any]) -> None:
    """Per route and open state, the count and oldest age the gauges export, read from
    the store; queued and retrying deliveries; the last success the store recorded
    (OTHER's completion below 500), none on the others."""
    api: Admin = await admin_for()
    for state, route in (
        (State.PARKED, ROUTE), (State.PARKED, ROUTE), (State.CLAIMED, ROUTE),
        (State.UNRESOLVED, OTHER), (State.IN_FLIGHT, OTHER), (State.COMPLETED, OTHER),
    ):  # fmt: skip
        await api.seed(state, route=route)
    await deliveries(api)  # on ROUTE: one queued, one retrying, one parked
    await asyncio.sleep(0.01)  # every open record has an age above 0 ms
    await api.gateway.refresh_key_metrics()
    registry = api.gateway.metrics.registry
    doc = (await api.as_("vera").get("/admin/overview")).json()
    assert doc["store"] == {"reachable": True, "error": None}
    rows = {row["route"]: row for row in doc["routes"]}
    assert list(rows) == [ROUTE, OTHER, SCOPED, SECRET]  # the config's order
    counts = {
        (name, state): figures["count"]
        for name, row in rows.items()
        for state, figures in row["keys"].items()
    }
    assert {k: v for k, v in counts.items() if v} == {
        (ROUTE, "parked"): 3,
        (ROUTE, "claimed"): 1,
        (OTHER, "unresolved"): 1,
    }
    for (name, state), count in counts.items():
        labels = {"route": name, "state": state}
        assert registry.get_sample_value("idempotency_gateway_keys", labels) == count
        gauge = registry.get_sample_value("idempotency_gateway_oldest_key_age_seconds", labels)
        age = rows[name]["keys"][state]["oldest_age_seconds"]
        assert (age > 0) == (count > 0) and gauge is not None and age >= round(gauge, 3) - 0.001
    assert rows[ROUTE]["queue"]["queued"] == 1 and rows[ROUTE]["queue"]["retrying"] == 1
    assert rows[OTHER]["queue"] is None  # a sync route with no deliveries
    ages = {name: row["last_success_age_seconds"] for name, row in rows.items()}
    assert ages[OTHER] is not None and ages[OTHER] >= 0, ages
    assert [ages[name] for name in (ROUTE, SCOPED, SECRET)] == [None, None, None], ages
    assert all(row["configured"] and row["delivery"] == "sync" for row in rows.values())


# -- records: unknown, scoped, shown ---------------------------------------------------


async def test_unknown_keys_are_refused_on_every_call(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    ref = KeyRef(record_digest(ROUTE, "", "nope"), ROUTE, "nope")
    answers = [
        await api.http.get(path(ref)),
        await api.http.post(path(ref, "claim"), json={"operator": "alice"}),
        await api.http.post(path(ref, "resolve"), json={"operator": "alice", "outcome": "retry"}),
    ]
    for answer in answers:
        assert_problem(answer, UnknownKey, route=ROUTE, key="nope")
    # Drawn by ProblemError.render, the proxy's renderer: the same bytes.
    assert answers[0].content == UnknownKey(route=ROUTE, key="nope").render()[2]


async def test_a_digest_names_only_its_own_route_and_key(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.PARKED)
    digest = {"digest": ref.digest}
    shown = await api.http.get(path(ref), params=digest)
    assert shown.status_code == 200 and shown.json()["key"] == ref.key
    elsewhere = [
        await api.http.get(f"/admin/keys/{OTHER}/{ref.key}", params=digest),
        await api.http.get(f"/admin/keys/{ROUTE}/another-key", params=digest),
        await api.http.post(f"/admin/keys/{OTHER}/{ref.key}/claim", params=digest, json={}),
    ]
    for answer in elsewhere:
        assert_problem(answer, UnknownKey)
    assert (await api.record(ref)).holder == ""


async def test_a_scoped_routes_record_needs_its_digest(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.PARKED, route=SCOPED, scope="tenant-a")
    bare = await api.http.get(path(ref))
    assert_problem(bare, DigestRequired, route=SCOPED, key=ref.key)
    assert "?digest=" in bare.json()["detail"]
    claim = await api.http.post(path(ref, "claim"), json={"operator": "alice"})
    assert_problem(claim, DigestRequired)
    claimed = await api.http.post(
        path(ref, "claim"), params={"digest": ref.digest}, json={"operator": "alice"}
    )
    assert claimed.status_code == 200 and claimed.json()["holder"] == "alice"


async def test_show_is_the_records_json(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.CLAIMED)
    shown = (await api.http.get(path(ref))).json()
    for moving in ("age_seconds", "state_age_seconds"):
        assert shown.pop(moving) >= 0
    assert shown == frozen(await api.record(ref))
    # Seeded within a millisecond or two, the events' order is their at_ms's.
    assert sorted(e["event"] for e in shown["history"]) == [
        "claimed",
        "forwarded",
        "parked",
        "unknown",
    ]


# -- claims and resolutions ------------------------------------------------------------


async def test_a_key_another_operator_holds_is_refused_naming_them(
    admin_for: Callable[..., Any],
) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.CLAIMED)  # alice holds it
    held = await api.record(ref)
    bob = await api.as_("bob").post(path(ref, "claim"), json={})
    assert_problem(
        bob,
        HeldByAnother,
        holder="alice",
        holder_since_ms=held.holder_since_ms,
        route=ROUTE,
        key=ref.key,
    )
    assert '"force": true' in bob.json()["detail"]
    assert frozen(await api.record(ref)) == frozen(held)
    again = await api.http.post(path(ref, "claim"), json={"operator": " alice "})
    assert again.status_code == 200 and again.json()["holder"] == "alice"
    taken = await api.as_("bob").post(path(ref, "claim"), json={"force": True})
    assert taken.status_code == 200 and taken.json()["holder"] == "bob"
    assert taken.json()["history"][-1]["takeover_from"] == "alice"


async def test_only_the_holder_may_resolve(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.CLAIMED)  # alice holds it
    before = frozen(await api.record(ref))
    for outcome in ("done", "retry"):
        bob = await api.as_("bob").post(path(ref, "resolve"), json={"outcome": outcome})
        assert_problem(bob, NotTheHolder, holder="alice", route=ROUTE, key=ref.key)
        assert "claim it first" in bob.json()["detail"]
    assert frozen(await api.record(ref)) == before
    done = await api.http.post(path(ref, "resolve"), json={"operator": "alice", "outcome": "done"})
    assert done.status_code == 200 and done.json()["state"] == "completed"


async def test_illegal_moves_are_invalid_transitions(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    running = await api.seed(State.IN_FLIGHT)
    parked = await api.seed(State.PARKED)
    completed = await api.seed(State.COMPLETED)
    resolve = {"operator": "alice", "outcome": "retry"}
    cases = [
        (await api.http.post(path(running, "claim"), json={"operator": "alice"}), "in_flight"),
        (await api.http.post(path(completed, "claim"), json={"operator": "alice"}), "completed"),
        # Resolving needs a claim first: a parked key nobody holds cannot be resolved.
        (await api.http.post(path(parked, "resolve"), json=resolve), "parked"),
    ]
    for answer, state in cases:
        assert_problem(answer, InvalidTransition, state=state, detail=f"The key is {state}.")
    assert (await api.record(parked)).state is State.PARKED
    assert (await api.record(running)).state is State.IN_FLIGHT


async def test_claim_and_resolve_count_and_answer_the_record(
    admin_for: Callable[..., Any],
) -> None:
    api: Admin = await admin_for()
    done_ref, retry_ref = await api.seed(State.PARKED), await api.seed(State.UNRESOLVED)
    for ref in (done_ref, retry_ref):
        claimed = await api.http.post(path(ref, "claim"), json={"operator": "alice"})
        assert claimed.status_code == 200 and claimed.json()["state"] == "claimed"
    given = {"status": 201, "headers": {"X-Ledger": "42"}, "body": {"paid": True}}
    done = await api.http.post(
        path(done_ref, "resolve"),
        json={"operator": "alice", "outcome": "done", "note": "paid", "response": given},
    )
    assert done.status_code == 200, done.text
    assert done.json()["response"] == {"status": 201, "origin": "operator", "body_omitted": False}
    assert done.json()["history"][-1]["note"] == "paid"
    stored = (await api.record(done_ref)).response
    assert stored is not None and stored.body == b'{"paid": true}'
    assert ("content-type", "application/json") in stored.headers
    retry = await api.http.post(
        path(retry_ref, "resolve"), json={"operator": "alice", "outcome": "retry"}
    )
    assert retry.status_code == 200 and retry.json()["state"] == "released"
    registry = api.gateway.metrics.registry
    for action, count in (("claim", 2), ("resolve_done", 1), ("resolve_retry", 1)):
        sample = registry.get_sample_value(
            "idempotency_gateway_operator_actions_total", {"action": action, "role": "operator"}
        )
        assert sample == count, action


# -- bodies an operator call cannot act on ------------------------------------------


#: (what is wrong, call, body as sent, the refusal, a word its detail has)
BAD_BODIES: list[tuple[str, str, bytes, type[OperatorRefusal], str]] = [
    ("not-json", "claim", b"{operator: alice}", NotJsonObject, "not valid JSON"),
    ("json-list", "claim", b'["alice"]', NotJsonObject, "not an object"),
    ("json-text", "resolve", b'"alice"', NotJsonObject, "not an object"),
    ("no-operator", "claim", b"{}", OperatorRequired, '"operator"'),
    ("blank-operator", "claim", b'{"operator": "  "}', OperatorRequired, '"operator"'),
    ("operator-number", "resolve", b'{"operator": 7, "outcome": "done"}', OperatorRequired, ""),
    ("no-outcome", "resolve", b'{"operator": "alice"}', BadOutcome, "retry"),
    ("bad-outcome", "resolve", b'{"operator": "alice", "outcome": "maybe"}', BadOutcome, "done"),
    (
        "bad-response",
        "resolve",
        b'{"operator": "alice", "outcome": "done", "response": {"status": 101}}',
        BadResponse,
        "200 to 599",
    ),
]


@MEMORY
@pytest.mark.parametrize(
    ("call", "body", "refusal", "word"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
async def test_bad_bodies_are_refused_with_their_own_type(
    admin_for: Callable[..., Any],
    call: str,
    body: bytes,
    refusal: type[OperatorRefusal],
    word: str,
) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.CLAIMED)
    before = frozen(await api.record(ref))
    # The shared token: it needs the body to name the operator.
    answer = await api.shared.post(
        path(ref, call), content=body, headers={"Content-Type": "application/json"}
    )
    assert_problem(answer, refusal)
    assert word in answer.json()["detail"]
    assert frozen(await api.record(ref)) == before


def test_each_bad_body_means_one_thing() -> None:
    """One type, one title: what differs between two occurrences is their detail."""
    kinds = [BadFilter, NotJsonObject, OperatorRequired, BadOutcome, DigestRequired, BadResponse]
    assert len({k.slug for k in kinds}) == len({k.title for k in kinds}) == len(kinds)
    assert all(k.status == 400 for k in kinds)


@MEMORY
async def test_bodies_over_the_limit_are_refused_declared_or_streamed(
    admin_for: Callable[..., Any],
) -> None:
    api: Admin = await admin_for()
    ref = await api.seed(State.CLAIMED)
    huge = b'{"operator": "' + b"x" * (65 * 1024) + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(huge), 8192):
            yield huge[start : start + 8192]

    json_type = {"Content-Type": "application/json"}
    declared = await api.http.post(path(ref, "claim"), content=huge, headers=json_type)
    streamed = await api.http.post(path(ref, "claim"), content=chunks(), headers=json_type)
    assert "content-length" not in streamed.request.headers
    for answer in (declared, streamed):
        assert_problem(answer, OperatorBodyTooLarge)
        assert str(64 * 1024) in answer.json()["detail"]
    assert (await api.record(ref)).holder == "alice"


@MEMORY
async def test_a_declared_length_is_a_number_only_in_ascii_digits(
    admin_for: Callable[..., Any],
) -> None:
    """A Content-Length the server let through that is no number (`²` passes
    str.isdigit() and int() refuses it) is not believed, never an error: the body as
    it arrives decides, within the same limit."""
    api: Admin = await admin_for()
    for declared in (b"\xb2", b"1\xb9", b"\xb3\xb3\xb3\xb3\xb3\xb3"):
        ref = await api.seed(State.PARKED)
        headers = {"Content-Type": "application/json", "Content-Length": declared}
        answer = await api.http.post(path(ref, "claim"), content=b"{}", headers=headers)
        assert answer.status_code == 200, (declared, answer.text)
        assert (await api.record(ref)).holder == "alice"


def test_check_response_names_the_field_and_operator_response_defaults() -> None:
    with pytest.raises(BadResponse) as refused:
        check_response({"headers": {"Content-Length": "3"}}, 1024, ROUTE)
    assert refused.value.extra == {"field": "response.headers.Content-Length"}
    assert "sets Content-Length itself" in refused.value.detail
    record = Record("d", ROUTE, "k", State.CLAIMED, "run", "fp", created_ms=1, now_ms=2)
    made = operator_response(None, record, "alice")
    assert made.status == 200 and made.origin == "operator" and b'"alice"' in made.body
    text = operator_response({"body": "paid"}, record, "alice")
    assert text.body == b"paid" and text.headers == ()


# -- the listing -----------------------------------------------------------------------


async def test_listing_filters_by_state_route_and_age(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    seeded = {
        state: await api.seed(state)
        for state in (State.IN_FLIGHT, State.UNRESOLVED, State.PARKED, State.CLAIMED)
    }
    other = await api.seed(State.PARKED, route=OTHER)
    await api.seed(State.COMPLETED)

    async def listed(**params: str) -> list[str]:
        answer = await api.http.get("/admin/keys", params=params)
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["count"] == len(doc["keys"])
        return [row["key"] for row in doc["keys"]]

    key = {state: ref.key for state, ref in seeded.items()}
    default = {key[State.UNRESOLVED], key[State.PARKED], key[State.CLAIMED], other.key}
    assert set(await listed()) == default
    assert await listed(state="in_flight") == [key[State.IN_FLIGHT]]
    assert set(await listed(state="parked,claimed", route=ROUTE)) == {
        key[State.PARKED],
        key[State.CLAIMED],
    }
    assert await listed(route=OTHER) == [other.key]
    assert await listed(route="no-such-route") == []
    assert await listed(older_than="1h") == []
    assert set(await listed(older_than="1ms")) == default
    rows = (await api.http.get("/admin/keys")).json()
    ages = [row["state_age_seconds"] for row in rows["keys"]]
    assert len(ages) == 4 and ages == sorted(ages, reverse=True)  # the oldest first
    # An in-flight key's place is when its lease ends: after those that wait on a person.
    mixed = (await api.http.get("/admin/keys", params={"state": "in_flight,parked"})).json()
    assert [row["state"] for row in mixed["keys"]] == ["parked", "parked", "in_flight"]


async def test_the_listing_pages_with_cursors_both_ways(admin_for: Callable[..., Any]) -> None:
    """`limit` rows a page, 100 unless asked; `next_cursor` walks on and
    `prev_cursor` back (null where the listing ends), the filters applied by the
    store on every page."""
    api: Admin = await admin_for()
    made = [await api.seed(State.PARKED) for _ in range(7)]
    await api.seed(State.PARKED, route=OTHER)

    async def page(**params: str) -> dict[str, Any]:
        answer = await api.http.get("/admin/keys", params={"route": ROUTE, **params})
        assert answer.status_code == 200, answer.text
        doc: dict[str, Any] = answer.json()
        assert doc["count"] == len(doc["keys"])
        return doc

    first = await page(limit="3")
    assert first["prev_cursor"] is None and first["next_cursor"]
    second = await page(limit="3", cursor=first["next_cursor"])
    third = await page(limit="3", cursor=second["next_cursor"])
    assert third["next_cursor"] is None
    walked = [row["key"] for doc in (first, second, third) for row in doc["keys"]]
    whole = (await page())["keys"]  # 100 a page: all of them, the oldest first
    assert walked == [row["key"] for row in whole]
    assert sorted(walked) == sorted(ref.key for ref in made)
    ages = [row["state_age_seconds"] for row in whole]
    assert ages == sorted(ages, reverse=True)
    back = await page(limit="3", cursor=third["prev_cursor"])
    assert [row["key"] for row in back["keys"]] == [row["key"] for row in second["keys"]]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "\u00b2"}, "limit"),  # str.isdigit() says yes
        ({"limit": "\u0662\u0660\u0660"}, "limit"),  # int() reads 200
        ({"limit": "1_0"}, "limit"),  # int() reads 10
        ({"limit": "-5"}, "limit"),
        ({"cursor": "not-a-cursor!"}, "cursor"),
        ({"cursor": "YTo5OTk5OTk5OTk5OTk5OTk5OTk5OTk6YWI"}, "cursor"),
        ({"cursor": "x" * 500}, "cursor"),
    ],
)
async def test_a_page_size_or_cursor_no_listing_gave_is_a_bad_filter(
    admin_for: Callable[..., Any], params: dict[str, str], field: str
) -> None:
    api: Admin = await admin_for()
    answer = await api.http.get("/admin/keys", params=params)
    assert answer.status_code == 400, answer.text
    doc = answer.json()
    assert doc["type"].endswith("/bad-filter") and doc["field"] == field, doc


async def test_a_listing_row_is_the_records_json_in_short(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    held, parked = await api.seed(State.CLAIMED), await api.seed(State.PARKED)
    rows = {row["key"]: row for row in (await api.http.get("/admin/keys")).json()["keys"]}
    for ref, holder in ((held, "alice"), (parked, None)):
        record = await api.record(ref)
        doc = record.to_json()
        row = rows[ref.key]
        assert set(row) == {
            "route",
            "key",
            "digest",
            "state",
            "age_seconds",
            "state_age_seconds",
            "run_id",
            "reason",
            "last_reconcile",
            "holder",
            "holder_since_ms",
            "upstream_status",
            "attempts",
            "next_attempt_ms",
        }
        assert row["attempts"] is None and row["next_attempt_ms"] is None  # not deliveries
        assert row["upstream_status"] is None  # timed out: no answer
        for name in ("route", "key", "digest", "state", "run_id"):
            assert row[name] == doc[name] == summary(record)[name]
        assert row["reason"] == record.reason == "upstream timed out"
        assert row["holder"] == holder and row["last_reconcile"] is None
        assert row["holder_since_ms"] == (record.holder_since_ms if holder else None)


async def deliveries(api: Admin) -> dict[str, KeyRef]:
    """One delivery in each state an operator meets: queued, retrying, parked."""
    headers = (("content-type", "application/json"), ("authorization", "Bearer caller-secret"))
    request = StoredRequest("POST", "/jobs/i?run=1", headers, b'{"k": 1}')
    refs = {}
    for state in ("queued", "retrying", "parked"):
        key = unique(state)
        ref = refs[state] = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
        accepted = await api.store.accept(NewDelivery(ref, "run-a", "fp", request, "T" * 22))
        assert accepted.outcome == "queued"
        if state == "queued":
            continue
        picked = await api.store.pick(ROUTE, ref, "run-1", 60, 8, "replica-a")
        assert picked.record is not None and picked.record.digest == ref.digest
        delay = 3600.0 if state == "retrying" else None
        attempt = {"result": "retry_scheduled", "status": 503}
        assert await api.store.retry_later(ref, "run-1", delay, attempt)
    return refs


async def test_a_delivery_shows_its_request_without_authorization(
    admin_for: Callable[..., Any],
) -> None:
    """Authorization by name and length alone (gateway/operators/redaction.py; every surface and
    header is tests/test_redaction.py's)."""
    api: Admin = await admin_for()
    ref = (await deliveries(api))["parked"]
    shown = await api.as_("vera").get(path(ref))
    assert shown.json()["request"] == {
        "method": "POST",
        "path": "/jobs/i",
        "query": [{"name": "run", "value": None, "hidden": True, "length": 1}],
        "headers": [
            {"name": "content-type", "value": "application/json", "hidden": False, "length": 16},
            {"name": "authorization", "value": None, "hidden": True, "length": 20},
        ],
    }
    assert "caller-secret" not in shown.text
    sync = await api.http.get(path(await api.seed(State.PARKED)))
    assert "request" not in sync.json()


async def test_deliveries_are_listed_by_their_states(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    refs = await deliveries(api)
    await api.seed(State.PARKED)

    async def rows(state: str) -> dict[str, dict[str, Any]]:
        answer = await api.http.get("/admin/keys", params={"state": state})
        assert answer.status_code == 200, answer.text
        return {row["key"]: row for row in answer.json()["keys"]}

    queued = await rows("queued")
    assert set(queued) == {refs["queued"].key}
    row = queued[refs["queued"].key]
    assert row["state"] == "queued" and row["attempts"] == 0 and row["next_attempt_ms"] > 0
    retrying = await rows("retrying")
    assert set(retrying) == {refs["retrying"].key}
    row = retrying[refs["retrying"].key]
    record = await api.record(refs["retrying"])
    assert row["attempts"] == 1 and row["next_attempt_ms"] == record.due_ms
    assert record.due_ms > record.now_ms + 60_000  # an hour away, give or take
    assert set(await rows("queued,retrying")) == {refs["queued"].key, refs["retrying"].key}
    parked = await rows("parked")
    assert refs["parked"].key in parked and len(parked) == 2
    assert parked[refs["parked"].key]["attempts"] == 1
    assert parked[refs["parked"].key]["next_attempt_ms"] is None


async def test_the_run_log_lists_a_routes_deliveries_by_status_time_and_key_prefix(
    admin_for: Callable[..., Any],
) -> None:
    """A route's deliveries in every state, completed ones included, narrowed by the
    upstream status, a time range and a literal key prefix; each row says its status,
    and a key's record its attempts."""
    api: Admin = await admin_for()
    refs = await deliveries(api)
    key = unique("done")
    done = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
    request = StoredRequest("POST", "/jobs/i", (), b"{}")
    await asyncio.sleep(0.005)  # completed surely after the others were placed
    assert (await api.store.accept(NewDelivery(done, "run-a", "fp", request, "T" * 22))).outcome
    assert (await api.store.pick(ROUTE, done, "run-1", 60, 8, "replica-b")).record is not None
    response = StoredResponse(200, (), b"")
    attempt = {"result": "completed", "status": 200}
    assert await api.store.complete(done, "run-1", response, 60, attempt)
    every = "completed,queued,retrying,in_flight,parked,unresolved,claimed"

    async def keys(**params: str) -> list[str]:
        answer = await api.http.get(
            "/admin/keys", params={"state": every, "route": ROUTE, **params}
        )
        assert answer.status_code == 200, answer.text
        return sorted(row["key"] for row in answer.json()["keys"])

    assert await keys() == sorted([done.key, *(r.key for r in refs.values())])
    assert await keys(status="503") == sorted([refs["retrying"].key, refs["parked"].key])
    assert await keys(status="200") == [done.key]
    assert await keys(key_prefix=done.key[:6]) == [done.key]
    assert await keys(key_prefix="don_") == []  # no wildcard
    record = await api.record(done)
    assert await keys(since=str(record.since_ms)) == [done.key, refs["retrying"].key]
    assert await keys(until=str(record.since_ms - 1)) == sorted(
        [refs["queued"].key, refs["parked"].key]
    )
    rows = (await api.http.get("/admin/keys", params={"state": every, "route": ROUTE})).json()
    statuses = {row["key"]: row["upstream_status"] for row in rows["keys"]}
    assert statuses[done.key] == 200 and statuses[refs["queued"].key] is None
    shown = (await api.http.get(path(done))).json()
    [run] = shown["delivery"]["runs"]
    assert run["replica"] == "replica-b" and run["outcome"] == "completed"
    assert run["status"] == 200 and run["failure"] is None and run["duration_ms"] >= 0


class MovesAfterListing(MemoryStore):
    """A memory store that runs `then` once, after it read the first page of parked
    keys: what others do while a bulk action walks its pages."""

    then: Callable[[], Awaitable[None]] | None = None

    async def list_records(self, states: frozenset[State], **kwargs: Any) -> Page:
        page = await super().list_records(states, **kwargs)
        then, self.then = self.then, None
        if then is not None and states == {State.PARKED}:
            await then()
        return page


async def parked_deliveries(api: Admin, count: int, status: int = 503) -> list[KeyRef]:
    """`count` deliveries parked after one attempt the upstream answered `status`."""
    request = StoredRequest("POST", "/jobs/i", (), b"{}")
    refs = []
    for _ in range(count):
        key = unique("bulk")
        ref = KeyRef(record_digest(ROUTE, "", key), ROUTE, key)
        await api.store.accept(NewDelivery(ref, "run-a", "fp", request, "T" * 22))
        assert (await api.store.pick(ROUTE, ref, "run-1", 60, 8, "replica-a")).record
        attempt = {"result": "exhausted", "status": status, "error": f"answered {status}"}
        assert await api.store.retry_later(ref, "run-1", None, attempt)
        refs.append(ref)
    return refs


@MEMORY
async def test_a_bulk_retry_skips_and_counts_the_keys_that_changed_meanwhile(
    admin_for: Callable[..., Any],
) -> None:
    """Every parked delivery of the route with status 503, counted first, retried in one
    call, each key's history naming the operator and the note; while the action walks,
    alice claims one key herself and bob retries another: both are skipped and counted,
    and left as they were. Another status's key is neither counted nor touched."""
    store = MovesAfterListing()
    api: Admin = await admin_for(store=store)
    refs = await parked_deliveries(api, 6)
    [other] = await parked_deliveries(api, 1, status=500)
    count = await api.http.get("/admin/bulk", params={"route": ROUTE, "status": "503"})
    assert count.status_code == 200 and count.json() == {"route": ROUTE, "count": 6}

    async def meanwhile() -> None:
        assert (await store.operator_claim(refs[1], "alice", force=False)).ok
        assert (await store.operator_claim(refs[2], "bob", force=False)).ok
        assert (await store.operator_resolve(refs[2], "bob", "retry", "mine", None, 60)).ok

    store.then = meanwhile
    body = {"route": ROUTE, "status": "503", "outcome": "retry", "note": "upstream fixed"}
    done = await api.http.post("/admin/bulk", json=body)
    assert done.status_code == 200, done.text
    assert done.json() == {"outcome": "retry", "acted": 4, "skipped": 2}
    for ref in (refs[0], *refs[3:]):
        record = await api.record(ref)
        assert record.state is State.QUEUED and record.attempts == 0
        resolved = record.history[-1]
        assert (resolved["event"], resolved["operator"], resolved["note"]) == (
            "resolved", "alice", "upstream fixed",
        )  # fmt: skip
    held = await api.record(refs[1])
    assert held.state is State.CLAIMED and held.holder == "alice"
    assert (await api.record(refs[2])).history[-1]["operator"] == "bob"
    assert (await api.record(other)).state is State.PARKED
    # A viewer acts on nothing; done needs a note; a route is required.
    viewer = await api.as_("vera").post("/admin/bulk", json=body)
    assert viewer.status_code == 403
    no_note = await api.http.post("/admin/bulk", json={**body, "outcome": "done", "note": ""})
    assert_problem(no_note, BadOperatorRequest, field="note")
    unrouted = await api.http.post("/admin/bulk", json={"outcome": "retry"})
    assert_problem(unrouted, BadFilter, field="route")
    assert (await api.record(other)).state is State.PARKED


async def test_retry_queues_a_parked_delivery_with_fresh_attempts(
    admin_for: Callable[..., Any],
) -> None:
    api: Admin = await admin_for()
    seeded = await deliveries(api)
    ref = seeded["parked"]
    claimed = await api.http.post(path(ref, "claim"), json={"operator": "alice"})
    assert claimed.status_code == 200, claimed.text
    body = {"operator": "alice", "outcome": "retry", "note": "upstream fixed"}
    resolved = await api.http.post(path(ref, "resolve"), json=body)
    assert resolved.status_code == 200, resolved.text
    doc = resolved.json()
    assert doc["state"] == "queued" and doc["delivery"]["attempts"] == 0
    queued = (await api.http.get("/admin/keys", params={"state": "queued"})).json()["keys"]
    assert {row["key"] for row in queued} == {ref.key, seeded["queued"].key}
    # Queued deliveries are the workers', not an operator's.
    again = await api.http.post(path(ref, "claim"), json={"operator": "alice", "force": True})
    assert_problem(again, InvalidTransition, state="queued")


@MEMORY
async def test_bad_listing_filters_name_the_filter(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    state = await api.http.get("/admin/keys", params={"state": "parked,released"})
    assert_problem(state, BadFilter, field="state")
    assert "'released'" in state.json()["detail"] and "in_flight" in state.json()["detail"]
    done = await api.http.get("/admin/keys", params={"state": "parked,completed"})
    assert_problem(done, BadFilter, field="route")
    assert "listed by route" in done.json()["detail"]
    for name, value in (
        ("status", "\u0665\u0660\u0663"),
        ("status", "99"),
        ("status", "5031"),
        ("since", "2026-13-01T00:00"),
        ("since", "\uff12\uff10\uff12\uff16-01-01T00:00"),
        ("until", "-5"),
        ("key_prefix", "k" * 1025),
    ):
        bad = await api.http.get("/admin/keys", params={name: value})
        assert_problem(bad, BadFilter, field=name)
    empty = await api.http.get("/admin/keys", params={"since": "2000", "until": "1000"})
    assert_problem(empty, BadFilter, field="until")
    age = await api.http.get("/admin/keys", params={"older_than": "a while"})
    assert_problem(age, BadFilter, field="older_than")
    assert age.json()["detail"].startswith("older_than is not a duration")
    # Digits of another script are no duration either (float() reads Arabic-Indic "10"
    # as 10, and so did the duration's pattern).
    for other in ("\u0661\u0660m", "\uff11\uff10m", "1_0m", "\u0661.\u0665s"):
        age = await api.http.get("/admin/keys", params={"older_than": other})
        assert_problem(age, BadFilter, field="older_than")


# -- health, readiness, metrics --------------------------------------------------------


async def test_healthz_readyz_and_metrics_need_no_token(admin_for: Callable[..., Any]) -> None:
    api: Admin = await admin_for()
    await api.seed(State.PARKED)
    async with api.anonymous() as client:
        health = await client.get("/healthz")
        ready = await client.get("/readyz")
        scrape = await client.get("/metrics")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert ready.status_code == 200, ready.text
    assert ready.json()["ready"] is True
    assert ready.json()["checks"] == {"config": "loaded", "store": "ok", "store_eviction": "ok"}
    assert set(ready.json()["store"]) == {"maxmemory_policy", "aof"}
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    assert f'idempotency_gateway_keys{{route="{ROUTE}",state="parked"}} 1.0' in scrape.text


@MEMORY
async def test_readyz_is_503_until_the_gateway_started(make_store: Callable[[], Store]) -> None:
    gateway = Gateway(config_for(NOWHERE, ROUTES), store=make_store(), sweep=False)
    app = create_admin_app(gateway)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        ready = await c.get("/readyz")
    assert ready.status_code == 503
    assert ready.json() == {
        "ready": False,
        "checks": {"config": "loaded", "store": "not started"},
    }


# -- a real Redis that goes away -------------------------------------------------------


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.mark.redis
@MEMORY  # the gateway's store is the RedisStore below, on a server this test stops
async def test_a_store_that_went_down_is_503_for_operators_and_readiness(
    admin_for: Callable[..., Any], own_redis: RedisServer
) -> None:
    store = RedisStore(
        StoreConfig(
            url=own_redis.url, prefix=unique("t") + ":", socket_timeout=1, connect_timeout=1
        )
    )
    api: Admin = await admin_for(store=store)
    ref = await api.seed(State.PARKED)
    assert (await api.http.get(path(ref))).status_code == 200
    own_redis.stop()
    for answer in (
        await api.http.get("/admin/keys"),
        await api.http.get(path(ref)),
        await api.http.post(path(ref, "claim"), json={"operator": "alice"}),
    ):
        assert answer.status_code == 503, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["type"] == PROBLEM_BASE + "store-unavailable"
    # The overview still answers, and says the store did not.
    overview = (await api.http.get("/admin/overview")).json()
    assert overview["store"]["reachable"] is False and overview["store"]["error"]
    assert all(row["keys"] is None and row["queue"] is None for row in overview["routes"])
    ready = await api.http.get("/readyz")
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert ready.json()["checks"]["store"] != "ok"
    # Still answered while the store is away: health and a scrape (store_up says 0).
    assert (await api.http.get("/healthz")).status_code == 200
    assert "idempotency_gateway_store_up 0.0" in (await api.http.get("/metrics")).text


# -- each handler on its own -----------------------------------------------------------


HANDLERS = {
    "healthz": ("GET", "/healthz", admin.healthz, 200),
    "readyz": ("GET", "/readyz", admin.readyz, 200),
    "metrics": ("GET", "/metrics", admin.metrics, 200),
    "list_keys": ("GET", "/admin/keys", admin.list_keys, 200),
    "show_key": ("GET", "/admin/keys/{route}/{key:path}", admin.show_key, 200),
    "claim_key": ("POST", "/admin/keys/{route}/{key:path}", admin.claim_key, 200),
    "resolve_key": ("POST", "/admin/keys/{route}/{key:path}", admin.resolve_key, 409),
}


@MEMORY
@pytest.mark.parametrize("name", HANDLERS)
async def test_each_handler_runs_on_its_own(admin_for: Callable[..., Any], name: str) -> None:
    """A handler needs only `app.state.gateway`, and refusals the problem renderer:
    not create_admin_app (bob resolves alice's key: NotTheHolder, 409)."""
    api: Admin = await admin_for()
    method, template, handler, status = HANDLERS[name]
    app = Starlette(
        routes=[Route(template, handler, methods=[method])],
        exception_handlers={ProblemError: problem_response},
    )
    app.state.gateway = api.gateway
    ref = await api.seed(State.CLAIMED if name == "resolve_key" else State.PARKED)
    url = template.replace("{route}", ref.route).replace("{key:path}", ref.key)
    body = {"operator": "bob", "outcome": "retry"} if method == "POST" else None
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://a",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as client:
        answer = await client.request(method, url, json=body)
    assert answer.status_code == status, answer.text
