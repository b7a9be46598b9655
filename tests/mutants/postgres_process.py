"""Broken builds of the PostgreSQL store that only a database that dies, hangs or is
restarted shows, and its cost on the wire. Each must fail the tests of
tests/test_postgres_faults.py, test_crashes.py, test_delivery_process.py or
test_store_round_trips.py it names. (The SQL rules' own mutants are in postgres.py.)"""

from dataclasses import replace

from tests.mutants import Mutant

FAULTS = "tests/test_postgres_faults.py::"
CRASHES = "tests/test_crashes.py::test_sigkill_mid_request_then_new_gateway"
SQL = "gateway/store/postgres/database.py"
DELIVERY = "tests/test_delivery_process.py::"

_PICK_LOCKS = """\
        AND r.state IN ('queued', 'retrying') AND r.due_ms <= t.now
    FOR UPDATE OF r SKIP LOCKED
),
earliest AS (
    SELECT r.digest FROM gateway_records r, t
    WHERE r.prefix = @prefix AND r.route = $1 AND r.state IN ('queued', 'retrying')
        AND r.due_ms <= t.now AND NOT EXISTS (SELECT 1 FROM hinted)
        -- this very pick, retried after a lost connection, took the hint: not another
        AND NOT EXISTS (SELECT 1 FROM hint WHERE hint.state = 'in_flight' AND hint.run_id = $3)
    ORDER BY r.due_ms, r.digest LIMIT 1
    FOR UPDATE OF r SKIP LOCKED
"""

PG_LEASE_EXPIRY_FREES = Mutant(
    name="pg-lease-expiry-frees",
    path="gateway/store/postgres/sql/expire.sql",
    old="state = CASE WHEN $2 = 'release' AND NOT r.delivery THEN 'released'",
    new="state = CASE WHEN NOT r.delivery THEN 'released'",
    tests=(f"{CRASHES}[postgres-reconcile]", f"{CRASHES}[postgres-park]"),
    breaks="on PostgreSQL a killed gateway's key is freed when its lease runs out, though "
    "the upstream had the request: the repeat runs it again",
)

MUTANTS = [
    PG_LEASE_EXPIRY_FREES,
    replace(
        PG_LEASE_EXPIRY_FREES,
        name="pg-storm-lease-frees",
        tests=(FAULTS + "test_sigkill_under_a_storm_and_restart_loses_nothing",),
        breaks="the keys answered while PostgreSQL was dead are freed when their leases run "
        "out after the restart: their repeats run them again",
    ),
    Mutant(
        name="pg-asynchronous-commit",
        path=SQL,
        old='            "application_name": "idempotency-gateway",\n',
        new='            "application_name": "idempotency-gateway",\n'
        '            "synchronous_commit": "off",\n',
        tests=(FAULTS + "test_acknowledged_writes_survive_a_crash_at_once",),
        breaks="a claim is acknowledged before its commit is on disk: a database crash "
        "right after loses it, and the key runs again",
    ),
    Mutant(
        name="pg-refused-connection-not-a-store-error",
        path=SQL,
        old="RETRIED = (\n    OSError,\n",
        new="RETRIED = (\n",
        tests=(FAULTS + "test_database_down_then_up_fails_closed_or_open_and_recovers[crash]",),
        breaks="with PostgreSQL down, keyed requests get a 500 instead of 503 with "
        "Retry-After, and fail_open routes fail instead of forwarding",
    ),
    Mutant(
        name="pg-fail-open-when-down",
        path="gateway/engine/core.py",
        old='if route.on_store_error == "fail_open":',
        new="if True:",
        tests=(
            FAULTS + "test_database_down_then_up_fails_closed_or_open_and_recovers[crash]",
            FAULTS + "test_database_down_then_up_fails_closed_or_open_and_recovers[hang]",
        ),
        breaks="with PostgreSQL down or hung, requests on fail_closed routes reach the "
        "upstream without a claim",
    ),
    Mutant(
        name="pg-pick-not-locked",
        path="gateway/store/postgres/sql/pick.sql",
        old=_PICK_LOCKS,
        new=_PICK_LOCKS.replace("    FOR UPDATE OF r SKIP LOCKED\n", ""),
        tests=(
            DELIVERY + "test_backlog_picked_by_two_replicas_at_once_runs_each_once[postgres]",
            DELIVERY + "test_storm_two_replicas_twenty_deliveries[postgres]",
        ),
        breaks="two replicas picking at once take the same queued item: it is delivered twice",
    ),
]
