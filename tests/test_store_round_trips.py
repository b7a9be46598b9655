"""What a request costs the PostgreSQL store on the wire: round trips, counted by a relay
in front of the session's own PostgreSQL (tests/support/pg_wire.py), not by the
driver's own account. The targets, as on Redis: a first request 2 (the claim,
the completion), a replay 1, a duplicate finding the key in flight 1.

A round trip is a Sync or a simple Query message: asyncpg's pool, left to its
defaults, sends a reset query (`SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
RESET ALL;`) each time a connection goes back to the pool, which doubles every figure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.config import StoreConfig
from gateway.records import KeyRef, State, StoredResponse
from gateway.store.postgres import PostgresStore
from tests.conftest import unique
from tests.support.pg_wire import PgRelay
from tests.support.postgres import DATABASE, USER, PostgresServer

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

RESPONSE = StoredResponse(200, (("content-type", "application/json"),), b'{"ok":true}')


@pytest.fixture
async def relayed(
    postgres_database: PostgresServer,
) -> AsyncIterator[tuple[PostgresStore, PgRelay]]:
    """A store whose every connection goes through a counting relay, warmed up: each
    statement prepared once per connection (asyncpg's statement cache) before counting."""
    async with PgRelay(postgres_database.port) as relay:
        url = f"postgresql://{USER}@127.0.0.1:{relay.port}/{DATABASE}"
        store = PostgresStore(StoreConfig(url=url, prefix=unique("rt") + ":", max_connections=1))
        try:
            for i in range(2):
                ref = KeyRef(unique("warm"), "charge", f"warm-{i}")
                assert await store.claim(ref, "warm", "fp", 10) is None
                assert await store.claim(ref, "other", "fp", 10) is not None
                assert await store.complete(ref, "warm", RESPONSE, 60)
                assert await store.claim(ref, "other", "fp", 10) is not None
            relay.reset()
            yield store, relay
        finally:
            await store.close()


async def test_first_request_two_round_trips_replay_one(
    relayed: tuple[PostgresStore, PgRelay],
) -> None:
    store, relay = relayed
    ref = KeyRef(unique("digest"), "charge", unique("key"))
    assert await store.claim(ref, "run-1", "fp", 10) is None  # claimed: forward
    in_flight = await store.claim(ref, "run-2", "fp", 10)  # a duplicate meanwhile
    assert in_flight is not None and in_flight.state is State.IN_FLIGHT
    duplicate = relay.reset()
    assert await store.complete(ref, "run-1", RESPONSE, 60)
    completion = relay.reset()
    replay = await store.claim(ref, "run-3", "fp", 10)
    assert replay is not None and replay.state is State.COMPLETED
    assert replay.response == RESPONSE
    replayed = relay.reset()
    # The claim and the duplicate's claim, then the completion, then the replay's claim:
    # one round trip each, and nothing else on the wire (no reset, no re-read).
    assert (duplicate.round_trips, completion.round_trips, replayed.round_trips) == (2, 1, 1), (
        duplicate,
        completion,
        replayed,
    )
    assert duplicate.queries == completion.queries == replayed.queries == []
