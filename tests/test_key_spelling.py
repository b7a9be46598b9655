"""The key has one spelling on the wire: the forward, each delivery attempt and each
reconcile check send the route's key header with the same bytes for the same key, and
no two keys share a spelling.

In-process gateways on the memory store and a real redis-server, in front of
tests/support/job_service.py, which records each request's `Idempotency-Key` bytes as
they arrived.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.assembly import Gateway
from gateway.config import KeySource, KeySpec
from gateway.keying import RequestParts, extract_key, key_header_value
from gateway.store.base import Store
from tests.conftest import GatewayClient, config_for, unique
from tests.support.servers import Process

pytestmark = pytest.mark.anyio

#: One of each kind of key: ASCII, Latin-1, beyond Latin-1, `%` (the encoding's own
#: mark), spaces at the ends (HTTP trims them from a header value), a no-break space,
#: quotes and a backslash. `{}` is where each run's unique part goes.
KEYS = [
    "inv-2026-11-{}",
    "café-{}",
    "請求書-{} ✓ 😀",
    "50%-off-{}",
    "%41-{}",
    " padded-{} ",
    "nbsp\u00a0{}",
    'q"uote\\{}',
]


def sync_route(service: Process) -> dict[str, Any]:
    return {
        "name": "now",
        "match": {"methods": ["POST"], "path": "/jobs/run"},
        "key": {"body": "job_key"},
        "fingerprint": ["method", "path", "body"],
        "upstream_timeout": "300ms",
        "on_unknown_outcome": "reconcile",
        # The query is the safe place for a key (every key can be checked there).
        "reconcile": {"url": service.url + "/jobs/status?key={key}", "every": "1h"},
    }


def async_route() -> dict[str, Any]:
    return {
        "name": "later",
        "match": {"methods": ["PUT"], "path": "/jobs/run"},
        "key": {"body": "job_key"},
        "delivery": "async",
        "retry": {"attempts": 2, "backoff": "50ms"},
    }


@pytest.fixture
async def gateway_at(
    make_store: Callable[[], Store], job_service: Process
) -> AsyncIterator[Callable[..., Any]]:
    opened: list[GatewayClient] = []

    async def build(routes: list[dict[str, Any]]) -> GatewayClient:
        gateway = Gateway(config_for(job_service.url, routes), store=make_store(), sweep=False)
        await gateway.start()
        opened.append(GatewayClient(gateway))
        return opened[-1]

    yield build
    for client in opened:
        await client.http.aclose()
        await client.gateway.close()


async def heard(service: Process, key: str) -> dict[str, list[str | None]]:
    """The `Idempotency-Key` bytes (latin-1) of each request about `key`, by kind."""
    async with httpx.AsyncClient() as client:
        log = (await client.get(service.url + "/_log")).json()
    found: dict[str, list[str | None]] = {"run": [], "status": []}
    for request in log["requests"]:
        if request["key"] == key:
            found[request["of"]].append(request["key_header"])
    return found


def names(wire: str) -> str:
    """The key a wire spelling names: percent-decoded when it holds a `%`."""
    return unquote(wire, errors="strict") if "%" in wire else wire


async def until_heard(service: Process, key: str, runs: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while len((await heard(service, key))["run"]) < runs:
        assert time.monotonic() < deadline, f"{key!r}: {await heard(service, key)}"
        await asyncio.sleep(0.05)


async def test_forward_delivery_and_check_spell_the_key_alike(
    gateway_at: Callable[..., Any], job_service: Process
) -> None:
    gw = await gateway_at([sync_route(job_service), async_route()])
    for shape in KEYS:
        key = shape.format(unique())
        first = await gw.post("/jobs/run", params={"sleep": "0.6"}, json={"job_key": key})
        assert first.status_code == 504  # the outcome is unknown: the key is unresolved
        accepted = await gw.request("PUT", "/jobs/run", json={"job_key": key})
        assert accepted.status_code == 202
        await asyncio.sleep(0.5)  # the first run finishes
        again = await gw.post("/jobs/run", json={"job_key": key})  # checks, then replays
        assert again.status_code == 200, again.text
        await until_heard(job_service, key, runs=2)
        got = await heard(job_service, key)
        assert len(got["status"]) == 1, f"{key!r}: the check was not sent: {got}"
        spellings = set(got["run"] + got["status"])
        assert len(spellings) == 1, f"{key!r} reached the service as {spellings}"
        wire = spellings.pop()
        assert wire is not None
        assert wire == key_header_value(key)
        assert names(wire) == key
        assert wire.isascii() and wire.isprintable() and wire == wire.strip()


TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1)


@given(TEXT)
@example(" leading")
@example("trailing\t")
@example("%")
def test_a_spelling_is_a_header_value_that_names_its_key(key: str) -> None:
    wire = key_header_value(key)
    assert wire.isascii() and wire.isprintable() and wire == wire.strip(" \t")
    assert names(wire) == key


#: The keys sent as they are, as a grammar: printable ASCII but `%`, `"` and `\`, a
#: space only inside. key_header_value asks with string methods; this is the oracle.
AS_IS = re.compile(r"[!#$&-\[\]-~](?:[ !#$&-\[\]-~]*[!#$&-\[\]-~])?")


@given(st.text(st.characters(max_codepoint=0xFF), max_size=6))
@example("")
@example(" ")
@example("a b")
@example(" a")
@example("a ")
@example("\x7f")
@example("a\\b")
def test_a_key_is_sent_as_it_is_exactly_when_the_grammar_says(key: str) -> None:
    written = key if AS_IS.fullmatch(key) else quote(key, safe="")
    assert key_header_value(key) == written


@given(TEXT, TEXT)
@example('"x"', "x")
@example("x", '"x"')
@example('"x\\"', '"x"')
@example("%78", "x")
def test_two_keys_never_share_a_spelling(a: str, b: str) -> None:
    if a != b:
        assert key_header_value(a) != key_header_value(b)
    # The pair a hand would not find: a key, and another spelled as the first is sent.
    wire = key_header_value(a)
    if wire != a:
        assert key_header_value(wire) != wire


def read_as_a_header_key(wire: str) -> str | None:
    """The key a gateway in front of the upstream (or an upstream that reads the
    Idempotency-Key draft's structured-field string) takes from the spelling, the way
    this gateway reads `key: {header: Idempotency-Key}`: `"x"` is the key `x`."""
    parts = RequestParts("POST", "/", "", [("idempotency-key", wire)], b"")
    spec = KeySpec(sources=(KeySource("header", "Idempotency-Key"),), max_length=4096)
    return extract_key(spec, parts, NOW)


NOW = datetime(2026, 11, 1, tzinfo=UTC)
#: Keys whose spelling (up to 12 characters a character) fits a header key's 4096.
SHORT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=300)


@given(SHORT, SHORT)
@example('"x"', "x")
@example('"x\\\\"', "x\\")
@example('"a b"', "a b")
def test_a_reader_of_the_header_tells_every_two_keys_apart(a: str, b: str) -> None:
    """Read back as a header key (a structured-field string unquoted), two keys'
    spellings are still two keys, and none is a malformed quoted string."""
    read_a, read_b = (
        read_as_a_header_key(key_header_value(a)),
        read_as_a_header_key(key_header_value(b)),
    )
    assert read_a is not None and read_b is not None
    if a != b:
        assert read_a != read_b, (a, b, key_header_value(a), key_header_value(b))
