"""The PostgreSQL store's SQL rules, broken one at a time."""

from tests.mutants import Mutant

CONTRACT = "tests/test_store_contract.py"
POSTGRES = "tests/test_store_postgres.py"

FREE = "gateway/store/postgres/sql/003_take_function.sql"
TAKE = "gateway/store/postgres/sql/004_hot_path.sql"
POOL = "gateway/store/postgres/pool.py"

# The claim's rule of a free key (gateway_free, migration 003), which gateway_take
# (004) asks of the row its read saw and, in its UPDATE's WHERE, of the row that UPDATE
# locked. Without it a claim takes whatever is there: a completed key runs again, an
# in-flight one twice.
_FREE = """\
    SELECT coalesce(expires_ms <= now_ms, false) OR state = 'released'
        OR (state = 'in_flight' AND lease_until_ms <= now_ms AND policy = 'release'
            AND NOT delivery)
"""
_CONFLICT = """\
                    AND gateway_free(r.state, r.expires_ms, r.lease_until_ms, r.delivery,
                                     t, p_policy);
"""
_RACE = f"{POSTGRES}::test_a_claim_that_loses_the_race_for_a_new_key_answers_with_the_winner"
_FREE_RACE = f"{POSTGRES}::test_a_claim_that_loses_the_race_for_a_free_row_answers_with_the_winner"

MUTANTS = [
    Mutant(
        name="pg-claim-not-conditional",
        path=FREE,
        old=_FREE,
        new="    SELECT true\n",
        tests=(
            f"{CONTRACT}::test_claim_free_key_then_read_it[postgres]",
            f"{CONTRACT}::test_complete_stores_response_for_replay[postgres]",
        ),
        breaks="a claim overwrites a key in flight or completed: the key runs twice",
    ),
    Mutant(
        name="pg-claim-conflict-not-conditional",
        path=TAKE,
        old=_CONFLICT,
        new="                    AND true;\n",
        tests=(_FREE_RACE,),
        breaks="two claims of a free row (expired, released) racing past the read both "
        "take the key: it runs twice",
    ),
    Mutant(
        name="pg-claim-lost-race-taken",
        path=TAKE,
        old="        ON CONFLICT (prefix, digest) DO NOTHING;\n        taken := FOUND;\n",
        new="        ON CONFLICT (prefix, digest) DO NOTHING;\n        taken := true;\n",
        tests=(_RACE,),
        breaks="a claim whose INSERT met a concurrent winner's row (READ COMMITTED: its "
        "read saw none) believes it took the key: it runs twice",
    ),
    Mutant(
        name="pg-accept-full-unread",
        path=TAKE,
        old="IF turn > 1 OR NOT p_fresh OR (p_delivery AND NOT p_admit) THEN",
        new="IF turn > 1 OR NOT p_fresh THEN",
        tests=(
            f"{POSTGRES}::test_a_claim_inserts_first_on_a_route_whose_last_claim_took_a_new_key",
        ),
        breaks="an accept that may not admit (the queue is full) skips the read on a route "
        "guessed fresh: a key already taken is answered 503 full instead of its record",
    ),
    Mutant(
        name="pg-claim-lost-mark-not-read-again",
        path=TAKE,
        old="                    CONTINUE WHEN NOT FOUND;  -- it moved meanwhile: read it again\n",
        new="",
        tests=(f"{POSTGRES}::test_a_duplicate_whose_key_completes_under_it_replays_the_response",),
        breaks="a duplicate whose key completed between its read and its `waiting` mark "
        "answers with an empty record instead of the response",
    ),
    Mutant(
        name="pg-complete-ignores-run-id",
        path=TAKE,
        old="    WHERE r.prefix = p_prefix AND r.digest = p_digest AND r.run_id = p_run_id\n"
        "        AND r.state IN ('in_flight', 'unresolved')",
        new="    WHERE r.prefix = p_prefix AND r.digest = p_digest\n"
        "        AND r.state IN ('in_flight', 'unresolved')",
        tests=(
            f"{CONTRACT}::test_stale_run_cannot_complete_release_or_unresolve[postgres]",
            f"{CONTRACT}::test_expired_lease_turns_unresolved_never_free[postgres]",
        ),
        breaks="a stale worker's late answer overwrites the run that now holds the key",
    ),
    Mutant(
        name="pg-reaper-deletes-open-records",
        path="gateway/store/postgres/sql/reap.sql",
        old="AND r.state IN ('completed', 'released') AND r.expires_ms <= (SELECT now FROM t)",
        new="AND coalesce(r.expires_ms, r.lease_until_ms) <= (SELECT now FROM t)",
        tests=(f"{POSTGRES}::test_the_reaper_deletes_expired_settled_records_and_nothing_open",),
        breaks="the reaper deletes unresolved, parked and dead in-flight records: their keys "
        "run again and nobody is left to reconcile them",
    ),
    Mutant(
        name="pg-pool-unbounded",
        path=POOL,
        old="            if self.size < self._max:\n",
        new="            if True:\n",
        tests=(f"{POSTGRES}::test_the_pool_opens_at_most_max_connections_and_serves_every_waiter",),
        breaks="a burst opens a connection per concurrent call, past store.max_connections "
        "(and the database's max_connections)",
    ),
    Mutant(
        name="pg-pool-waiters-never-served",
        path=POOL,
        old="""        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
""",
        new="",
        tests=(f"{POSTGRES}::test_the_pool_opens_at_most_max_connections_and_serves_every_waiter",),
        breaks="calls queued for a connection wait until they time out although "
        "connections come back idle",
    ),
    Mutant(
        name="pg-pool-lends-an-open-transaction",
        path=POOL,
        old="conn.is_closed() or conn.is_in_transaction():",
        new="conn.is_closed():",
        tests=(f"{POSTGRES}::test_a_connection_left_in_a_transaction_is_never_lent_again",),
        breaks="a connection left inside a transaction is lent again: the next claim runs "
        "in it and never commits",
    ),
    Mutant(
        name="pg-pool-lends-a-cut-short-connection",
        path="gateway/store/postgres/database.py",
        old="""                    keep = False
                    try:""",
        new="""                    keep = True
                    try:""",
        tests=(f"{POSTGRES}::test_a_connection_whose_call_timed_out_is_never_lent_again",),
        breaks="a connection whose call timed out mid-statement is lent again: the next "
        "call fails on it or reads the cut call's answer",
    ),
    Mutant(
        name="pg-timeout-retried",
        path="gateway/store/postgres/database.py",
        old="                if retried or isinstance(exc, TimeoutError):\n",
        new="                if retried:\n",
        tests=(f"{POSTGRES}::test_a_call_that_runs_out_of_time_is_not_retried",),
        breaks="a call that timed out runs again: a hung database costs a request twice",
    ),
]
