"""The operator API's refusals (gateway/operators/actions.py, which gateway/admin/api.py answers
with), caught by tests/test_admin.py."""

from tests.mutants import Mutant

A = "tests/test_admin.py::"

MUTANTS = [
    Mutant(
        name="operator-refused-resolve-answered-200",
        path="gateway/operators/actions.py",
        old="        if not resolved.ok:\n            raise refusal(resolved, ref)\n",
        new="",
        tests=(
            A + "test_only_the_holder_may_resolve",
            A + "test_illegal_moves_are_invalid_transitions",
        ),
        breaks="a resolve the store refused (not the holder, not claimed) is answered 200 "
        "as if it had been done",
    ),
    Mutant(
        name="operator-not-the-holder-reported-as-invalid-transition",
        path="gateway/operators/actions.py",
        old='    if result.refused == "holder":\n',
        new='    if result.refused == "holder-of-record":\n',
        tests=(A + "test_only_the_holder_may_resolve",),
        breaks="an operator who does not hold the key is told the move is illegal for its "
        "state, not that someone else holds it and who",
    ),
    Mutant(
        name="operator-digest-of-another-record",
        path="gateway/operators/actions.py",
        old="    if record is None or record.route != ref.route or record.key != ref.key:\n",
        new="    if record is None:\n",
        tests=(A + "test_a_digest_names_only_its_own_route_and_key",),
        breaks="a ?digest= reaches another route's or key's record under this route and key, "
        "so an operator claims a record they did not name",
    ),
]
