"""Durations and sizes as written (gateway/config/units.py: ASCII spaces, at most
MAX_DURATION) and a store that cannot keep a duration (the Redis scripts check theirs
before they write), caught by tests/test_config.py and tests/test_store_contract.py."""

from tests.mutants import Mutant

C = "tests/test_config.py::"
WHOLE = "tests/test_store_contract.py::test_a_settling_write_happens_whole_or_not_at_all"

MUTANTS = [
    Mutant(
        name="units-any-space",
        path="gateway/config/units.py",
        old='    return text.strip(" ")\n',
        new="    return text.strip()\n",
        tests=(C + "test_a_unit_is_written_with_ascii_spaces_alone",),
        breaks='"\\u20035s" and " 1 MiB\\u2028" are read as if their spaces were ASCII: the '
        "gateway reads a value an editor's schema and other tools refuse",
    ),
    Mutant(
        name="units-any-space-inside",
        path="gateway/config/units.py",
        old='DURATION_RE = re.compile(r"([0-9]+(?:\\.[0-9]+)?|\\.[0-9]+) *(ms|s|m|h|d)?")\n',
        new='DURATION_RE = re.compile(r"([0-9]+(?:\\.[0-9]+)?|\\.[0-9]+)\\s*(ms|s|m|h|d)?")\n',
        tests=(C + "test_a_unit_is_written_with_ascii_spaces_alone",),
        breaks='"1\\u3000s" is one second',
    ),
    Mutant(
        name="duration-unbounded",
        path="gateway/config/units.py",
        old="    if seconds > MAX_DURATION:\n",
        new="    if False:\n",
        tests=(C + "test_a_duration_is_at_most_100_years",),
        breaks="response_ttl: 999999999999d passes check-config; on Redis every completion "
        "then fails after it half wrote its record",
    ),
    Mutant(
        name="redis-complete-writes-before-checking-its-ttl",
        path="gateway/store/redis/lua/complete.lua",
        old="local ttl = ms_arg(5)\n",
        new="local ttl = ARGV[5]\n",
        tests=(WHOLE + "[1e20ms-redis]", WHOLE + "[1e20ms-cluster]"),
        breaks="a completion whose ttl Redis refuses has already written the record: it is "
        "completed with no expiry while the call fails, and the log says its lease will "
        "expire into review",
    ),
    Mutant(
        name="redis-release-writes-before-checking-its-ttl",
        path="gateway/store/redis/lua/release.lua",
        old="local ttl = ms_arg(4)\n",
        new="local ttl = ARGV[4]\n",
        tests=(WHOLE + "[1e20ms-redis]",),
        breaks="a release whose tombstone's ttl Redis refuses has already written its event "
        "and state: released with no expiry while the call fails",
    ),
    Mutant(
        name="redis-operator-resolve-writes-before-checking-its-ttl",
        path="gateway/store/redis/lua/op_resolve.lua",
        old="local ttl = ms_arg(7)\n",
        new="local ttl = ARGV[7]\n",
        tests=(WHOLE + "[1e20ms-redis]",),
        breaks='an operator\'s "done" whose ttl Redis refuses has already written the note '
        "and the response: the operator is told it failed, and it half happened",
    ),
    Mutant(
        name="redis-check-end-writes-before-checking-its-ttl",
        path="gateway/store/redis/lua/check_end.lua",
        old="local ttl = ms_arg(7)\n",
        new="local ttl = ARGV[7]\n",
        tests=(WHOLE + "[1e20ms-redis]",),
        breaks='a check\'s "done" whose ttl Redis refuses has already written its answer and '
        "the response",
    ),
]
