"""Process faults: builds that lose or free keys when a gateway or Redis dies."""

from dataclasses import replace

from tests.mutants import Mutant

FAULTS = "tests/test_faults_process.py"
EACH_POINT = f"{FAULTS}::test_gateway_sigkill_at_each_point_of_a_request"
REDIS_NONE = f"{FAULTS}::test_redis_sigkill_and_restart_mid_load[none]"
REDIS_AOF = f"{FAULTS}::test_redis_sigkill_and_restart_mid_load[aof-always]"
STORM = f"{FAULTS}::test_gateway_sigkill_at_random_points_of_a_storm"
CRASHES = "tests/test_crashes.py"

LEASE_EXPIRY_FREES = Mutant(
    name="lease-expiry-frees",
    path="gateway/store/lua/_lib.lua",
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
        path="gateway/store/lua/claim.lua",
        old="if not state or state == 'released' then\n",
        new="if not state or state == 'released' then do return {1, now} end\n",
        tests=(EACH_POINT, REDIS_AOF),
        breaks="the claim is not stored before the forward: every duplicate runs, and a "
        "gateway that dies mid-request leaves no trace",
    ),
    Mutant(
        name="sweep-frees-unresolved",
        path="gateway/reconcile.py",
        old='elif route.on_unknown_outcome == "reconcile" and route.reconcile is not None:',
        new="elif False:",
        tests=(EACH_POINT,),
        breaks="the restarted gateway's sweep releases unresolved keys instead of checking "
        "them: work that ran is free to run again",
    ),
    Mutant(
        name="fail-open-when-store-down",
        path="gateway/engine.py",
        old='if route.on_store_error == "fail_open":',
        new="if True:",
        tests=(REDIS_AOF,),
        breaks="with Redis down, requests reach the upstream without a claim",
    ),
    Mutant(
        name="store-reset-unnoticed",
        path="gateway/app.py",
        old="            if lost:\n",
        new="            if False:\n",
        tests=(REDIS_NONE,),
        breaks="a Redis that came back empty goes unnoticed: no metric, no log",
    ),
    Mutant(
        name="store-reset-marker-expires",
        path="gateway/store/redis.py",
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
        path="gateway/engine.py",
        old="                await settle.lost(reason)\n"
        "                raise OutcomeUnknown(reason, route=route.name, key=ref.key) from None\n",
        new="                await settle.retry(reason)\n"
        "                raise OutcomeUnknown(reason, route=route.name, key=ref.key) from None\n",
        tests=(f"{CRASHES}::test_sigterm_past_grace_marks_in_flight_unresolved",),
        breaks="a SIGTERM past the grace frees the keys of forwards still out: their "
        "repeats run again, though the upstream may have done the work",
    ),
    Mutant(
        name="shutdown-without-grace",
        path="gateway/engine.py",
        old="await asyncio.wait(set(self.tasks), timeout=grace)",
        new="await asyncio.wait(set(self.tasks), timeout=0)",
        tests=(f"{CRASHES}::test_sigterm_lets_short_requests_finish",),
        breaks="a SIGTERM cuts off forwards that would finish within the grace: their "
        "callers get 504 and their keys need a check",
    ),
]
