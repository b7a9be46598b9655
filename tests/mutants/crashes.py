"""Process faults: builds that lose or free keys when a gateway or Redis dies."""

from tests.mutants import Mutant

FAULTS = "tests/test_faults_process.py"
EACH_POINT = f"{FAULTS}::test_gateway_sigkill_at_each_point_of_a_request"
REDIS_NONE = f"{FAULTS}::test_redis_sigkill_and_restart_mid_load[none]"
REDIS_AOF = f"{FAULTS}::test_redis_sigkill_and_restart_mid_load[aof-always]"

MUTANTS = [
    Mutant(
        name="lease-expiry-frees",
        path="gateway/store/lua/_lib.lua",
        old="  if policy == 'release' then\n",
        new="  if true then\n",
        tests=(EACH_POINT,),
        breaks="a dead gateway's key is freed when its lease runs out, though the work may "
        "have run: a repeat runs it again",
    ),
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
]
