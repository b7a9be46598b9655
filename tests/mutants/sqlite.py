"""The SQLite store's rules, broken one at a time: its transactions, its notices, its
counts, its schema's guards."""

from tests.mutants import Mutant

CONTRACT = "tests/test_store_contract.py"
SQLITE = "tests/test_store_sqlite.py"
PROCESS = "tests/test_sqlite_process.py"
STATES = "tests/test_store_states.py::test_store_state_machine_sqlite"

DATABASE = "gateway/store/sqlite/database.py"
SCHEMA = "gateway/store/sqlite/schema.py"
STORE = "gateway/store/sqlite/store.py"
ROWS = "gateway/store/sqlite/rows.py"
DELIVERY = "gateway/store/sqlite/delivery.py"
NOTICES = "gateway/store/sqlite/notices.py"

MUTANTS = [
    Mutant(
        name="sqlite-new-worker-unheard",
        path=NOTICES,
        old="            if data == HELLO:\n                self._peers_at = -PEERS_TTL\n",
        new="            if data == HELLO:\n",
        tests=(f"{SQLITE}::test_a_waiter_in_another_store_is_woken_by_the_notice",),
        breaks="a worker that started after another listed the folder gets none of its "
        "notices for a second: its waiters wait for the fallback re-read",
    ),
    Mutant(
        name="sqlite-turns-not-taken",
        path=DATABASE,
        old="        if self._fd is None or not self.shared:\n            return True",
        new="        if True:\n            return True",
        tests=(
            f"{SQLITE}::test_a_worker_waits_its_turn_at_the_write_lock_in_the_kernels_queue",
            f"{SQLITE}::test_a_worker_holding_the_write_lock_too_long_gets_a_store_error_answered",
        ),
        breaks="workers sharing the file wait for its lock by SQLite's growing sleeps: one "
        "starves for seconds while the other commits back to back",
    ),
    Mutant(
        name="sqlite-claim-takes-any-key",
        path=STORE,
        old="            if found is not None:\n                return found\n            fresh",
        new="            fresh",
        tests=(
            f"{CONTRACT}::test_claim_free_key_then_read_it[sqlite]",
            f"{CONTRACT}::test_concurrent_first_claims_one_wins[sqlite]",
        ),
        breaks="a claim overwrites a key in flight or completed: the key runs twice",
    ),
    Mutant(
        name="sqlite-deferred-transaction",
        path=DATABASE,
        old='            conn.execute("BEGIN IMMEDIATE")\n        except sqlite3.Error as exc:\n'
        "            self._answers",
        new='            conn.execute("BEGIN DEFERRED")\n        except sqlite3.Error as exc:\n'
        "            self._answers",
        tests=(f"{SQLITE}::test_stores_claiming_the_same_keys_at_once_each_wait_their_turn",),
        breaks="a batch reads before it holds the write lock: two workers read a key free "
        "at once, and the second's write fails (SQLITE_BUSY_SNAPSHOT) instead of waiting",
    ),
    Mutant(
        name="sqlite-undone-transaction-goes-on",
        path=DATABASE,
        old="                if not conn.in_transaction:\n                    # SQLite rolled",
        new="                if False:\n                    # SQLite rolled",
        tests=(f"{SQLITE}::test_a_full_file_is_a_store_error_never_a_500",),
        breaks="after SQLite undid a transaction whole (a full disk), the batch's later "
        "operations run outside any transaction and every caller is told its operation "
        "failed, though some were committed",
    ),
    Mutant(
        name="sqlite-unguarded-failure-commits",
        path=DATABASE,
        old='                    conn.execute("ROLLBACK")\n'
        "                    return batch, True\n",
        new="                    pass\n",
        tests=(
            f"{SQLITE}::test_one_failing_operation_fails_alone",
            f"{SQLITE}::test_an_operation_failing_half_way_in_a_batch_is_undone_alone",
        ),
        breaks="an operation that fails after a write, in a batch run without savepoints, "
        "keeps that write: half an operation is committed",
    ),
    Mutant(
        name="sqlite-failed-operation-keeps-its-deferred-write",
        path=DATABASE,
        old="            except Exception as exc:\n                self._deferred = deferred\n",
        new="            except Exception as exc:\n",
        tests=(f"{SQLITE}::test_a_deferred_write_runs_once_per_commit_and_goes_with_a_failure",),
        breaks="a write an operation deferred to the commit stays though the operation "
        "failed: a route's last success is one whose completion was undone",
    ),
    Mutant(
        name="sqlite-accept-past-the-bound",
        path=DELIVERY,
        old="    \" AND state IN ('queued', 'retrying')) < ?9\"",
        new="    \" AND state IN ('queued', 'retrying')) <= ?9\"",
        tests=(f"{CONTRACT}::test_accept_admits_exactly_the_limit_of_a_burst[sqlite]",),
        breaks="a new key is queued on a route whose queue is at its bound: max_queued "
        "admits one more than it says",
    ),
    Mutant(
        name="sqlite-answer-to-a-gone-caller",
        path=DATABASE,
        old="        if call.future.done():\n            continue\n",
        new="",
        tests=(f"{SQLITE}::test_callers_that_are_gone_leave_the_thread_serving",),
        breaks="an answer for a caller cancelled while its operation ran (a client gone) "
        "raises on the loop, and the callers answered after it in the batch wait forever",
    ),
    Mutant(
        name="sqlite-one-commit-per-operation",
        path=DATABASE,
        old="            while len(batch) < self.max_batch:",
        new="            while len(batch) < 1:",
        tests=(f"{SQLITE}::test_claims_of_many_callers_share_commits",),
        breaks="no group commit: every claim and completion pays an fsync of its own",
    ),
    Mutant(
        name="sqlite-no-notices-between-workers",
        path=STORE,
        old="        self.notices.publish(effects)\n",
        new="",
        tests=(f"{SQLITE}::test_a_waiter_in_another_store_is_woken_by_the_notice",),
        breaks="a duplicate waiting in another worker is answered only at its next "
        "fallback re-read, not when the key completes",
    ),
    Mutant(
        name="sqlite-counts-not-kept",
        path=ROWS,
        old="        if before == after:\n            return\n",
        new="        return\n",
        tests=(STATES, f"{CONTRACT}::test_accept_admits_exactly_the_limit_of_a_burst[sqlite]"),
        breaks="the kept counts drift from the records: stats, queue_stats and an async "
        "route's bound are wrong",
    ),
    Mutant(
        name="sqlite-settled-request-kept",
        path=ROWS,
        old='            blobs.setdefault("request", None)\n',
        new="            pass\n",
        tests=(STATES,),
        breaks="a settled delivery keeps its stored request (a body the gateway no "
        "longer needs stays on disk)",
    ),
    Mutant(
        name="sqlite-pick-ignores-due",
        path=DELIVERY,
        old="            elif record.due_ms > now:\n",
        new="            elif False:\n",
        tests=(STATES, f"{CONTRACT}::test_pick_never_claims_a_delivery_that_is_not_due[sqlite]"),
        breaks="a delivery is attempted before its retry is due",
    ),
    Mutant(
        name="sqlite-newer-schema-accepted",
        path=SCHEMA,
        old="        if version > newest:\n",
        new="        if False:\n",
        tests=(f"{PROCESS}::test_a_file_the_gateway_cannot_use_stops_the_start",),
        breaks="a file a newer gateway wrote is opened by an older one, which misreads it",
    ),
    Mutant(
        name="sqlite-foreign-file-accepted",
        path=SCHEMA,
        old="        if app != APPLICATION_ID and (app != 0 or tables):\n",
        new="        if False:\n",
        tests=(f"{PROCESS}::test_a_file_the_gateway_cannot_use_stops_the_start",),
        breaks="another program's database is taken over: the gateway's tables are added to it",
    ),
    Mutant(
        name="sqlite-read-only-stops-the-start",
        path=SCHEMA,
        old="            if not _read_only(exc) or not _current(conn):\n",
        new="            if True:\n",
        tests=(f"{SQLITE}::test_a_read_only_file_is_a_store_error_never_a_500",),
        breaks="a read-only file stops the start instead of answering 503 (or fail_open) "
        "until it is writable",
    ),
    Mutant(
        name="sqlite-shared-notice-folder-used",
        path=NOTICES,
        old="            if shared:\n",
        new="            if False:\n",
        tests=(f"{SQLITE}::test_a_notice_folder_open_to_others_is_not_used",),
        breaks="a notice folder another user can read or write is used: they read the "
        "keys and routes of every change, or pose as a worker",
    ),
    Mutant(
        name="sqlite-notice-due-unchecked",
        path=NOTICES,
        old="            and all(type(part) is int for part in item[3:5])\n",
        new="",
        tests=(f"{SQLITE}::test_notices_from_anything_but_a_worker_are_dropped",),
        breaks="a datagram with a due time that is not a number reaches the delivery "
        "workers, which compare it with their clock and fail",
    ),
    Mutant(
        name="sqlite-dead-lease-released",
        path=STORE,
        old='        if policy == "release" and not record.delivery:\n',
        new="        if not record.delivery:\n",
        tests=(
            f"{CONTRACT}::test_expired_lease_turns_unresolved_never_free[sqlite]",
            f"{PROCESS}::test_sigkill_of_every_worker_loses_nothing_and_runs_nothing_twice",
        ),
        breaks="a key whose gateway died mid-forward is freed when its lease runs out, "
        "whatever the route says: the next repeat sends it again",
    ),
    Mutant(
        name="sqlite-plain-completion-drops-history",
        path=STORE,
        old="AND state = 'in_flight' AND history = '[]'",
        new="AND state = 'in_flight'",
        tests=(f"{CONTRACT}::test_check_not_done_releases_and_next_claim_keeps_history[sqlite]",),
        breaks="a key run again after a release completes without its `completed` event: "
        "its story, as the operators read it, stops at the release",
    ),
    Mutant(
        name="sqlite-new-key-claim-takes-any",
        path=STORE,
        old='" ON CONFLICT (digest) DO NOTHING"',
        new='" ON CONFLICT (digest) DO UPDATE SET run_id = excluded.run_id"',
        tests=(
            f"{CONTRACT}::test_claim_free_key_then_read_it[sqlite]",
            f"{CONTRACT}::test_concurrent_first_claims_one_wins[sqlite]",
        ),
        breaks="a claim of a key that has a row takes it over: the key runs twice",
    ),
    Mutant(
        name="sqlite-default-file-in-the-working-directory",
        path="gateway/config/store.py",
        old="    folder = os.path.dirname(os.path.abspath(source))\n",
        new="    folder = os.getcwd()\n",
        tests=(
            "tests/test_config.py::test_no_store_url_is_sqlite_beside_the_config_file",
            f"{PROCESS}::test_no_store_url_is_a_sqlite_file_beside_the_config_that_survives_sigkill",
        ),
        breaks="with no store.url the file lands wherever the gateway was started: a "
        "service started from another directory opens an empty store and runs keys again",
    ),
    Mutant(
        name="sqlite-default-only-without-a-store-section",
        path="gateway/config/model.py",
        old='            if not (store and {"url", "sentinel", "cluster"} & store.keys()):\n',
        new="            if store is None:\n",
        tests=("tests/test_config.py::test_no_store_url_is_sqlite_beside_the_config_file",),
        breaks="a store section without a url (a prefix, a key) leaves the file relative "
        "to the working directory",
    ),
    Mutant(
        name="memory-start-silent-about-keeping-nothing",
        path="gateway/config/summary.py",
        old='        return f"memory ({MEMORY_KEEPS_NOTHING})"\n',
        new="        return store.kind\n",
        tests=(f"{PROCESS}::test_memory_says_at_start_that_it_keeps_nothing",),
        breaks="memory:// starts without saying that a restart forgets every key",
    ),
    Mutant(
        name="sqlite-default-refusal-silent-about-store-url",
        path="gateway/cli.py",
        old="        if is_default_store(store, config.source):\n",
        new="        if False:\n",
        tests=(f"{PROCESS}::test_a_default_file_that_cannot_be_opened_names_store_url",),
        breaks="a default file that cannot be opened stops the start without naming the "
        "setting that moves it",
    ),
    Mutant(
        name="sqlite-image-without-a-volume",
        path="deploy/Dockerfile",
        old="VOLUME /var/lib/idempotency-gateway\n",
        new="",
        tests=("tests/test_deploy.py::test_the_sqlite_compose_keeps_the_database_on_a_volume",),
        breaks="the image keeps the SQLite file in the container's layer: a new container "
        "starts empty and runs every completed key again",
    ),
    Mutant(
        name="sqlite-file-swapped-unnoticed",
        path=DATABASE,
        old="        lost = self.watch.check()\n",
        new='        lost = ""\n',
        tests=(f"{SQLITE}::test_a_file_deleted_or_replaced_under_the_store_refuses_every_write",),
        breaks="the file deleted, replaced or truncated under a running gateway: it goes on "
        "committing to a file no restart finds, and every key it held runs again",
    ),
    Mutant(
        name="sqlite-notice-removes-any-entry",
        path=NOTICES,
        old="            if stat.S_ISSOCK(path.lstat().st_mode):\n",
        new="            if True:\n",
        tests=(f"{SQLITE}::test_what_else_is_in_the_notice_folder_fails_no_write",),
        breaks="a send that fails removes whatever the folder holds under that name, not "
        "only a dead worker's socket",
    ),
    Mutant(
        name="sqlite-notice-skips-the-peer-after-junk",
        path=NOTICES,
        old="        for peer in list(self._others()):",
        new="        for peer in self._others():",
        tests=(f"{SQLITE}::test_what_else_is_in_the_notice_folder_fails_no_write",),
        breaks="an entry dropped from the list of peers while it is walked skips the next "
        "one: a worker is not told of a completion and its waiters sleep to the fallback",
    ),
    Mutant(
        name="sqlite-driver-error-escapes",
        path=DATABASE,
        old="        except (sqlite3.Error, OverflowError) as exc:",
        new="        except OverflowError as exc:",
        tests=(f"{PROCESS}::test_a_file_locked_while_running_is_a_503_then_service_resumes",),
        breaks="a file locked by another program past the timeout is the driver's error, "
        "not a store error: an answer that is not the route's 503",
    ),
]
