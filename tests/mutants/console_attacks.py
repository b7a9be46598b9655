"""Holes an attacker from outside the console and the operator API would use, each
caught by tests/test_console_attacks.py."""

from tests.mutants import Mutant

T = "tests/test_console_attacks.py::"
SSO = "tests/test_console.py::test_the_console_behind_the_documented_single_sign_on_proxy"

MUTANTS = [
    Mutant(
        name="operator-digest-not-checked",
        path="gateway/operators/actions.py",
        old="    if digest is not None and not DIGEST.fullmatch(digest):\n",
        new="    if False:\n",
        tests=(T + "test_a_digest_that_is_no_digest_is_a_bad_request_not_a_crash",),
        breaks="a `?digest=` that is no record id reaches the store: on Redis, one that does "
        "not start with hex crashes the request (500, connection reset, traceback)",
    ),
    Mutant(
        name="operator-api-body-of-any-type",
        path="gateway/admin/api.py",
        old='    if media_type != "application/json":\n',
        new="    if False:\n",
        tests=(
            T + "test_a_cross_site_form_cannot_act_through_the_sso_proxy",
            SSO,
        ),
        breaks="the operator API reads any body as JSON: behind a single-sign-on proxy, "
        "another site's text/plain form takes over and resolves keys as the operator",
    ),
    Mutant(
        name="console-session-outranks-the-sso-proxy",
        path="gateway/console/access.py",
        old="    if _proxy_disowns(request, gateway, session):\n",
        new="    if False:\n",
        tests=(
            T + "test_a_console_session_yields_to_the_user_the_sso_proxy_names",
            SSO,
        ),
        breaks="behind the single-sign-on proxy, a console cookie outlives the proxy's "
        "user: the next person at a shared browser acts as the previous one",
    ),
    Mutant(
        name="refused-credentials-not-logged",
        path="gateway/operators/identity.py",
        old="        log.warning(\n",
        new="        log.debug(\n",
        tests=(T + "test_refused_sign_ins_and_tokens_are_logged_and_never_the_token",),
        breaks="a wrong token at the console or the API leaves no log line: someone "
        "guessing tokens is never seen",
    ),
    Mutant(
        name="console-role-of-the-sign-in",
        path="gateway/console/access.py",
        old="    operator = gateway.operators.by_name(session.name)\n",
        new="    operator = gateway.operators.by_name(session.name) and Operator(\n"
        "        session.name,\n"
        '        __import__("gateway.operators.identity", fromlist=["Role"]).Role.OPERATOR,\n'
        '        "session",\n'
        "    )\n",
        tests=("tests/test_console.py::test_removing_an_operator_signs_them_out",),
        breaks="a session keeps the role its operator had at sign-in: an operator made a "
        "viewer by a reload goes on claiming and resolving until the cookie expires",
    ),
    Mutant(
        name="documented-nginx-block-without-host",
        path="docs/operator-api.md",
        old="    proxy_set_header Host $http_host;",
        new="   ",
        tests=(SSO,),
        breaks="the documented nginx block sends nginx's own Host: behind it, the console "
        "refuses every claim and resolve as a forged post",
    ),
]
