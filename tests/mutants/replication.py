"""Broken builds for `store.wait_for_replicas` on every topology, and for the answer a
caller gets when something unexpected fails (tests/test_store_replication.py,
tests/test_store_contract.py, tests/test_hostile.py, tests/test_listener.py)."""

from tests.mutants import Mutant

REPL = "tests/test_store_replication.py"
CONTRACT = "tests/test_store_contract.py"
TOPOLOGY = "gateway/store/redis/topology.py"

MUTANTS = [
    Mutant(
        name="cluster-wait-through-the-cluster-pipeline",
        path=TOPOLOGY,
        old="    if not isinstance(client, _QueueingCluster):\n",
        new="    if True:\n",
        tests=(
            f"{CONTRACT}::test_claim_free_key_then_read_it[cluster+wait]",
            f"{CONTRACT}::test_accept_queues_a_free_key_with_its_request_and_token[cluster+wait]",
            f"{REPL}::test_wait_for_replicas_works_on_a_cluster",
        ),
        breaks="on a Cluster with wait_for_replicas, redis-py's pipeline refuses EVALSHA: "
        "every keyed request a bare 500, no job ever runs",
    ),
    Mutant(
        name="cluster-wait-on-another-connection",
        path=TOPOLOGY,
        old="    reply, acked = await client.on_slot_owner(keys[0], commands)\n"
        "    if isinstance(reply, NoScriptError)",
        new="    reply, acked = (\n"
        "        (await client.on_slot_owner(keys[0], commands[:1]))[0],\n"
        "        await client.execute_command(*commands[1]),\n"
        "    )\n"
        "    if isinstance(reply, NoScriptError)",
        tests=(f"{REPL}::test_on_a_cluster_the_wait_counts_the_key_owners_replicas",),
        breaks="WAIT goes where redis-py sends a keyless command, on another connection: "
        "it counts replicas that never saw the script's write, so a claim a failover can "
        "lose counts as confirmed",
    ),
    Mutant(
        name="cluster-wait-ignores-a-moved-slot",
        path=TOPOLOGY,
        old="                    if isinstance(replies[0], MovedError):\n",
        new="                    if False:\n",
        tests=(f"{REPL}::test_a_cluster_wait_follows_a_moved_slot_a_lost_connection_and_noscript",),
        breaks="after a resharding or a failover the script gets MOVED and the call is a "
        "store error (503) until the client's slot map is read again",
    ),
    Mutant(
        name="cluster-wait-gives-up-on-a-lost-connection",
        path=TOPOLOGY,
        old="                    elif not any(isinstance(r, _LOST) for r in replies):\n",
        new="                    else:\n",
        tests=(f"{REPL}::test_a_cluster_wait_follows_a_moved_slot_a_lost_connection_and_noscript",),
        breaks="a pooled connection the server closed fails the claim or accept (503) instead "
        "of being tried again on a new one, as every other store call is",
    ),
    Mutant(
        name="cluster-wait-never-loads-its-script",
        path=TOPOLOGY,
        old="    if isinstance(reply, NoScriptError) and loads is not None:\n",
        new="    if False:\n",
        tests=(f"{REPL}::test_a_cluster_wait_follows_a_moved_slot_a_lost_connection_and_noscript",),
        breaks="after a restart or SCRIPT FLUSH every claim and accept with wait_for_replicas "
        "on a Cluster fails with NOSCRIPT (503) for ever",
    ),
    Mutant(
        name="unconfirmed-accept-passed-as-confirmed",
        path="gateway/store/redis/delivery.py",
        old="            return replace(accepted, confirmed=False)\n",
        new="            return accepted\n",
        tests=(
            f"{REPL}::test_an_accept_the_replicas_did_not_confirm_is_queued_unconfirmed",
            f"{REPL}::test_on_a_cluster_the_wait_counts_the_key_owners_replicas",
        ),
        breaks="an accept no replica confirmed answers a plain 202: the caller is not told a "
        "failover could still lose it",
    ),
    Mutant(
        name="unconfirmed-accept-is-a-store-error",
        path="gateway/store/redis/delivery.py",
        old="            return replace(accepted, confirmed=False)\n",
        new="            raise StoreError('only some replicas confirmed the accepted delivery')\n",
        tests=(f"{REPL}::test_accepts_a_stopped_replica_did_not_confirm_say_so_and_run_once",),
        breaks="an accept no replica confirmed answers 503 store-unavailable ('retry later') "
        "while the job stays queued and runs: the caller believes it was refused",
    ),
    Mutant(
        name="unconfirmed-accept-answered-accepted",
        path="gateway/engine/core.py",
        old='"accepted" if accepted.confirmed else "accepted_unconfirmed"',
        new='"accepted"',
        tests=(f"{REPL}::test_accepts_a_stopped_replica_did_not_confirm_say_so_and_run_once",),
        breaks="the engine answers an unconfirmed accept with the plain 202 of a confirmed one",
    ),
    Mutant(
        name="lost-accept-said-not-forwarded",
        path="gateway/engine/refusals.py",
        old='    if route.delivery.mode == "async":\n        detail = (',
        new="    if False:\n        detail = (",
        tests=(
            "tests/test_delivery.py::test_an_accept_whose_answer_was_lost_is_not_said_to_be_refused",
        ),
        breaks="an accept the store wrote before failing is answered 'did not forward the "
        "request' while it is queued and runs",
    ),
    Mutant(
        name="memory-store-takes-wait-for-replicas",
        path="gateway/config/store.py",
        old="            _check_memory(given, problems)\n",
        new="            pass\n",
        tests=("tests/test_config.py::test_memory_store_refuses_wait_for_replicas",),
        breaks="check-config accepts wait_for_replicas on memory://, which has no replicas: "
        "a confirmation promised and never made",
    ),
    Mutant(
        name="unexpected-error-left-to-the-server",
        path="gateway/proxy/app.py",
        old="        except Exception as exc:\n            # Nothing a caller sends",
        new="        except StoreError as exc:\n            # Nothing a caller sends",
        tests=(
            "tests/test_hostile.py::test_an_unexpected_error_is_a_problem_answer_and_a_logged_cause",
        ),
        breaks="an unexpected error on the proxy's path is answered without its route, by the "
        "listener's last resort, and not counted",
    ),
    Mutant(
        name="listener-last-resort-is-a-bare-500",
        path="gateway/http/cycle.py",
        old="        _, headers, payload = internal_error(exc, self.scope, None).render()\n",
        new="        headers, payload = [(b'content-type', b'text/plain; charset=utf-8'), "
        "(b'content-length', b'21')], b'Internal Server Error'\n",
        tests=(
            "tests/test_listener.py::test_an_app_that_fails_before_answering_gets_a_problem_not_a_bare_500",
        ),
        breaks="an app that fails before answering gets uvicorn's text/plain 500, no problem+json, "
        "no logged cause",
    ),
    Mutant(
        name="sentinel-pool-refuses-past-its-size",
        path="gateway/store/redis/topology.py",
        old="            connection_pool_class=_QueueingSentinelPool,\n",
        new="",
        tests=("tests/test_sentinel.py::test_a_burst_past_the_pool_waits_for_a_connection",),
        breaks="on Sentinel, store calls past store.max_connections fail (503s in a burst, a "
        "listing's bucket reads refused) instead of waiting for a connection",
    ),
]

# A delivery's pick is the write that lets an attempt reach the upstream: with
# wait_for_replicas it is confirmed as a claim is, and put back unsent when it is not
# (gateway/store/redis/delivery.py, lua/pick.lua, lua/put_back.lua, gateway/delivery/worker.py).
DELIVERY = "gateway/store/redis/delivery.py"
PUT_BACK = f"{CONTRACT}::test_a_pick_the_replicas_did_not_confirm_is_put_back_unsent"
RETRIED = f"{REPL}::test_a_retried_pick_that_finds_its_own_pick_still_needs_the_replicas"

MUTANTS += [
    Mutant(
        name="pick-without-wait",
        path=DELIVERY,
        old="        if self.wait_for_replicas:\n            # The pick is what lets",
        new="        if False:\n            # The pick is what lets",
        tests=(f"{PUT_BACK}[redis+wait]", RETRIED),
        breaks="a delivery attempt goes out on a pick no replica holds: a failover loses "
        "the pick and the job runs again",
    ),
    Mutant(
        name="unconfirmed-pick-sent-anyway",
        path=DELIVERY,
        old="        if reply[0] == 1 and acked is not None and acked < self.wait_for_replicas:\n",
        new="        if False:\n",
        tests=(f"{PUT_BACK}[sentinel+wait]", RETRIED),
        breaks="the store waits for the replicas, then sends the attempt whatever they said",
    ),
    Mutant(
        name="put-back-counts-the-attempt",
        path="gateway/store/redis/lua/put_back.lua",
        old="local attempts = math.max(0, tonumber(rec[4] or '1') - 1)\n",
        new="local attempts = tonumber(rec[4] or '1')\n",
        tests=(f"{PUT_BACK}[cluster+wait]",),
        breaks="an attempt that was never sent uses up one of the route's retry.attempts",
    ),
    Mutant(
        name="put-back-history-grows-per-try",
        path="gateway/store/redis/lua/put_back.lua",
        old="if last and last.event == 'put_back' and last.reason == ARGV[5] then\n",
        new="if false then\n",
        tests=(RETRIED,),
        breaks="while a replica is down every retried pick adds an event: the record's "
        "history grows for as long as the outage lasts",
    ),
    Mutant(
        name="retried-pick-is-gone",
        path="gateway/store/redis/lua/pick.lua",
        old="if state == 'in_flight' and rec[4] == ARGV[3] and rec[5] == '1' then\n",
        new="if false then\n",
        tests=(f"{CONTRACT}::test_a_pick_repeated_by_its_own_run_is_that_pick[redis]", RETRIED),
        breaks="a pick whose reply was lost is found 'gone' by its repeat: the delivery stays "
        "in flight, unsent, until its lease makes it an unknown outcome",
    ),
    Mutant(
        name="memory-retried-pick-is-gone",
        path="gateway/store/memory.py",
        old="            and record.run_id == run_id\n        ):",
        new="            and record.run_id == 'never'\n        ):",
        tests=(f"{CONTRACT}::test_a_pick_repeated_by_its_own_run_is_that_pick[memory]",),
        breaks="the memory store's pick repeated by its run finds its delivery 'gone'",
    ),
    Mutant(
        name="worker-new-run-id-per-pick-retry",
        path="gateway/delivery/worker.py",
        old='self.engine, route, due.ref, self.replica, run_id, verdict == "probe"\n',
        new='self.engine, route, due.ref, self.replica, secrets.token_hex(8), verdict == "probe"\n',
        tests=("tests/test_delivery.py::test_a_pick_whose_reply_was_lost_is_found_by_its_repeat",),
        breaks="a pick retried after a store error is another run: it cannot find what its "
        "first try took, which stays in flight until its lease runs out",
    ),
]
