"""One contract, every store (memory, PostgreSQL, SQLite, and Redis as one server,
Sentinel and Cluster, each with and without `wait_for_replicas`): what every method of
Store promises."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.errors import StoreError
from gateway.records import KeyRef, State, StoredRequest, StoredResponse
from gateway.store.base import CheckResult, ExpiredPolicy, NewDelivery, PickResult, Store
from gateway.store.notices import Due
from gateway.store.pages import MAX_PAGE_SIZE, READ_ROUNDS, InvalidCursor, Match, Page
from gateway.store.redis import RedisStore
from gateway.store.redis.admission import admission_key
from gateway.store.redis.listing import BUCKETS, bucket_of
from gateway.store.redis.record import text
from gateway.store.route_pauses import PauseMove
from gateway.store.transfer import ExportedRecord
from tests.conftest import EVERY_TOPOLOGY, unique
from tests.support.servers import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("store_kind", EVERY_TOPOLOGY)]

RESPONSE = StoredResponse(201, (("content-type", "application/json"),), b'{"ok":true}')


@pytest.fixture
async def store(make_store: Callable[[], Store]) -> AsyncIterator[Store]:
    s = make_store()
    await s.start()
    yield s
    await s.close()


def ref() -> KeyRef:
    digest = unique("d").replace("-", "").ljust(32, "0")[:32]
    return KeyRef(digest, "send-reminder", unique("key"))


async def test_claim_free_key_then_read_it(store: Store) -> None:
    r = ref()
    assert await store.claim(r, "run-1", "fp", 30) is None
    record = await store.claim(r, "run-2", "fp", 30)
    assert record is not None
    assert record.state is State.IN_FLIGHT
    assert record.run_id == "run-1"
    assert record.fingerprint == "fp"
    assert (record.route, record.key) == (r.route, r.key)
    assert record.lease_until_ms > record.now_ms


async def test_claim_repeated_by_same_run_returns_its_own_record(store: Store) -> None:
    r = ref()
    assert await store.claim(r, "run-1", "fp", 30) is None
    again = await store.claim(r, "run-1", "fp", 30)
    assert again is not None and again.run_id == "run-1" and again.state is State.IN_FLIGHT


async def test_concurrent_first_claims_one_wins(store: Store) -> None:
    """Claims of one new key at once (on PostgreSQL, over the pool's connections, each
    statement's snapshot taken before the others commit): exactly one takes it, and
    every other one reads the winner's record."""
    for _ in range(10):
        r = ref()
        runs = [f"run-{i}" for i in range(12)]
        got = await asyncio.gather(*(store.claim(r, run, "fp", 30) for run in runs))
        winners = [run for run, record in zip(runs, got, strict=True) if record is None]
        assert len(winners) == 1, winners
        assert all(g is None or g.run_id == winners[0] for g in got)
        held = await store.get(r)
        assert held is not None and held.run_id == winners[0]


async def test_complete_stores_response_for_replay(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    assert await store.complete(r, "run-1", RESPONSE, 60)
    record = await store.claim(r, "run-2", "fp", 30)
    assert record is not None and record.state is State.COMPLETED
    assert record.response == RESPONSE
    # Retried completion of the same run is success, not a second write.
    assert await store.complete(r, "run-1", RESPONSE, 60)


async def test_stale_run_cannot_complete_release_or_unresolve(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    assert not await store.complete(r, "other", RESPONSE, 60)
    assert not await store.release(r, "other", 60, "test")
    assert not await store.mark_unresolved(r, "other", "timeout")
    record = await store.get(r)
    assert record is not None and record.state is State.IN_FLIGHT and record.run_id == "run-1"


#: Seconds past any store's keeping: 10^16 ms (more than Redis's scripts take), 10^20 ms
#: (more than PostgreSQL's bigint). Config refuses both (config.units.MAX_DURATION).
TOO_LONG = (1e13, 1e17)


#: How a settling write is reached: (the record's state before it, the write).
SETTLING = [
    "complete", "complete-late", "check-done", "operator-done", "operator-retry", "release",
]  # fmt: skip


async def _settle_with(store: Store, way: str, r: KeyRef, ttl: float) -> None:
    """Make `r` ready for `way`'s write (a claim, then what it needs), then write."""
    if way == "release":  # a run with a story to keep: released as a tombstone
        await _settle_with(store, "operator-retry", r, 60)
    run = "run-2" if way == "release" else "run-1"
    assert await store.claim(r, run, "fp", 30) is None
    if way not in ("complete", "release"):
        assert await store.mark_unresolved(r, "run-1", "timed out")
    if way.startswith("operator"):
        assert (await store.operator_claim(r, "alice", False)).ok
    before = await store.get(r)
    assert before is not None
    try:
        if way.startswith("complete"):
            await store.complete(r, "run-1", RESPONSE, ttl)
        elif way == "release":
            await store.release(r, run, ttl, "not sent")
        elif way == "check-done":
            assert await store.begin_check(r, "run-1", 5, 0)
            await store.end_check(
                CheckResult(r, "run-1", "done", {"status": 200}, RESPONSE, ttl, 3600)
            )
        else:
            outcome = way.removeprefix("operator-")
            await store.operator_resolve(r, "alice", outcome, "checked", RESPONSE, ttl)
    except StoreError:
        after = await store.get(r)
        assert after is not None
        assert (after.state, after.response, after.history, after.holder) == (
            before.state,
            before.response,
            before.history,
            before.holder,
        ), after
    else:
        after = await store.get(r)
        assert after is not None
        settled = State.RELEASED if way in ("operator-retry", "release") else State.COMPLETED
        assert after.state is settled, after


@pytest.mark.parametrize("ttl", TOO_LONG, ids=["1e16ms", "1e20ms"])
async def test_a_settling_write_happens_whole_or_not_at_all(store: Store, ttl: float) -> None:
    """A completion (of a run in flight, a late answer, a check's "done", an operator's
    "done") or a release with its tombstone (an operator's "retry"), given a ttl the
    store cannot keep, either takes effect whole or is refused (StoreError) with the
    record as it was: the engine's log then says its lease turns it unresolved, which
    must be true. A Redis script does not undo its earlier commands when a later one
    fails: its PEXPIRE, refused after the record was written, left it completed with no
    expiry while the call failed."""
    for way in SETTLING:
        await _settle_with(store, way, ref(), ttl)


async def test_release_frees_key_for_next_run(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    assert await store.release(r, "run-1", 60, "test")
    assert await store.get(r) is None
    assert await store.claim(r, "run-2", "fp", 30) is None


async def test_release_does_not_touch_completed(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    await store.complete(r, "run-1", RESPONSE, 60)
    assert not await store.release(r, "run-1", 60, "test")
    record = await store.get(r)
    assert record is not None and record.state is State.COMPLETED


async def test_unresolved_keeps_reason_and_history_and_blocks_claims(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    assert await store.mark_unresolved(r, "run-1", "read timeout")
    assert await store.mark_unresolved(r, "run-1", "read timeout")  # repeated: same result
    assert not await store.release(r, "run-1", 60, "test")  # unresolved is never released by a run
    record = await store.claim(r, "run-2", "fp", 30)
    assert record is not None and record.state is State.UNRESOLVED
    assert record.reason == "read timeout"
    assert [e["event"] for e in record.history] == ["unknown"]


async def test_late_answer_completes_unresolved_record(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    await store.mark_unresolved(r, "run-1", "read timeout")
    assert await store.complete(r, "run-1", RESPONSE, 60)
    record = await store.get(r)
    assert record is not None and record.state is State.COMPLETED
    assert [e["event"] for e in record.history] == ["unknown", "completed"]


async def test_expired_lease_turns_unresolved_never_free(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 0.05)
    await asyncio.sleep(0.15)
    record = await store.claim(r, "run-2", "fp", 30)
    assert record is not None
    assert record.state is State.UNRESOLVED
    assert record.reason == "lease_expired"
    assert record.run_id == "run-1"
    # The dead run's late answer still counts; nobody else's does.
    assert not await store.complete(r, "run-2", RESPONSE, 60)
    assert await store.complete(r, "run-1", RESPONSE, 60)


async def test_completed_record_expires_after_ttl(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    await store.complete(r, "run-1", RESPONSE, 0.05)
    await asyncio.sleep(0.15)
    assert await store.get(r) is None
    assert await store.claim(r, "run-2", "fp", 30) is None


async def test_unresolved_record_does_not_expire(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 0.05)
    await store.mark_unresolved(r, "run-1", "read timeout")
    await asyncio.sleep(0.2)
    record = await store.get(r)
    assert record is not None and record.state is State.UNRESOLVED


@pytest.mark.parametrize("change", ["complete", "release", "unresolved"])
async def test_changes_notify_local_watchers(store: Store, change: str) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    with store.notifier.watch(r.digest) as event:
        waiting = await store.claim(r, "run-2", "fp", 30)  # a waiter saw it in flight
        assert waiting is not None and waiting.state is State.IN_FLIGHT
        if change == "complete":
            await store.complete(r, "run-1", RESPONSE, 60)
        elif change == "release":
            await store.release(r, "run-1", 60, "test")
        else:
            await store.mark_unresolved(r, "run-1", "timeout")
        await asyncio.wait_for(event.wait(), 5)


async def test_info_reports_the_eviction_policy_and_persistence(
    store: Store, store_kind: str
) -> None:
    """The stores the tests start never evict; Redis ones run without AOF, the
    PostgreSQL one commits to disk (fsync, synchronous_commit), as the SQLite one does
    (synchronous=FULL), the memory store has nothing to persist."""
    info = await store.info()
    assert info.maxmemory_policy == "noeviction" and not info.evicts
    assert info.aof == {"memory": "n/a", "postgres": "yes", "sqlite": "yes"}.get(store_kind, "no")
    assert info.refusal(allow_eviction=False) == "" and not info.error
    assert await store.info() == info  # a second look changes nothing


async def test_binary_bodies_and_headers_round_trip(store: Store) -> None:
    r = ref()
    body = bytes(range(256)) * 10 + b"\n\n{"
    response = StoredResponse(200, (("content-encoding", "gzip"), ("x-a", "1"), ("x-a", "2")), body)
    await store.claim(r, "run-1", "fp", 30)
    await store.complete(r, "run-1", response, 60)
    record = await store.get(r)
    assert record is not None and record.response == response


# -- unknown outcomes: policies, checks, operators ---------------------------------


async def unresolved(store: Store, run: str = "run-1") -> KeyRef:
    r = ref()
    await store.claim(r, run, "fp", 30)
    assert await store.mark_unresolved(r, run, "read timeout")
    return r


async def test_mark_unresolved_can_park_directly(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    assert await store.mark_unresolved(r, "run-1", "read timeout", park=True)
    record = await store.get(r)
    assert record is not None and record.state is State.PARKED
    assert [e["event"] for e in record.history] == ["unknown", "parked"]


@pytest.mark.parametrize(
    ("policy", "state"),
    [("unresolved", State.UNRESOLVED), ("parked", State.PARKED), ("release", None)],
)
async def test_expired_lease_follows_route_policy(
    store: Store, policy: str, state: State | None
) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 0.05)
    await asyncio.sleep(0.15)
    record = await store.claim(r, "run-2", "fp", 30, policy)  # type: ignore[arg-type]
    if state is None:  # released: this claim took the key, carrying the story on
        assert record is None
        now = await store.get(r)
        assert now is not None and now.run_id == "run-2" and now.state is State.IN_FLIGHT
        assert [e["event"] for e in now.history] == ["released"]
    else:
        assert record is not None and record.state is state and record.reason == "lease_expired"


async def test_sweep_expires_dead_leases_only(store: Store) -> None:
    dead, alive = ref(), ref()
    await store.claim(dead, "run-1", "fp", 0.05)
    await store.claim(alive, "run-2", "fp", 30)
    await asyncio.sleep(0.15)
    changed = await store.expire_leases(lambda route: "unresolved")
    assert [(c.digest, s) for c, s in changed] == [(dead.digest, "unresolved")]
    assert (await store.get(dead)).state is State.UNRESOLVED  # type: ignore[union-attr]
    assert (await store.get(alive)).state is State.IN_FLIGHT  # type: ignore[union-attr]
    assert await store.expire_leases(lambda route: "unresolved") == []


async def test_one_check_at_a_time_and_once_per_interval(store: Store) -> None:
    r = await unresolved(store)
    assert await store.begin_check(r, "run-1", 30, 0)
    assert not await store.begin_check(r, "run-1", 30, 0)  # one at a time
    assert (
        await store.end_check(
            CheckResult(r, "run-1", "inconclusive", {"status": 500}, None, 60, 3600)
        )
        == "unresolved"
    )
    assert not await store.begin_check(r, "run-1", 30, 60)  # checked less than 60 s ago
    assert await store.begin_check(r, "run-1", 30, 0)
    assert not await store.begin_check(r, "wrong-run", 30, 0)


async def test_check_done_completes_with_the_reconciled_response(store: Store) -> None:
    r = await unresolved(store)
    assert await store.begin_check(r, "run-1", 30, 0)
    reconciled = StoredResponse(200, (), b'{"reconciled":true}', origin="reconciled")
    assert (
        await store.end_check(
            CheckResult(r, "run-1", "done", {"status": 200}, reconciled, 60, 3600)
        )
        == "completed"
    )
    record = await store.claim(r, "run-2", "fp", 30)
    assert record is not None and record.state is State.COMPLETED
    assert record.response == reconciled
    assert [e["event"] for e in record.history] == ["unknown", "reconcile"]
    assert record.history[-1]["answer"] == {"status": 200}


async def test_check_not_done_releases_and_next_claim_keeps_history(store: Store) -> None:
    r = await unresolved(store)
    assert await store.begin_check(r, "run-1", 30, 0)
    assert (
        await store.end_check(CheckResult(r, "run-1", "not_done", {"status": 404}, None, 60, 3600))
        == "released"
    )
    assert await store.claim(r, "run-2", "fp", 30) is None
    assert await store.complete(r, "run-2", RESPONSE, 60)
    record = await store.get(r)
    assert record is not None and record.state is State.COMPLETED
    assert [e["event"] for e in record.history] == ["unknown", "reconcile", "released", "completed"]


async def test_inconclusive_check_parks_after_park_after(store: Store) -> None:
    r = await unresolved(store)
    await asyncio.sleep(0.1)
    assert await store.begin_check(r, "run-1", 30, 0)
    assert (
        await store.end_check(
            CheckResult(r, "run-1", "inconclusive", {"error": "timeout"}, None, 60, 0.05)
        )
        == "parked"
    )
    record = await store.get(r)
    assert record is not None and record.state is State.PARKED
    assert record.reconcile == {"error": "timeout"}


async def test_end_check_after_someone_else_settled_changes_nothing(store: Store) -> None:
    r = await unresolved(store)
    assert await store.begin_check(r, "run-1", 30, 0)
    assert await store.park(r, "test")
    assert (
        await store.end_check(CheckResult(r, "run-1", "not_done", {"status": 404}, None, 60, 3600))
        == ""
    )
    assert (await store.get(r)).state is State.PARKED  # type: ignore[union-attr]


async def test_two_operators_one_wins_takeover_is_recorded(store: Store) -> None:
    r = await unresolved(store)
    await store.park(r, "test")
    alice = await store.operator_claim(r, "alice", force=False)
    assert alice.ok and alice.holder == "alice" and alice.holder_since_ms > 0
    bob = await store.operator_claim(r, "bob", force=False)
    assert not bob.ok and bob.refused == "held" and bob.holder == "alice"
    assert bob.holder_since_ms == alice.holder_since_ms
    assert (await store.operator_claim(r, "alice", force=False)).ok  # holder again: fine
    refused = await store.operator_resolve(r, "bob", "done", "", None, 60)
    assert not refused.ok and refused.refused == "holder" and refused.holder == "alice"
    taken = await store.operator_claim(r, "bob", force=True)
    assert taken.ok and taken.holder == "bob"
    record = await store.get(r)
    assert record is not None and record.state is State.CLAIMED and record.holder == "bob"
    claims = [e for e in record.history if e["event"] == "claimed"]
    assert [c["operator"] for c in claims] == ["alice", "bob"]
    assert claims[1]["takeover_from"] == "alice"


@pytest.mark.parametrize("outcome", ["done", "retry"])
async def test_operator_resolve(store: Store, outcome: str) -> None:
    r = await unresolved(store)
    assert (await store.operator_claim(r, "alice", force=False)).ok
    response = StoredResponse(200, (), b"resolved", origin="operator")
    result = await store.operator_resolve(r, "alice", outcome, "checked the ledger", response, 60)
    assert result.ok
    record = await store.get(r)
    assert record is not None
    if outcome == "done":
        assert result.state == "completed" and record.state is State.COMPLETED
        assert record.response == response
    else:
        assert result.state == "released" and record.state is State.RELEASED
        assert await store.claim(r, "run-2", "fp", 30) is None
    resolved = [e for e in record.history if e["event"] == "resolved"]
    assert resolved == [
        {
            "at_ms": resolved[0]["at_ms"],
            "event": "resolved",
            "operator": "alice",
            "outcome": outcome,
            "note": "checked the ledger",
        }
    ]


async def test_operator_moves_refused_from_wrong_states(store: Store) -> None:
    r = ref()
    assert (await store.operator_claim(r, "alice", force=False)).refused == "missing"
    await store.claim(r, "run-1", "fp", 30)
    claim = await store.operator_claim(r, "alice", force=True)
    assert not claim.ok and claim.refused == "state" and claim.state == "in_flight"
    resolve = await store.operator_resolve(r, "alice", "done", "", None, 60)
    assert not resolve.ok and resolve.state == "in_flight"


async def test_open_records_and_stats_come_from_indexes(store: Store) -> None:
    a, b = await unresolved(store), await unresolved(store)
    await store.park(b, "test")
    c = ref()
    await store.claim(c, "run-1", "fp", 30)
    records = await store.open_records(frozenset({State.UNRESOLVED, State.PARKED, State.IN_FLIGHT}))
    found = {r.digest: r.state for r in records}
    assert found[a.digest] is State.UNRESOLVED
    assert found[b.digest] is State.PARKED
    assert found[c.digest] is State.IN_FLIGHT
    stats = {(s.route, s.state): s for s in await store.stats()}
    assert stats[("send-reminder", State.UNRESOLVED)].count >= 1
    assert stats[("send-reminder", State.PARKED)].oldest_seconds >= 0
    assert ("send-reminder", State.IN_FLIGHT) not in stats


async def test_the_sweeps_listing_is_the_unresolved_of_one_route_oldest_first(
    store: Store,
) -> None:
    """The sweep's work list: a route's unresolved records only (not the parked, in
    flight or done), the longest unresolved first, a page at a time."""
    backlog = []
    for _ in range(5):
        backlog.append(await unresolved(store))
        await asyncio.sleep(0.003)  # each its own millisecond: the order is by age
    parked = await unresolved(store)
    await store.park(parked, "test")
    flying, done = ref(), ref()
    await store.claim(flying, "run-1", "fp", 30)
    await store.claim(done, "run-1", "fp", 30)
    await store.complete(done, "run-1", RESPONSE, 60)
    unresolved_only = frozenset({State.UNRESOLVED})
    route = backlog[0].route
    first = await store.list_records(unresolved_only, route=route, limit=3)
    rest = await store.list_records(unresolved_only, route=route, cursor=first.next, limit=3)
    listed = [*first.records, *rest.records]
    assert [r.key for r in listed] == [r.key for r in backlog]
    assert all(r.state is State.UNRESOLVED for r in listed)
    assert not rest.next


# -- deliveries: accept, pick, retry_later ------------------------------------------

REQUEST = StoredRequest(
    "POST", "/jobs/send?period=2026-11", (("content-type", "application/json"),), b'{"n":1}'
)
TOKEN = "Qk3-9w_0123456789abcd"
ATTEMPT = {"result": "status", "status": 503}


class Heard:
    """The store's delivery notices, as a worker would hear them (with `notices=False`,
    as a worker without lanes does: `lost` only)."""

    def __init__(self, store: Store, notices: bool = True) -> None:
        self.due: list[Due] = []
        self.taken: list[str] = []
        self.lost = 0
        self.stop = store.due.listen(
            self.due.append, self.taken.append, self.on_lost, notices=notices
        )

    def on_lost(self) -> None:
        self.lost += 1

    async def subscribed(self, store: Store) -> Heard:
        """Once the store hears its notices (Redis subscribes in the background)."""
        subscribed = getattr(store, "subscribed", None)
        if subscribed is not None:
            await asyncio.wait_for(subscribed.wait(), 10)
        return self

    async def until(self, found: Callable[[], bool]) -> None:
        # Pub/sub delivers in another task (on a cluster, one per shard): a bounded
        # wait, 10 s, since one CI-like run under load missed a notice at 5 s.
        deadline = asyncio.get_running_loop().time() + 10
        while asyncio.get_running_loop().time() < deadline:
            if found():
                return
            await asyncio.sleep(0.05)
        if found():
            return
        raise AssertionError("the notice never came")


async def accepted(store: Store, run: str = "run-a") -> KeyRef:
    r = ref()
    result = await store.accept(NewDelivery(r, run, "fp", REQUEST, TOKEN, origin="replica-a"))
    assert result.outcome == "queued" and result.record is None and result.now_ms > 0
    return r


async def picked(store: Store, r: KeyRef, run: str = "run-1", **limits: Any) -> PickResult:
    limits = {"lease": 30, "max_attempts": 8, "replica": "replica-b", **limits}
    return await store.pick(r.route, r, run, **limits)


async def test_accept_queues_a_free_key_with_its_request_and_token(store: Store) -> None:
    r = await accepted(store)
    record = await store.get(r)
    assert record is not None and record.state is State.QUEUED and record.delivery
    assert (record.run_id, record.fingerprint, record.route, record.key) == (
        "run-a",
        "fp",
        r.route,
        r.key,
    )
    assert record.attempts == 0 and 0 < record.due_ms <= record.now_ms
    assert record.token == TOKEN and TOKEN not in str(record.to_json())
    assert await store.get_request(r) == REQUEST
    # The same accept retried finds its own record; the caller counts it as queued.
    again = await store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))
    assert again.outcome == "exists" and again.record is not None
    assert again.record.run_id == "run-a" and again.record.state is State.QUEUED


async def test_delivery_token_is_the_token_alone(store: Store) -> None:
    """A delivery's token, read without its record, for as long as the record lasts;
    "" for a key that is no delivery, a missing one, and one past its expiry."""
    r = await accepted(store)
    assert await store.delivery_token(r) == TOKEN
    await picked(store, r)
    assert await store.complete(r, "run-1", RESPONSE, 0.3)
    assert await store.delivery_token(r) == TOKEN
    sync = ref()
    await store.claim(sync, "run-1", "fp", 30)
    assert await store.delivery_token(sync) == ""
    assert await store.delivery_token(ref()) == ""
    await asyncio.sleep(0.5)
    assert await store.delivery_token(r) == ""


async def test_accept_never_overwrites_an_existing_key(store: Store) -> None:
    r = await accepted(store)
    other = StoredRequest("POST", "/other", (), b"other")
    found = await store.accept(NewDelivery(r, "run-b", "fp2", other, "another-token-000000000"))
    assert found.outcome == "exists" and found.record is not None
    assert found.record.run_id == "run-a" and found.record.fingerprint == "fp"
    assert found.record.token == TOKEN and await store.get_request(r) == REQUEST
    # Nor a sync key: in flight or completed, it stays what it is, with no request.
    sync = ref()
    await store.claim(sync, "run-1", "fp", 30)
    held = await store.accept(NewDelivery(sync, "run-b", "fp", REQUEST, TOKEN))
    assert held.outcome == "exists" and held.record is not None
    assert held.record.state is State.IN_FLIGHT and not held.record.delivery
    await store.complete(sync, "run-1", RESPONSE, 60)
    done = await store.accept(NewDelivery(sync, "run-b", "fp", REQUEST, TOKEN, limit=0))
    assert done.outcome == "exists" and done.record is not None
    assert done.record.response == RESPONSE
    assert await store.get_request(sync) is None


async def test_accept_refused_admission_stores_nothing(store: Store) -> None:
    r = ref()
    full = await store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN, limit=0))
    assert full.outcome == "full" and full.record is None
    assert await store.get(r) is None and await store.get_request(r) is None
    assert await store.queue_stats() == []


async def test_refused_admission_still_settles_a_dead_lease(store: Store) -> None:
    """A key whose gateway died is what its route's policy says before anything else,
    even when the queue is full: under release it is released (its story kept)."""
    r = ref()
    await store.claim(r, "run-1", "fp", 0.05)
    await asyncio.sleep(0.15)
    full = await store.accept(
        NewDelivery(r, "run-a", "fp", REQUEST, TOKEN, limit=0, expired="release")
    )
    assert full.outcome == "full" and full.record is None
    record = await store.get(r)
    assert record is not None and record.state is State.RELEASED
    assert [e["event"] for e in record.history] == ["released"]


async def test_accepted_delivery_is_listed_counted_and_announced(store: Store) -> None:
    heard = await Heard(store).subscribed(store)
    r = await accepted(store)
    candidates, now = await store.due_candidates(r.route, 10)
    assert [c.ref.digest for c in candidates] == [r.digest] and now > 0
    assert candidates[0].due_ms <= now
    [stat] = await store.queue_stats()
    assert (stat.route, stat.queued, stat.retrying) == (r.route, 1, 0)
    assert stat.oldest_wait_seconds >= 0
    await heard.until(lambda: any(d.ref.digest == r.digest for d in heard.due))
    [due] = [d for d in heard.due if d.ref.digest == r.digest]
    assert due.origin == "replica-a" and due.ref.route == r.route and due.now_ms >= due.due_ms
    assert (await store.due_candidates("another-route", 10))[0] == []


async def test_picked_delivery_is_not_picked_again(store: Store) -> None:
    heard = await Heard(store).subscribed(store)
    r = await accepted(store)
    first = await picked(store, r)
    assert first.why == "" and first.record is not None
    assert first.record.state is State.IN_FLIGHT and first.record.run_id == "run-1"
    assert first.record.attempts == 1 and first.record.lease_until_ms > first.now_ms
    assert store.codec.decode_request(r.digest, first.request) == REQUEST
    attempt = first.record.history[-1]
    assert (attempt["event"], attempt["attempt"], attempt["run_id"], attempt["replica"]) == (
        "attempt",
        1,
        "run-1",
        "replica-b",
    )
    second = await picked(store, r, "run-2")
    assert second.record is None and second.why == "gone"
    record = await store.get(r)
    assert record is not None and record.run_id == "run-1" and record.attempts == 1
    assert (await store.due_candidates(r.route, 10))[0] == []
    assert await store.queue_stats() == []
    await heard.until(lambda: r.digest in heard.taken)


async def test_a_pick_repeated_by_its_own_run_is_that_pick(store: Store) -> None:
    """A pick whose reply was lost is repeated with the same run id (redis-py retries a
    command once; the worker retries a pick that failed): it finds the record it took,
    in flight for its run, and is that pick, with its request. "gone" would leave the
    record in flight, never sent, until its lease made it an unknown outcome."""
    r = await accepted(store)
    await picked(store, r)
    again = await picked(store, r)
    assert again.why == "" and again.record is not None, again
    record = again.record
    assert (record.state, record.run_id, record.attempts) == (State.IN_FLIGHT, "run-1", 1)
    assert store.codec.decode_request(r.digest, again.request) == REQUEST
    assert [e["event"] for e in record.history] == ["attempt"]
    other = await picked(store, r, "run-2")
    assert other.record is None and other.why == "gone"


@pytest.fixture
def replicas(store_kind: str, request: pytest.FixtureRequest) -> list[RedisServer]:
    """The replicas a `+wait` store's WAIT counts (a Cluster's: every primary's)."""
    if store_kind == "redis+wait":
        return [request.getfixturevalue("redis_replicated").replica]
    if store_kind == "sentinel+wait":
        return [request.getfixturevalue("redis_sentinel").replica]
    if store_kind == "cluster+wait":
        return list(request.getfixturevalue("redis_cluster_replicated").replica_nodes())
    return []


@contextlib.contextmanager
def stopped(replicas: list[RedisServer]) -> Iterator[None]:
    """The replicas stopped (SIGSTOP): they hold nothing written meanwhile."""
    for replica in replicas:
        replica.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for replica in replicas:
            replica.signal(signal.SIGCONT)


async def test_a_pick_the_replicas_did_not_confirm_is_put_back_unsent(
    store: Store, replicas: list[RedisServer]
) -> None:
    """With wait_for_replicas, a pick is the write that lets an attempt reach the
    upstream: one the replicas did not confirm could be lost by a failover, and the
    attempt made again. It is put back where it was, unsent: due again soon, the
    attempt not counted, its history saying why (consecutive ones are one event), and
    announced; never left in flight for its lease, never an unknown outcome. Once the
    replicas confirm again, it is picked. A store with no replicas has nothing to
    confirm: memory, PostgreSQL (whose standbys a commit waits for when
    synchronous_standby_names names them), and Redis without the setting."""
    if not replicas:
        pytest.skip("no replicas asked for: a pick has nothing to wait for")
    heard = await Heard(store).subscribed(store)
    r = await accepted(store)  # the replicas confirm it
    with stopped(replicas):
        unsent = await picked(store, r)
        early = await picked(store, r, "run-2")
    assert unsent.record is None and unsent.why == "unconfirmed", unsent
    assert unsent.due_ms > unsent.now_ms, unsent
    assert early.record is None and early.why == "not_due", early
    record = await store.get(r)
    assert record is not None and record.state is State.QUEUED, record
    assert record.attempts == 0 and record.due_ms == unsent.due_ms
    [event] = record.history
    assert event["event"] == "put_back" and "replicas confirmed" in event["reason"], event
    assert await store.get_request(r) == REQUEST
    [stat] = await store.queue_stats()
    assert (stat.queued, stat.retrying) == (1, 0)
    assert [c.ref.digest for c in (await store.due_candidates(r.route, 10))[0]] == [r.digest]
    await heard.until(lambda: any(d.due_ms == unsent.due_ms for d in heard.due))
    await asyncio.sleep((unsent.due_ms - unsent.now_ms) / 1000 + 0.05)
    sent = await picked(store, r, "run-3")
    assert sent.record is not None and sent.record.attempts == 1, sent
    assert [e["event"] for e in sent.record.history] == ["put_back", "attempt"]
    # A retrying delivery goes back to retrying, its attempts as they were.
    assert await store.retry_later(r, "run-3", 0, ATTEMPT)
    with stopped(replicas):
        again = await picked(store, r, "run-4")
    assert again.why == "unconfirmed", again
    record = await store.get(r)
    assert record is not None and record.state is State.RETRYING and record.attempts == 1
    assert record.last_attempt == ATTEMPT
    events = [e["event"] for e in record.history]
    assert events == ["put_back", "attempt", "retry_scheduled", "put_back"], events


async def test_pick_never_claims_a_delivery_that_is_not_due(store: Store) -> None:
    r = await accepted(store)
    await picked(store, r)
    assert await store.retry_later(r, "run-1", 30, ATTEMPT)
    early = await picked(store, r, "run-2")
    assert early.record is None and early.why == "not_due"
    assert early.due_ms >= early.now_ms + 29_000
    assert early.next is not None and early.next.ref.digest == r.digest
    record = await store.get(r)
    assert record is not None and record.state is State.RETRYING and record.run_id == "run-1"


async def test_a_delayed_accept_is_never_picked_before_its_due_time(store: Store) -> None:
    heard = await Heard(store).subscribed(store)
    r = ref()
    accepted_ = await store.accept(
        NewDelivery(r, "run-a", "fp", REQUEST, TOKEN, origin="replica-a", delay_ms=30_000)
    )
    assert accepted_.outcome == "queued"
    record = await store.get(r)
    assert record is not None and record.state is State.QUEUED and record.attempts == 0
    assert record.due_ms == accepted_.now_ms + 30_000 and record.created_ms == accepted_.now_ms
    early = await picked(store, r)
    assert early.record is None and early.why == "not_due"
    assert early.due_ms == record.due_ms
    # A pick of another hint (a search of the route, where the store can) passes it by.
    assert (await picked(store, ref(), "run-2")).record is None
    [candidate], now = await store.due_candidates(r.route, 10)
    assert candidate.ref.digest == r.digest and candidate.due_ms == record.due_ms > now
    [stat] = await store.queue_stats()
    assert (stat.queued, stat.retrying, stat.oldest_wait_seconds) == (1, 0, 0)
    # A repeat keeps the first due time, whatever it asks for.
    again = await store.accept(NewDelivery(r, "run-b", "fp", REQUEST, TOKEN, delay_ms=0))
    assert again.outcome == "exists" and again.record is not None
    assert again.record.due_ms == record.due_ms and again.record.run_id == "run-a"
    await heard.until(lambda: any(d.ref.digest == r.digest for d in heard.due))
    [due] = [d for d in heard.due if d.ref.digest == r.digest]
    assert due.due_ms == record.due_ms and due.now_ms == accepted_.now_ms
    after = await store.get(r)
    assert after is not None and after.state is State.QUEUED and after.attempts == 0
    assert [e["event"] for e in after.history] == []  # waiting is no attempt
    # A short delay: due once it passes, then picked as any queued delivery is.
    soon = ref()
    await store.accept(NewDelivery(soon, "run-c", "fp", REQUEST, TOKEN, delay_ms=150))
    assert (await picked(store, soon, "run-3")).why == "not_due"
    await asyncio.sleep(0.2)
    taken = await picked(store, soon, "run-4")
    assert taken.record is not None and taken.record.attempts == 1


async def test_pick_never_starts_an_attempt_over_the_limit(store: Store) -> None:
    r = await accepted(store)
    await picked(store, r, max_attempts=1)
    assert await store.retry_later(r, "run-1", 0, ATTEMPT)
    over = await picked(store, r, "run-2", max_attempts=1, park_reason="attempts exhausted")
    assert over.record is None and over.why == "exhausted"
    record = await store.get(r)
    assert record is not None and record.state is State.PARKED
    assert record.attempts == 1 and record.reason == "attempts exhausted"
    assert await store.get_request(r) == REQUEST  # kept for a person's retry
    fresh = await accepted(store)  # a limit lowered to 0: parked before any attempt
    assert (await picked(store, fresh, max_attempts=0, park_reason="gone")).why == "exhausted"


async def test_stale_run_cannot_schedule_a_retry(store: Store) -> None:
    r = await accepted(store)
    await picked(store, r)
    assert not await store.retry_later(r, "run-a", 1, ATTEMPT)  # the acceptance's run id
    assert await store.retry_later(r, "run-1", 1, ATTEMPT)
    assert await store.retry_later(r, "run-1", 1, ATTEMPT)  # the same call, retried
    assert not await store.retry_later(r, "run-1", 1, {"result": "not_sent"})
    record = await store.get(r)
    assert record is not None and record.state is State.RETRYING
    assert record.last_attempt == ATTEMPT and record.due_ms > record.now_ms
    assert [e["event"] for e in record.history] == ["attempt", "retry_scheduled"]
    sync = ref()  # a sync key is never scheduled
    await store.claim(sync, "run-1", "fp", 30)
    assert not await store.retry_later(sync, "run-1", 1, ATTEMPT)


async def test_retried_delivery_is_due_again_and_picked(store: Store) -> None:
    heard = await Heard(store).subscribed(store)
    r = await accepted(store)
    await picked(store, r)
    assert await store.retry_later(r, "run-1", 0.05, ATTEMPT, origin="replica-b")
    await heard.until(lambda: any(d.origin == "replica-b" for d in heard.due))
    [due] = [d for d in heard.due if d.origin == "replica-b"]
    assert due.ref.digest == r.digest and due.due_ms >= due.now_ms + 50
    [stat] = await store.queue_stats()
    assert (stat.queued, stat.retrying) == (0, 1)
    await asyncio.sleep(0.1)
    again = await picked(store, r, "run-2")
    assert again.record is not None and again.record.attempts == 2
    assert again.record.last_attempt == ATTEMPT
    assert [e["event"] for e in again.record.history] == ["attempt", "retry_scheduled", "attempt"]


async def test_an_uncounted_retry_gives_back_the_attempt_its_pick_counted(store: Store) -> None:
    """A paused route's refused probe is not an attempt of its delivery: retrying, its
    attempts down by one, so one attempt allowed and only probes made, it is never
    parked for exhaustion."""
    probe = {"result": "probe_refused", "status": 503}
    r = await accepted(store)
    first = await picked(store, r, max_attempts=1)
    assert first.record is not None and first.record.attempts == 1
    assert await store.retry_later(r, "run-1", 0, probe, uncounted=True)
    assert await store.retry_later(r, "run-1", 0, probe, uncounted=True)  # repeated: once
    record = await store.get(r)
    assert record is not None and record.state is State.RETRYING and record.attempts == 0
    assert record.last_attempt == probe
    assert [e["event"] for e in record.history] == ["attempt", "retry_scheduled"]
    [stat] = await store.queue_stats()
    assert (stat.queued, stat.retrying) == (0, 1)
    again = await picked(store, r, "run-2", max_attempts=1)
    assert again.record is not None and again.record.attempts == 1, again
    assert await store.retry_later(r, "run-2", 0, probe, uncounted=True)
    third = await picked(store, r, "run-3", max_attempts=1)
    assert third.record is not None and third.record.attempts == 1, third
    # A counted retry after it keeps its attempt: the next pick is over the limit.
    assert await store.retry_later(r, "run-3", 0, ATTEMPT)
    over = await picked(store, r, "run-4", max_attempts=1)
    assert over.record is None and over.why == "exhausted", over


async def test_retry_later_without_delay_parks_with_the_reason(store: Store) -> None:
    r = await accepted(store)
    await picked(store, r)
    last = {**ATTEMPT, "reason": "attempts exhausted after 8"}
    assert await store.retry_later(r, "run-1", None, last)
    record = await store.get(r)
    assert record is not None and record.state is State.PARKED
    assert record.reason == "attempts exhausted after 8" and record.last_attempt == last
    assert await store.get_request(r) == REQUEST


@pytest.mark.parametrize("settle", ["complete", "release"])
async def test_settling_a_delivery_deletes_its_request(store: Store, settle: str) -> None:
    r = await accepted(store)
    await picked(store, r)
    if settle == "complete":
        assert await store.complete(r, "run-1", RESPONSE, 60, {"result": "completed"})
    else:
        assert await store.release(r, "run-1", 60, "test")
    assert await store.get_request(r) is None
    record = await store.get(r)
    assert record is not None
    if settle == "complete":
        assert record.state is State.COMPLETED and record.response == RESPONSE
        assert record.last_attempt == {"result": "completed"} and record.token == TOKEN
    else:
        assert record.state is State.RELEASED
    assert await store.queue_stats() == []


@pytest.mark.parametrize("policy", ["unresolved", "parked", "release"])
async def test_expired_delivery_lease_is_never_retried_or_dropped(
    store: Store, policy: ExpiredPolicy
) -> None:
    r = await accepted(store)
    await picked(store, r, lease=0.05)
    await asyncio.sleep(0.15)
    [(changed, state)] = await store.expire_leases(lambda route: policy)
    expected = "parked" if policy == "parked" else "unresolved"
    assert changed.digest == r.digest and state == expected
    record = await store.get(r)
    assert record is not None and record.state is State(expected)
    assert record.reason == "lease_expired" and record.run_id == "run-1"
    assert await store.get_request(r) == REQUEST
    assert await store.queue_stats() == []


@pytest.mark.parametrize(("result", "retry_in", "after"), [
    ("not_done", 0.0, "retrying"), ("not_done", None, "parked"), ("done", None, "completed"),
])  # fmt: skip
async def test_a_check_decides_an_unresolved_delivery(
    store: Store, result: str, retry_in: float | None, after: str
) -> None:
    r = await accepted(store)
    await picked(store, r)
    assert await store.mark_unresolved(r, "run-1", "read timeout")
    assert await store.begin_check(r, "run-1", 30, 0)
    answer = {"status": 404 if result == "not_done" else 200}
    response = RESPONSE if result == "done" else None
    got = await store.end_check(
        CheckResult(r, "run-1", result, answer, response, 60, 3600, retry_in)
    )
    assert got == after
    record = await store.get(r)
    assert record is not None and record.state is State(after)
    kept = await store.get_request(r)
    assert kept == (None if after == "completed" else REQUEST)
    if after == "retrying":
        again = await picked(store, r, "run-2")
        assert again.record is not None and again.record.attempts == 2


@pytest.mark.parametrize("outcome", ["retry", "done"])
async def test_operator_resolves_a_parked_delivery(store: Store, outcome: str) -> None:
    heard = await Heard(store).subscribed(store)
    r = await accepted(store)
    await picked(store, r, max_attempts=1)
    assert await store.retry_later(r, "run-1", None, ATTEMPT)
    assert (await store.operator_claim(r, "alice", force=False)).ok
    response = StoredResponse(200, (), b"by hand", origin="operator")
    result = await store.operator_resolve(r, "alice", outcome, "", response, 60)
    record = await store.get(r)
    assert record is not None and result.ok
    if outcome == "done":
        assert result.state == "completed" and await store.get_request(r) is None
        return
    assert result.state == "queued" and record.state is State.QUEUED
    assert record.attempts == 0 and not record.holder and record.due_ms <= record.now_ms
    await heard.until(lambda: len([d for d in heard.due if d.ref.digest == r.digest]) == 2)
    again = await picked(store, r, "run-2", max_attempts=1)
    assert again.record is not None and again.record.attempts == 1


async def test_operators_cannot_claim_queued_or_retrying_deliveries(store: Store) -> None:
    r = await accepted(store)
    assert (await store.operator_claim(r, "alice", force=True)).state == "queued"
    await picked(store, r)
    await store.retry_later(r, "run-1", 30, ATTEMPT)
    refused = await store.operator_claim(r, "alice", force=True)
    assert not refused.ok and refused.refused == "state" and refused.state == "retrying"


async def test_queue_reads_split_by_route_and_state_earliest_first(store: Store) -> None:
    first, second = await accepted(store), await accepted(store)
    other = KeyRef(ref().digest, "other-route", "k")
    await store.accept(NewDelivery(other, "run-a", "fp", REQUEST, TOKEN))
    await picked(store, second)
    await store.retry_later(second, "run-1", 30, ATTEMPT)
    stats = {s.route: s for s in await store.queue_stats()}
    assert (stats[first.route].queued, stats[first.route].retrying) == (1, 1)
    assert (stats["other-route"].queued, stats["other-route"].retrying) == (1, 0)
    candidates, _ = await store.due_candidates(first.route, 10)
    assert [c.ref.digest for c in candidates] == [first.digest, second.digest]
    assert candidates[0].due_ms < candidates[1].due_ms


async def test_open_records_lists_queued_and_retrying_from_the_due_indexes(store: Store) -> None:
    queued, retrying, gone = await accepted(store), await accepted(store), await accepted(store)
    await picked(store, retrying)
    await store.retry_later(retrying, "run-1", 30, ATTEMPT)
    await picked(store, gone)  # in flight: no longer in a due index
    both = await store.open_records(frozenset({State.QUEUED, State.RETRYING}))
    found = {r.digest: r.state for r in both}
    assert found[queued.digest] is State.QUEUED and found[retrying.digest] is State.RETRYING
    assert gone.digest not in found and len(both) == len(found)  # each once
    only = await store.open_records(frozenset({State.RETRYING}))
    assert retrying.digest in {r.digest for r in only}
    assert all(r.state is State.RETRYING for r in only)
    listed = [r for r in only if r.digest == retrying.digest]
    assert listed[0].attempts == 1 and listed[0].due_ms > listed[0].now_ms
    old = await store.open_records(frozenset({State.IN_FLIGHT}))
    assert gone.digest in {r.digest for r in old} and queued.digest not in {r.digest for r in old}


async def test_a_store_says_when_delivery_notices_may_have_been_missed(
    make_store: Callable[[], Store], store_kind: str
) -> None:
    """On (re)subscribing, Redis reports `lost`: the workers rescan. An in-process
    store never misses one."""
    fresh = make_store()
    heard = Heard(fresh)
    await fresh.start()
    try:
        if store_kind == "memory":
            assert heard.lost == 0
        else:
            await heard.until(lambda: heard.lost >= 1)
    finally:
        await fresh.close()


async def due_subscribers(store: Store) -> int:
    """Connections Redis has subscribed to the first bucket's delivery channel."""
    assert isinstance(store, RedisStore)
    channel = store._due_channels[0]
    if not store.cluster:
        return int((await store.client.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1])
    node = store.client.get_node_from_key(channel)
    shard = aioredis.Redis(host=node.host, port=node.port)
    try:
        return int((await shard.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1])
    finally:
        await shard.aclose()


async def test_delivery_notices_are_heard_only_while_a_worker_listens(
    make_store: Callable[[], Store], store_kind: str
) -> None:
    """A process that delivers nothing hears no due or taken notice: on Redis it is not
    even subscribed to the buckets' `d` channels, so an accept costs it (and Redis) no
    message. A worker that starts listening is subscribed, told `lost` (it rescans what
    was said before), and hears the next; one that stops is unsubscribed again."""
    # Subscriptions per channel are Redis's (PUBSUB SHARDNUMSUB); PostgreSQL's one
    # LISTEN connection per process (SQLite's socket per process) hears its channel
    # whether or not a worker listens, and the store drops the notices nobody listens to.
    redis_like = store_kind not in ("memory", "postgres", "sqlite")
    fresh = make_store()
    rescans = Heard(fresh, notices=False)
    await fresh.start()
    try:
        await rescans.subscribed(fresh)
        assert not fresh.due.listening
        missed = await accepted(fresh)
        if redis_like:
            await rescans.until(lambda: rescans.lost >= 1)
            assert await due_subscribers(fresh) == 0
        heard = await Heard(fresh).subscribed(fresh)
        assert fresh.due.listening
        if redis_like:
            await heard.until(lambda: heard.lost >= 1)
            assert await due_subscribers(fresh) == 1
        r = await accepted(fresh)
        await heard.until(lambda: any(d.ref.digest == r.digest for d in heard.due))
        if store_kind != "postgres":
            # PostgreSQL hands a NOTIFY to the listening connection some time after the
            # commit, so the notice of `missed` may reach a worker that started since;
            # hearing it is harmless (the rescan would find it anyway).
            assert missed.digest not in {d.ref.digest for d in heard.due}
        assert (await picked(fresh, r)).why == ""
        await heard.until(lambda: r.digest in heard.taken)
        assert rescans.due == [] and rescans.taken == []
        heard.stop()
        assert not fresh.due.listening
        if redis_like:
            for _ in range(100):
                if await due_subscribers(fresh) == 0:
                    break
                await asyncio.sleep(0.05)
            assert await due_subscribers(fresh) == 0
    finally:
        await fresh.close()


# -- the last success per route ---------------------------------------------------------


def on_route(route: str, avoid: KeyRef | None = None) -> KeyRef:
    """A fresh key of `route`, in another Redis bucket than `avoid`'s record."""
    while True:
        r = KeyRef(ref().digest, route, unique("key"))
        if avoid is None or bucket_of(r.digest) != bucket_of(avoid.digest):
            return r


async def test_last_success_is_a_completion_the_upstream_handled(store: Store) -> None:
    """Only a completion that took effect with an answer that says the upstream handled
    the request (records.is_success: 2xx, 3xx, 4xx but 408 and 429) counts: a stored
    503 or 429 (a route may cache them), a stale run's refused completion, a release, a
    check's and an operator's "done" do not (no upstream answered a forward there)."""
    assert await store.last_successes() == {}
    failed, stale, checked, by_hand, limited = (on_route(n) for n in ("a", "b", "c", "d", "g"))
    for r in (failed, stale, checked, by_hand, limited):
        await store.claim(r, "run-1", "fp", 30)
    assert await store.complete(failed, "run-1", StoredResponse(503, (), b"down"), 60)
    assert await store.complete(limited, "run-1", StoredResponse(429, (), b"slow down"), 60)
    assert not await store.complete(stale, "run-2", RESPONSE, 60)
    assert await store.release(stale, "run-1", 60, "test")
    for r in (checked, by_hand):
        assert await store.mark_unresolved(r, "run-1", "read timeout", park=r is by_hand)
    assert await store.begin_check(checked, "run-1", 30, 0)
    after = await store.end_check(
        CheckResult(checked, "run-1", "done", {"status": 200}, RESPONSE, 60, 3600)
    )
    assert after == "completed"
    assert (await store.operator_claim(by_hand, "alice", force=False)).ok
    assert (await store.operator_resolve(by_hand, "alice", "done", "paid", RESPONSE, 60)).ok
    assert await store.last_successes() == {}
    late = on_route("e")  # a late answer to an unresolved key is still the upstream's
    await store.claim(late, "run-1", "fp", 30)
    assert await store.mark_unresolved(late, "run-1", "read timeout")
    assert await store.complete(late, "run-1", StoredResponse(303, (), b""), 60)
    delivered = on_route("f")
    assert (
        await store.accept(NewDelivery(delivered, "run-a", "fp", REQUEST, TOKEN))
    ).outcome == "queued"
    assert (await picked(store, delivered)).record is not None
    assert await store.complete(delivered, "run-1", RESPONSE, 60, {"result": "completed"})
    ages = await store.last_successes()
    assert sorted(ages) == ["e", "f"] and all(age >= 0 for age in ages.values()), ages


async def test_last_success_is_the_latest_of_every_part_of_the_store(store: Store) -> None:
    """Two successes of one route, recorded in two Redis buckets (on a Cluster, perhaps
    two masters) more than a second apart (PostgreSQL keeps the time to the second):
    the age is the second's, on every store."""
    first = on_route("r")
    second = on_route("r", avoid=first)
    for r in (first, second):
        await store.claim(r, "run-1", "fp", 30)
    assert await store.complete(first, "run-1", RESPONSE, 60)
    await asyncio.sleep(1.5)
    started = time.monotonic()
    assert await store.complete(second, "run-1", RESPONSE, 60)
    age = (await store.last_successes())["r"]
    # No more than the time since just before the second completion (to the ms of
    # each clock): the first's age would be 1.5 s more.
    assert 0 <= age <= time.monotonic() - started + 0.01, age


# -- the operator roster -------------------------------------------------------------------


async def test_an_entry_that_comes_back_is_valid_from_a_new_time(store: Store) -> None:
    """The roster (store/operator_roster.py): an entry keeps its time while it stays
    with the same mark, every replica recording the same roster gets the same answer,
    and an entry that leaves and comes back, or whose mark changes and changes back,
    gets a time later than every one before: a session stamped with an old time never
    matches again."""
    assert await store.roster() == {}
    first = await store.record_roster({"token:alice": "a1", "token:bob": "b1"})
    assert set(first) == {"token:alice", "token:bob"}
    assert (first["token:alice"].mark, first["token:bob"].mark) == ("a1", "b1")
    assert await store.roster() == first
    assert await store.record_roster({"token:bob": "b1", "token:alice": "a1"}) == first

    removed = await store.record_roster({"token:bob": "b1"})
    assert removed == {"token:bob": first["token:bob"]} == await store.roster()
    back = await store.record_roster({"token:alice": "a1", "token:bob": "b1"})
    assert back["token:bob"] == first["token:bob"]
    assert back["token:alice"].mark == "a1"
    rotated = await store.record_roster({"token:alice": "a2", "token:bob": "b1"})
    restored = await store.record_roster({"token:alice": "a1", "token:bob": "b1"})
    times = [r["token:alice"].since_ms for r in (first, back, rotated, restored)]
    assert times == sorted(set(times)), times  # strictly later each time, same ms or not
    assert restored["token:bob"] == first["token:bob"]

    odd = {"identity_header:ålice {x}": "a mark with spaces", "token:\\": ""}
    assert {n: e.mark for n, e in (await store.record_roster(odd)).items()} == odd
    assert {n: e.mark for n, e in (await store.roster()).items()} == odd
    assert await store.record_roster({}) == {} == await store.roster()


async def test_recordings_at_once_are_applied_one_after_the_other(store: Store) -> None:
    """Replicas that load configs at the same moment: each recording is applied whole
    (its answer is exactly the roster it asked for), and an entry that comes back gets
    a time no earlier answer gave it."""
    both = {"token:alice": "a", "token:bob": "b"}
    alone = {"token:alice": "a"}
    rosters = [both if i % 2 else alone for i in range(16)]
    answers = await asyncio.gather(*(store.record_roster(r) for r in rosters))
    for roster, answer in zip(rosters, answers, strict=True):
        assert {name: entry.mark for name, entry in answer.items()} == roster
    alice = {answer["token:alice"] for answer in answers}
    assert len(alice) == 1  # never left: one time throughout
    bob = sorted({answer["token:bob"].since_ms for answer in answers if "token:bob" in answer})
    assert all(since >= next(iter(alice)).since_ms for since in bob)


async def test_every_process_reads_the_roster_another_recorded(
    store: Store, make_store: Callable[[], Store], store_kind: str
) -> None:
    if store_kind == "memory":
        pytest.skip("the memory store is one process's")
    recorded = await store.record_roster({"token:alice": "a"})
    other = make_store()  # another replica's store: the same prefix
    await other.start()
    try:
        assert await other.roster() == recorded
        assert await other.record_roster({"token:alice": "a"}) == recorded
    finally:
        await other.close()


# -- the routes' pauses (store/route_pauses.py) --------------------------------------------


def refused(pause_after: int = 3, every_ms: int = 60_000) -> PauseMove:
    return PauseMove(
        "refused", why="connect refused", pause_after=pause_after, probe_every_ms=every_ms
    )


async def test_a_route_pauses_after_its_failures_and_a_probe_answered_resumes_it(
    store: Store,
) -> None:
    """Consecutive refusals pause a route at pause_after, by "auto", with a probe due
    probe_every later; an answer resets the count; a probe is taken once per interval;
    the probe's answer lifts the pause."""
    route = unique("route")
    fresh = await store.route_pause(route)
    assert (fresh.failures, fresh.paused, fresh.verdict) == (0, False, "open")
    assert fresh.now_ms > 0
    for expected in (1, 2):
        state, verdict = await store.change_pause(route, refused())
        assert (state.failures, state.paused, verdict) == (expected, False, "open")
    state, _ = await store.change_pause(route, PauseMove("answered"))
    assert (state.failures, state.paused) == (0, False)  # consecutive only
    for _ in range(3):
        state, verdict = await store.change_pause(route, refused())
    assert state.paused and state.by == "auto" and state.why == "connect refused"
    assert verdict == "closed" and state.failures == 3
    assert state.probe_ms - state.since_ms == 60_000
    read = await store.route_pause(route)
    assert (read.since_ms, read.by, read.probe_ms, read.verdict) == (
        state.since_ms,
        "auto",
        state.probe_ms,
        "closed",
    )
    assert (await store.change_pause(route, PauseMove("probe")))[1] == "closed"
    listed = (await store.route_pauses())[route]
    assert dataclasses.replace(listed, now_ms=0) == dataclasses.replace(read, now_ms=0)

    other = unique("route")  # a probe every 1 ms: due at once
    for _ in range(2):
        await store.change_pause(other, refused(2, 1))
    await asyncio.sleep(0.01)
    assert (await store.route_pause(other)).verdict == "probe"
    takes = await asyncio.gather(
        *(store.change_pause(other, PauseMove("probe", probe_every_ms=60_000)) for _ in range(8))
    )
    assert sorted(verdict for _, verdict in takes) == ["closed"] * 7 + ["probe"]
    state, verdict = await store.change_pause(other, PauseMove("answered"))
    assert (state.paused, state.failures, verdict, state.by) == (False, 0, "open", "auto")
    assert state.why == "a probe was answered"


async def test_a_manual_pause_is_lifted_by_a_manual_resume_alone(store: Store) -> None:
    """An operator's pause sends no probe and an answer does not lift it; a resume
    does, with who and why recorded; it takes over an automatic pause, keeping since."""
    route = unique("route")
    for _ in range(2):
        await store.change_pause(route, refused(2, 1))
    auto = await store.route_pause(route)
    state, verdict = await store.change_pause(
        route, PauseMove("pause", by="alice", why='upstream maintenance ünïcode "x"')
    )
    assert (state.paused, state.by, verdict) == (True, "alice", "closed")
    assert state.why == 'upstream maintenance ünïcode "x"' and state.since_ms == auto.since_ms
    await asyncio.sleep(0.01)
    assert (await store.change_pause(route, PauseMove("probe")))[1] == "closed"
    state, verdict = await store.change_pause(route, PauseMove("answered"))
    assert (state.paused, state.by, verdict) == (True, "alice", "closed")
    state, verdict = await store.change_pause(route, PauseMove("resume", by="bob", why="fixed"))
    assert (state.paused, state.failures, state.by, state.why, verdict) == (
        False,
        0,
        "bob",
        "fixed",
        "open",
    )
    assert (await store.route_pause(route)).by == "bob"


async def test_refusals_at_once_are_all_counted(store: Store) -> None:
    route = unique("route")
    await asyncio.gather(*(store.change_pause(route, refused(0)) for _ in range(10)))
    assert (await store.route_pause(route)).failures == 10


async def test_every_process_shares_the_pause(
    store: Store, make_store: Callable[[], Store], store_kind: str
) -> None:
    if store_kind == "memory":
        pytest.skip("the memory store is one process's")
    route = unique("route")
    await store.change_pause(route, PauseMove("pause", by="alice", why="w"))
    other = make_store()  # another replica's store: the same prefix
    await other.start()
    try:
        seen = await other.route_pause(route)
        assert (seen.paused, seen.by, seen.why) == (True, "alice", "w")
        await other.change_pause(route, PauseMove("resume", by="bob", why="ok"))
        assert not (await store.route_pause(route)).paused
    finally:
        await other.close()


# -- rate limits: one bucket per name, over every process on the store -----------------


async def test_a_rate_limit_gives_its_burst_then_answers_the_wait(store: Store) -> None:
    """A quiet bucket gives `burst` tokens at once; the next take is refused with the
    wait until the next token (one interval), and a refusal changes nothing."""
    name = unique("rate")
    assert [await store.take_token(name, 10.0, 3) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = await store.take_token(name, 10.0, 3)
    assert 0.05 < wait <= 0.1, wait
    again = await store.take_token(name, 10.0, 3)
    assert 0.0 < again <= wait, (wait, again)  # refused: still counting down, not pushed on
    await asyncio.sleep(again + 0.01)
    assert await store.take_token(name, 10.0, 3) == 0.0
    assert await store.take_token(name, 10.0, 3) > 0.0
    assert await store.take_token(unique("rate"), 10.0, 3) == 0.0  # another name: its own


async def test_a_rate_limit_survives_a_script_flush(store: Store, store_kind: str) -> None:
    """Redis that lost its scripts (a restart, SCRIPT FLUSH): the bucket's script is
    loaded again and the take answered, the bucket as it was."""
    if not isinstance(store, RedisStore):
        pytest.skip("scripts are Redis's")
    name = unique("rate")
    assert await store.take_token(name, 1.0, 1) == 0.0
    if store_kind.startswith("cluster"):
        await store.client.execute_command("SCRIPT FLUSH", target_nodes="all")
    else:
        await store.client.script_flush()
    assert 0.9 < await store.take_token(name, 1.0, 1) <= 1.0


async def test_a_rate_limit_never_gives_more_than_rate_times_span_plus_burst(
    store: Store, make_store: Callable[[], Store], store_kind: str
) -> None:
    """Takers at once (two stores on one backend, as two replicas: the memory store is
    one process's own) over about 0.6 s: at most rate x span + burst tokens, and close
    to that many (a refused take waits its answer, as the worker does)."""
    name, rate, burst = unique("rate"), 50.0, 2
    stores = [store]
    if store_kind != "memory":
        other = make_store()
        await other.start()
        stores.append(other)
    taken: list[float] = []
    start = time.monotonic()

    async def taker(s: Store) -> None:
        while time.monotonic() - start < 0.6:
            wait = await s.take_token(name, rate, burst)
            if wait == 0.0:
                taken.append(time.monotonic())
            else:
                await asyncio.sleep(wait)

    try:
        await asyncio.gather(*(taker(stores[i % len(stores)]) for i in range(6)))
    finally:
        for s in stores[1:]:
            await s.close()
    span = taken[-1] - start
    assert len(taken) <= rate * span + burst + 1, (len(taken), span)  # +1: clocks' edges
    # Far short of it is a limit that loses tokens; how far a shared machine delays the
    # takers' sleeps sets the margin.
    assert len(taken) >= rate * span * 0.5, (len(taken), span)


# -- listings: pages from a cursor; counts kept as records move; the queue's bound ----


def on(route: str) -> KeyRef:
    return KeyRef(ref().digest, route, unique("key"))


async def open_as(store: Store, state: State, route: str = "r-a") -> KeyRef:
    """A record of `route` in `state` (unresolved, parked or claimed)."""
    r = on(route)
    await store.claim(r, "run-1", "fp", 30)
    assert await store.mark_unresolved(r, "run-1", "read timeout", park=state is State.PARKED)
    if state is State.CLAIMED:
        assert (await store.operator_claim(r, "alice", force=False)).ok
    return r


async def walk(store: Store, states: frozenset[State], limit: int, **filters: Any) -> list[Page]:
    pages, cursor = [], ""
    while True:
        page = await store.list_records(states, cursor=cursor, limit=limit, **filters)
        pages.append(page)
        assert len(page.records) <= limit
        if not page.next:
            return pages
        cursor = page.next


OPEN = frozenset({State.UNRESOLVED, State.PARKED, State.CLAIMED})


async def test_pages_list_every_record_once_in_place_order(store: Store) -> None:
    """Three states, two routes, pages of 4: each record exactly once, ordered by the
    time each entered its state (then digest), across states and pages."""
    made = {}
    for i in range(15):
        state = (State.UNRESOLVED, State.PARKED, State.CLAIMED)[i % 3]
        r = await open_as(store, state, route=("r-a", "r-b")[i % 2])
        made[r.digest] = state
    pages = await walk(store, OPEN, 4)
    rows = [record for page in pages for record in page.records]
    assert sorted(r.digest for r in rows) == sorted(made)
    assert {r.digest: r.state for r in rows} == made
    places = [(r.since_ms, r.digest) for r in rows]
    assert places == sorted(places)
    assert [len(p.records) for p in pages][:-1] == [4] * (len(pages) - 1)
    assert pages[0].prev == "" and pages[-1].next == ""
    assert all(r.now_ms == page.now_ms for page in pages for r in page.records)


async def test_pages_walk_back_with_prev(store: Store) -> None:
    for i in range(9):
        await open_as(store, State.PARKED, route=f"r-{i % 3}")
    forward = await walk(store, OPEN, 2)
    back, cursor = [], forward[-1].prev
    while cursor:
        page = await store.list_records(OPEN, cursor=cursor, limit=2)
        back.append([r.digest for r in page.records])
        cursor = page.prev
    assert back == [[r.digest for r in p.records] for p in reversed(forward[:-1])]
    # From a page read backwards, `next` goes forward again.
    again = await store.list_records(OPEN, cursor=forward[1].prev, limit=2)
    assert [r.digest for r in again.records] == [r.digest for r in forward[0].records]
    following = await store.list_records(OPEN, cursor=again.next, limit=2)
    assert [r.digest for r in following.records] == [r.digest for r in forward[1].records]


async def test_pages_cover_every_record_exactly_once_while_others_change_state(
    store: Store,
) -> None:
    """Between pages, records move: parked ones are claimed (a listed state: they come
    again at their new place, which is later), unresolved ones are parked, claimed ones
    resolved (gone from the listing), and new ones are parked. Every record that stays
    in its state throughout is listed exactly once; one that moved is listed at most
    once per state it was in; nothing is skipped."""
    records = {}
    for i in range(24):
        state = (State.UNRESOLVED, State.PARKED, State.CLAIMED)[i % 3]
        records[(await open_as(store, state, route=("r-a", "r-b")[i % 2])).digest] = state
    refs = {}
    seen: list[tuple[str, State]] = []
    moved: set[str] = set()
    cursor, turn = "", 0
    while True:
        page = await store.list_records(OPEN, cursor=cursor, limit=3)
        seen += [(r.digest, r.state) for r in page.records]
        for r in page.records:
            refs[r.digest] = KeyRef(r.digest, r.route, r.key)
        if not page.next:
            break
        cursor, turn = page.next, turn + 1
        # Move one record the walk has not reached and one it has passed, each way.
        listed = {d for d, _ in seen}
        ahead = [d for d in records if d not in listed and d not in moved]
        behind = [d for d, _ in seen if d not in moved]
        for digest in (ahead[:1] + behind[:1]) if turn % 2 else ahead[:2]:
            state = records[digest]
            moved.add(digest)
            r = refs.get(digest) or await _ref_of(store, digest)
            if state is State.PARKED:
                assert (await store.operator_claim(r, "bob", force=False)).ok
            elif state is State.UNRESOLVED:
                assert await store.park(r, "between pages")
            else:
                assert (await store.operator_resolve(r, "alice", "retry", "", None, 60)).ok
        # A key parked after the page was read: a millisecond later, so its place is
        # surely after the cursor (in the same millisecond, a smaller digest would put
        # it before, where the walk has passed).
        await asyncio.sleep(0.002)
        records[(await open_as(store, State.PARKED, route="r-c")).digest] = State.PARKED
    counted: dict[str, list[State]] = {}
    for digest, state in seen:
        counted.setdefault(digest, []).append(state)
    for digest in records:
        if digest not in moved:
            assert counted.get(digest) == [records[digest]], digest  # exactly once
        else:
            states = counted.get(digest, [])
            assert len(states) == len(set(states)) <= 2, (digest, states)


async def _ref_of(store: Store, digest: str) -> KeyRef:
    for record in await store.open_records(OPEN):
        if record.digest == digest:
            return KeyRef(digest, record.route, record.key)
    raise AssertionError(digest)


async def test_pages_filter_by_state_route_and_age_in_the_store(store: Store) -> None:
    old = [await open_as(store, State.PARKED, route="r-a") for _ in range(3)]
    await asyncio.sleep(1.5)
    young = [await open_as(store, State.PARKED, route="r-a") for _ in range(2)]

    async def listed(states: frozenset[State], **filters: Any) -> list[str]:
        return [r.digest for p in await walk(store, states, 2, **filters) for r in p.records]

    parked = frozenset({State.PARKED})
    # First, while the young ones are surely younger than a second.
    assert sorted(await listed(parked, route="r-a", older_than=1.0)) == sorted(
        r.digest for r in old
    )
    other = await open_as(store, State.PARKED, route="r-b")
    held = await open_as(store, State.CLAIMED, route="r-a")
    queued = await accepted(store)
    assert sorted(await listed(parked, route="r-a")) == sorted(r.digest for r in old + young)
    assert await listed(parked, route="r-b") == [other.digest]
    assert await listed(parked, route="nowhere") == []
    assert await listed(frozenset({State.CLAIMED})) == [held.digest]
    assert await listed(frozenset({State.QUEUED}), route=queued.route) == [queued.digest]
    assert await listed(frozenset()) == []


async def parked_after(store: Store, key: str, status: int | None, route: str) -> KeyRef:
    """A delivery of `key` parked after its one attempt, answered `status` (None: never
    sent)."""
    r = KeyRef(ref().digest, route, key)
    await store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))
    assert (await picked(store, r)).record is not None
    attempt = {"result": "exhausted", "status": status, "error": "no attempt left"}
    assert await store.retry_later(r, "run-1", None, attempt)
    await asyncio.sleep(0.002)  # each a place of its own
    return r


async def test_pages_match_a_time_range_a_literal_key_prefix_and_a_status(store: Store) -> None:
    """The run log's filters: places within a time range (both ends included), a key
    prefix in which `%`, `_`, `*`, `[` and `\\` are characters like any other, and the
    upstream status of the last attempt; each alone and together, walked in pages."""
    route = unique("runs")
    keys = [
        ("inv-1", 503), ("inv-2", 200), ("in%v_3", 503), ("inv*[x]\\", 503),
        ("other", 503), ("inv-4", None), ("Inv-5", 503),
    ]  # fmt: skip
    made = [await parked_after(store, key, status, route) for key, status in keys]
    records = [await store.get(r) for r in made]
    places = [r.since_ms for r in records if r is not None]
    parked = frozenset({State.PARKED})

    async def listed(match: Match) -> list[str]:
        pages = await walk(store, parked, 2, route=route, match=match)
        return [r.key for p in pages for r in p.records]

    assert await listed(Match()) == [key for key, _ in keys]
    assert await listed(Match(key_prefix="inv")) == ["inv-1", "inv-2", "inv*[x]\\", "inv-4"]
    assert await listed(Match(key_prefix="in%")) == ["in%v_3"]
    assert await listed(Match(key_prefix="in_")) == []
    assert await listed(Match(key_prefix="inv*")) == ["inv*[x]\\"]
    assert await listed(Match(key_prefix="inv*[x]\\")) == ["inv*[x]\\"]
    assert await listed(Match(status=503)) == ["inv-1", "in%v_3", "inv*[x]\\", "other", "Inv-5"]
    assert await listed(Match(status=200)) == ["inv-2"]
    assert await listed(Match(status=404)) == []
    assert await listed(Match(since_ms=places[2], until_ms=places[4])) == [
        "in%v_3", "inv*[x]\\", "other",
    ]  # fmt: skip
    assert await listed(Match(since_ms=places[5])) == ["inv-4", "Inv-5"]
    assert await listed(Match(until_ms=places[0])) == ["inv-1"]
    assert await listed(Match(until_ms=places[0] - 1)) == []
    together = Match(since_ms=places[1], until_ms=places[5], key_prefix="inv", status=503)
    assert await listed(together) == ["inv*[x]\\"]
    # Walked back from the end, the same rows.
    pages = await walk(store, parked, 1, route=route, match=Match(key_prefix="inv"))
    back, cursor = [], pages[-1].prev
    while cursor:
        page = await store.list_records(
            parked, route=route, cursor=cursor, limit=1, match=Match(key_prefix="inv")
        )
        back = [r.key for r in page.records] + back
        cursor = page.prev
    shown = [r.key for p in pages for r in p.records]
    assert back == shown[: len(back)] and back


async def test_a_page_the_key_prefix_drops_reads_a_bounded_part(store: Store) -> None:
    """Many parked deliveries whose keys do not match come first: a page of one reads
    at most READ_ROUNDS x 2 of them, answered empty with `next`; the walk finds the
    match past them."""
    route = unique("runs")
    for i in range(12):
        await parked_after(store, f"other-{i}", 503, route)
    wanted = await parked_after(store, "wanted-1", 503, route)
    match = Match(key_prefix="wanted")
    parked = frozenset({State.PARKED})
    first = await store.list_records(parked, route=route, limit=1, match=match)
    assert first.records == [] and first.next
    pages = await walk(store, parked, 1, route=route, match=match)
    assert [r.digest for p in pages for r in p.records] == [wanted.digest]


async def completed_after(
    store: Store, key: str, status: int, route: str, ttl: float = 60
) -> KeyRef:
    """A delivery of `key` completed at its first attempt with `status`."""
    r = KeyRef(ref().digest, route, key)
    await store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))
    assert (await picked(store, r)).record is not None
    response = StoredResponse(status, (), b"")
    attempt = {"result": "completed", "status": status}
    assert await store.complete(r, "run-1", response, ttl, attempt)
    await asyncio.sleep(0.002)
    return r


async def test_completed_deliveries_are_listed_by_route_while_kept(store: Store) -> None:
    """A route's completed deliveries are listed by when each completed, beside its
    parked ones, matched by status and key prefix, until their records expire; a sync
    route's completed keys are not listed, and completed records are asked for by
    route."""
    route = unique("runs")
    short = await completed_after(store, "job-short", 200, route, ttl=1.0)
    done = [await completed_after(store, f"job-{i}", (200, 201)[i % 2], route) for i in range(3)]
    parked = await parked_after(store, "job-parked", 503, route)
    sync = KeyRef(ref().digest, route, "job-sync")
    await store.claim(sync, "run-1", "fp", 30)
    assert await store.complete(sync, "run-1", RESPONSE, 60)
    both = frozenset({State.COMPLETED, State.PARKED})

    async def listed(states: frozenset[State], **filters: Any) -> list[str]:
        pages = await walk(store, states, 2, route=route, **filters)
        return [r.digest for p in pages for r in p.records]

    finished = [short.digest, *(r.digest for r in done)]
    assert await listed(both) == [*finished, parked.digest]
    rows = (await store.list_records(frozenset({State.COMPLETED}), route=route)).records
    assert [r.state for r in rows] == [State.COMPLETED] * 4
    assert await listed(both, match=Match(status=201)) == [done[1].digest]
    assert await listed(both, match=Match(status=503)) == [parked.digest]
    assert await listed(both, match=Match(key_prefix="job-s")) == [short.digest]
    with pytest.raises(ValueError):
        await store.list_records(frozenset({State.COMPLETED}))
    await asyncio.sleep(1.2)  # the short one's record expires
    assert await listed(frozenset({State.COMPLETED})) == [r.digest for r in done]
    # A later completion (trimming what expired on Redis) lists on as before.
    late = await completed_after(store, "job-late", 200, route)
    assert await listed(frozenset({State.COMPLETED})) == [*(r.digest for r in done), late.digest]


async def _redis_evals(store: Store) -> int | None:
    """EVALSHA calls the store's one Redis server has answered; None for other stores."""
    if not isinstance(store, RedisStore) or store.cluster:
        return None
    stats = await store.client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_eval"))


#: In-flight keys too young for the filter, listed before the old ones.
YOUNG = 30


async def test_a_filtered_page_reads_a_bounded_part_and_next_goes_on(store: Store) -> None:
    """Many records the filter drops come first: in-flight keys too young for
    `older_than` whose leases end before the old ones'. A page reads at most
    READ_ROUNDS x (limit + 1) of them: it is short (here empty) with `next` set, its
    cost bounded however many the filter drops; a walk following `next` (or `prev`)
    lists every match exactly once, and ends only after the last."""
    old = [on("r-a") for _ in range(3)]
    for r in old:
        await store.claim(r, "run-1", "fp", 600)  # a long lease: listed late
    await asyncio.sleep(4.5)
    # Listed first, and too young while the claims and the walks take under 4 s (with room for a
    # loaded machine and a WAIT for a replica per claim).
    for _ in range(YOUNG):
        await store.claim(on("r-a"), "run-1", "fp", 30)
    flying = frozenset({State.IN_FLIGHT})
    matches = sorted(r.digest for r in old)
    for filters in ({"older_than": 4.0}, {"older_than": 4.0, "route": "r-a"}):
        before = await _redis_evals(store)
        first = await store.list_records(flying, limit=1, **filters)
        after = await _redis_evals(store)
        assert first.records == [] and first.next and not first.prev, filters
        if before is not None and after is not None:
            # READ_ROUNDS rounds of a script per bucket (twice at most), not one
            # round per two young keys.
            assert after - before <= READ_ROUNDS * 2 * BUCKETS, (filters, after - before)
        pages = await walk(store, flying, 2, **filters)
        assert sorted(r.digest for p in pages for r in p.records) == matches, filters
        assert pages[-1].records, filters  # the walk ends past the last match
        back = await store.list_records(flying, cursor=pages[-1].prev, limit=2, **filters)
        shown = [p for p in pages if p.records]
        assert [r.digest for r in back.records] == [r.digest for r in shown[-2].records]
        # Walked back from the end to the start, every match once too.
        seen, cursor = list(pages[-1].records), pages[-1].prev
        while cursor:
            page = await store.list_records(flying, cursor=cursor, limit=2, **filters)
            seen += page.records
            cursor = page.prev
        assert sorted(r.digest for r in seen) == matches, filters


async def test_waiting_deliveries_and_in_flight_keys_are_listed_at_their_places(
    store: Store,
) -> None:
    """A waiting delivery's place is when it is due; an in-flight key's, when its lease
    ends: a retry due in a minute comes after one queued now."""
    later = await accepted(store)
    await picked(store, later)
    await store.retry_later(later, "run-1", 60, ATTEMPT)
    now = await accepted(store)
    rows = (await store.list_records(frozenset({State.QUEUED, State.RETRYING}))).records
    assert [(r.digest, r.state) for r in rows] == [
        (now.digest, State.QUEUED),
        (later.digest, State.RETRYING),
    ]
    long_lease, short_lease = ref(), ref()
    await store.claim(long_lease, "run-1", "fp", 60)
    await store.claim(short_lease, "run-1", "fp", 30)
    flying = (await store.list_records(frozenset({State.IN_FLIGHT}))).records
    assert [r.digest for r in flying] == [short_lease.digest, long_lease.digest]


async def test_a_cursor_no_listing_gave_is_refused(store: Store) -> None:
    for given in ("nonsense!", "YTox", "a" * 200, "Yjo5OTk5OTk5OTk5OTk5OTk5OTk5OmFi"):
        with pytest.raises(InvalidCursor):
            await store.list_records(OPEN, cursor=given)
    for limit in (0, -1, MAX_PAGE_SIZE + 1):
        with pytest.raises(ValueError):
            await store.list_records(OPEN, limit=limit)


async def test_counts_follow_every_move(store: Store) -> None:
    """The counts behind the overview and the gauges, after each kind of move into and
    out of a counted state, on a route of this test's own."""
    route = unique("counted")

    async def counts() -> dict[str, int]:
        found = {str(s.state): s.count for s in await store.stats() if s.route == route}
        for q in await store.queue_stats():
            if q.route == route:
                found |= {"queued": q.queued, "retrying": q.retrying}
        return {state: n for state, n in found.items() if n}

    a, b, c = on(route), on(route), on(route)
    for r in (a, b, c):
        await store.claim(r, "run-1", "fp", 30)
        assert await store.mark_unresolved(r, "run-1", "read timeout")
    assert await counts() == {"unresolved": 3}
    assert await store.complete(c, "run-1", RESPONSE, 60)  # a late answer
    assert await store.park(b, "test")
    assert await counts() == {"unresolved": 1, "parked": 1}
    assert (await store.operator_claim(b, "alice", force=False)).ok
    assert (await store.operator_claim(a, "bob", force=False)).ok
    assert (await store.operator_claim(a, "carol", force=True)).ok  # a takeover: still one
    assert await counts() == {"claimed": 2}
    assert (await store.operator_resolve(b, "alice", "retry", "", None, 60)).ok
    assert (await store.operator_resolve(a, "carol", "done", "", RESPONSE, 60)).ok
    assert await counts() == {}
    d, e, f = on(route), on(route), on(route)
    for r in (d, e, f):
        assert (
            await store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN))
        ).outcome == "queued"
    assert (await store.accept(NewDelivery(d, "run-b", "fp", REQUEST, TOKEN))).outcome == "exists"
    assert await counts() == {"queued": 3}
    assert (await store.pick(route, d, "run-1", 30, 8, "x")).record is not None
    assert await store.retry_later(d, "run-1", 0, ATTEMPT)
    assert (await store.pick(route, e, "run-1", 30, 8, "x")).record is not None
    assert await counts() == {"queued": 1, "retrying": 1}
    assert await store.mark_unresolved(e, "run-1", "read timeout")
    assert await counts() == {"queued": 1, "retrying": 1, "unresolved": 1}
    assert await store.begin_check(e, "run-1", 30, 0)
    assert (
        await store.end_check(CheckResult(e, "run-1", "not_done", {}, None, 60, 3600, 0))
        == "retrying"
    )
    assert await counts() == {"queued": 1, "retrying": 2}
    assert (await store.pick(route, f, "run-2", 30, 0, "x")).why == "exhausted"
    assert await counts() == {"retrying": 2, "parked": 1}
    assert (await store.operator_claim(f, "alice", force=False)).ok
    assert (await store.operator_resolve(f, "alice", "retry", "", None, 60)).ok
    assert await counts() == {"retrying": 2, "queued": 1}
    picked_d = await store.pick(route, d, "run-3", 30, 8, "x")
    assert picked_d.record is not None
    assert await store.complete(d, "run-3", RESPONSE, 60)
    assert await counts() == {"retrying": 1, "queued": 1}
    assert await store.repair_counts([route]) == 0  # nothing drifted
    assert await counts() == {"retrying": 1, "queued": 1}


async def test_counts_give_the_oldest_of_each_state(store: Store) -> None:
    route = unique("aged")
    first = await open_as(store, State.PARKED, route=route)
    await asyncio.sleep(1.2)
    await open_as(store, State.PARKED, route=route)
    [parked] = [s for s in await store.stats() if s.route == route]
    assert parked.count == 2 and parked.oldest_seconds >= 1.2
    assert (await store.operator_claim(first, "alice", force=False)).ok
    stats = {s.state: s for s in await store.stats() if s.route == route}
    assert stats[State.PARKED].count == 1 and stats[State.PARKED].oldest_seconds < 1.2
    assert stats[State.CLAIMED].count == 1


async def test_accept_admits_exactly_the_limit_of_a_burst(store: Store) -> None:
    """Fifty new keys at once on a route with room for 7: exactly 7 are queued, the
    rest refused with nothing stored; a repeat of a queued key is "exists" however
    full the queue; another route has its own room; a pick makes room for one."""
    route = unique("bounded")
    burst = [on(route) for _ in range(50)]
    got = await asyncio.gather(
        *(
            store.accept(NewDelivery(r, f"run-{i}", "fp", REQUEST, TOKEN, limit=7))
            for i, r in enumerate(burst)
        )
    )
    queued = [r for r, a in zip(burst, got, strict=True) if a.outcome == "queued"]
    assert len(queued) == 7 and sum(a.outcome == "full" for a in got) == 43
    for r, a in zip(burst, got, strict=True):
        if a.outcome == "full":
            assert await store.get(r) is None
    repeat = await store.accept(NewDelivery(queued[0], "run-x", "fp", REQUEST, TOKEN, limit=7))
    assert repeat.outcome == "exists"
    assert (
        await store.accept(NewDelivery(on(route), "run-y", "fp", REQUEST, TOKEN, limit=7))
    ).outcome == ("full")
    assert (
        await store.accept(NewDelivery(on(unique("other")), "r", "fp", REQUEST, TOKEN, limit=1))
    ).outcome == ("queued")
    assert (await store.pick(route, queued[0], "run-p", 30, 8, "x")).record is not None
    assert (
        await store.accept(NewDelivery(on(route), "run-z", "fp", REQUEST, TOKEN, limit=7))
    ).outcome == ("queued")
    [stat] = [q for q in await store.queue_stats() if q.route == route]
    assert stat.queued == 7


async def test_accepts_that_fail_leave_the_whole_bound(store: Store) -> None:
    """Accepts that fail in the store (each key's record is a value of the wrong type,
    so the accept script errors) store nothing and hold no room: after more failures
    than the bound, a burst still gets the whole bound. (On a Cluster the route's room
    is taken before the accept script runs, in a call of its own.)"""
    route = unique("failing")
    broken = [on(route) for _ in range(5)]
    if isinstance(store, RedisStore):
        for r in broken:
            await store.client.set(store._tag(r.digest) + r.digest, "not a record")
        for r in broken:
            with pytest.raises(StoreError):
                await store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN, limit=3))
        await store.client.delete(*(store._tag(r.digest) + r.digest for r in broken))
    burst = [on(route) for _ in range(5)]
    got = [
        await store.accept(NewDelivery(r, "run-b", "fp", REQUEST, TOKEN, limit=3)) for r in burst
    ]
    assert [a.outcome for a in got] == ["queued"] * 3 + ["full"] * 2


async def test_pages_break_ties_by_digest(store: Store) -> None:
    """Records parked in one burst share their place (the same millisecond); the walk
    goes on from the cursor's digest among them: none skipped, none twice."""
    route = unique("ties")
    refs = [on(route) for _ in range(60)]
    await asyncio.gather(*(store.claim(r, "run-1", "fp", 30) for r in refs))
    await asyncio.gather(*(store.mark_unresolved(r, "run-1", "t", park=True) for r in refs))
    rows = [
        r for p in await walk(store, frozenset({State.PARKED}), 7, route=route) for r in p.records
    ]
    assert sorted(r.digest for r in rows) == sorted(r.digest for r in refs)
    places = [(r.since_ms, r.digest) for r in rows]
    assert places == sorted(places)
    assert len(places) > len({since for since, _ in places})  # ties there were


async def test_repair_mends_counts_and_marks_left_apart(store: Store) -> None:
    """What a script that failed midway (or a process that died between two writes,
    on a Cluster) could leave: a count off, an admission mark missing and one too
    many; and records an older layout kept in one index per state for every route.
    repair_counts puts each right; a store that counts in the records' own step has
    nothing to repair."""
    route = unique("mended")
    parked = [await open_as(store, State.PARKED, route=route) for _ in range(3)]
    waiting = [on(route) for _ in range(2)]
    for r in waiting:
        assert (
            await store.accept(NewDelivery(r, "run-a", "fp", REQUEST, TOKEN, limit=5))
        ).outcome == "queued"
    if not isinstance(store, RedisStore):
        assert await store.repair_counts([route]) == 0
        return
    client, tag = store.client, store._tag(parked[0].digest)
    await client.hincrby(tag + "n", f"parked/{route}", 5)  # a count off
    marks = admission_key(store.prefix, route)
    await client.zrem(marks, waiting[0].digest)  # a waiting delivery unmarked
    legacy = on(route)  # a record an older gateway filed in its one index per state
    await store.claim(legacy, "run-1", "fp", 30)
    assert await store.mark_unresolved(legacy, "run-1", "t", park=True)
    ltag = store._tag(legacy.digest)
    member = f"{legacy.digest}/{route}"
    score = await client.zscore(f"{ltag}i:parked:{route}", member)
    await client.zrem(f"{ltag}i:parked:{route}", member)
    await client.zadd(ltag + "i:parked", {member: score})
    assert await store.repair_counts([route]) >= 3
    [stat] = [s for s in await store.stats() if s.route == route]
    assert stat.count == 4
    found = await store.list_records(frozenset({State.PARKED}), route=route)
    assert sorted(r.digest for r in found.records) == sorted(r.digest for r in [*parked, legacy])
    marked = sorted(text(d) for d in await client.zrange(marks, 0, -1))
    assert marked == sorted(r.digest for r in waiting)
    # A mark of nothing that waits, long ago (its delivery picked, then a crash before
    # the mark went): dropped. The marks' size is what the bound reads.
    await client.zadd(marks, {"f" * 32: 1})
    assert await store.repair_counts([route]) == 1
    assert sorted(text(d) for d in await client.zrange(marks, 0, -1)) == marked
    assert await store.repair_counts([route]) == 0


async def test_a_page_that_drops_an_entry_still_leads_on(store: Store) -> None:
    """A page drops an index entry whose record it finds gone or moved (deleted behind
    the store's back, or moved between reading the index and the record): the walk
    still goes on to every other record. (Only Redis reads the two apart.)"""
    route = unique("gone")
    refs = [await open_as(store, State.PARKED, route=route) for _ in range(6)]
    if not isinstance(store, RedisStore):
        return
    first = (await store.list_records(frozenset({State.PARKED}), route=route, limit=2)).records
    await store.client.delete(store._tag(first[1].digest) + first[1].digest)
    pages = await walk(store, frozenset({State.PARKED}), 2, route=route)
    listed = [r.digest for p in pages for r in p.records]
    assert sorted(listed) == sorted(r.digest for r in refs if r.digest != first[1].digest)


async def _one_in_every_state(store: Store) -> dict[State, KeyRef]:
    """A record in each state, each with what it keeps (a history, a response, an
    operator's hold, a delivery's request and attempts)."""
    refs = {state: ref() for state in State}
    assert await store.claim(refs[State.IN_FLIGHT], "run-1", "fp", 300) is None
    done = refs[State.COMPLETED]
    assert await store.claim(done, "run-1", "fp", 30) is None
    assert await store.complete(done, "run-1", RESPONSE, 600)
    for state in (State.UNRESOLVED, State.PARKED, State.CLAIMED, State.RELEASED):
        r = refs[state]
        assert await store.claim(r, "run-1", "fp", 30) is None
        assert await store.mark_unresolved(r, "run-1", "timed out", park=state is State.PARKED)
    assert (await store.operator_claim(refs[State.CLAIMED], "alice", False)).ok
    released = refs[State.RELEASED]
    assert (await store.operator_claim(released, "bob", False)).ok
    assert (await store.operator_resolve(released, "bob", "retry", "", None, 600)).ok
    queued, retrying = refs[State.QUEUED], refs[State.RETRYING]
    for r in (queued, retrying):
        r_ = KeyRef(r.digest, "deliveries", r.key)
        refs[State.QUEUED if r is queued else State.RETRYING] = r_
        assert (await store.accept(NewDelivery(r_, "run-a", "fp", REQUEST, TOKEN))).outcome == (
            "queued"
        )
    retrying = refs[State.RETRYING]
    assert (await store.pick("deliveries", retrying, "run-b", 30, 8, "x")).record is not None
    assert await store.retry_later(retrying, "run-b", 60, ATTEMPT)
    for state, r in refs.items():
        record = await store.get(r)
        assert record is not None and record.state is state
    return refs


async def _export_all(store: Store, page: int) -> list[ExportedRecord]:
    items: list[ExportedRecord] = []
    cursor = ""
    for _ in range(1000):
        exported = await store.export_records(cursor, page)
        items += exported.items
        if not exported.next:
            return items
        cursor = exported.next
    raise AssertionError("the export never ended")


async def test_export_then_import_recreates_every_record_as_it_was(
    store: Store, make_other_store: Callable[[], Store]
) -> None:
    """A copy through export_records and import_records: every record in every state as
    it was (history, stored bytes, attempts, the time a completed one has left), the
    kept counts with it, and a queued delivery still picked once."""
    refs = await _one_in_every_state(store)
    other = make_other_store()
    await other.start()
    try:
        assert not await other.holds_keys()  # another prefix or file: nothing of `store`'s
        items = {i.record.digest: i for i in await _export_all(store, page=3)}
        mine = {r.digest for r in refs.values()}
        assert mine <= items.keys()
        chosen = [items[d] for d in sorted(mine)]
        assert await other.import_records(chosen) == []
        assert await other.holds_keys()
        # Again: a digest held already is skipped, changing nothing.
        assert sorted(await other.import_records(chosen)) == sorted(mine)
        for state, r in refs.items():
            was, now = await store.get(r), await other.get(r)
            assert was is not None and now is not None, state
            assert dataclasses.replace(now, now_ms=was.now_ms) == was, state
            assert await other.get_request(r) == await store.get_request(r), state
        copied = {i.record.digest: i for i in await _export_all(other, page=1000)}
        done = refs[State.COMPLETED].digest
        ttl = copied[done].ttl_ms
        assert ttl is not None and 0 < ttl <= 600_000
        assert ttl > (items[done].ttl_ms or 0) - 30_000  # kept, not restarted nor lost
        assert copied[refs[State.PARKED].digest].ttl_ms is None

        counted = {(s.route, s.state, s.count) for s in await store.stats()}
        assert {(s.route, s.state, s.count) for s in await other.stats()} == counted
        queues = {(q.route, q.queued, q.retrying) for q in await other.queue_stats()}
        assert ("deliveries", 1, 1) in queues
        parked = await other.list_records(frozenset({State.PARKED}))
        assert refs[State.PARKED].digest in {r.digest for r in parked.records}
        queued = refs[State.QUEUED]
        picked = await other.pick("deliveries", queued, "run-c", 30, 8, "x")
        assert picked.record is not None and picked.record.attempts == 1
        assert (await other.pick("deliveries", queued, "run-d", 30, 8, "x")).record is None
    finally:
        await other.close()
