"""`wait_for_replicas`: the store on a Redis whose replicas do not confirm a write, and
real gateways on the topologies that take the setting.

One Redis server without replicas stands in for replicas that fell behind: WAIT never
reaches the count asked for. The contract suite runs over every topology with and
without the setting; what is here is about WAIT alone: a retried call's confirmation,
a Sentinel setup whose replica is stopped (what callers are told, and that the work
still runs once), and a Redis Cluster with replicas (the WAIT goes to the key's
primary, on the script's connection).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from redis.crc import key_slot

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.keying import record_digest
from gateway.records import KeyRef, State
from gateway.store.base import NewDelivery
from gateway.store.redis import RedisStore
from gateway.store.redis.listing import bucket_of
from tests.conftest import unique, upstream_count
from tests.support.servers import Process, RedisServer, free_port, gateway_process
from tests.support.topologies import ClusterSetup, SentinelSetup, redis_cli, replica_synced
from tests.test_store_contract import REQUEST, TOKEN, ref

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

PROBLEMS = "https://idempotency-gateway.dev/problems/"


async def test_an_accept_the_replicas_did_not_confirm_is_queued_unconfirmed(
    redis_server: RedisServer,
) -> None:
    """wait_for_replicas on a server with none: the delivery is queued (it will run),
    and the store says its replicas did not confirm it; it is no store error, which
    would tell the caller nothing was accepted."""
    server = redis_server
    config = StoreConfig(
        url=server.url, prefix=unique("t") + ":", wait_for_replicas=1, socket_timeout=0.3
    )
    replicated = RedisStore(config)
    await replicated.start()
    try:
        r = ref()
        accepted = await replicated.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))
        assert (accepted.outcome, accepted.confirmed) == ("queued", False), accepted
        record = await replicated.get(r)
        assert record is not None and record.state is State.QUEUED
        assert await replicated.get_request(r) == REQUEST
    finally:
        await replicated.close()


@pytest.fixture
async def views(redis_server: RedisServer) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """One prefix seen by two stores: a plain one, standing in for a first try whose
    write landed but whose reply was lost, and one with wait_for_replicas: 1 on a
    server without replicas, for the retry."""
    prefix = unique("t") + ":"
    plain = RedisStore(StoreConfig(url=redis_server.url, prefix=prefix))
    replicated = RedisStore(
        StoreConfig(url=redis_server.url, prefix=prefix, wait_for_replicas=1, socket_timeout=0.3)
    )
    await plain.start()
    await replicated.start()
    yield plain, replicated
    await replicated.close()
    await plain.close()


async def test_a_retried_claim_that_finds_its_own_claim_still_needs_the_replicas(
    views: tuple[RedisStore, RedisStore],
) -> None:
    """redis-py retries a command once after a timeout, and WAIT's own wait can be that
    timeout: the first try's claim landed on the master, unconfirmed. The retry finds
    the record in flight under its own run id; it must not take that as a confirmed
    claim (the request would go out on a claim a failover can lose, and run twice). It
    is a store error (503, never forwarded), and the claim is released for the retry."""
    plain, replicated = views
    r = ref()
    assert await plain.claim(r, "run-a", "fp", 30) is None  # the first try's write
    with pytest.raises(StoreError, match="replicas confirmed the claim"):
        await replicated.claim(r, "run-a", "fp", 30)
    assert await plain.claim(r, "run-b", "fp", 30) is None  # free for the retry


async def test_a_retried_accept_that_finds_its_own_delivery_still_needs_the_replicas(
    views: tuple[RedisStore, RedisStore],
) -> None:
    """The same for a delivery: a retried accept that finds its own queued record is
    not a confirmed one. It is unconfirmed, and the delivery stays queued; another
    run's accept that finds it is a repeat, which answers with the record."""
    plain, replicated = views
    r = ref()
    assert (await plain.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))).outcome == "queued"
    retried = await replicated.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))
    assert retried.record is not None and retried.record.run_id == "run-a"
    assert not retried.confirmed
    record = await replicated.get(r)
    assert record is not None and record.state is State.QUEUED
    repeat = await replicated.accept(NewDelivery(r, "run-b", "fp", REQUEST, TOKEN))
    assert repeat.outcome == "exists" and repeat.confirmed


async def test_a_retried_pick_that_finds_its_own_pick_still_needs_the_replicas(
    views: tuple[RedisStore, RedisStore],
) -> None:
    """A pick's first try took the delivery on the master, unconfirmed, and its reply
    was lost; the retry finds it in flight for its own run. That is no confirmed pick:
    it is put back unsent, as a pick made now would be. Picks unconfirmed again and
    again leave one history event, counted, not one per try."""
    plain, replicated = views
    replicated.deliveries.unconfirmed_pick_delay = 0.05
    r = ref()
    assert (await plain.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))).outcome == "queued"
    first = await plain.pick(r.route, r, "run-1", 30, 8, "replica-a")  # the first try's write
    assert first.record is not None
    retried = await replicated.pick(r.route, r, "run-1", 30, 8, "replica-a")
    assert retried.record is None and retried.why == "unconfirmed", retried
    for run in ("run-2", "run-3"):
        await asyncio.sleep(0.1)
        again = await replicated.pick(r.route, r, run, 30, 8, "replica-a")
        assert again.why == "unconfirmed", again
    record = await plain.get(r)
    assert record is not None and record.state is State.QUEUED and record.attempts == 0
    [event] = record.history
    assert (event["event"], event["times"]) == ("put_back", 3), event
    assert event["last_ms"] > event["at_ms"] and "0 of 1 replicas" in event["reason"]


def primary_of(replica: RedisServer) -> int:
    """The port of the primary a cluster replica follows."""
    for line in redis_cli(replica.port, "info", "replication").splitlines():
        if line.startswith("master_port:"):
            return int(line.partition(":")[2])
    raise AssertionError(f"{replica.port} is not a replica")


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_on_a_cluster_the_wait_counts_the_key_owners_replicas() -> None:
    """WAIT counts the replicas that hold the writes of the connection it runs on. With
    one primary's replica stopped, a claim and an accept of a key that primary owns are
    unconfirmed (the claim released, the accept queued), while keys of the other
    primaries are confirmed. A WAIT sent to every node, or on another connection,
    would count replicas that never saw the write: a failover could then lose a
    claim the gateway forwarded on."""
    cluster = ClusterSetup(replicas=1).start()
    nodes = tuple(("127.0.0.1", node.port) for node in cluster.nodes)
    store = RedisStore(
        StoreConfig(
            cluster_nodes=nodes, prefix=unique("t") + ":", wait_for_replicas=1, socket_timeout=1.0
        )
    )
    await store.start()
    replica = cluster.replica_nodes()[0]
    owner = primary_of(replica)

    def owned(by_owner: bool) -> KeyRef:
        while True:
            r = ref()
            node = store.client.get_node_from_key(store._keys(r)[0][0])
            if (node.port == owner) is by_owner:
                return r

    claims, accepts = [owned(True) for _ in range(4)], [owned(True) for _ in range(4)]
    healthy = [owned(False) for _ in range(2)]
    replica.signal(signal.SIGSTOP)
    try:
        refused = await asyncio.gather(
            *(store.claim(r, "run-a", "fp", 30) for r in claims), return_exceptions=True
        )
        unconfirmed = await asyncio.gather(
            *(store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN)) for r in accepts)
        )
        assert await store.claim(healthy[0], "run-a", "fp", 30) is None
        confirmed = await store.accept(NewDelivery(healthy[1], "run-a", "fp", REQUEST, TOKEN))
        released = [await store.get(r) for r in claims]
        queued = [await store.get(r) for r in accepts]
    finally:
        replica.signal(signal.SIGCONT)
        await store.close()
        cluster.stop()
    assert all(
        isinstance(e, StoreError) and "replicas confirmed the claim" in str(e) for e in refused
    ), refused
    assert [(a.outcome, a.confirmed) for a in unconfirmed] == [("queued", False)] * 4, unconfirmed
    assert (confirmed.outcome, confirmed.confirmed) == ("queued", True), confirmed
    assert all(r is None or r.state is State.RELEASED for r in released), released
    assert all(r is not None and r.state is State.QUEUED for r in queued), queued


@pytest.mark.cluster
async def test_a_cluster_wait_follows_a_moved_slot_a_lost_connection_and_noscript(
    redis_cluster_replicated: ClusterSetup,
) -> None:
    """The script and its WAIT go to the slot's owner as the client's slot map names
    it. A map gone stale (the slot moved since: resharding, a failover) gets MOVED:
    both are sent again to the owner it names. Connections the server closed (killed,
    timed out on its side) fail: both are sent again on a new one. A flushed script
    (NOSCRIPT) is loaded, then both are sent again. Each time the call is confirmed,
    not a store error."""
    nodes = tuple(("127.0.0.1", node.port) for node in redis_cluster_replicated.nodes)
    config = StoreConfig(
        cluster_nodes=nodes, prefix=unique("t") + ":", wait_for_replicas=1, socket_timeout=1.0
    )
    store = RedisStore(config)
    await store.start()
    try:
        moved, lost = ref(), ref()
        key = store._keys(moved)[0][0]
        client = store.client
        owner = client.get_node_from_key(key)
        elsewhere = next(n for n in client.get_primaries() if n.name != owner.name)
        client.nodes_manager.slots_cache[client.keyslot(key)] = [elsewhere]
        assert await store.claim(moved, "run-a", "fp", 30) is None
        assert client.get_node_from_key(key).name == owner.name  # the map follows
        await store.accept(
            NewDelivery(ref(), "run-a", "fp", REQUEST, TOKEN)
        )  # connections to reuse
        for node in redis_cluster_replicated.masters():
            redis_cli(node.port, "client", "kill", "type", "normal")
        accepted = await store.accept(NewDelivery(lost, "run-a", "fp", REQUEST, TOKEN))
        for node in redis_cluster_replicated.masters():
            redis_cli(node.port, "script", "flush")
        flushed = await store.accept(NewDelivery(ref(), "run-a", "fp", REQUEST, TOKEN))
    finally:
        await store.close()
    assert (accepted.outcome, accepted.confirmed) == ("queued", True), accepted
    assert (flushed.outcome, flushed.confirmed) == ("queued", True), flushed


# -- real gateways ------------------------------------------------------------------------


def start_gateway(tmp_path: Path, upstream: Process, store: dict[str, Any]) -> tuple[Process, str]:
    """A gateway on `store` with a sync route (/jobs/charge) and an async one
    (/jobs/send); its process and base URL."""
    port = free_port()
    common = {"upstream": upstream.url, "key": {"header": "Idempotency-Key"}}
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {"prefix": unique("t") + ":", **store},
        "routes": [
            {"name": "charge", "match": {"path": "/jobs/charge"}, **common},
            {
                "name": "send",
                "match": {"path": "/jobs/send"},
                "delivery": "async",
                "on_unknown_outcome": "park",
                "retry": {"attempts": 3, "backoff": "100ms"},
                **common,
            },
        ],
    }
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return gateway_process(path, port).start(), f"http://127.0.0.1:{port}"


async def until_delivered(client: httpx.AsyncClient, status_url: str, timeout: float = 30) -> str:
    """Poll a status URL until its delivery completed; its last state."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        response = await client.get(status_url)
        state = response.json().get("state", "") if response.status_code == 200 else ""
        if state == "completed":
            break
        await asyncio.sleep(0.1)
    return state


@pytest.mark.process
@pytest.mark.sentinel
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_accepts_a_stopped_replica_did_not_confirm_say_so_and_run_once(
    upstream: Process, tmp_path: Path
) -> None:
    """Sentinel with `wait_for_replicas: 1` and the replica stopped (SIGSTOP): an accept
    is stored and queued on the master, but no replica confirms it. Every caller gets
    202 `accepted-unconfirmed` with the status URL (never a 503 that says the job was
    refused while it runs), and every such job is delivered exactly once. A sync
    claim the replica did not confirm is released, so its 503 is the truth: it never
    reached the upstream, and its retry runs it once."""
    setup = SentinelSetup().start()
    replica = setup.replica
    gateway: Process | None = None
    stopped = False
    try:
        sentinel = {"master": setup.master_name, "nodes": setup.nodes}
        store = {"sentinel": sentinel, "wait_for_replicas": 1, "socket_timeout": "1s"}
        gateway, base = start_gateway(tmp_path, upstream, store)
        sends = [unique("unconfirmed") for _ in range(8)]
        charges = [unique("unconfirmed-claim") for _ in range(4)]
        async with httpx.AsyncClient(base_url=base, timeout=15) as client:
            replica.signal(signal.SIGSTOP)
            stopped = True
            accepted = await asyncio.gather(
                *(client.post("/jobs/send", headers={"Idempotency-Key": k}) for k in sends)
            )
            refused = await asyncio.gather(
                *(client.post("/jobs/charge", headers={"Idempotency-Key": k}) for k in charges)
            )
            replica.signal(signal.SIGCONT)
            stopped = False
            docs = [json.loads(r.content) for r in accepted]
            urls = [d.get("status_url", "") for d in docs]  # a refusal names none
            states = await asyncio.gather(*(until_delivered(client, url) for url in urls if url))
            repeats = await asyncio.gather(
                *(client.post("/jobs/send", headers={"Idempotency-Key": k}) for k in sends)
            )
            retried = await asyncio.gather(
                *(client.post("/jobs/charge", headers={"Idempotency-Key": k}) for k in charges)
            )
    finally:
        if stopped:
            replica.signal(signal.SIGCONT)
        if gateway is not None:
            gateway.stop()
        setup.stop()
    for response, doc in zip(accepted, docs, strict=True):
        assert response.status_code == 202, (response, doc)
        assert response.headers["content-type"] == "application/problem+json", response.headers
        assert doc["type"] == PROBLEMS + "accepted-unconfirmed", doc
        assert doc["state"] == "queued" and response.headers["location"] == doc["status_url"]
        assert "stored" in doc["title"] and "replica" in doc["title"], doc
        assert "same key" in doc["detail"], doc
    assert states == ["completed"] * len(sends), states
    assert [r.status_code for r in repeats] == [202] * len(sends), repeats
    assert [await upstream_count(upstream, k) for k in sends] == [1] * len(sends)
    for response in refused:  # released: the refusal is the whole truth
        assert response.status_code == 503 and response.headers["retry-after"], response
        assert response.json()["type"] == PROBLEMS + "store-unavailable"
    assert [r.status_code for r in retried] == [200] * len(charges), retried
    assert [await upstream_count(upstream, k) for k in charges] == [1] * len(charges)


@pytest.mark.process
@pytest.mark.cluster
async def test_wait_for_replicas_works_on_a_cluster(
    redis_cluster_replicated: ClusterSetup, upstream: Process, tmp_path: Path
) -> None:
    """check-config accepts `wait_for_replicas` on a Redis Cluster, so it works there:
    keyed requests on a healthy cluster with a replica per primary are answered as on
    one server (200 and its replay; 202, confirmed), each job runs once. Each WAIT went
    to the primary that holds its key, after the script on the same connection: the
    cluster's replicas confirm every write."""
    nodes = [f"127.0.0.1:{node.port}" for node in redis_cluster_replicated.nodes]
    store = {"cluster": {"nodes": nodes}, "wait_for_replicas": 1, "socket_timeout": "2s"}
    gateway, base = start_gateway(tmp_path, upstream, store)
    charges, sends = (
        [unique("cw-claim") for _ in range(12)],
        [unique("cw-accept") for _ in range(12)],
    )
    try:
        async with httpx.AsyncClient(base_url=base, timeout=15) as client:
            first = [
                await client.post("/jobs/charge", headers={"Idempotency-Key": k}) for k in charges
            ]
            again = [
                await client.post("/jobs/charge", headers={"Idempotency-Key": k}) for k in charges
            ]
            accepted = [
                await client.post("/jobs/send", headers={"Idempotency-Key": k}) for k in sends
            ]
            urls = [
                r.json().get("status_url", "") if r.status_code == 202 else "" for r in accepted
            ]
            states = await asyncio.gather(*(until_delivered(client, url) for url in urls if url))
    finally:
        gateway.stop()
    assert [(r.status_code, r.headers["content-type"]) for r in first] == [
        (200, "application/json")
    ] * len(charges), [(r.status_code, r.text[:200]) for r in first]
    assert all(r.headers.get("idempotent-replayed") == "true" for r in again), again
    assert [(r.status_code, r.headers["content-type"]) for r in accepted] == [
        (202, "application/json")
    ] * len(sends), [(r.status_code, r.text[:200]) for r in accepted]
    assert states == ["completed"] * len(sends), states
    counts = [await upstream_count(upstream, k) for k in charges + sends]
    assert counts == [1] * len(counts), counts


# -- a failover after the replicas fell behind ------------------------------------------


def owner_of(cluster: ClusterSetup, name: str) -> RedisServer:
    """The primary that holds Redis key `name`."""
    slot = key_slot(name.encode())
    for node in cluster.masters():
        for line in redis_cli(node.port, "cluster", "nodes").splitlines():
            if "myself" not in line:
                continue
            for served in line.split()[8:]:
                low, _, high = served.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return node
    raise AssertionError(f"no primary holds slot {slot}")


def fill(port: int, tag: str, megabytes: int) -> None:
    """`megabytes` MiB written to the server at `port` under hash tag `tag`, so that a
    stopped replica falls that far behind: what it holds when it resumes ends well
    before anything written after this (its socket buffers cannot reach past it)."""
    value = b"x" * (1024 * 1024)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for i in range(megabytes):
            name = f"{{{tag}}}:filler-{i}".encode()
            sock.sendall(
                b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, len(value))
                + value
                + b"\r\n"
            )
        reply = b""
        while reply.count(b"+OK") < megabytes:
            reply += sock.recv(65536)


async def posted(client: httpx.AsyncClient, key: str, target: str) -> httpx.Response:
    """POST `target` with `key` until the gateway answers 202 (a failover answers 503
    until the store is back)."""
    deadline = time.monotonic() + 60
    while True:
        response = await client.post(target, headers={"Idempotency-Key": key})
        if response.status_code == 202 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.5)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "topology",
    [
        pytest.param("sentinel", marks=pytest.mark.sentinel),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ],
)
@pytest.mark.long
async def test_deliveries_run_once_when_the_master_dies_ahead_of_its_replica(
    upstream: Process, tmp_path: Path, topology: str
) -> None:
    """`wait_for_replicas: 1`; the replica of the master holding two deliveries is
    stopped (SIGSTOP) and falls 48 MiB behind; the master is then killed and the
    replica promoted. A: accepted while all was well, its first attempt answered 503
    Retry-After 3; its retry comes due while the replica is stopped. B: accepted while
    it was stopped (202 accepted-unconfirmed). No attempt goes out on a pick the
    replica does not hold: each is put back, unsent, until a replica confirms it. So
    after the failover (the old master back as the new one's replica) A runs once
    more (its job, once) and B, repeated as its 202 says, runs once; a pick sent
    unconfirmed would have been lost with the master, and its job run again."""
    prefix = unique("t") + ":"
    cluster: ClusterSetup | None = None
    sentinel: SentinelSetup | None = None
    if topology == "sentinel":
        sentinel = SentinelSetup().start()
        master, replica = sentinel.master, sentinel.replica
        store: dict[str, Any] = {
            "sentinel": {"master": sentinel.master_name, "nodes": sentinel.nodes}
        }
    else:
        cluster = ClusterSetup(replicas=1).start()
        store = {"cluster": {"nodes": cluster.addresses}}
    store.update(prefix=prefix, wait_for_replicas=1, socket_timeout="1s")

    def record_name(key: str) -> tuple[str, str]:
        digest = record_digest("send", "", key)
        tag = f"{bucket_of(digest):02x}"
        return f"{prefix}{{{tag}}}:{digest}", tag

    first, tag = unique("lag-a"), ""
    if cluster is not None:
        name, tag = record_name(first)
        master = owner_of(cluster, name)
        replica = next(n for n in cluster.replica_nodes() if primary_of(n) == master.port)
        second = unique("lag-b")
        while owner_of(cluster, record_name(second)[0]).port != master.port:
            second = unique("lag-b")
    else:
        second, tag = unique("lag-b"), "fill"
    gateway: Process | None = None
    gateway_log = ""
    states: list[str] = []
    stopped = False
    try:
        gateway, base = start_gateway(tmp_path, upstream, store)
        async with httpx.AsyncClient(base_url=base, timeout=15) as client:
            a = await client.post(
                "/jobs/send?fail_first=1&retry_after=3", headers={"Idempotency-Key": first}
            )
            assert (a.status_code, a.headers["content-type"]) == (202, "application/json"), a
            deadline = time.monotonic() + 15
            while await upstream_count(upstream, first) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            answered_at = time.monotonic()
            await asyncio.sleep(0.5)  # the retry's schedule reaches the replica
            replica.signal(signal.SIGSTOP)
            stopped = True
            fill(master.port, tag, 48)
            b = await client.post("/jobs/send", headers={"Idempotency-Key": second})
            assert b.status_code == 202 and b.json()["type"] == PROBLEMS + "accepted-unconfirmed"
            await asyncio.sleep(max(0.0, answered_at + 3 + 3 - time.monotonic()))
            while_behind = [await upstream_count(upstream, k) for k in (first, second)]
            master.kill()
            replica.signal(signal.SIGCONT)
            stopped = False
            deadline = time.monotonic() + 60
            while "role:master" not in redis_cli(replica.port, "info", "replication"):
                assert time.monotonic() < deadline, "no failover"
                await asyncio.sleep(0.2)
            if sentinel is not None:
                sentinel.restart_as_replica(master)
            else:
                master.start()  # rejoins as the replica of the one promoted
            deadline = time.monotonic() + 60
            while not replica_synced(master.port):
                assert time.monotonic() < deadline, "the old master never synced"
                await asyncio.sleep(0.2)
            repeat = await posted(client, second, "/jobs/send")
            assert repeat.status_code == 202, (repeat, repeat.text)
            states = [
                await until_delivered(client, r.json()["status_url"], 60) for r in (a, repeat)
            ]
    finally:
        if stopped:
            replica.signal(signal.SIGCONT)
        if gateway is not None:
            gateway.stop()
            gateway_log = gateway.output()
        if sentinel is not None:
            sentinel.stop()
        if cluster is not None:
            cluster.stop()
    # A: the 503, then its job once; B: once.
    runs = [await upstream_count(upstream, k) for k in (first, second)]
    assert runs == [2, 1], (
        f"runs {runs}; while the replica was behind: {while_behind}; states {states}\n"
        + "\n".join(line for line in gateway_log.splitlines() if "gateway.access" not in line)[
            -8000:
        ]
    )
    assert while_behind == [1, 0], f"sent on picks no replica held: {while_behind}"
    assert states == ["completed", "completed"], states
