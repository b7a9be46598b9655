"""The PostgreSQL store's group commit (postgres_batch.py), broken one place at a time."""

from tests.mutants import Mutant

BATCH = "gateway/store/postgres/batch.py"
SQL = "gateway/store/postgres/database.py"
TESTS = "tests/test_store_postgres_batch.py"

MUTANTS = [
    Mutant(
        name="pg-batch-answers-reversed",
        path=BATCH,
        old="        return [by_ordinal.get(i) for i in range(1, len(taken) + 1)]\n",
        new="        return [by_ordinal.get(len(taken) + 1 - i)"
        " for i in range(1, len(taken) + 1)]\n",
        tests=(f"{TESTS}::test_each_caller_gets_its_own_answer_from_a_mixed_batch",),
        breaks="a caller gets another caller's answer: a new key's caller replays another "
        "key's response, a stale run is told its completion stored",
    ),
    Mutant(
        name="pg-batch-unsorted",
        path=BATCH,
        old="        taken.sort(key=lambda e: e.args[0])\n",
        new="",
        tests=(f"{TESTS}::test_two_batches_of_the_same_keys_in_opposite_orders_do_not_deadlock",),
        breaks="two batches lock the same rows in opposite orders: a deadlock, one batch "
        "aborted after deadlock_timeout (a second of every caller's latency)",
    ),
    Mutant(
        name="pg-batch-failure-not-alone",
        path=BATCH,
        old="            self.alone += len(taken)\n            return [_ALONE] * len(taken)\n",
        new="            raise\n",
        tests=(f"{TESTS}::test_one_failing_entry_fails_alone_and_the_others_are_claimed",),
        breaks="one entry's error fails every caller of its batch (503s for claims that "
        "would have succeeded)",
    ),
    Mutant(
        name="pg-batch-attempt-dropped",
        path=BATCH,
        old="    columns[5] = [None if a is None else json.dumps(a) for a in columns[5]]\n",
        new="    columns[5] = [None for a in columns[5]]\n",
        tests=(f"{TESTS}::test_deliveries_completed_in_one_batch_keep_each_its_own_attempt",),
        breaks="a delivery completed in a batch loses its last attempt (the console and "
        "the operator API show none)",
    ),
    Mutant(
        name="pg-batch-last-success-batched",
        path=SQL,
        old='Batched(self, "complete", complete_arrays, alone=lambda a: bool(a[6]))',
        new='Batched(self, "complete", complete_arrays)',
        tests=(f"{TESTS}::test_completions_that_write_the_last_success_run_alone",),
        breaks="a completion that asks for the route's last success joins a batch, "
        "whose statement does not write it: the route's last success goes stale",
    ),
    Mutant(
        name="pg-batch-close-leaves-the-queue",
        path=BATCH,
        old="        queued, self._queue = self._queue, []\n",
        new="        queued = []\n",
        tests=(f"{TESTS}::test_closing_the_store_answers_every_queued_caller",),
        breaks="callers queued when the store closes wait forever (a shutdown that hangs)",
    ),
    Mutant(
        name="pg-no-lock-timeout",
        path=SQL,
        old='            "lock_timeout": str(max(1, int(config.socket_timeout * 500))),\n',
        new="",
        tests=(f"{TESTS}::test_a_key_locked_elsewhere_does_not_fail_the_rest_of_its_batch",),
        breaks="one key locked elsewhere times out its whole batch: the others' upstream "
        "answers are lost and their keys end unresolved",
    ),
    Mutant(
        name="pg-batch-lost-connection-alone",
        path=BATCH,
        old="        except (asyncpg.QueryCanceledError, *_CONNECTION_LOST):\n",
        new="        except asyncpg.QueryCanceledError:\n",
        tests=(f"{TESTS}::test_a_lost_connection_sends_the_batch_again_not_each_entry_alone",),
        breaks="a connection lost under a batch sends every entry to run alone",
    ),
    Mutant(
        name="pg-batch-outage-one-batch-a-deadline",
        path=BATCH,
        old="                taken = self._take(everything=True)\n",
        new="                taken = self._take()\n",
        tests=(f"{TESTS}::test_a_database_that_gives_no_connection_fails_the_whole_queue_at_once",),
        breaks="while the database hangs, a queue of callers is answered one deadline per "
        "batch: minutes behind a long queue",
    ),
]
