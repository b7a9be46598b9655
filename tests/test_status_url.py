"""The status URL of an accepted delivery (docs/design/delivery.md section 4).

In-process: ProxyApp over httpx's ASGITransport, on the memory store and a real
redis-server. The records are made by the store's own delivery operations (accept,
then pick, retry_later, complete), as the engine and the worker will make them, so
these tests read exactly what a replica would find. Whoever holds the URL reads the
delivery's state; any other URL, however close, gets one and the same 404.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from gateway import logs
from gateway.assembly import Gateway
from gateway.config import Config, StoreConfig
from gateway.encryption import new_key
from gateway.engine import accept as accept_module
from gateway.engine.accept import accepted_reply, delivery_ids, status_url
from gateway.errors import ConfigError
from gateway.keying import RequestParts, record_digest, scope_value
from gateway.records import KeyRef, State, StoredRequest, StoredResponse
from gateway.store.base import NewDelivery, Store, codec_for
from gateway.store.memory import MemoryStore
from gateway.store.postgres import PostgresStore
from gateway.store.redis import RedisStore
from tests.conftest import GatewayClient, config_for, unique
from tests.support.ledger import Ledger
from tests.support.pg_wire import PgRelay
from tests.support.postgres import DATABASE, USER, PostgresServer
from tests.support.servers import RedisServer, free_port

pytestmark = pytest.mark.anyio

#: Nothing listens there: a status request is the gateway's own answer, never forwarded.
UPSTREAM = f"http://127.0.0.1:{free_port()}"
PREFIX = "/_idempotency"
INVOICES = {
    "name": "send-invoices",
    "match": {"methods": ["POST"], "path": "/jobs/invoices"},
    "key": {"header": "Idempotency-Key"},
}
OTHER = {"name": "other", "match": {"path": "/jobs/other"}, "key": {"header": "Idempotency-Key"}}
TENANTS = {
    "name": "tenant-jobs",
    "match": {"path": "/jobs/tenant"},
    "key": {"header": "Idempotency-Key", "scope": ["header.X-Tenant"]},
}
#: Everything goes to a catch-all route, except the gateway's own paths.
CATCH_ALL = {"name": "everything", "match": {"path": "/{rest:path}"}}
ROUTES = [INVOICES, OTHER, TENANTS, CATCH_ALL]

REQUEST = StoredRequest("POST", "/jobs/invoices", (("content-type", "application/json"),), b"{}")
#: An internal error text: it names an upstream address, which callers must never see.
ERROR_TEXT = "connect to 10.1.2.3:8443 refused (upstream send-invoices)"
#: What the engine's delivery settlement records of an attempt that did not complete.
RETRY = {"result": "retry_scheduled", "status": 503, "error": ERROR_TEXT, "retry_after": 30}
PARK = {**RETRY, "result": "exhausted", "reason": f"attempts exhausted (8); last: {ERROR_TEXT}"}


@dataclass(frozen=True)
class Delivery:
    ref: KeyRef
    token: str

    @property
    def url(self) -> str:
        return status_url(PREFIX, self.ref.route, self.ref.digest, self.token)


@pytest.fixture
def open_store(store_kind: str, request: pytest.FixtureRequest) -> Callable[..., Store]:
    """Stores of the parametrised kind, `store:` settings as in a config file; Redis
    ones share a prefix per test, so two stores see the same records."""
    prefix = unique("t") + ":"

    def make(**store: Any) -> Store:
        if store_kind == "memory":
            return MemoryStore(codec_for(StoreConfig(**store)))
        server: RedisServer = request.getfixturevalue("redis_server")
        return RedisStore(StoreConfig(url=server.url, prefix=prefix, socket_timeout=1.0, **store))

    return make


@pytest.fixture
async def gateway_on() -> AsyncIterator[Callable[..., Any]]:
    """`await gateway_on(store, routes=..., **top)`: a started gateway and a client on it."""
    opened: list[GatewayClient] = []

    async def build(store: Store, routes: list[dict[str, Any]] = ROUTES, **top: Any) -> Any:
        # These gateways read status only: none delivers, so the records the tests make
        # with store.accept stay in the state they were made (a gateway delivers queued
        # work of its routes, sync ones too: see DeliveryWorker.configure).
        top["server"] = {"max_deliveries": 0, **top.get("server", {})}
        gateway = Gateway(config_for(UPSTREAM, routes, **top), store=store, sweep=False)
        await gateway.start()
        opened.append(GatewayClient(gateway))
        return opened[-1]

    yield build
    for client in opened:
        await client.http.aclose()
        await client.gateway.close()


async def accept(store: Store, route: str = "send-invoices", scope: str = "") -> Delivery:
    key = unique("invoices")
    ref = KeyRef(record_digest(route, scope, key), route, key)
    token = secrets.token_urlsafe(16)
    accepted = await store.accept(NewDelivery(ref, "run-a", "fp", REQUEST, token))
    assert accepted.outcome == "queued"
    return Delivery(ref, token)


async def attempt(store: Store, delivery: Delivery, run: str = "run-1") -> None:
    picked = await store.pick(delivery.ref.route, delivery.ref, run, 30, 8, "replica-a")
    assert picked.record is not None and picked.record.state is State.IN_FLIGHT


def tenant_scope(tenant: str) -> str:
    spec = config_for(UPSTREAM, [TENANTS]).routes[0].key
    assert spec is not None
    return scope_value(spec, RequestParts("GET", "", "", [("x-tenant", tenant)], b""))


def when(text: str) -> datetime:
    assert text.endswith("Z"), text  # RFC 3339, UTC
    moment = datetime.fromisoformat(text)
    assert moment.utcoffset() == timedelta(0)
    return moment


def near_now(text: str, after: float = 0) -> bool:
    return abs(when(text) - datetime.now(UTC) - timedelta(seconds=after)) < timedelta(seconds=10)


async def read(gw: GatewayClient, delivery: Delivery, **kwargs: Any) -> dict[str, Any]:
    response = await gw.http.get(delivery.url, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    for hidden in (ERROR_TEXT, "10.1.2.3", "reason", "history", "run-1", "replica-a"):
        assert hidden not in response.text
    doc: dict[str, Any] = response.json()
    assert doc["route"] == delivery.ref.route and doc["key"] == delivery.ref.key
    assert doc["status_url"] == delivery.url
    assert near_now(doc["accepted_at"])
    return doc


# -- what the holder reads, in each state --------------------------------------------


async def test_queued_then_in_flight(open_store: Callable[..., Store], gateway_on: Any) -> None:
    store = open_store()
    gw = await gateway_on(store)
    delivery = await accept(store)
    doc = await read(gw, delivery)
    assert doc["state"] == "queued" and doc["attempts"] == 0 and doc["last_attempt"] is None
    assert near_now(doc["next_attempt_at"]) and "response" not in doc
    await attempt(store, delivery)
    doc = await read(gw, delivery)
    assert doc["state"] == "in_flight" and doc["attempts"] == 1
    assert doc["last_attempt"] is None and doc["next_attempt_at"] is None


async def test_retrying_and_parked_show_result_classes_not_error_texts(
    open_store: Callable[..., Store], gateway_on: Any
) -> None:
    store = open_store()
    gw = await gateway_on(store)
    delivery = await accept(store)
    await attempt(store, delivery)
    assert await store.retry_later(delivery.ref, "run-1", 30, RETRY)
    doc = await read(gw, delivery)
    assert doc["state"] == "retrying" and doc["attempts"] == 1
    assert doc["last_attempt"].keys() == {"at", "result", "status"}
    assert doc["last_attempt"]["result"] == "retry_scheduled"
    assert doc["last_attempt"]["status"] == 503
    assert near_now(doc["last_attempt"]["at"]) and near_now(doc["next_attempt_at"], after=30)

    parked = await accept(store)
    await attempt(store, parked)
    assert await store.retry_later(parked.ref, "run-1", None, PARK)
    doc = await read(gw, parked)
    assert doc["state"] == "parked" and doc["next_attempt_at"] is None
    assert doc["last_attempt"] == {"at": doc["last_attempt"]["at"], "result": "exhausted",
                                   "status": 503}  # fmt: skip
    assert near_now(doc["last_attempt"]["at"]) and "last:" not in json.dumps(doc)


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        (b'{"sent": 412}', {"body": '{"sent": 412}'}),
        (b"\xff\x00binary", {"body_base64": base64.b64encode(b"\xff\x00binary").decode()}),
    ],
    ids=["text", "binary"],
)
async def test_completed_shows_the_response_as_a_replay_would_send_it(
    open_store: Callable[..., Store], gateway_on: Any, body: bytes, shown: dict[str, str]
) -> None:
    store = open_store()
    gw = await gateway_on(store)
    delivery = await accept(store)
    await attempt(store, delivery)
    headers = (
        ("content-type", "application/json"),
        ("connection", "x-hop"),
        ("x-hop", "per-connection"),
        ("transfer-encoding", "chunked"),
        ("idempotent-replayed", "false"),
        ("x-invoices", "412"),
    )
    stored = StoredResponse(201, headers, body)
    assert await store.complete(delivery.ref, "run-1", stored, 3600, {"result": "completed"})
    doc = await read(gw, delivery)
    assert doc["state"] == "completed" and doc["attempts"] == 1
    assert doc["next_attempt_at"] is None
    assert doc["last_attempt"]["result"] == "completed" and doc["last_attempt"]["status"] == 201
    assert near_now(doc["last_attempt"]["at"])
    assert doc["response"] == {
        "status": 201,
        "headers": [["content-type", "application/json"], ["x-invoices", "412"]],
        **shown,
        "origin": "upstream",
    }


async def test_completed_past_max_stored_body_says_so(
    open_store: Callable[..., Store], gateway_on: Any
) -> None:
    store = open_store()
    gw = await gateway_on(store)
    delivery = await accept(store)
    await attempt(store, delivery)
    stored = StoredResponse(
        200, (("content-encoding", "gzip"), ("x-a", "1")), b"", body_omitted=True
    )
    assert await store.complete(delivery.ref, "run-1", stored, 3600)
    response = (await read(gw, delivery))["response"]
    assert response == {"status": 200, "headers": [["x-a", "1"]], "body_omitted": True,
                        "origin": "upstream"}  # fmt: skip


# -- nobody else reads it --------------------------------------------------------------


async def test_every_wrong_url_gets_the_identical_404(
    open_store: Callable[..., Store], gateway_on: Any
) -> None:
    store = open_store()
    gw = await gateway_on(store)
    mine, theirs = await accept(store), await accept(store)
    elsewhere = await accept(store, route="other")
    tenant = await accept(store, route="tenant-jobs", scope=tenant_scope("acme"))
    sync = KeyRef(record_digest("send-invoices", "", unique()), "send-invoices", "sync-key")
    assert await store.claim(sync, "run-s", "fp", 30) is None  # a sync key: no token
    await attempt(store, theirs)
    done = StoredResponse(200, (), b"theirs")
    assert await store.complete(theirs.ref, "run-1", done, 3600)
    route, digest, token = "send-invoices", mine.ref.digest, mine.token
    s = f"{PREFIX}/status"
    wrong: dict[str, tuple[str, dict[str, str]]] = {
        "wrong token": (f"{s}/{route}/{digest}/{secrets.token_urlsafe(16)}", {}),
        "another record's token": (f"{s}/{route}/{digest}/{theirs.token}", {}),
        "its token on another record": (f"{s}/{route}/{theirs.ref.digest}/{token}", {}),
        "another route's name": (f"{s}/other/{digest}/{token}", {}),
        "another route's record": (
            f"{s}/{route}/{elsewhere.ref.digest}/{elsewhere.token}",
            {},
        ),
        "other scope headers": (tenant.url, {"x-tenant": "evil"}),
        "no scope header": (tenant.url, {}),
        "a sync key's record": (f"{s}/{route}/{sync.digest}/{token}", {}),
        "unknown digest": (f"{s}/{route}/{secrets.token_hex(16)}/{token}", {}),
        "unknown route": (f"{s}/nope/{digest}/{token}", {}),
        "digest in capitals": (f"{s}/{route}/{digest.upper()}/{token}", {}),
        "digest short": (f"{s}/{route}/{digest[:-1]}/{token}", {}),
        "token short": (f"{s}/{route}/{digest}/{token[:-1]}", {}),
        "token long": (f"{s}/{route}/{digest}/{token}A", {}),
        "token percent-encoded": (f"{s}/{route}/{digest}/%{ord(token[0]):02X}{token[1:]}", {}),
        "token missing": (f"{s}/{route}/{digest}", {}),
        "a segment more": (f"{s}/{route}/{digest}/{token}/x", {}),
        "not status": (f"{PREFIX}/state/{route}/{digest}/{token}", {}),
        "the prefix alone": (f"{PREFIX}/", {}),
    }
    answers = {what: await gw.http.get(url, headers=h) for what, (url, h) in wrong.items()}
    first = answers["wrong token"]
    assert first.status_code == 404
    assert first.json()["type"].endswith("/unknown-status"), first.text
    for what, answer in answers.items():
        assert answer.status_code == 404, what
        assert answer.content == first.content, what
        assert answer.headers["content-type"] == "application/problem+json", what
        assert answer.headers["cache-control"] == "no-store", what
    for leaked in (mine.ref.key, theirs.ref.key, "theirs", route, "queued", "completed"):
        assert leaked not in first.text
    # and the right ones still answer
    assert (await read(gw, mine))["state"] == "queued"
    assert (await read(gw, tenant, headers={"x-tenant": "acme"}))["state"] == "queued"


async def test_other_methods_are_405_and_head_is_get_without_a_body(
    open_store: Callable[..., Store], gateway_on: Any
) -> None:
    store = open_store()
    gw = await gateway_on(store)
    delivery = await accept(store)
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        for url in (delivery.url, f"{PREFIX}/anything"):
            answer = await gw.http.request(method, url, content=b"x")
            assert answer.status_code == 405, (method, url)
            assert answer.headers["allow"] == "GET, HEAD"
            assert answer.headers["cache-control"] == "no-store"
            assert answer.json()["type"].endswith("/method-not-allowed")
    got = await gw.http.get(delivery.url)
    head = await gw.http.head(delivery.url)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == got.headers["content-length"]
    assert head.headers["content-type"] == "application/json"
    assert head.headers["cache-control"] == "no-store"
    missing = await gw.http.head(f"{PREFIX}/status/send-invoices/{'0' * 32}/{delivery.token}")
    assert missing.status_code == 404 and missing.headers["cache-control"] == "no-store"


async def test_store_down_is_503_as_the_proxy_answers() -> None:
    port = free_port()  # nothing listens there
    store = RedisStore(
        StoreConfig(url=f"redis://127.0.0.1:{port}/0", socket_timeout=0.5, connect_timeout=0.5)
    )
    gateway = Gateway(config_for(UPSTREAM, ROUTES), store=store, sweep=False)
    client = GatewayClient(gateway)  # not started: the store never answers anyway
    try:
        url = status_url(PREFIX, "send-invoices", "0" * 32, secrets.token_urlsafe(16))
        answer = await client.http.get(url)
        proxied = await client.http.post("/jobs/invoices", headers={"idempotency-key": "k"})
    finally:
        await client.http.aclose()
        await store.close()
    assert answer.status_code == 503 == proxied.status_code
    assert answer.headers["retry-after"] == "1" and answer.headers["cache-control"] == "no-store"
    assert answer.json()["type"] == proxied.json()["type"]
    assert str(port) not in answer.text


# -- at rest, in logs, in config -------------------------------------------------------


async def test_with_encryption_the_token_is_sealed_and_still_works(
    open_store: Callable[..., Store], gateway_on: Any, request: pytest.FixtureRequest
) -> None:
    key = new_key()
    store = open_store(encryption_key=key)
    gw = await gateway_on(store)
    delivery = await accept(store)
    assert (await read(gw, delivery))["state"] == "queued"
    if isinstance(store, RedisStore):
        server: RedisServer = request.getfixturevalue("redis_server")
        raw = redis.Redis.from_url(server.url)
        try:
            stored = b"".join(raw.dump(name) or b"" for name in raw.scan_iter(f"{store.prefix}*"))
        finally:
            raw.close()
        assert stored and delivery.token.encode() not in stored
        # A store with another key cannot open it: the URL then finds nothing.
        stranger = await gateway_on(open_store(encryption_key=new_key()))
        assert (await stranger.http.get(delivery.url)).status_code == 404
    else:
        assert isinstance(store, MemoryStore)
        sealed = b"".join(store._tokens.values())
        assert sealed and delivery.token.encode() not in sealed


@pytest.mark.redis
@pytest.mark.parametrize("store_kind", ["redis"])
async def test_a_response_that_does_not_open_is_said_to_be_unreadable(
    open_store: Callable[..., Store], gateway_on: Any, redis_server: RedisServer
) -> None:
    """A sealed response moved in from another record does not open: the holder learns
    the delivery completed and that its response cannot be read, not why (a key id)."""
    store = open_store(encryption_key=new_key())
    gw = await gateway_on(store)
    alice, bob = await accept(store), await accept(store)
    for delivery, body in ((alice, b"alice's"), (bob, b"bob's")):
        await attempt(store, delivery)
        done = StoredResponse(200, (), body)
        assert await store.complete(delivery.ref, "run-1", done, 3600)
    assert isinstance(store, RedisStore)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        [alice_name] = raw.scan_iter(f"{store.prefix}*:{alice.ref.digest}")
        [bob_name] = raw.scan_iter(f"{store.prefix}*:{bob.ref.digest}")
        raw.hset(bob_name, "resp", raw.hget(alice_name, "resp") or b"")
    finally:
        raw.close()
    doc = await read(gw, bob)
    assert doc["state"] == "completed" and doc["response"] == {"unreadable": True}
    assert "alice" not in json.dumps(doc)


async def test_access_log_shows_the_token_as_stars(
    open_store: Callable[..., Store], gateway_on: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(logs, "_writer", logs.AccessWriter(stream, as_json=True))
    store = open_store()
    gw = await gateway_on(store)
    delivery = await accept(store)
    ref = delivery.ref
    await gw.http.get(delivery.url)
    await gw.http.get(f"{PREFIX}/status/{ref.route}/{ref.digest}/{delivery.token}/more")
    await gw.http.get(f"{PREFIX}/status/{ref.route}/{delivery.token}")  # a segment short
    await gw.http.post(delivery.url)
    logs.flush_access_log()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 4
    assert delivery.token not in stream.getvalue()
    shown = f"{PREFIX}/status/{ref.route}/{ref.digest}/***"
    assert [line["path"] for line in lines] == [
        shown,
        shown,
        f"{PREFIX}/***",
        shown,
    ]
    assert [line["status"] for line in lines] == [200, 404, 404, 405]
    assert lines[0]["outcome"] == "status" and lines[0]["key"] == ref.key
    assert lines[1]["outcome"] == "status_not_found" and lines[1]["route"] is None


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("/jobs/invoices", "/jobs/invoices"),
        (f"{PREFIX}", f"{PREFIX}"),
        (f"{PREFIX}/status/r/{'a' * 32}/tok", f"{PREFIX}/status/r/{'a' * 32}/***"),
        (f"/x/..{PREFIX}/status/r/{'a' * 32}/tok", f"/x/..{PREFIX}/status/r/{'a' * 32}/***"),
        (f"{PREFIX}/status/r/tok", f"{PREFIX}/***"),
        (f"{PREFIX}/tok", f"{PREFIX}/***"),
    ],
)
def test_access_path_before_normalisation_too(path: str, shown: str) -> None:
    """The access line's path is the one the caller sent, dot-segments and all."""
    assert logs.access_path(path, PREFIX) == shown


@pytest.mark.parametrize("store_kind", ["memory"])
async def test_the_prefix_is_a_setting_and_kept_over_a_reload(
    open_store: Callable[..., Store], gateway_on: Any
) -> None:
    store = open_store()
    gw = await gateway_on(store, server={"status_prefix": "/ops/idem"})
    delivery = await accept(store)
    ref = delivery.ref
    url = status_url("/ops/idem", ref.route, ref.digest, delivery.token)
    assert (await gw.http.get(url)).json()["state"] == "queued"
    # Under the default prefix there is nothing of the gateway's now: the route has it.
    assert (await gw.http.get(delivery.url)).status_code == 502
    # A record made while the route looked one way is still read after a reload.
    config: Config = gw.gateway.config
    changed = replace(
        config,
        routes=tuple(replace(r, upstream="http://127.0.0.1:10") for r in config.routes),
        server=replace(config.server, status_prefix="/elsewhere"),
    )
    kept = gw.gateway.reload(changed)
    assert kept == ["server.status_prefix changed: restart the gateway to apply it"]
    assert (await gw.http.get(url)).json()["state"] == "queued"


@pytest.mark.parametrize(
    ("path", "prefix", "message"),
    [
        ("/_idempotency/status/x", None, 'routes[0].match.path: "/_idempotency/status/x" is under '
         'server.status_prefix "/_idempotency", which the gateway answers itself; move the '
         "route, or set another status_prefix"),
        ("/ops/{rest:path}", "/ops", 'routes[0].match.path: "/ops/{rest:path}" is under '
         'server.status_prefix "/ops"'),
    ],
)  # fmt: skip
def test_a_route_under_the_prefix_is_a_config_error(
    path: str, prefix: str | None, message: str
) -> None:
    top = {"server": {"status_prefix": prefix}} if prefix else {}
    with pytest.raises(ConfigError) as caught:
        config_for(UPSTREAM, [{"name": "r", "match": {"path": path}}], **top)
    assert message in str(caught.value)


@pytest.mark.parametrize("path", ["/_idempotency", "/_idempotencyx/a", "/{rest:path}", "/a/b"])
def test_routes_beside_or_around_the_prefix_are_fine(path: str) -> None:
    config_for(UPSTREAM, [{"name": "r", "match": {"path": path}}])


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ("idem", '"idem" must start with /'),
        ("/idem/", '"/idem/" must not end with /'),
        ("/", '"/" must not end with /'),
        ("/idem/{x}", '"/idem/{x}" is a fixed path, not a pattern'),
        ("/idem//x", '"/idem//x" must not hold empty, . or .. segments'),
        ("/a/../b", '"/a/../b" must not hold empty, . or .. segments'),
        ("/a b", '"/a b" must be a plain path'),
        ("/a%2Fb", '"/a%2Fb" must be a plain path'),
    ],
)
def test_a_bad_prefix_says_what_to_write(prefix: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_for(UPSTREAM, [CATCH_ALL], server={"status_prefix": prefix})
    assert f"server.status_prefix: {message}" in str(caught.value)
    assert "write e.g. /_idempotency" in str(caught.value)


@pytest.mark.parametrize("key", ["inv-2026-11", 'a "quoted" \\ key', "é 中 😀 \u2028", "\x01"])
@pytest.mark.parametrize("outcome", ["accepted", "replayed"])
def test_the_202_body_is_json_of_its_four_fields(key: str, outcome: str) -> None:
    """The 202 is spelled out by hand (no dict, no encoder per request): it must be
    what json.dumps writes, for any key a caller may send."""
    route = config_for(UPSTREAM, [INVOICES]).routes[0]
    ref = KeyRef(record_digest(route.name, "", key), route.name, key)
    token = secrets.token_urlsafe(16)
    reply = accepted_reply(PREFIX, route, ref, "queued", token, outcome)
    url = status_url(PREFIX, route.name, ref.digest, token)
    fields = {"route": route.name, "key": key, "state": "queued", "status_url": url}
    assert reply.body == json.dumps(fields).encode()
    assert json.loads(reply.body) == fields
    assert reply.status == 202 and ("location", url) in reply.headers
    assert (("idempotent-replayed", "true") in reply.headers) is (outcome == "replayed")
    due = "2026-12-04T18:00:00.250Z"  # a delayed delivery's: one more field, last
    later = accepted_reply(PREFIX, route, ref, "queued", token, outcome, due)
    assert later.body == json.dumps({**fields, "due": due}).encode()
    unconfirmed = accepted_reply(PREFIX, route, ref, "queued", token, "accepted_unconfirmed", due)
    assert unconfirmed.status == 202 and json.loads(unconfirmed.body)["due"] == due


def test_run_ids_and_tokens_are_fresh_and_full_length() -> None:
    """One read of the CSPRNG gives both: a 16-hex run id and a 22-character urlsafe
    token of 128 bits, neither ever repeated, every bit of the token in use."""
    drawn = [delivery_ids() for _ in range(2000)]
    run_ids, tokens = {r for r, _ in drawn}, {t for _, t in drawn}
    assert len(run_ids) == len(tokens) == len(drawn)
    assert all(len(r) == 16 and int(r, 16) >= 0 for r in run_ids)
    raw = [base64.urlsafe_b64decode(t + "==") for t in tokens]
    assert all(len(t) == 22 and len(b) == 16 for t, b in zip(tokens, raw, strict=True))
    ones = [sum(int.from_bytes(b, "big") >> bit & 1 for b in raw) for bit in range(128)]
    assert all(700 < count < 1300 for count in ones)  # each bit random, none stuck


def test_the_token_is_all_128_bits_of_its_own_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run id and token split one 24-byte draw: the token is its last 16 bytes, whole
    (none shared with the run id, which the access log and admin API show)."""
    drawn = bytes(range(100, 124))
    monkeypatch.setattr(accept_module.os, "urandom", lambda n: drawn[:n])
    run_id, token = delivery_ids()
    assert run_id == drawn[:8].hex()
    assert base64.urlsafe_b64decode(token + "==") == drawn[8:]


# -- a wrong token costs what a missing record costs ---------------------------------

#: A stored response as large as max_stored_body lets one be, and incompressible.
BIG = StoredResponse(200, (("content-type", "application/octet-stream"),), os.urandom(1 << 20))


async def big_delivery(store: Store) -> Delivery:
    delivery = await accept(store)
    await attempt(store, delivery)
    assert await store.complete(delivery.ref, "run-1", BIG, 3600)
    return delivery


def guesses(delivery: Delivery, n: int) -> list[tuple[str, str]]:
    """n wrong-token URLs of the delivery, and n of a record that does not exist."""
    s, route = f"{PREFIX}/status", delivery.ref.route
    return [
        (
            f"{s}/{route}/{delivery.ref.digest}/{secrets.token_urlsafe(16)}",
            f"{s}/{route}/{secrets.token_hex(16)}/{secrets.token_urlsafe(16)}",
        )
        for _ in range(n)
    ]


@pytest.mark.redis
async def test_a_wrong_token_never_reads_the_stored_response_on_redis(
    redis_server: RedisServer, gateway_on: Any
) -> None:
    """Counted by Redis itself (INFO's total_net_output_bytes): wrong-token requests
    for a record holding 1 MiB move nothing like the response's size (the gateway's
    own background reads, a few small hashes, are counted too)."""
    store = RedisStore(StoreConfig(url=redis_server.url, prefix=unique("t") + ":"))
    gw = await gateway_on(store)
    delivery = await big_delivery(store)
    direct = redis.Redis.from_url(redis_server.url)
    try:
        before = direct.info("stats")["total_net_output_bytes"]
        for wrong, _ in guesses(delivery, 10):
            assert (await gw.http.get(wrong)).status_code == 404
        sent = direct.info("stats")["total_net_output_bytes"] - before
    finally:
        direct.close()
    assert sent < 64 * 1024, f"Redis sent {sent} bytes for 10 wrong tokens"
    # The right token still reads it all.
    assert len(base64.b64decode((await read(gw, delivery))["response"]["body_base64"])) == 1 << 20


@pytest.mark.postgres
async def test_a_wrong_token_never_reads_the_stored_response_on_postgres(
    postgres_database: PostgresServer, gateway_on: Any
) -> None:
    """Counted on the wire (a relay in front of PostgreSQL): the database sends next to
    nothing for wrong-token requests for a record holding 1 MiB."""
    async with PgRelay(postgres_database.port) as relay:
        url = f"postgresql://{USER}@127.0.0.1:{relay.port}/{DATABASE}"
        store = PostgresStore(StoreConfig(url=url, prefix=unique("t") + ":", socket_timeout=2.0))
        gw = await gateway_on(store)
        delivery = await big_delivery(store)
        relay.reset()
        for wrong, _ in guesses(delivery, 10):
            assert (await gw.http.get(wrong)).status_code == 404
        sent = relay.reset().server_bytes
        assert sent < 64 * 1024, f"PostgreSQL sent {sent} bytes for 10 wrong tokens"
        doc = await read(gw, delivery)
        assert len(base64.b64decode(doc["response"]["body_base64"])) == 1 << 20


@pytest.mark.redis
async def test_a_wrong_token_for_a_large_record_is_as_fast_as_for_none(
    redis_server: RedisServer, gateway_on: Any, ledger: Ledger
) -> None:
    """Side by side in one run, interleaved: the median wrong-token answer for a record
    holding 1 MiB against the median answer for a record that does not exist."""
    store = RedisStore(StoreConfig(url=redis_server.url, prefix=unique("t") + ":"))
    gw = await gateway_on(store)
    delivery = await big_delivery(store)
    times: dict[str, list[float]] = {"existing": [], "missing": []}
    for wrong, missing in guesses(delivery, 150):
        for what, url in (("existing", wrong), ("missing", missing)):
            started = time.perf_counter()
            answer = await gw.http.get(url)
            times[what].append(time.perf_counter() - started)
            assert answer.status_code == 404
    existing, missing = statistics.median(times["existing"]), statistics.median(times["missing"])
    ratio = existing / missing
    ledger.record(
        "status URL guesses",
        "wrong token for a 1 MiB record against no record",
        requests=300,
        bad_inputs=300,
        detail=f"medians {existing * 1e3:.2f} ms and {missing * 1e3:.2f} ms: {ratio:.2f}x",
    )
    assert ratio < 1.5, f"wrong token {existing * 1e3:.2f} ms, no record {missing * 1e3:.2f} ms"


# -- a wrong token costs and answers the same whether or not the key exists -----------


def spread(a: float, b: float) -> float:
    """How far apart two medians are, the larger over the smaller."""
    return max(a, b) / min(a, b)


@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "plain"])
async def test_a_missing_token_costs_what_a_stored_one_does(
    open_store: Callable[..., Store], encrypted: bool, ledger: Ledger
) -> None:
    """The store's token read, side by side in one run: a delivery's token (opened:
    with store.encryption_key a decryption) against no record's. Medians of batches,
    interleaved, so the store's own time is compared and not the network's."""
    store = open_store(**({"encryption_key": new_key()} if encrypted else {}))
    await store.start()
    try:
        delivery = await accept(store)
        absent = KeyRef(secrets.token_hex(16), delivery.ref.route, "")
        assert await store.delivery_token(delivery.ref) == delivery.token
        assert await store.delivery_token(absent) == ""
        batch = 200 if isinstance(store, MemoryStore) else 20
        times: dict[str, list[float]] = {"existing": [], "missing": []}
        for _ in range(40):
            for what, ref in (("existing", delivery.ref), ("missing", absent)):
                started = time.perf_counter()
                for _ in range(batch):
                    await store.delivery_token(ref)
                times[what].append((time.perf_counter() - started) / batch)
    finally:
        await store.close()
    existing, missing = statistics.median(times["existing"]), statistics.median(times["missing"])
    ledger.record(
        "status URL guesses",
        f"token read, {type(store).__name__}, {'encrypted' if encrypted else 'plain'}",
        requests=0,
        detail=f"medians {existing * 1e6:.1f} us and {missing * 1e6:.1f} us",
    )
    # Half a microsecond apart is below what any caller can tell over a network, and
    # within a loaded machine's noise on the memory store's sub-microsecond reads; a
    # token decrypted for one side only costs several.
    assert spread(existing, missing) < 1.3 or abs(existing - missing) < 0.5e-6, (
        f"a delivery's token {existing * 1e6:.1f} us, no record's {missing * 1e6:.1f} us"
    )


@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "plain"])
async def test_a_wrong_token_answers_the_same_whether_or_not_the_key_exists(
    open_store: Callable[..., Store], gateway_on: Any, encrypted: bool, ledger: Ledger
) -> None:
    """Through the gateway: wrong-token URLs of a delivery and URLs of no record get
    the same status, headers and body, in the same time (medians side by side)."""
    store = open_store(**({"encryption_key": new_key()} if encrypted else {}))
    gw = await gateway_on(store)
    delivery = await accept(store)
    times: dict[str, list[float]] = {"existing": [], "missing": []}
    answers: dict[str, set[tuple[int, tuple[tuple[str, str], ...], bytes]]] = {
        "existing": set(),
        "missing": set(),
    }
    for wrong, missing in guesses(delivery, 150):
        for what, url in (("existing", wrong), ("missing", missing)):
            started = time.perf_counter()
            answer = await gw.http.get(url)
            times[what].append(time.perf_counter() - started)
            shown = tuple((n, v) for n, v in answer.headers.items() if n != "date")
            answers[what].add((answer.status_code, shown, answer.content))
    assert answers["existing"] == answers["missing"]
    assert len(answers["existing"]) == 1 and next(iter(answers["existing"]))[0] == 404
    existing, missing = statistics.median(times["existing"]), statistics.median(times["missing"])
    ledger.record(
        "status URL guesses",
        f"wrong token against no record, {'encrypted' if encrypted else 'plain'}",
        requests=300,
        bad_inputs=300,
        detail=f"medians {existing * 1e3:.2f} ms and {missing * 1e3:.2f} ms",
    )
    assert spread(existing, missing) < 1.3, (existing, missing)
