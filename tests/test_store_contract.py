"""One contract, every store (memory, Redis, Cluster, PostgreSQL): what every method
of Store promises."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.records import KeyRef, State, StoredRequest, StoredResponse
from gateway.store.base import ExpiredPolicy, PickResult, Store
from gateway.store.notices import Due
from gateway.store.redis import RedisStore, _bucket
from tests.conftest import ALL_STORES, unique

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("store_kind", ALL_STORES)]

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
    PostgreSQL one commits to disk (fsync, synchronous_commit), the memory store has
    nothing to persist."""
    info = await store.info()
    assert info.maxmemory_policy == "noeviction" and not info.evicts
    assert info.aof == {"memory": "n/a", "postgres": "yes"}.get(store_kind, "no")
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
        await store.end_check(r, "run-1", "inconclusive", {"status": 500}, None, 60, 3600)
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
        await store.end_check(r, "run-1", "done", {"status": 200}, reconciled, 60, 3600)
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
        await store.end_check(r, "run-1", "not_done", {"status": 404}, None, 60, 3600) == "released"
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
        await store.end_check(r, "run-1", "inconclusive", {"error": "timeout"}, None, 60, 0.05)
        == "parked"
    )
    record = await store.get(r)
    assert record is not None and record.state is State.PARKED
    assert record.reconcile == {"error": "timeout"}


async def test_end_check_after_someone_else_settled_changes_nothing(store: Store) -> None:
    r = await unresolved(store)
    assert await store.begin_check(r, "run-1", 30, 0)
    assert await store.park(r, "test")
    assert await store.end_check(r, "run-1", "not_done", {"status": 404}, None, 60, 3600) == ""
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
        for _ in range(100):  # pub/sub delivers in another task: give it up to 5 s
            if found():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the notice never came")


async def accepted(store: Store, run: str = "run-a") -> KeyRef:
    r = ref()
    result = await store.accept(r, run, "fp", REQUEST, TOKEN, origin="replica-a")
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
    again = await store.accept(r, "run-a", "fp", REQUEST, TOKEN)
    assert again.outcome == "exists" and again.record is not None
    assert again.record.run_id == "run-a" and again.record.state is State.QUEUED


async def test_accept_never_overwrites_an_existing_key(store: Store) -> None:
    r = await accepted(store)
    other = StoredRequest("POST", "/other", (), b"other")
    found = await store.accept(r, "run-b", "fp2", other, "another-token-000000000")
    assert found.outcome == "exists" and found.record is not None
    assert found.record.run_id == "run-a" and found.record.fingerprint == "fp"
    assert found.record.token == TOKEN and await store.get_request(r) == REQUEST
    # Nor a sync key: in flight or completed, it stays what it is, with no request.
    sync = ref()
    await store.claim(sync, "run-1", "fp", 30)
    held = await store.accept(sync, "run-b", "fp", REQUEST, TOKEN)
    assert held.outcome == "exists" and held.record is not None
    assert held.record.state is State.IN_FLIGHT and not held.record.delivery
    await store.complete(sync, "run-1", RESPONSE, 60)
    done = await store.accept(sync, "run-b", "fp", REQUEST, TOKEN, admit=False)
    assert done.outcome == "exists" and done.record is not None
    assert done.record.response == RESPONSE
    assert await store.get_request(sync) is None


async def test_accept_refused_admission_stores_nothing(store: Store) -> None:
    r = ref()
    full = await store.accept(r, "run-a", "fp", REQUEST, TOKEN, admit=False)
    assert full.outcome == "full" and full.record is None
    assert await store.get(r) is None and await store.get_request(r) is None
    assert await store.queue_stats() == []


async def test_refused_admission_still_settles_a_dead_lease(store: Store) -> None:
    """A key whose gateway died is what its route's policy says before anything else,
    even when the queue is full: under release it is released (its story kept)."""
    r = ref()
    await store.claim(r, "run-1", "fp", 0.05)
    await asyncio.sleep(0.15)
    full = await store.accept(r, "run-a", "fp", REQUEST, TOKEN, admit=False, expired="release")
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
    got = await store.end_check(r, "run-1", result, answer, response, 60, 3600, retry_in)
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
    await store.accept(other, "run-a", "fp", REQUEST, TOKEN)
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
    # LISTEN connection per process hears its channel whether or not a worker listens,
    # and the store drops the notices nobody listens to.
    redis_like = store_kind in ("redis", "cluster")
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
        if avoid is None or _bucket(r.digest) != _bucket(avoid.digest):
            return r


async def test_last_success_is_a_completion_below_500(store: Store) -> None:
    """Only a completion that took effect with a status below 500 counts: a stored 503,
    a stale run's refused completion, a release, a check's and an operator's "done"
    do not (no upstream answered a forward there)."""
    assert await store.last_successes() == {}
    failed, stale, checked, by_hand = (on_route(n) for n in ("a", "b", "c", "d"))
    for r in (failed, stale, checked, by_hand):
        await store.claim(r, "run-1", "fp", 30)
    assert await store.complete(failed, "run-1", StoredResponse(503, (), b"down"), 60)
    assert not await store.complete(stale, "run-2", RESPONSE, 60)
    assert await store.release(stale, "run-1", 60, "test")
    for r in (checked, by_hand):
        assert await store.mark_unresolved(r, "run-1", "read timeout", park=r is by_hand)
    assert await store.begin_check(checked, "run-1", 30, 0)
    after = await store.end_check(checked, "run-1", "done", {"status": 200}, RESPONSE, 60, 3600)
    assert after == "completed"
    assert (await store.operator_claim(by_hand, "alice", force=False)).ok
    assert (await store.operator_resolve(by_hand, "alice", "done", "paid", RESPONSE, 60)).ok
    assert await store.last_successes() == {}
    late = on_route("e")  # a late answer to an unresolved key is still the upstream's
    await store.claim(late, "run-1", "fp", 30)
    assert await store.mark_unresolved(late, "run-1", "read timeout")
    assert await store.complete(late, "run-1", StoredResponse(404, (), b""), 60)
    delivered = on_route("f")
    assert (await store.accept(delivered, "run-a", "fp", REQUEST, TOKEN)).outcome == "queued"
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
