from tests.mutants import Mutant

MUTANTS = [
    Mutant(
        name="set-cookie-stored",
        path="gateway/engine/replay.py",
        old='NEVER_STORED = frozenset({"set-cookie", "set-cookie2"})',
        new="NEVER_STORED = frozenset()",
        tests=("tests/test_proxy.py::test_set_cookie_and_strip_headers_never_replayed",),
        breaks="a caller's Set-Cookie is stored and replayed to others",
    ),
]
