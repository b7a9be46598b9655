"""A small store pool: the notification subscriber outside the pool's bound, and
commands past the pool that wait for a connection."""

from tests.mutants import Mutant

P = "tests/test_store_pool.py::"

MUTANTS = [
    Mutant(
        name="subscriber-on-the-bounded-pool",
        path="gateway/store/redis/notices.py",
        old="    return aioredis.ConnectionPool(**kwargs)\n",
        new="    return client.connection_pool\n",
        tests=(P + "test_waiting_duplicates_answer_on_a_small_pool_waiting_for_replicas[1]",),
        breaks="with store.max_connections: 1 the subscriber holds the only connection and "
        "every request fails or waits for ever",
    ),
    Mutant(
        name="cluster-pipeline-takes-no-turn",
        path="gateway/store/redis/topology.py",
        old="        async with client.turn():\n            with _closed_under_it():\n"
        "                return await super().execute(",
        new="        if client:\n            with _closed_under_it():\n"
        "                return await super().execute(",
        tests=(
            P + "test_a_burst_past_a_cluster_pool_waits_for_connections[1]",
            P + "test_a_burst_past_a_cluster_pool_waits_for_connections[2]",
        ),
        breaks="on a Cluster a burst of listings past store.max_connections fails with 503 "
        "instead of waiting for a connection",
    ),
    Mutant(
        name="cluster-turn-waits-for-ever",
        path="gateway/store/redis/topology.py",
        old="await asyncio.wait_for(self._slots.acquire(), self._queue_timeout)",
        new="await self._slots.acquire()",
        tests=(P + "test_a_cluster_call_that_finds_no_connection_in_time_says_so",),
        breaks="on a Cluster a call waits for a connection without end while others hold every one",
    ),
    Mutant(
        name="store-error-with-a-wordless-cause",
        path="gateway/errors.py",
        old='return cls(f"{what}: {words[0] if words else type(exc).__name__}")',
        new='return cls(f"{what}: {exc}")',
        tests=(P + "test_a_store_error_names_a_cause_that_has_no_words",),
        breaks="a store failure whose driver error has no words logs `redis read failed: ` "
        "and nothing more",
    ),
]
