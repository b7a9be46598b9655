"""Process faults: builds that lose or free keys when a gateway or Redis dies."""

from dataclasses import replace

from tests.mutants import Mutant

FAULTS = "tests/test_faults_process.py"
EACH_POINT = f"{FAULTS}::test_gateway_sigkill_at_each_point_of_a_request"
REDIS_NONE = f"{FAULTS}::test_redis_sigkill_and_restart_mid_load[none]"
REDIS_AOF = f"{FAULTS}::test_redis_sigkill_and_restart_mid_load[aof-always]"
STORM = f"{FAULTS}::test_gateway_sigkill_at_random_points_of_a_storm"
LATE_CLAIMS = f"{FAULTS}::test_claims_redis_runs_after_the_gateway_gave_up_are_released"
LANDS_AFTER = "tests/test_proxy.py::test_a_claim_that_lands_after_its_release_is_released_too"
CRASHES = "tests/test_crashes.py"

LEASE_EXPIRY_FREES = Mutant(
    name="lease-expiry-frees",
    path="gateway/store/redis/lua/_lib.lua",
    old="  if policy == 'release' then\n",
    new="  if true then\n",
    tests=(EACH_POINT,),
    breaks="a dead gateway's key is freed when its lease runs out, though the work may "
    "have run: a repeat runs it again",
)

MUTANTS = [
    LEASE_EXPIRY_FREES,
    Mutant(
        name="claim-not-persisted",
        path="gateway/store/redis/lua/claim.lua",
        old="if not state or state == 'released' then\n",
        new="if not state or state == 'released' then do return {1, now} end\n",
        tests=(EACH_POINT, REDIS_AOF),
        breaks="the claim is not stored before the forward: every duplicate runs, and a "
        "gateway that dies mid-request leaves no trace",
    ),
    Mutant(
        name="sweep-frees-unresolved",
        path="gateway/reconcile.py",
        old='                and route.on_unknown_outcome == "reconcile"\n',
        new="                and False\n",
        tests=(EACH_POINT,),
        breaks="the restarted gateway's sweep releases unresolved keys instead of checking "
        "them: work that ran is free to run again",
    ),
    Mutant(
        name="fail-open-when-store-down",
        path="gateway/engine/core.py",
        old='if route.on_store_error == "fail_open":',
        new="if True:",
        tests=(REDIS_AOF,),
        breaks="with Redis down, requests reach the upstream without a claim",
    ),
    Mutant(
        name="store-reset-unnoticed",
        path="gateway/assembly.py",
        old="            if lost:\n",
        new="            if False:\n",
        tests=(REDIS_NONE,),
        breaks="a Redis that came back empty goes unnoticed: no metric, no log",
    ),
    Mutant(
        name="store-reset-marker-expires",
        path="gateway/store/redis/store.py",
        old="pipe.set(marker, token, nx=True)",
        new="pipe.set(marker, token, nx=True, px=1500)",
        tests=(f"{FAULTS}::test_redis_sigkill_and_restart_mid_load[aof-always]",),
        breaks="the marker expires by itself: every replica cries 'store reset' though "
        "nothing was lost",
    ),
    # The same break, each caught by another test on its own.
    replace(
        LEASE_EXPIRY_FREES,
        name="storm-kill-lease-frees",
        tests=(STORM,),
        breaks="keys a killed gateway held in a storm are freed when their leases run out: "
        "the next round's repeats run them again",
    ),
    replace(
        LEASE_EXPIRY_FREES,
        name="restart-lease-frees",
        tests=(
            f"{CRASHES}::test_sigkill_mid_request_then_new_gateway[reconcile]",
            f"{CRASHES}::test_sigkill_mid_request_then_new_gateway[park]",
        ),
        breaks="the gateway started after a SIGKILL frees the dead one's key when its lease "
        "runs out, though the upstream had the request",
    ),
    Mutant(
        name="shutdown-releases-in-flight",
        path="gateway/engine/core.py",
        old="                await guarded(settle.lost(reason), settle)\n"
        "                raise OutcomeUnknown(reason, route=route.name, key=ref.key) from None\n",
        new="                await guarded(settle.retry(reason), settle)\n"
        "                raise OutcomeUnknown(reason, route=route.name, key=ref.key) from None\n",
        tests=(f"{CRASHES}::test_sigterm_past_grace_marks_in_flight_unresolved",),
        breaks="a SIGTERM past the grace frees the keys of forwards still out: their "
        "repeats run again, though the upstream may have done the work",
    ),
    Mutant(
        name="shutdown-without-grace",
        path="gateway/engine/core.py",
        old="await asyncio.wait(set(self.tasks), timeout=grace)",
        new="await asyncio.wait(set(self.tasks), timeout=0)",
        tests=(f"{CRASHES}::test_sigterm_lets_short_requests_finish",),
        breaks="a SIGTERM cuts off forwards that would finish within the grace: their "
        "callers get 504 and their keys need a check",
    ),
    Mutant(
        name="failed-claim-not-released",
        path="gateway/engine/core.py",
        old="                self._release_unsent(route, ref, run_id)\n",
        new="                pass\n",
        tests=(LATE_CLAIMS, LANDS_AFTER),
        breaks="a claim Redis runs after the gateway gave up on it holds a key nothing "
        "was sent for: repeats wait out its lease, then it is an unknown outcome",
    ),
    Mutant(
        name="failed-claim-release-not-read-back",
        path="gateway/engine/core.py",
        old="                record = await self.store.get(ref)\n",
        new="                record = None\n",
        tests=(LANDS_AFTER,),
        breaks="a release that ran before the late claim it undoes is taken as done: the "
        "claim lands after it and holds the key until its lease ends",
    ),
    Mutant(
        name="orphaned-workers-keep-serving",
        path="gateway/cli.py",
        old="sockets=sockets, supervisor_fd=supervisor_fd)",
        new="sockets=sockets, supervisor_fd=None)",
        tests=("tests/test_sqlite_process.py::test_workers_stop_when_their_supervisor_is_killed",),
        breaks="workers of a SIGKILLed supervisor go on answering on the shared listener "
        "with nobody to restart or stop them",
    ),
]
