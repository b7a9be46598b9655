"""The PostgreSQL store's SQL rules, broken one at a time."""

from tests.mutants import Mutant

CONTRACT = "tests/test_store_contract.py"
POSTGRES = "tests/test_store_postgres.py"

# The claim's two conditions: the snapshot's (a taken row is not touched) and the
# conflict's (DO UPDATE only WHERE the row is free). Without them a claim takes
# whatever is there: a completed key runs again, an in-flight one runs twice.
_GUARD = "    WHERE NOT EXISTS (SELECT 1 FROM found WHERE NOT found.free)\n"
_CLAIM = """\
    ON CONFLICT (prefix, digest) DO UPDATE SET
        route = excluded.route, key = excluded.key, state = 'in_flight',
        run_id = excluded.run_id, fingerprint = excluded.fingerprint,
        created_ms = excluded.created_ms, since_ms = excluded.since_ms,
        lease_until_ms = excluded.lease_until_ms, expires_ms = NULL, response = NULL,
        reason = '', holder = '', holder_since_ms = 0, check_lock_ms = 0, check_token = '',
        last_check_ms = 0, reconcile = '{}', waiting = false, delivery = false, attempts = 0,
        due_ms = 0, last_attempt = '{}', token = NULL, request = NULL,
        history = CASE
            WHEN r.expires_ms <= excluded.created_ms THEN '[]'  -- gone: nothing to carry
            WHEN r.state = 'in_flight' THEN r.history || jsonb_build_array(jsonb_build_object(
                'at_ms', excluded.created_ms, 'event', 'released',
                'reason', 'lease expired; route policy: release'))
            ELSE r.history
        END
    WHERE r.expires_ms <= excluded.created_ms OR r.state = 'released'
        OR (r.state = 'in_flight' AND r.lease_until_ms <= excluded.created_ms
            AND $7 = 'release' AND NOT r.delivery)
    RETURNING @record(r)"""
_WHERE = """\
    WHERE r.expires_ms <= excluded.created_ms OR r.state = 'released'
        OR (r.state = 'in_flight' AND r.lease_until_ms <= excluded.created_ms
            AND $7 = 'release' AND NOT r.delivery)
"""

MUTANTS = [
    Mutant(
        name="pg-claim-not-conditional",
        path="gateway/store/sql/claim.sql",
        old=_GUARD + _CLAIM,
        new=_CLAIM.replace(_WHERE, ""),
        tests=(
            f"{CONTRACT}::test_claim_free_key_then_read_it[postgres]",
            f"{CONTRACT}::test_complete_stores_response_for_replay[postgres]",
        ),
        breaks="a claim overwrites a key in flight or completed: the key runs twice",
    ),
    Mutant(
        name="pg-claim-conflict-not-conditional",
        path="gateway/store/sql/claim.sql",
        old=_CLAIM,
        new=_CLAIM.replace(_WHERE, ""),
        tests=(f"{CONTRACT}::test_concurrent_first_claims_one_wins[postgres]",),
        breaks="two first claims racing past the snapshot both take the key: it runs twice",
    ),
    Mutant(
        name="pg-complete-ignores-run-id",
        path="gateway/store/sql/complete.sql",
        old="WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2\n"
        "        AND r.state IN ('in_flight', 'unresolved')",
        new="WHERE r.prefix = @prefix AND r.digest = $1\n"
        "        AND r.state IN ('in_flight', 'unresolved')",
        tests=(
            f"{CONTRACT}::test_stale_run_cannot_complete_release_or_unresolve[postgres]",
            f"{CONTRACT}::test_expired_lease_turns_unresolved_never_free[postgres]",
        ),
        breaks="a stale worker's late answer overwrites the run that now holds the key",
    ),
    Mutant(
        name="pg-reaper-deletes-open-records",
        path="gateway/store/sql/reap.sql",
        old="AND r.state IN ('completed', 'released') AND r.expires_ms <= (SELECT now FROM t)",
        new="AND coalesce(r.expires_ms, r.lease_until_ms) <= (SELECT now FROM t)",
        tests=(f"{POSTGRES}::test_the_reaper_deletes_expired_settled_records_and_nothing_open",),
        breaks="the reaper deletes unresolved, parked and dead in-flight records: their keys "
        "run again and nobody is left to reconcile them",
    ),
]
