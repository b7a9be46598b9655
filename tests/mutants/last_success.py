"""The last success per route (Store.last_successes, the overview's column), broken
one store at a time: not written, written for a 5xx, the buckets' max taken wrong, a
row never refreshed; the overview not reading it; and the process's gauge counting an
answer before it arrived whole."""

from tests.mutants import Mutant

C = "tests/test_store_contract.py::"
HANDLED = C + "test_last_success_is_a_completion_the_upstream_handled"
LATEST = C + "test_last_success_is_the_latest_of_every_part_of_the_store"
HOT = "gateway/store/postgres/sql/004_hot_path.sql"
REPLICAS = "tests/test_replicas.py::test_a_success_through_one_replica_shows_in_the_others_overview"

GAUGE = "tests/test_streaming.py::test_last_success_is_an_answer_that_arrived_whole"

MUTANTS = [
    Mutant(
        name="last-success-gauge-at-the-head",
        path="gateway/engine/outbound.py",
        old="    if response.rest is None or response.rest.whole:\n",
        new="    if True:\n",
        tests=(GAUGE,),
        breaks="a streamed 200 cut off mid-body (an unknown outcome, parked) counts as the "
        "route's last success: NoRecentSuccess stays quiet while every answer breaks",
    ),
    Mutant(
        name="redis-last-success-not-written",
        path="gateway/store/redis/lua/complete.lua",
        old="if ARGV[8] == '1' then",
        new="if false then",
        tests=(HANDLED + "[redis]", REPLICAS + "[redis]"),
        breaks="a Redis completion writes no last success: another replica's overview says "
        "none yet while the route succeeds",
    ),
    Mutant(
        name="redis-last-success-for-a-5xx",
        path="gateway/store/redis/store.py",
        old='"1" if is_success(response.status) else ""',
        new='"1"',
        tests=(HANDLED + "[redis]",),
        breaks="a stored 503 counts as the route's last success on Redis, hiding an outage",
    ),
    Mutant(
        name="redis-last-success-oldest-bucket",
        path="gateway/store/redis/store.py",
        old="latest[text(route)] = max(int(at), latest.get(text(route), 0))",
        new="latest[text(route)] = min(int(at), latest.get(text(route), int(at)))",
        tests=(LATEST + "[redis]", LATEST + "[cluster]"),
        breaks="the last success read over Redis's buckets is the oldest bucket's, not the "
        "latest: a working route looks stuck",
    ),
    Mutant(
        name="postgres-last-success-not-inserted",
        path=HOT,
        old="        IF NOT FOUND THEN\n            INSERT INTO gateway_successes",
        new="        IF false THEN\n            INSERT INTO gateway_successes",
        tests=(HANDLED + "[postgres]", REPLICAS + "[postgres]"),
        breaks="a route's first success on PostgreSQL writes no row: its last success stays "
        "none on every replica",
    ),
    Mutant(
        name="postgres-last-success-never-refreshed",
        path=HOT,
        old="s.at_ms < t - 1000",
        new="s.at_ms < 0",
        tests=(LATEST + "[postgres]",),
        breaks="a route's row on PostgreSQL keeps its first success: the age grows while "
        "the route keeps succeeding",
    ),
    Mutant(
        name="postgres-last-success-asked-once",
        path="gateway/store/postgres/store.py",
        old="self._success_due[ref.route] = now + 1.0",
        new="self._success_due[ref.route] = now + 3600.0",
        tests=(LATEST + "[postgres]",),
        breaks="a process asks for its route's last success to be written once and never "
        "again: the age grows while the route keeps succeeding",
    ),
    Mutant(
        name="postgres-last-success-for-a-5xx",
        path="gateway/store/postgres/store.py",
        old="success = is_success(response.status) and ",
        new="success = True and ",
        tests=(HANDLED + "[postgres]",),
        breaks="a stored 503 counts as the route's last success on PostgreSQL, hiding an outage",
    ),
    Mutant(
        name="overview-last-success-not-from-the-store",
        path="gateway/operators/actions.py",
        old="                successes.get(name), gateway.metrics",
        new="                None, gateway.metrics",
        tests=(REPLICAS + "[redis]", "tests/test_admin.py::test_overview_has_the_gauges_figures"),
        breaks="the overview shows this replica's own last success only, so replicas disagree",
    ),
]
