"""What an operator sees of a delivery's stored request and of a stored response
(gateway/operators/redaction.py, admin.show_headers and admin.show_query in
gateway/config/admin.py), caught by tests/test_redaction.py."""

from tests.mutants import Mutant

R = "tests/test_redaction.py::"

MUTANTS = [
    Mutant(
        name="redaction-shows-every-value",
        path="gateway/operators/redaction.py",
        old="        ShownValue(name, value if name.lower() in names else None, len(value))\n",
        new="        ShownValue(name, value, len(value))\n",
        tests=(
            R + "test_the_api_shows_harmless_values_and_the_length_of_the_rest[plain-vera]",
            R + "test_the_console_shows_harmless_values_and_the_length_of_the_rest[encrypted-vera]",
            R + "test_keys_show_prints_harmless_values_and_the_length_of_the_rest[plain-table]",
        ),
        breaks="a viewer reads the caller's X-Api-Key, X-Auth-Token and signature in the "
        "console, the API and `keys show`, encrypted at rest or not",
    ),
    Mutant(
        name="redaction-show-headers-takes-credentials",
        path="gateway/config/admin.py",
        old='        for name in sorted(CREDENTIAL_HEADERS & (values.get("show_headers") or '
        "frozenset())):\n",
        new="        for name in ():\n",
        tests=(R + "test_show_headers_never_shows_credentials",),
        breaks="admin.show_headers: [Authorization] is accepted, and every operator reads "
        "the callers' bearer tokens",
    ),
    Mutant(
        name="redaction-shows-every-query-value",
        path="gateway/operators/redaction.py",
        old="        shown.append(ShownValue(name, value if name in parameters else None, "
        "len(value)))\n",
        new="        shown.append(ShownValue(name, value, len(value)))\n",
        tests=(
            R + "test_the_api_shows_harmless_values_and_the_length_of_the_rest[plain-vera]",
            R + "test_the_console_shows_harmless_values_and_the_length_of_the_rest[encrypted-vera]",
            R + "test_keys_show_prints_harmless_values_and_the_length_of_the_rest[plain-table]",
        ),
        breaks="a viewer reads the caller's ?api_key= and signature parameters in the "
        "console, the API and `keys show`",
    ),
    Mutant(
        name="redaction-shows-every-response-header",
        path="gateway/operators/redaction.py",
        old="        ShownValue(name, value if name.lower() in shown else None, len(value))\n",
        new="        ShownValue(name, value, len(value))\n",
        tests=(
            R + "test_a_stored_response_shows_harmless_header_values_and_the_length_of_the_rest",
        ),
        breaks="the key page shows a token the upstream answered its caller with (in a "
        "stored response's header) to every operator and viewer",
    ),
]
