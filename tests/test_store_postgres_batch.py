"""The PostgreSQL store's group commit (gateway/store/postgres/batch.py): claims and
completions that queue for a connection together go in one statement, and each caller
still gets its own answer, as if its statement had run alone.

Each test makes the queue on purpose: a store with a pool of one connection, that
connection held by a slow call while the claims (or completions) are made, so they
all queue, and the drainer takes them all when it comes free."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import pytest

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import KeyRef, Record, State, StoredRequest, StoredResponse
from gateway.store.base import NewDelivery
from gateway.store.postgres import PostgresStore
from gateway.store.postgres.batch import Batched
from tests.conftest import unique
from tests.support.postgres import (
    PostgresServer,
    end_sessions_waiting_on_a_lock,
    lock_record,
    sessions_waiting_on_a_lock,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

T = TypeVar("T")


def ref(route: str = "r") -> KeyRef:
    digest = unique("d").replace("-", "").ljust(32, "0")[:32]
    return KeyRef(digest, route, unique("key"))


def response(text: str) -> StoredResponse:
    return StoredResponse(200, (("content-type", "text/plain"),), text.encode())


@pytest.fixture
async def store(postgres_database: PostgresServer) -> AsyncIterator[PostgresStore]:
    """A store whose pool has one connection (not started: no reaper, no listener)."""
    config = StoreConfig(url=postgres_database.url, prefix=unique("b") + ":", max_connections=1)
    s = PostgresStore(config)
    # Every completion's last success is written already: none asks for it (those run
    # alone), so each one may join a batch.
    s._success_due["r"] = time.monotonic() + 3600
    yield s
    await s.close()


def batcher(store: PostgresStore, name: str) -> Batched:
    return store.db.batchers[name]


async def _queued(
    store: PostgresStore,
    calls: list[Awaitable[T]],
    then: Callable[[list[asyncio.Task[T]]], None] | None = None,
) -> list[asyncio.Task[T]]:
    """`calls` started while the pool's one connection is busy, so that every one of
    them queues; `then` on their tasks; the connection is given back."""
    busy = asyncio.create_task(
        store.db.call(lambda conn: conn.fetchval("SELECT pg_sleep(0.05)"), "busy")
    )
    while store.db.pool().free():
        await asyncio.sleep(0.001)
    tasks = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0)  # each one runs up to its queue
    assert sum(len(b._queue) for b in store.db.batchers.values()) == len(calls)
    if then is not None:
        then(tasks)
        await asyncio.sleep(0)
    await busy
    return tasks


def _rows(server: PostgresServer, store: PostgresStore) -> dict[str, str]:
    """digest -> run_id of the store's rows, as another session sees them (committed)."""
    found = server.sql(
        f"SELECT digest, run_id FROM gateway_records WHERE prefix = '{store.prefix}'"
    )
    return {str(d): str(r) for d, r in found}


async def test_claims_that_queue_together_go_in_one_statement_each_to_its_caller(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    refs = [ref() for _ in range(20)]
    tasks = await _queued(store, [store.claim(r, f"run-{i}", "fp", 30) for i, r in enumerate(refs)])
    assert await asyncio.gather(*tasks) == [None] * 20
    claims = batcher(store, "claim")
    assert (claims.sent, claims.batches, claims.batched) == (1, 1, 20)
    assert _rows(postgres_database, store) == {r.digest: f"run-{i}" for i, r in enumerate(refs)}
    # Alone (a connection is free): the lone statement, as before.
    assert await store.claim(ref(), "run-x", "fp", 30) is None
    assert (claims.sent, claims.batches) == (1, 1)


async def test_each_caller_gets_its_own_answer_from_a_mixed_batch(
    store: PostgresStore,
) -> None:
    """Replays and new keys in one batch of claims, then completions that succeed and
    completions that do not in one batch: every answer differs from its neighbours', so
    an answer given to the wrong caller is seen (a replay's record to a new key's
    caller, another key's response, ok for a stale run)."""
    done = [ref() for _ in range(8)]
    for i, r in enumerate(done):
        assert await store.claim(r, f"run-d{i}", "fp", 30) is None
        assert await store.complete(r, f"run-d{i}", response(f"done {i}"), 60)
    new = [ref() for _ in range(8)]
    mixed = [r for pair in zip(done, new, strict=True) for r in pair]
    tasks = await _queued(
        store, [store.claim(r, f"run-n{i}", "fp", 30) for i, r in enumerate(mixed)]
    )
    claimed = await asyncio.gather(*tasks)
    assert batcher(store, "claim").batched == 16
    for i, (r, found) in enumerate(zip(mixed, claimed, strict=True)):
        if i % 2:
            assert found is None, (i, found)
            continue
        assert isinstance(found, Record) and found.state is State.COMPLETED, (i, found)
        assert found.key == r.key and found.response == response(f"done {i // 2}")
    # Completions: each new key's own run with its own response (ok), and a stale run
    # on each completed key (refused).
    completions = []
    for i, r in enumerate(new):
        completions.append(store.complete(r, f"run-n{2 * i + 1}", response(f"new {i}"), 60))
        completions.append(store.complete(done[i], "run-stale", response("stale"), 60))
    tasks = await _queued(store, completions)
    assert await asyncio.gather(*tasks) == [True, False] * 8
    assert batcher(store, "complete").batched == 16
    for i, r in enumerate(new):
        found = await store.get(r)
        assert found is not None and found.response == response(f"new {i}"), (i, found)
        kept = await store.get(done[i])
        assert kept is not None and kept.response == response(f"done {i}")


async def test_deliveries_completed_in_one_batch_keep_each_its_own_attempt(
    store: PostgresStore,
) -> None:
    """A delivery's completion carries its attempt (JSON, a jsonb column): in a batch,
    as text cast in the statement; each record keeps its own."""
    refs = [ref() for _ in range(4)]
    for r in refs:
        queued = await store.accept(
            NewDelivery(r, "run-a", "fp", StoredRequest("POST", "/j", (), b"{}"), "t")
        )
        assert queued.outcome == "queued"
        got = await store.pick(r.route, r, f"run-{r.digest}", 30, 8, "replica")
        assert got.record is not None and got.record.run_id == f"run-{r.digest}"
    attempts = [{"result": "status", "status": 500 + i, "note": f"n{i}"} for i in range(4)]
    calls = [
        store.complete(r, f"run-{r.digest}", response(f"{i}"), 60, attempts[i])
        for i, r in enumerate(refs)
    ]
    tasks = await _queued(store, calls)
    assert await asyncio.gather(*tasks) == [True] * 4
    assert batcher(store, "complete").batched == 4
    for i, r in enumerate(refs):
        found = await store.get(r)
        assert found is not None and found.state is State.COMPLETED
        assert found.last_attempt == attempts[i] and found.response == response(f"{i}")


async def test_the_same_key_twice_in_one_batch_decides_as_one_after_the_other(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    r, other = ref(), ref()
    calls = [store.claim(r, "run-1", "fp", 30), store.claim(other, "run-o", "fp", 30)]
    calls.append(store.claim(r, "run-2", "fp", 30))
    tasks = await _queued(store, calls)
    first, _, second = await asyncio.gather(*tasks)
    assert batcher(store, "claim").batched == 3
    assert first is None
    assert second is not None and second.state is State.IN_FLIGHT and second.run_id == "run-1"
    assert _rows(postgres_database, store)[r.digest] == "run-1"
    # The duplicate marked it waiting: the completion is announced, and replays.
    assert await store.complete(r, "run-1", response("once"), 60)
    found = await store.claim(r, "run-3", "fp", 30)
    assert found is not None and found.response == response("once")


async def test_one_failing_entry_fails_alone_and_the_others_are_claimed(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    """A lease so long that its end overflows bigint: that entry's gateway_take raises,
    which aborts the batch's transaction. Each entry then runs alone: that one fails,
    every other is claimed."""
    refs = [ref() for _ in range(6)]
    poison = ref()
    calls = [store.claim(r, f"run-{i}", "fp", 30) for i, r in enumerate(refs)]
    calls.insert(3, store.claim(poison, "run-p", "fp", 9.223371e15))
    tasks = await _queued(store, calls)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results.pop(3), StoreError)
    assert results == [None] * 6
    assert batcher(store, "claim").batches == 1
    assert _rows(postgres_database, store) == {r.digest: f"run-{i}" for i, r in enumerate(refs)}


async def test_a_caller_cancelled_in_the_queue_is_dropped_and_in_flight_leaves_the_rest(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    # Cancelled while queued: never sent.
    refs = [ref() for _ in range(5)]
    calls = [store.claim(r, f"run-{i}", "fp", 30) for i, r in enumerate(refs)]
    tasks = await _queued(store, calls, then=lambda tasks: tasks[2].cancel())
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    assert batcher(store, "claim").batched == 4
    rows = _rows(postgres_database, store)
    assert refs[2].digest not in rows and len(rows) == 4
    # Cancelled while its batch waits on a lock (another session's uncommitted claim of
    # one of the keys): the statement goes on, and the others get their answers.
    held, mine, after = ref(), ref(), ref()
    other = await asyncpg.connect(postgres_database.url)
    try:
        tx = other.transaction()
        await tx.start()
        claim = store.db.statements["claim"]
        won = await other.fetchrow(
            claim, held.digest, "r", held.key, "run-h", "fp", 30000, "", True
        )
        assert won is not None and won["outcome"] == 1
        calls = [store.claim(r, f"run-{r.digest}", "fp", 30) for r in (held, mine, after)]
        tasks = await _queued(store, calls)
        await sessions_waiting_on_a_lock(postgres_database, 1)
        victim = tasks[[held, mine, after].index(mine)]
        victim.cancel()
        await asyncio.sleep(0.05)
        await tx.rollback()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await other.close()
    assert [type(x) for x in results] == [
        asyncio.CancelledError if r is mine else type(None) for r in (held, mine, after)
    ]
    rows = _rows(postgres_database, store)
    assert all(rows[r.digest] == f"run-{r.digest}" for r in (held, mine, after))


async def test_two_batches_of_the_same_keys_in_opposite_orders_do_not_deadlock(
    postgres_database: PostgresServer,
) -> None:
    """Batch A takes x, then waits for m (another session holds it); batch B, whose
    callers came as y then x, must wait for x holding nothing. Sent in its callers'
    order, B would take y first: when m is let go, A wants y and B wants x, a cycle that
    the server breaks after deadlock_timeout by aborting one batch."""
    prefix = unique("dl") + ":"
    config = StoreConfig(url=postgres_database.url, prefix=prefix, max_connections=1)
    a, b = PostgresStore(config), PostgresStore(config)
    x, m, y = sorted((ref() for _ in range(3)), key=lambda r: r.digest)
    other = await asyncpg.connect(postgres_database.url)
    try:
        tx = other.transaction()
        await tx.start()
        claim = a.db.statements["claim"]
        won = await other.fetchrow(claim, m.digest, "r", m.key, "run-h", "fp", 30000, "", True)
        assert won is not None and won["outcome"] == 1
        in_a = await _queued(a, [a.claim(r, f"a-{r.key}", "fp", 30) for r in (x, m, y)])
        await sessions_waiting_on_a_lock(postgres_database, 1)
        in_b = await _queued(b, [b.claim(r, f"b-{r.key}", "fp", 30) for r in (y, x)])
        await sessions_waiting_on_a_lock(postgres_database, 2)
        await tx.rollback()
        found: list[Any] = await asyncio.gather(*in_a, *in_b)
    finally:
        await other.close()
        await a.close()
        await b.close()
    assert found[:3] == [None, None, None]
    assert [(f.state, f.run_id) for f in found[3:]] == [
        (State.IN_FLIGHT, f"a-{y.key}"),
        (State.IN_FLIGHT, f"a-{x.key}"),
    ]
    assert (batcher(a, "claim").alone, batcher(b, "claim").alone) == (0, 0)


async def test_completions_that_write_the_last_success_run_alone(store: PostgresStore) -> None:
    """A completion that asks for the route's last success (a second row lock, in
    gateway_successes) never joins a batch, whose statement does not write it: it runs
    alone, and the route's last success is written."""
    refs = [ref("fresh-route") for _ in range(3)]
    for i, r in enumerate(refs):
        assert await store.claim(r, f"run-{i}", "fp", 30) is None
    calls = [store.complete(r, f"run-{i}", response(f"{i}"), 60) for i, r in enumerate(refs)]
    busy = asyncio.create_task(
        store.db.call(lambda conn: conn.fetchval("SELECT pg_sleep(0.05)"), "busy")
    )
    while store.db.pool().free():
        await asyncio.sleep(0.001)
    assert await asyncio.gather(*calls) == [True] * 3
    await busy
    assert batcher(store, "complete").sent == 0
    assert "fresh-route" in await store.last_successes()


# --- attempts to break the group commit ------------------------------------------------


def _store(server: PostgresServer, **settings: Any) -> PostgresStore:
    config = StoreConfig(url=server.url, prefix=unique("b") + ":", max_connections=1, **settings)
    s = PostgresStore(config)
    s._success_due["r"] = time.monotonic() + 3600
    return s


async def _hold_the_connection(store: PostgresStore, seconds: float) -> asyncio.Task[Any]:
    busy = asyncio.create_task(
        store.db.call(lambda conn: conn.fetchval(f"SELECT pg_sleep({seconds})"), "busy")
    )
    while store.db.pool().free():
        await asyncio.sleep(0.001)
    return busy


async def test_closing_the_store_answers_every_queued_caller(
    postgres_database: PostgresServer,
) -> None:
    """A drainer cancelled by close() before its first step never ran its own error
    path: its queued callers, and every later caller of that statement (the batcher
    still thought a drainer was waiting), got no answer at all."""
    store = _store(postgres_database)
    busy = await _hold_the_connection(store, 0.2)
    queued = asyncio.ensure_future(store.claim(ref(), "run-1", "fp", 30))
    await asyncio.sleep(0)  # queued, its drainer made but not yet run
    assert batcher(store, "claim")._waiting
    await store.close()
    await asyncio.gather(busy, return_exceptions=True)
    later = asyncio.ensure_future(store.claim(ref(), "run-2", "fp", 30))
    done, pending = await asyncio.wait([queued, later], timeout=5)
    for task in pending:
        task.cancel()
    assert not pending, "a caller was left without an answer"
    assert all(isinstance(task.exception(), StoreError) for task in done)


async def test_a_key_locked_elsewhere_does_not_fail_the_rest_of_its_batch(
    postgres_database: PostgresServer,
) -> None:
    """Another transaction holds one key's row. Its completion waits; the others in
    its batch completed before only if they ran alone: in one statement they all timed
    out, and three upstream answers were lost (their keys left in flight, then
    unresolved). lock_timeout (half the statement's) ends the batch early, and its
    entries run alone: only the held key's caller gets the StoreError."""
    store = _store(postgres_database, socket_timeout=0.5)
    held, *others = [ref() for _ in range(4)]
    for i, r in enumerate([held, *others]):
        assert await store.claim(r, f"run-{i}", "fp", 30) is None
    other = await asyncpg.connect(postgres_database.url)
    try:
        async with other.transaction():
            await lock_record(other, store.prefix, held.digest)
            calls = [
                store.complete(r, f"run-{i}", response(str(i)), 60)
                for i, r in enumerate([held, *others])
            ]
            tasks = await _queued(store, calls)
            results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await other.close()
    try:
        assert isinstance(results[0], StoreError) and results[1:] == [True, True, True], results
        for i, r in enumerate(others, start=1):
            found = await store.get(r)
            assert found is not None and found.state is State.COMPLETED
            assert found.response == response(str(i))
        assert batcher(store, "complete").batches == 1
    finally:
        await store.close()


async def test_a_lost_connection_sends_the_batch_again_not_each_entry_alone(
    store: PostgresStore, postgres_database: PostgresServer
) -> None:
    """A connection killed under a batch is Database.call's to retry (the batch again,
    on a new connection): asyncpg's connection errors are PostgresErrors too, and were
    taken for one entry's error, sending every entry to run alone."""
    held, a, b = ref(), ref(), ref()
    other = await asyncpg.connect(postgres_database.url)
    try:
        async with other.transaction():
            won = await other.fetchrow(
                store.db.statements["claim"], held.digest, "r", held.key, "run-h", "fp",
                30000, "", True,
            )  # fmt: skip
            assert won["outcome"] == 1
            calls = [store.claim(r, f"run-{r.key}", "fp", 30) for r in (held, a, b)]
            tasks = await _queued(store, calls)
            await sessions_waiting_on_a_lock(postgres_database, 1)
            end_sessions_waiting_on_a_lock(postgres_database)
            await asyncio.sleep(0.05)
            raise _RollBack
    except _RollBack:
        pass
    finally:
        await other.close()
    assert await asyncio.gather(*tasks) == [None, None, None]
    claims = batcher(store, "claim")
    assert claims.alone == 0 and claims.batches == 2, (claims.batches, claims.alone)


class _RollBack(Exception):
    """Leaves `async with conn.transaction()` by rolling it back."""


async def test_a_database_that_gives_no_connection_fails_the_whole_queue_at_once(
    postgres_database: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No connection within the deadline (the database hung): every queued call fails
    then. Taking one batch per drainer answered the rest one deadline per batch later,
    minutes behind a long queue."""
    timeout = 0.25
    store = _store(postgres_database, socket_timeout=timeout)
    batcher(store, "claim")._cap = 2  # a small cap stands for a long queue
    stuck = asyncio.create_task(store.db.call(lambda conn: asyncio.sleep(30), "stuck"))
    while store.db.pool().free():
        await asyncio.sleep(0.001)

    async def hang(**_: Any) -> None:
        await asyncio.sleep(30)

    monkeypatch.setattr(asyncpg, "connect", hang)  # the database takes no new connection
    start = time.monotonic()

    async def claim(i: int) -> float:
        with pytest.raises(StoreError):
            await store.claim(ref(), f"run-{i}", "fp", 30)
        return time.monotonic() - start

    took = await asyncio.gather(*[claim(i) for i in range(6)])
    await asyncio.gather(stuck, return_exceptions=True)
    store.db._pool = None  # its one connection is gone with `stuck`: nothing to close
    # One deadline (2 x socket_timeout) for every caller, not one per batch of two.
    assert max(took) - min(took) < timeout, took
