"""Broken builds the soak (tests/test_soak.py) and the isolation checks
(tests/test_isolation.py) must catch."""

from tests.mutants import Mutant

SOAK = "tests/test_soak.py::test_soak_mixed_traffic_with_faults"
ISOLATION = "tests/test_isolation.py"

RECONCILE_DONE_RERUNS = Mutant(
    name="reconcile-done-reruns",
    path="gateway/reconcile.py",
    old='            return "done", {"status": response.status}',
    new='            return "not_done", {"status": response.status}',
    tests=(SOAK,),
    breaks="a status check that says the work ran releases the key, so it runs again",
)

MUTANTS = [
    Mutant(
        name="claim-while-in-flight",
        path="gateway/store/redis/lua/claim.lua",
        old="if not state or state == 'released' then",
        new="if not state or state == 'released' or state == 'in_flight' then",
        tests=(SOAK,),
        breaks="a duplicate on another gateway claims a key that is in flight and runs it again",
    ),
    Mutant(
        name="unknown-outcome-released",
        path="gateway/engine/core.py",
        old='if route.on_unknown_outcome == "release":',
        new="if True:",
        tests=(SOAK,),
        breaks="a request that timed out after it was sent is released and resent blind",
    ),
    Mutant(
        name="dead-gateway-lease-released",
        path="gateway/store/base.py",
        old='"reconcile": "unresolved",',
        new='"reconcile": "release",',
        tests=(SOAK,),
        breaks="a killed gateway's in-flight key is released blind when its lease runs out",
    ),
    RECONCILE_DONE_RERUNS,
    Mutant(
        name="scope-ignored",
        path="gateway/engine/core.py",
        old="record_digest(route.name, scope_value(route.key, parts), key)",
        new='record_digest(route.name, "", key)',
        tests=(f"{ISOLATION}::test_scope_never_replays_across_tenants",),
        breaks="one tenant is replayed another's response for the same key",
    ),
    Mutant(
        name="admin-token-from-query",
        path="gateway/admin/api.py",
        old="return gateway, gateway.operators.authenticate(request.headers, client)",
        new="return gateway, gateway.operators.authenticate({**request.headers, "
        '"authorization": "Bearer " + request.query_params["access_token"]} '
        'if "access_token" in request.query_params else request.headers, client)',
        tests=(
            f"{ISOLATION}::test_bad_admin_tokens_get_401_and_change_nothing",
            "tests/test_admin.py::test_every_operator_call_without_the_token_is_unauthorized",
        ),
        breaks="the admin token is accepted from the query string, where logs keep it",
    ),
    Mutant(
        name="admin-token-plain-compare",
        path="gateway/operators/identity.py",
        old="if hmac.compare_digest(given, digest) and found is None:",
        new="if given == digest and found is None:",
        tests=(
            f"{ISOLATION}::test_admin_token_is_compared_in_constant_time",
            "tests/test_admin.py::test_a_token_is_decided_by_compare_digest_alone",
        ),
        breaks="the admin token is compared with ==, which leaks it through timing",
    ),
    Mutant(
        name="admin-listens-everywhere",
        path="gateway/config/admin.py",
        old='listen: ListenAddress = "127.0.0.1:9090"',
        new='listen: ListenAddress = "0.0.0.0:9090"',
        tests=(f"{ISOLATION}::test_admin_listener_defaults_to_loopback_in_a_real_process",),
        breaks="the operator API is reachable from other hosts unless configured otherwise",
    ),
    Mutant(
        name="store-url-password-logged",
        path="gateway/config/addresses.py",
        old="shown = show(mask_url(url))",
        new="shown = show(url)",
        tests=(f"{ISOLATION}::test_logs_never_contain_secrets",),
        breaks="a rejected config reload logs the Redis password inside the store URL",
    ),
    Mutant(
        name="numeric-token-echoed",
        path="gateway/config/types.py",
        old='f"expected text, got {secret_kind(token)}; quote it"',
        new='f"expected text, got {show(token)}; quote it"',
        tests=(f"{ISOLATION}::test_config_errors_never_show_passwords_or_tokens",),
        breaks="an admin token YAML reads as a number is repeated in the error and the log",
    ),
]
