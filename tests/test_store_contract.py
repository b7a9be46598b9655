"""One contract, both stores: what every method of Store promises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.records import KeyRef, State, StoredResponse
from gateway.store.base import Store
from tests.conftest import unique

pytestmark = pytest.mark.anyio

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
    assert not await store.release(r, "other")
    assert not await store.mark_unresolved(r, "other", "timeout")
    record = await store.get(r)
    assert record is not None and record.state is State.IN_FLIGHT and record.run_id == "run-1"


async def test_release_frees_key_for_next_run(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    assert await store.release(r, "run-1")
    assert await store.get(r) is None
    assert await store.claim(r, "run-2", "fp", 30) is None


async def test_release_does_not_touch_completed(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    await store.complete(r, "run-1", RESPONSE, 60)
    assert not await store.release(r, "run-1")
    record = await store.get(r)
    assert record is not None and record.state is State.COMPLETED


async def test_unresolved_keeps_reason_and_history_and_blocks_claims(store: Store) -> None:
    r = ref()
    await store.claim(r, "run-1", "fp", 30)
    assert await store.mark_unresolved(r, "run-1", "read timeout")
    assert await store.mark_unresolved(r, "run-1", "read timeout")  # repeated: same result
    assert not await store.release(r, "run-1")  # unresolved is never released by a run
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
        if change == "complete":
            await store.complete(r, "run-1", RESPONSE, 60)
        elif change == "release":
            await store.release(r, "run-1")
        else:
            await store.mark_unresolved(r, "run-1", "timeout")
        await asyncio.wait_for(event.wait(), 5)


async def test_binary_bodies_and_headers_round_trip(store: Store) -> None:
    r = ref()
    body = bytes(range(256)) * 10 + b"\n\n{"
    response = StoredResponse(200, (("content-encoding", "gzip"), ("x-a", "1"), ("x-a", "2")), body)
    await store.claim(r, "run-1", "fp", 30)
    await store.complete(r, "run-1", response, 60)
    record = await store.get(r)
    assert record is not None and record.response == response
