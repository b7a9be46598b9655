"""The `keys` CLI's input and answers (gateway/admin/client.py): every bad one is a
line that says so, never a traceback; caught by tests/test_keys_cli.py, which runs the
CLI as a process."""

from tests.mutants import Mutant

K = "tests/test_keys_cli.py::"
INPUT = K + "test_bad_input_is_one_line_and_nothing_is_sent"
ANSWER = K + "test_an_answer_that_is_not_the_apis_is_one_line"

MUTANTS = [
    Mutant(
        name="cli-arguments-unchecked",
        path="gateway/admin/client.py",
        old="        _check_arguments(args)\n",
        new="",
        tests=(INPUT + "[key-not-utf8]", INPUT + "[route-not-utf8]"),
        breaks="a key typed with a byte that is not UTF-8 gives UnicodeEncodeError's "
        "traceback instead of a line",
    ),
    Mutant(
        name="cli-token-unchecked",
        path="gateway/admin/client.py",
        old="        _check_token(token, source)\n",
        new="",
        tests=(INPUT + "[token-line-break]", INPUT + "[token-euro]"),
        breaks="a token with a line break or a character outside Latin-1 gives http.client's "
        "traceback",
    ),
    Mutant(
        name="cli-answer-shape-unchecked",
        path="gateway/admin/client.py",
        old="        if not isinstance(doc, dict):\n            raise NotTheApi(",
        new="        if False:\n            raise NotTheApi(",
        tests=(ANSWER + "[claim-list]", ANSWER + "[claim-html]"),
        breaks="an --admin-url that answers 200 with a login page gives JSONDecodeError's "
        "traceback",
    ),
    Mutant(
        name="cli-response-digits-unbounded",
        path="gateway/admin/client.py",
        old="        if count > MAX_DIGITS:\n",
        new="        if False:\n",
        tests=(INPUT + "[response-long-number]",),
        breaks="--response with a number of 5,000 digits prints Python's advice to call "
        "sys.set_int_max_str_digits()",
    ),
]
