"""Broken builds of rate limits (`delivery.rate`): the bucket, where it is kept, and
what a delivery held back by it counts as."""

from tests.mutants import Mutant

C = "tests/test_store_contract.py::"
R = "tests/test_delivery_rate.py::"
TWO = R + "test_two_processes_keep_to_one_rate[sqlite]"

MUTANTS = [
    Mutant(
        name="rate-checked-per-process",
        path="gateway/delivery/worker.py",
        old="wait = await self.store.take_token(name, route.delivery.rate",
        new="wait = await self.store.take_token(name + self.replica, route.delivery.rate",
        tests=(TWO,),
        breaks="each process keeps a rate of its own: the upstream sees the rate times the "
        "number of processes",
    ),
    Mutant(
        name="rate-limited-attempt-counted",
        path="gateway/delivery/worker.py",
        old='self.engine.metrics.rate_limited.labels(route.name, "delivery").inc()',
        new='self.engine.metrics.attempt(route.name, "retry_scheduled")',
        tests=(TWO,),
        breaks="a delivery held back by the rate limit, never sent, counts as an attempt",
    ),
    Mutant(
        name="rate-limit-ignored-by-worker",
        path="gateway/delivery/worker.py",
        old="            wait = await self._take_token(lane.route)\n",
        new="            wait = 0.0\n",
        tests=(TWO,),
        breaks="deliveries go out as fast as the workers pick them, whatever delivery.rate says",
    ),
    Mutant(
        name="rate-asks-with-every-slot",
        path="gateway/delivery/worker.py",
        old="            lane.one_ask_until = lane.held_until + ONE_ASK\n",
        new="            lane.one_ask_until = 0.0\n",
        tests=(TWO,),
        breaks="a lane held back by the limit asks the store once per concurrency slot for "
        "each token: store round trips multiplied, for nothing",
    ),
    Mutant(
        name="rate-held-delivery-goes-last",
        path="gateway/delivery/worker.py",
        old="            lane.one_ask_until = lane.held_until + ONE_ASK\n"
        "            lane.push(ready_at, next(self._seq), due)\n",
        new="            lane.one_ask_until = lane.held_until + ONE_ASK\n"
        "            lane.push(lane.held_until, next(self._seq), due)\n",
        tests=("tests/test_delivery.py::test_a_rate_limited_route_delivers_in_due_order",),
        breaks="a delivery held back by the limit goes behind the ones queued after it",
    ),
    Mutant(
        name="rate-hint-again-goes-last",
        path="gateway/delivery/worker.py",
        old="self.due_at.get(digest, ready_at) < ready_at:",
        new="self.due_at.get(digest, ready_at) < ready_at and False:",
        tests=("tests/test_delivery.py::test_a_rate_limited_route_delivers_in_due_order",),
        breaks="on a rate-limited route a delivery hinted again (an attempt's next) goes "
        "behind the ones accepted after it",
    ),
    Mutant(
        name="rate-refusal-takes",
        path="gateway/store/rate.py",
        old="        return tat_ms, (allowed_at - now_ms) / 1000.0\n",
        new="        return start + step, (allowed_at - now_ms) / 1000.0\n",
        tests=(C + "test_a_rate_limit_gives_its_burst_then_answers_the_wait[memory]",),
        breaks="a refused take pushes the next token further off: waiting takers starve",
    ),
    Mutant(
        name="rate-burst-doubled-redis",
        path="gateway/store/redis/lua/rate.lua",
        old="local allowed_at = start + step - burst * step\n",
        new="local allowed_at = start + step - 2 * burst * step\n",
        tests=(C + "test_a_rate_limit_gives_its_burst_then_answers_the_wait[redis]",),
        breaks="Redis lets twice the burst through at once",
    ),
    Mutant(
        name="rate-postgres-wait-wrong",
        path="gateway/store/postgres/sql/009_rate_limits.sql",
        old="        RETURN (start + step_ms - burst * step_ms - now_ms) / 1000;\n",
        new="        RETURN 0;\n",
        tests=(C + "test_a_rate_limit_gives_its_burst_then_answers_the_wait[postgres]",),
        breaks="PostgreSQL answers a refused take as a token taken: more than the rate "
        "gets through",
    ),
    Mutant(
        name="rate-sqlite-bucket-not-read",
        path="gateway/store/sqlite/store.py",
        old="rate.take(row[0] if row is not None else 0.0, now",
        new="rate.take(0.0, now",
        tests=(C + "test_a_rate_limit_gives_its_burst_then_answers_the_wait[sqlite]",),
        breaks="SQLite reads every bucket as quiet: each take succeeds",
    ),
    Mutant(
        name="rate-check-without-token",
        path="gateway/reconcile.py",
        old="            if not await self._token(route, wait):\n",
        new="            if False:\n",
        tests=("tests/test_reconcile_sweep.py::test_checks_take_the_routes_rate_limit",),
        breaks="reconcile checks after an outage reach the service at once, past its rate",
    ),
]
