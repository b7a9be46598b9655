"""Stored responses encrypted at rest (store.encryption_key): the envelope, what
Redis holds, rotation, tampering, records moved between keys, and config errors.

Redis tests run an in-process gateway (the real config path, a real redis-server and
the real upstream) and read Redis raw, as someone with a dump of it would.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from prometheus_client import generate_latest

from gateway import cli
from gateway.assembly import Gateway
from gateway.config import parse_config
from gateway.encryption import PLAIN, ResponseCodec, Unreadable, key_id, new_key, parse_key
from gateway.errors import ConfigError
from gateway.keying import record_digest
from gateway.records import KeyRef, State, StoredRequest, StoredResponse
from gateway.store.base import codec_for
from gateway.store.memory import MemoryStore
from gateway.store.redis import BUCKETS, RedisStore
from tests.conftest import GatewayClient, config_for, unique, upstream_count
from tests.support.ledger import Ledger
from tests.support.servers import (
    ROOT,
    Process,
    RedisServer,
    free_port,
    gateway_process,
    wait_for_port,
)

pytestmark = pytest.mark.anyio

K1, K2, K3 = new_key(), new_key(), new_key()
RAW1, RAW2 = parse_key(K1), parse_key(K2)
ID1, ID2 = key_id(RAW1), key_id(RAW2)
PERSONAL = "alice.personal@example.com"
ROUTE = "mail"
RESPONSE = StoredResponse(
    200, (("content-type", "application/json"), ("x-user", PERSONAL)), b'{"to": "' + b"x" * 40
)


def secrets_in(text: str | bytes) -> list[str]:
    """Any of the test keys, in any form, found in `text`."""
    data = text.encode() if isinstance(text, str) else text
    found = []
    for key in (K1, K2, K3):
        raw = parse_key(key)
        forms = [key, key.rstrip("="), base64.b64encode(raw).decode(), raw.hex()]
        found += [key for form in forms if form.encode() in data]
        found += [key] if raw in data else []
    return found


# -- the envelope ------------------------------------------------------------------


def test_envelope_layout_round_trip_and_fresh_nonces() -> None:
    codec = ResponseCodec(RAW1)
    digest = record_digest(ROUTE, "", "k1")
    first, second = codec.encode(digest, RESPONSE), codec.encode(digest, RESPONSE)
    assert first[:1] == b"\x01" and first[1:5] == ID1
    assert len(first) == len(RESPONSE.encode()) + 1 + 4 + 12 + 16
    assert PERSONAL.encode() not in first and b"content-type" not in first
    assert first[5:17] != second[5:17], "every record gets its own random nonce"
    assert codec.decode(digest, first) == RESPONSE == codec.decode(digest, second)


def test_envelope_refuses_every_changed_byte(ledger: Ledger) -> None:
    """A flipped bit anywhere (version, key id, nonce, ciphertext, tag) is refused:
    never read as some other response."""
    codec = ResponseCodec(RAW1, (RAW2,))
    digest = record_digest(ROUTE, "", "k1")
    sealed = codec.encode(digest, RESPONSE)
    refused: list[str] = []
    wrong: list[int] = []
    for i in range(len(sealed)):
        changed = bytearray(sealed)
        changed[i] ^= 0x01 if i else 0x02  # the version byte flipped to another value
        try:
            codec.decode(digest, bytes(changed))
            wrong.append(i)
        except Unreadable as exc:
            refused.append(str(exc))
    ledger.record(
        "isolation",
        "envelope_refuses_every_changed_byte",
        bad_inputs=len(sealed),
        detail=f"{len(sealed) - len(wrong)} of {len(sealed)} single-bit changes refused",
    )
    assert wrong == []
    assert all(not secrets_in(message) for message in refused)


def test_envelope_is_bound_to_its_record() -> None:
    codec = ResponseCodec(RAW1)
    here, there = record_digest(ROUTE, "", "a"), record_digest(ROUTE, "", "b")
    with pytest.raises(Unreadable, match="copied from another record"):
        codec.decode(there, codec.encode(here, RESPONSE))
    other_route = record_digest("other", "", "a")
    with pytest.raises(Unreadable):
        codec.decode(other_route, codec.encode(here, RESPONSE))


def test_responses_sealed_before_kinds_existed_still_open() -> None:
    """A response sealed the way every earlier release sealed it (associated data:
    envelope header and digest, nothing more) opens as it did."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    digest = record_digest(ROUTE, "", "k-old")
    header, nonce = b"\x01" + ID1, bytes(range(12))
    sealed = AESGCM(RAW1).encrypt(nonce, RESPONSE.encode(), header + digest.encode())
    assert ResponseCodec(RAW1).decode(digest, header + nonce + sealed) == RESPONSE
    assert ResponseCodec(RAW2, (RAW1,)).decode(digest, header + nonce + sealed) == RESPONSE


def test_requests_and_tokens_are_sealed_bound_to_their_kind_and_record() -> None:
    codec = ResponseCodec(RAW1)
    here, there = record_digest(ROUTE, "", "a"), record_digest(ROUTE, "", "b")
    request = StoredRequest("POST", "/jobs/x?a=1", (("x-user", PERSONAL), ("x-a", "\n")), b"\n{")
    sealed = codec.encode_request(here, request)
    assert PERSONAL.encode() not in sealed and b"/jobs/x" not in sealed
    assert codec.decode_request(here, sealed) == request
    token = codec.encode_token(here, "Qk3-9w_0123456789abcd")
    assert b"Qk3" not in token and codec.decode_token(here, token) == "Qk3-9w_0123456789abcd"
    with pytest.raises(Unreadable, match="copied from another record"):
        codec.decode_request(there, sealed)
    # A sealed request or token moved into another field of its own record does not open.
    with pytest.raises(Unreadable):
        codec.decode(here, sealed)
    with pytest.raises(Unreadable):
        codec.decode_token(here, sealed)
    with pytest.raises(Unreadable):
        codec.decode_request(here, token)
    with pytest.raises(Unreadable):
        codec.decode_request(here, codec.encode(here, RESPONSE))
    # Plain ones: read without a key, refused with one unless read_unencrypted.
    assert PLAIN.decode_request(here, request.encode()) == request
    assert PLAIN.decode_token(here, PLAIN.encode_token(here, "t")) == "t"
    with pytest.raises(Unreadable, match="unencrypted"):
        codec.decode_request(here, request.encode())
    with pytest.raises(Unreadable, match="unencrypted"):
        codec.decode_token(here, b"t")
    migrating = ResponseCodec(RAW1, read_plain=True)
    assert migrating.decode_request(here, request.encode()) == request
    with pytest.raises(Unreadable, match="not a stored request"):
        PLAIN.decode_request(here, b'["POST"]\nbody')


def test_reading_picks_the_key_by_its_id() -> None:
    digest = record_digest(ROUTE, "", "k")
    old = ResponseCodec(RAW1).encode(digest, RESPONSE)
    rotated = ResponseCodec(RAW2, (RAW1,))
    assert rotated.decode(digest, old) == RESPONSE
    assert rotated.encode(digest, RESPONSE)[1:5] == ID2
    with pytest.raises(Unreadable) as caught:
        ResponseCodec(RAW2).decode(digest, old)
    message = str(caught.value)
    assert ID1.hex() in message and ID2.hex() in message and not secrets_in(message)
    with pytest.raises(Unreadable, match="no key is configured"):
        PLAIN.decode(digest, old)


def test_plain_records_are_refused_while_a_key_is_set_unless_read_unencrypted() -> None:
    """With a key set, nothing the gateway writes is plain: a plain response was
    written by someone else (or before encryption was on), and is refused unless the
    migration setting reads it. Damaged bytes are an Unreadable, not a crash."""
    digest = record_digest(ROUTE, "", "k")
    plain = RESPONSE.encode()
    # JSON allows leading whitespace: refusal must not hang on the first byte being "[".
    for data in (plain, b" " + plain, b"\t" + plain):
        with pytest.raises(Unreadable, match=r"stored unencrypted while store\.encryption_key"):
            ResponseCodec(RAW1).decode(digest, data)
        with pytest.raises(Unreadable, match="read_unencrypted"):
            ResponseCodec(RAW2, (RAW1,)).decode(digest, data)
    assert ResponseCodec(RAW1, read_plain=True).decode(digest, plain) == RESPONSE
    # Without a key to write (none, or only previous keys: encryption being turned
    # off) responses are written plain, so plain ones are read.
    assert PLAIN.decode(digest, plain) == RESPONSE
    assert ResponseCodec(None, (RAW1,)).decode(digest, plain) == RESPONSE
    for damaged in (b"\x01short", b"not json\nbody", b"[1,2]\n", b""):
        for codec in (ResponseCodec(RAW1), ResponseCodec(RAW1, read_plain=True), PLAIN):
            with pytest.raises(Unreadable, match="damaged"):
                codec.decode(digest, damaged)


def test_codec_for_wires_read_unencrypted() -> None:
    digest = record_digest(ROUTE, "", "k")
    route = {"name": "r", "match": {"path": "/r"}, "upstream": "http://127.0.0.1:1"}

    def codec(**store: Any) -> ResponseCodec:
        return codec_for(parse_config({"store": store, "routes": [route]}, "t").store)

    with pytest.raises(Unreadable, match="unencrypted"):
        codec(encryption_key=K1).decode(digest, RESPONSE.encode())
    assert codec(encryption_key=K1, read_unencrypted=True).decode(digest, RESPONSE.encode())
    assert codec(previous_encryption_keys=[K1]).decode(digest, RESPONSE.encode())


def test_key_formats() -> None:
    raw = bytes(range(32))
    urlsafe = base64.urlsafe_b64encode(raw).decode()
    assert parse_key(urlsafe) == raw
    assert parse_key(urlsafe.rstrip("=")) == raw
    assert parse_key(base64.b64encode(raw).decode()) == raw
    assert len(parse_key(new_key())) == 32 and new_key() != new_key()


# -- config ----------------------------------------------------------------------


def config_errors(store: dict[str, Any], env: dict[str, str]) -> str:
    route = {"name": "r", "match": {"path": "/r"}, "upstream": "http://127.0.0.1:1"}
    with pytest.raises(ConfigError) as caught:
        parse_config({"store": store, "routes": [route]}, "gateway.yaml", env=env)
    return str(caught.value)


def test_config_errors_name_the_place_and_the_fix_never_the_key(ledger: Ledger) -> None:
    short = base64.urlsafe_b64encode(b"k" * 16).decode()
    path = "store.previous_encryption_keys"
    cases = [  # (store section, the problem at its YAML path, the fix)
        ({"encryption_key": short}, "store.encryption_key: is 16 bytes once decoded", "keygen"),
        ({"encryption_key": "not base64 at all!"}, "store.encryption_key: is not base64", "keygen"),
        ({"encryption_key": "${UNSET_KEY}"}, "store.encryption_key: is empty", "set it"),
        ({"encryption_key": 12345}, "store.encryption_key: expected a key as text", "${"),
        (
            {"encryption_key": K1, "previous_encryption_keys": [K2, K1]},
            f"{path}[1]: is the same key as store.encryption_key",
            "list each key once",
        ),
        (
            {"encryption_key": K1, "previous_encryption_keys": K2},
            f"{path}: expected a list",
            '["${OLD_KEY}"]',
        ),
        (
            {"previous_encryption_keys": [K2, "${OLD}"]},
            f"{path}[1]: is the same key as {path}[0]",
            "list each key once",
        ),
    ]
    seen = []
    for store, problem, fix in cases:
        message = config_errors(store, env={"OLD": K2})
        seen.append(message)
        assert message.startswith(f"gateway.yaml: {problem}") and fix in message, message
        assert message.count("\n") == 0, "one problem, one line"
    ledger.record(
        "isolation",
        "encryption_config_errors",
        bad_inputs=len(cases),
        detail="wrong length, not base64, empty, not text, duplicates, not a list",
    )
    assert not any(secrets_in(message) or short in message for message in seen)


def test_keys_come_from_the_environment_and_stay_out_of_cli_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_KEY_NEW", K2)
    monkeypatch.setenv("GATEWAY_KEY_OLD", K1)
    path = tmp_path / "gateway.yaml"
    route = {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": "/jobs/mail"},
        "upstream": "http://127.0.0.1:5000",
        "key": {"body": "job_key"},
    }
    store = {
        "url": "memory://",
        "encryption_key": "${GATEWAY_KEY_NEW}",
        "previous_encryption_keys": ["${GATEWAY_KEY_OLD}"],
    }
    path.write_text(yaml.safe_dump({"store": store, "routes": [route]}))
    assert cli.main(["check-config", str(path)]) == 0
    explain = ["explain", "--config", str(path), "POST", "/jobs/mail", "-d", '{"job_key": 1}']
    assert cli.main(explain) == 0
    assert cli.main(["keygen"]) == 0
    out = capsys.readouterr()
    assert f"new responses sealed with key id {ID2.hex()}; also reads key id(s) {ID1.hex()}" in (
        out.out
    )
    generated = out.out.strip().splitlines()[-1]
    assert len(parse_key(generated)) == 32 and generated not in out.err
    config = parse_config(yaml.safe_load(path.read_text()), str(path))
    assert config.store.encryption_key == RAW2 and config.store.previous_encryption_keys == (RAW1,)
    assert not secrets_in(out.out + out.err + repr(config))


# -- what Redis holds --------------------------------------------------------------


def route_config(**changes: Any) -> dict[str, Any]:
    return {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": "/jobs/mail"},
        "key": {"body": "job_key"},
        "wait_timeout": "2s",
        **changes,
    }


@asynccontextmanager
async def running(
    upstream: Process, store: dict[str, Any], **route: Any
) -> AsyncIterator[GatewayClient]:
    """A gateway as `run` builds it from config: restart = leave and enter again."""
    config = config_for(upstream.url, [route_config(**route)], store=store)
    gateway = Gateway(config, sweep=False)
    await gateway.start()
    if isinstance(gateway.store, RedisStore):
        await subscribed(gateway.store)
    client = GatewayClient(gateway)
    try:
        yield client
    finally:
        await client.http.aclose()
        await gateway.close()


async def subscribed(store: RedisStore) -> None:
    """Wait for the store's notification listener: a RedisStore closed before it has
    subscribed waits 10 s for the listener (redis-py swallows the cancel)."""
    channel = store._channels[-1]
    async with asyncio.timeout(15):
        while not (await store.client.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1]:
            await asyncio.sleep(0.01)


def redis_name(prefix: str, key: str) -> str:
    digest = record_digest(ROUTE, "", key)
    return f"{prefix}{{{int(digest[:4], 16) % BUCKETS:02x}}}:{digest}"


async def send(client: GatewayClient, key: str) -> Any:
    return await client.post("/jobs/mail", json={"job_key": key, "to": PERSONAL})


def assert_problem(response: Any, key: str) -> dict[str, Any]:
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc: dict[str, Any] = response.json()
    assert doc["type"].endswith("/stored-response-unreadable")
    assert doc["title"] == "Stored response cannot be decrypted"
    assert doc["key"] == key and "record is kept" in doc["detail"]
    assert PERSONAL not in response.text and not secrets_in(response.text)
    return doc


@pytest.fixture
def raw_redis(redis_server: RedisServer) -> Any:
    client = redis.Redis(port=redis_server.port)
    yield client
    client.close()


@pytest.mark.redis
async def test_redis_holds_no_plaintext_and_replays(
    redis_server: RedisServer, upstream: Process, raw_redis: Any
) -> None:
    plain_prefix, sealed_prefix = unique("plain") + ":", unique("sealed") + ":"
    plain_key, key = unique(), unique()
    async with running(upstream, {"url": redis_server.url, "prefix": plain_prefix}) as plain:
        assert (await send(plain, plain_key)).status_code == 200
    store = {"url": redis_server.url, "prefix": sealed_prefix, "encryption_key": K1}
    async with running(upstream, store) as gateway:
        first = await send(gateway, key)
        again = await send(gateway, key)
    # The control: without a key, the body and headers are there to read.
    plain_raw = b"|".join(raw_redis.hgetall(redis_name(plain_prefix, plain_key)).values())
    assert PERSONAL.encode() in plain_raw and b"application/json" in plain_raw
    fields = raw_redis.hgetall(redis_name(sealed_prefix, key))
    raw = b"|".join(fields.values())
    for plaintext in (PERSONAL.encode(), b"application/json", b"x-run", b"uvicorn", b"[200,"):
        assert plaintext not in raw, plaintext
    assert fields[b"resp"][:5] == b"\x01" + ID1
    assert first.status_code == 200 and first.json()["body"].count(PERSONAL) == 1
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content and again.headers["x-run"] == "1"
    assert await upstream_count(upstream, key) == 1


@pytest.mark.redis
async def test_rotation_reads_old_keys_writes_the_new_one_and_never_deletes(
    redis_server: RedisServer,
    upstream: Process,
    raw_redis: Any,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefix = unique("rot") + ":"
    old, new = unique("old"), unique("new")
    url = redis_server.url
    async with running(upstream, {"url": url, "prefix": prefix, "encryption_key": K1}) as one:
        written = await send(one, old)
    assert raw_redis.hget(redis_name(prefix, old), "resp")[1:5] == ID1
    rotated = {"url": url, "prefix": prefix, "encryption_key": K2, "previous_encryption_keys": [K1]}
    async with running(upstream, rotated) as two:
        replayed = await send(two, old)
        fresh = await send(two, new)
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.content == written.content
    assert raw_redis.hget(redis_name(prefix, new), "resp")[1:5] == ID2
    before = raw_redis.hgetall(redis_name(prefix, old))
    caplog.set_level(logging.INFO)
    async with running(upstream, {"url": url, "prefix": prefix, "encryption_key": K2}) as three:
        refused = [await send(three, old), await send(three, old)]
        still = await send(three, new)
        counted = three.gateway.metrics.registry.get_sample_value(
            "idempotency_gateway_requests_total", {"route": ROUTE, "outcome": "unreadable"}
        )
        metrics_text = generate_latest(three.gateway.metrics.registry)
        kept = await three.gateway.store.get(KeyRef(record_digest(ROUTE, "", old), ROUTE, old))
    after = raw_redis.hgetall(redis_name(prefix, old))
    runs = await upstream_count(upstream, old)
    ledger.record(
        "isolation",
        "encryption_rotation",
        requests=6,
        faults=1,
        upstream_duplicates=runs - 1,
        records_lost=0 if after else 1,
        detail="K1 -> [K2, K1] -> [K2]: old record replayed, then refused and kept",
    )
    for response in refused:
        doc = assert_problem(response, old)
        assert ID1.hex() in doc["detail"] and ID2.hex() in doc["detail"]
    assert after == before, "the unreadable record is kept exactly as it was"
    assert kept is not None and kept.state is State.COMPLETED and kept.response is None
    assert ID1.hex() in kept.to_json()["response"]["unreadable"]
    assert runs == 1
    assert still.headers["idempotent-replayed"] == "true" and still.content == fresh.content
    assert counted == 2
    logged = [r.getMessage() for r in caplog.records if "cannot be decrypted" in r.getMessage()]
    assert len(logged) == 2 and record_digest(ROUTE, "", old) in logged[0]
    assert not secrets_in(caplog.text) and not secrets_in(metrics_text)


@pytest.mark.redis
async def test_tampered_ciphertext_gives_the_problem_not_a_wrong_replay(
    redis_server: RedisServer, upstream: Process, raw_redis: Any, ledger: Ledger
) -> None:
    prefix = unique("tamper") + ":"
    store = {"url": redis_server.url, "prefix": prefix, "encryption_key": K1}
    keys = [unique() for _ in range(3)]
    async with running(upstream, store) as gateway:
        for key in keys:
            assert (await send(gateway, key)).status_code == 200
        # Flip one bit of the nonce, of the ciphertext, of the tag.
        for key, where in zip(keys, (7, 40, -1), strict=True):
            name = redis_name(prefix, key)
            sealed = bytearray(raw_redis.hget(name, "resp"))
            sealed[where] ^= 0x01
            raw_redis.hset(name, "resp", bytes(sealed))
        answers = [await send(gateway, key) for key in keys]
    runs = [await upstream_count(upstream, key) for key in keys]
    ledger.record(
        "isolation",
        "encryption_tampered_ciphertext",
        requests=6,
        faults=3,
        upstream_duplicates=sum(runs) - len(keys),
        detail="one bit flipped in the nonce, the ciphertext, the tag",
    )
    for key, answer in zip(keys, answers, strict=True):
        assert "changed in the store" in assert_problem(answer, key)["detail"]
    assert runs == [1, 1, 1]


@pytest.mark.redis
async def test_ciphertext_moved_to_another_record_does_not_open(
    redis_server: RedisServer, upstream: Process, raw_redis: Any, ledger: Ledger
) -> None:
    prefix = unique("moved") + ":"
    store = {"url": redis_server.url, "prefix": prefix, "encryption_key": K1}
    alice, bob = unique("alice"), unique("bob")
    async with running(upstream, store) as gateway:
        alices = await send(gateway, alice)
        await send(gateway, bob)
        raw_redis.hset(
            redis_name(prefix, bob), "resp", raw_redis.hget(redis_name(prefix, alice), "resp")
        )
        answer = await send(gateway, bob)
        alice_again = await send(gateway, alice)
    ledger.record(
        "isolation",
        "encryption_ciphertext_moved",
        requests=4,
        faults=1,
        upstream_duplicates=await upstream_count(upstream, bob) - 1,
        detail="alice's sealed response copied into bob's record",
    )
    assert alice not in answer.text, "bob must never get alice's response"
    assert "copied from another record" in assert_problem(answer, bob)["detail"]
    assert alice_again.content == alices.content


@pytest.mark.redis
async def test_encryption_turned_on_over_plain_records(
    redis_server: RedisServer, upstream: Process, raw_redis: Any
) -> None:
    """Responses stored before a key was set replay only with read_unencrypted (the
    migration setting); after the key is removed, sealed ones give the problem
    unless the key is still listed as previous."""
    prefix = unique("on") + ":"
    before, sealed = unique(), unique()
    url = redis_server.url
    async with running(upstream, {"url": url, "prefix": prefix}) as plain:
        first = await send(plain, before)
    async with running(upstream, {"url": url, "prefix": prefix, "encryption_key": K1}) as keyed:
        assert "stored unencrypted" in assert_problem(await send(keyed, before), before)["detail"]
    migrating = {"url": url, "prefix": prefix, "encryption_key": K1, "read_unencrypted": True}
    async with running(upstream, migrating) as keyed:
        assert (await send(keyed, before)).content == first.content
        written = await send(keyed, sealed)
    assert raw_redis.hget(redis_name(prefix, sealed), "resp")[:5] == b"\x01" + ID1
    reading = {"url": url, "prefix": prefix, "previous_encryption_keys": [K1]}
    async with running(upstream, reading) as off:
        assert (await send(off, sealed)).content == written.content
        newest = unique()
        await send(off, newest)
    assert raw_redis.hget(redis_name(prefix, newest), "resp").startswith(b"[200,")
    async with running(upstream, {"url": url, "prefix": prefix}) as none:
        assert "no key is configured" in assert_problem(await send(none, sealed), sealed)["detail"]
    assert await upstream_count(upstream, before) == 1


FORGED = StoredResponse(200, (("content-type", "application/json"),), b'{"forged": true}')


@pytest.mark.redis
async def test_plain_response_written_into_redis_is_not_replayed_with_a_key(
    redis_server: RedisServer, upstream: Process, raw_redis: Any, ledger: Ledger
) -> None:
    """Someone who can write to Redis replaces a sealed response with a plain one:
    with a key set it is unreadable (500, record kept, counted), never replayed."""
    prefix = unique("forge") + ":"
    key = unique()
    store = {"url": redis_server.url, "prefix": prefix, "encryption_key": K1}
    async with running(upstream, store) as gateway:
        assert (await send(gateway, key)).status_code == 200
        name = redis_name(prefix, key)
        raw_redis.hset(name, "resp", FORGED.encode())
        before = raw_redis.hgetall(name)
        answers = [await send(gateway, key), await send(gateway, key)]
        counted = gateway.gateway.metrics.registry.get_sample_value(
            "idempotency_gateway_requests_total", {"route": ROUTE, "outcome": "unreadable"}
        )
    after = raw_redis.hgetall(name)
    ledger.record(
        "isolation",
        "encryption_plain_response_forged",
        requests=3,
        faults=1,
        upstream_duplicates=await upstream_count(upstream, key) - 1,
        detail="a plain response written into a sealed record's field",
    )
    for answer in answers:
        assert b"forged" not in answer.content
        assert "idempotent-replayed" not in answer.headers
        assert "stored unencrypted" in assert_problem(answer, key)["detail"]
    assert after == before, "the record is kept as it was"
    assert counted == 2
    assert await upstream_count(upstream, key) == 1
    # The migration setting reads plain responses: that is what it is for.
    async with running(upstream, {**store, "read_unencrypted": True}) as migrating:
        replayed = await send(migrating, key)
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.json() == {"forged": True}


@pytest.mark.redis
@pytest.mark.parametrize("read_unencrypted", [False, True])
async def test_plain_completion_notice_does_not_wake_a_waiter_with_it(
    redis_server: RedisServer, upstream: Process, raw_redis: Any, read_unencrypted: bool
) -> None:
    """A waiter in another replica is woken by a completion notice that carries the
    response. A plain one published on the channel while the first request is still
    running is not replayed with a key set: the waiter reads the record and waits on
    for the real answer (with read_unencrypted, it is replayed, as plain records are)."""
    prefix = unique("notice") + ":"
    key = unique()
    store = {"url": redis_server.url, "prefix": prefix, "encryption_key": K1}
    waiting = {**store, "read_unencrypted": read_unencrypted}
    name = redis_name(prefix, key)
    params = {"hold": "1"}
    async with (
        running(upstream, store, wait_timeout="60s") as first,
        running(upstream, waiting, wait_timeout="60s") as second,
    ):
        replica = second.gateway.store
        assert isinstance(replica, RedisStore)
        heard = asyncio.Event()
        hear = replica.notices._notice

        def spy(data: bytes) -> None:
            hear(data)
            heard.set()

        replica.notices._notice = spy  # type: ignore[method-assign]
        body = {"job_key": key, "to": PERSONAL}
        running_one = asyncio.create_task(first.post("/jobs/mail", json=body, params=params))
        async with asyncio.timeout(30):
            while await upstream_count(upstream, key) < 1:
                await asyncio.sleep(0.02)
        waiter = asyncio.create_task(second.post("/jobs/mail", json=body, params=params))
        async with asyncio.timeout(30):
            while not raw_redis.hexists(name, "w"):  # the waiter is registered on it
                await asyncio.sleep(0.02)
        digest = record_digest(ROUTE, "", key)
        channel = f"{prefix}{{{int(digest[:4], 16) % BUCKETS:02x}}}:c"
        # Published only while the record is still in flight: the forged notice comes
        # before the real one, whatever the timing.
        forge = r"""
            if redis.call('HGET', KEYS[1], 's') ~= 'in_flight' then return -1 end
            return redis.call('SPUBLISH', ARGV[1], ARGV[2] .. '\n' ..
                redis.call('HGET', KEYS[1], 'f') .. '\n' .. ARGV[3])
        """
        receivers = raw_redis.eval(forge, 1, name, channel, f"{digest}/{ROUTE}", FORGED.encode())
        assert receivers >= 1
        async with asyncio.timeout(30):
            await heard.wait()
        await asyncio.sleep(0.05)  # the woken waiter runs before any other notice lands
        async with httpx.AsyncClient() as client:
            await client.post(f"{upstream.url}/_release", json={"key": key})
        real, answer = await running_one, await waiter
    assert real.status_code == 200 and b"forged" not in real.content
    assert answer.headers["idempotent-replayed"] == "true"
    if read_unencrypted:
        assert answer.json() == {"forged": True}
    else:
        assert answer.content == real.content, answer.text
    assert await upstream_count(upstream, key) == 1


# -- the memory store gets the same envelope -----------------------------------------


async def test_memory_store_seals_and_refuses_alike(upstream: Process) -> None:
    async with running(upstream, {"url": "memory://", "encryption_key": K1}) as gateway:
        store = gateway.gateway.store
        assert isinstance(store, MemoryStore)
        key = unique()
        first = await send(gateway, key)
        assert (await send(gateway, key)).content == first.content
        digest = record_digest(ROUTE, "", key)
        sealed = store._sealed[digest]
        assert sealed[:5] == b"\x01" + ID1 and PERSONAL.encode() not in sealed
        assert store._records[digest].response is None
        store._sealed[digest] = sealed[:-1] + bytes([sealed[-1] ^ 1])
        assert_problem(await send(gateway, key), key)
        assert digest in store._records and await upstream_count(upstream, key) == 1


@pytest.mark.parametrize("read_unencrypted", [False, True])
async def test_memory_store_refuses_plain_responses_with_a_key(
    upstream: Process, read_unencrypted: bool
) -> None:
    store_config = {"url": "memory://", "encryption_key": K1, "read_unencrypted": read_unencrypted}
    async with running(upstream, store_config) as gateway:
        store = gateway.gateway.store
        assert isinstance(store, MemoryStore)
        key = unique()
        await send(gateway, key)
        digest = record_digest(ROUTE, "", key)
        store._sealed[digest] = FORGED.encode()
        answer = await send(gateway, key)
        assert digest in store._records and await upstream_count(upstream, key) == 1
    if read_unencrypted:
        assert answer.json() == {"forged": True}
    else:
        assert "stored unencrypted" in assert_problem(answer, key)["detail"]


# -- encryption turned on over deliveries stored plain: a real process ------------------

OPERATOR = "enc-alice-" + "t" * 24
CONSOLE_SECRET = "enc-console-secret-" + "s" * 32


def gateway_config(tmp: Path, upstream: Process, redis_url: str, prefix: str, key: str) -> Path:
    """A gateway on `redis_url` whose async route parks a delivery after one attempt;
    with `key`, store.encryption_key (and no read_unencrypted)."""
    store: dict[str, Any] = {"url": redis_url, "prefix": prefix}
    if key:
        store["encryption_key"] = key
    port, admin = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {
            "listen": f"127.0.0.1:{admin}",
            "operators": [{"name": "alice", "role": "operator", "token_env": "ENC_TOKEN"}],
            "session_secret_env": "ENC_SECRET",
        },
        "store": store,
        "routes": [
            {
                "name": "deliver",
                "match": {"methods": ["POST"], "path": "/jobs/deliver"},
                "upstream": upstream.url,
                "key": {"header": "X-Job-Key"},
                "delivery": "async",
                "retry": {"attempts": 1},
            }
        ],
    }
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_gateway(path: Path) -> tuple[Process, str, str]:
    config = yaml.safe_load(path.read_text())
    port = int(config["server"]["listen"].rsplit(":", 1)[1])
    env = {"ENC_TOKEN": OPERATOR, "ENC_SECRET": CONSOLE_SECRET}
    process = gateway_process(path, port, env=env).start()
    admin = config["admin"]["listen"]
    wait_for_port(int(admin.rsplit(":", 1)[1]))
    return process, f"http://127.0.0.1:{port}", f"http://{admin}"


def keys_show(admin: str, key: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "GATEWAY_OPERATOR_TOKEN": OPERATOR, "GATEWAY_ADMIN_URL": admin}
    env.pop("GATEWAY_ADMIN_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "gateway", "keys", "show", "deliver", key],
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=30,
    )


@pytest.mark.process
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_delivery_stored_plain_opens_after_encryption_is_turned_on(
    tmp_path: Path, upstream: Process, redis_server: RedisServer
) -> None:
    """Deliveries parked (their one attempt answered 503) by a gateway without
    store.encryption_key; the gateway restarted with one (no read_unencrypted), so their
    stored requests cannot be opened; one of them also had its history changed in
    Redis into something that is not JSON. The API, the console's key page and `keys
    show` open both keys (200): the request shown as unreadable, why in the gateway's
    words, the damaged history as an event that says so. The operator claims and
    resolves them: a retry is never sent (parked again: the request is unreadable),
    done completes it. A caller's repeat is told, in the gateway's words, that its
    status URL cannot be given (its token is stored plain too)."""
    prefix = unique("enc") + ":"
    plain, damaged = unique("enc-plain"), unique("enc-damaged")
    first = gateway_config(tmp_path, upstream, redis_server.url, prefix, "")
    process, proxy, admin = start_gateway(first)
    try:
        for key in (plain, damaged):
            answer = httpx.post(
                f"{proxy}/jobs/deliver?status=503", content=b"{}", headers={"X-Job-Key": key}
            )
            assert answer.status_code == 202, answer.text
            deadline = time.monotonic() + 10
            while httpx.get(proxy + answer.headers["location"]).json()["state"] != "parked":
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        process.stop()
    raw = redis.Redis(port=redis_server.port)
    try:
        digest = record_digest("deliver", "", damaged)
        name = f"{prefix}{{{int(digest[:4], 16) % BUCKETS:02x}}}:{digest}"
        assert raw.hset(name, "h", b'[{"at_ms": "not a time"') == 0
    finally:
        raw.close()
    process, proxy, admin = start_gateway(
        gateway_config(tmp_path, upstream, redis_server.url, prefix, K1)
    )
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    try:
        with httpx.Client(base_url=admin, headers=auth, timeout=10) as api:
            shown = {key: api.get(f"/admin/keys/deliver/{key}") for key in (plain, damaged)}
            for key, answer in shown.items():
                assert answer.status_code == 200, (key, answer.status_code, answer.text)
                request = answer.json()["request"]
                assert list(request) == ["unreadable"], request
                assert (
                    "stored unencrypted while store.encryption_key is set"
                    in (request["unreadable"])
                ), request
            history = shown[damaged].json()["history"]
            assert sorted(e["event"] for e in history) == ["accepted", "unreadable"], history
            [unreadable] = [e for e in history if e["event"] == "unreadable"]
            assert "history is damaged" in unreadable["reason"], unreadable
            with httpx.Client(base_url=admin, headers={"Origin": admin}, timeout=10) as console:
                signed = console.post("/console/signin", data={"token": OPERATOR})
                assert signed.status_code == 303, signed.text
                pages = [
                    console.get("/console/key", params={"route": "deliver", "key": key})
                    for key in (plain, damaged)
                ]
            for page in pages:
                assert page.status_code == 200, page.text
                assert "Cannot be read: it is stored unencrypted" in page.text, page.text
            assert "History unreadable: the stored history is damaged" in pages[1].text
            for key in (plain, damaged):
                result = keys_show(admin, key)
                assert result.returncode == 0, result.stderr
                out = result.stdout.decode()
                assert "request:  unreadable: it is stored unencrypted" in out, out
            repeat = httpx.post(
                f"{proxy}/jobs/deliver?status=503", content=b"{}", headers={"X-Job-Key": damaged}
            )
            # Its status URL's token is stored plain too: no 202 can name it. Said so.
            assert repeat.status_code == 500, repeat.text
            assert repeat.headers["content-type"] == "application/problem+json"
            assert "cannot give its status URL" in repeat.json()["detail"], repeat.text
            # Claimed and resolved: a retry is never sent, done completes it.
            for key in (plain, damaged):
                claim = api.post(f"/admin/keys/deliver/{key}/claim", json={})
                assert claim.status_code == 200, claim.text
                retry = api.post(f"/admin/keys/deliver/{key}/resolve", json={"outcome": "retry"})
                assert retry.status_code == 200, retry.text
            deadline = time.monotonic() + 10
            for key in (plain, damaged):
                while (doc := api.get(f"/admin/keys/deliver/{key}").json())["state"] != "parked":
                    assert time.monotonic() < deadline, doc
                    time.sleep(0.05)
                assert "stored request unreadable" in doc["reason"], doc
                assert api.post(f"/admin/keys/deliver/{key}/claim", json={}).status_code == 200
                done = api.post(
                    f"/admin/keys/deliver/{key}/resolve",
                    json={"outcome": "done", "note": "sent by hand"},
                )
                assert done.status_code == 200 and done.json()["state"] == "completed", done.text
    finally:
        process.stop()
    for key in (plain, damaged):
        assert upstream_count_now(upstream, key) == 1, key


def upstream_count_now(upstream: Process, key: str) -> int:
    answer = httpx.get(f"{upstream.url}/_count", params={"key": key}, timeout=10)
    return int(answer.json()["count"])
