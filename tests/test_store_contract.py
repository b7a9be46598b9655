"""One contract, both stores: what every method of Store promises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.records import KeyRef, State, StoredResponse
from gateway.store.base import Store
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
    memory store has nothing to persist."""
    info = await store.info()
    assert info.maxmemory_policy == "noeviction" and not info.evicts
    assert info.aof == ("n/a" if store_kind == "memory" else "no")
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
