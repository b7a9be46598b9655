"""No parse of caller input takes more than linear time (gateway/keying.py's depth
check, gateway/config/loading.py's environment references), caught by the tests that
time 8x an input against 1x and the real process that answers others meanwhile."""

from tests.mutants import Mutant

K = "tests/test_keys.py::test_no_body_takes_more_than_linear_time_to_parse"

MUTANTS = [
    Mutant(
        name="json-string-pattern-backtracks",
        path="gateway/keying.py",
        old="""_JSON_STRING = re.compile("""
        """r'"[^"\\\\]*(?:\\\\(?:.|\\Z)[^"\\\\]*)*(?:"|\\Z)', re.DOTALL)""",
        new="""_JSON_STRING = re.compile(r'"[^"\\\\]*(?:\\\\.[^"\\\\]*)*"', re.DOTALL)""",
        tests=(
            K + "[escaped-quotes]",
            "tests/test_hostile.py::test_a_body_built_to_parse_slowly_is_answered_while_others_are",
        ),
        breaks="a string that never closes is tried again at every later quote: 80 KB of "
        "escaped quotes after 65 brackets holds the event loop 20 s, 1 MiB an hour",
    ),
    Mutant(
        name="json-string-pattern-fails-on-a-last-backslash",
        path="gateway/keying.py",
        old="""(?:\\\\(?:.|\\Z)[^"\\\\]*)*""",
        new="""(?:\\\\.[^"\\\\]*)*""",
        tests=(K + "[escaped-quotes-then-backslash]", K + "[quote-backslash]"),
        breaks="a body ending in a lone backslash inside a string makes the pattern fail past "
        "its quote: quadratic again",
    ),
    Mutant(
        name="env-reference-pattern-backtracks",
        path="gateway/config/loading.py",
        old='_ENV_RE = re.compile(r"\\$\\$\\{|\\$\\{([^}]*)\\}?")',
        new='_ENV_RE = re.compile(r"\\$\\$\\{|\\$\\{([^}]*)\\}|\\$\\{")',
        tests=("tests/test_config.py::test_env_references_are_read_in_linear_time",),
        breaks="a config line of `${` that never close takes quadratic time to load",
    ),
]
