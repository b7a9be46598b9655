"""Every answer of the admin listener is the gateway's own: problem+json, or the
console's page (gateway/admin/api.py, gateway/admin/listener.py, gateway/console/site.py),
with the proxy listener's guards against hostile clients;
and /readyz says a store's refusal in the gateway's words (StoreInfo.refusal in
gateway/store/base.py). Caught by tests/test_admin_listener.py (a real process, raw
bytes) and tests/test_store_info.py."""

from tests.mutants import Mutant

L = "tests/test_admin_listener.py::"
INFO = "tests/test_store_info.py::"

MUTANTS = [
    Mutant(
        name="admin-unmatched-as-plain-text",
        path="gateway/admin/api.py",
        old="            HTTPException: unmatched,\n",
        new="",
        tests=(L + "test_paths_and_methods_nothing_serves_are_the_gateways_answers",),
        breaks="a path nothing serves, or a method a path does not take, gets Starlette's "
        "text/plain 404 or 405 on the operator API, health and metrics paths",
    ),
    Mutant(
        name="console-unmatched-as-plain-text",
        path="gateway/console/site.py",
        old="            HTTPException: _unmatched,\n",
        new="",
        tests=(L + "test_paths_and_methods_nothing_serves_are_the_gateways_answers",),
        breaks="a console page that is not there, or a form path opened with GET, gets "
        "Starlette's text/plain 404 or 405 instead of the console's page",
    ),
    Mutant(
        name="admin-failure-as-plain-text",
        path="gateway/admin/api.py",
        old="            Exception: failed,\n",
        new="",
        tests=(L + "test_a_handler_that_fails_answers_in_the_gateways_words",),
        breaks="an exception no handler expected answers Starlette's text/plain 500",
    ),
    Mutant(
        name="console-failure-as-plain-text",
        path="gateway/console/site.py",
        old="            Exception: _failed,\n",
        new="",
        tests=(L + "test_a_handler_that_fails_answers_in_the_gateways_words",),
        breaks="an exception under a console page answers Starlette's text/plain 500",
    ),
    Mutant(
        name="admin-listener-stock-uvicorn",
        path="gateway/serve.py",
        old="create_admin_app(gateway), config.admin.listen, admin_protocol(settings), "
        "date_header=True",
        new='create_admin_app(gateway), config.admin.listen, "auto", date_header=True',
        tests=(
            L + "test_requests_that_are_not_http_get_a_problem",
            L + "test_a_150_mb_head_is_cut_off_at_the_bound",
            L + "test_a_trickled_head_and_a_stalled_body_time_out",
            L + "test_connections_over_the_cap_are_refused",
        ),
        breaks="the admin listener runs stock uvicorn: a request head of any size held in "
        "memory, no head or body deadline, no connection cap, text/plain 400s",
    ),
    Mutant(
        name="admin-not-http-as-the-proxys-malformed-request",
        path="gateway/admin/listener.py",
        old="        return NotHttp(detail)\n",
        new="        return super().malformed(detail)\n",
        tests=(L + "test_requests_that_are_not_http_get_a_problem",),
        breaks="the admin listener's unparsable requests get the proxy's type, which says "
        "the request was not forwarded",
    ),
    Mutant(
        name="admin-refusal-with-two-dates",
        path="gateway/http/protocol.py",
        old='            if not any(name == b"date" for name, _ in default):',
        new="            if True:",
        tests=(L + "test_a_trickled_head_and_a_stalled_body_time_out",),
        breaks="the admin listener's refusals carry two Date headers (uvicorn's and the "
        "listener's)",
    ),
    Mutant(
        name="admin-key-stops-at-a-newline",
        path="gateway/admin/api.py",
        old='    regex = "(?s:.*)"\n',
        new='    regex = ".*"\n',
        tests=(L + "test_paths_and_methods_nothing_serves_are_the_gateways_answers",),
        breaks="a key with a line break in it is a path nothing serves, not a key",
    ),
    Mutant(
        name="admin-deep-json-is-a-500",
        path="gateway/admin/api.py",
        old="    except RecursionError:\n",
        new="    except ZeroDivisionError:\n",
        tests=(L + "test_a_body_nested_deeper_than_json_is_read_is_refused",),
        breaks="a body of deeply nested JSON raises RecursionError: a 500, not a 400",
    ),
    Mutant(
        name="readyz-repeats-redis",
        path="gateway/records.py",
        old='            found = f"{where} did not say its maxmemory-policy (its INFO was '
        'refused)"\n',
        new='            found = f"{where} did not say its maxmemory-policy ({self.error})"\n',
        tests=(INFO + "test_readiness_says_an_acl_refusal_in_the_gateways_words",),
        breaks="/readyz, which needs no token, repeats Redis's own refusal text",
    ),
]
