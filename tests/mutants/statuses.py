"""A status outside 100..599 (records.is_status): from an upstream an unknown outcome
(gateway/upstream/parser.py), and never the start of an answer the gateway writes
(gateway/http/cycle.py), caught by tests/test_upstream_hostile.py, test_upstream_faults.py
and test_listener.py."""

from tests.mutants import Mutant

H = "tests/test_upstream_hostile.py::test_a_status_outside_100_to_599_is_an_unknown_outcome"
F = "tests/test_upstream_faults.py::"

MUTANTS = [
    Mutant(
        name="upstream-status-outside-100-599-taken",
        path="gateway/upstream/parser.py",
        old="    def _not_a_status(self, status: int) -> None:\n",
        new="    def _not_a_status(self, status: int) -> None:\n        return\n",
        tests=(
            H + "[uvloop-600]",
            F + "test_a_status_outside_100_to_599_is_an_unknown_outcome[jobs-whole-600]",
            F + "test_a_delivery_answered_outside_100_to_599_is_never_attempted_again[999]",
        ),
        breaks="an upstream's `HTTP/1.1 600` is a final answer: the key is released and a "
        "delivery retried, so the job runs twice, and the caller gets zero bytes",
    ),
    Mutant(
        name="upstream-status-without-reason-unchecked",
        path="gateway/upstream/parser.py",
        old="            self._not_a_status(status)  # a status line without a reason phrase\n",
        new="            pass\n",
        tests=(H + "[asyncio-600-no-reason]", H + "[uvloop-000]"),
        breaks="a status line with no reason phrase (llhttp calls no on_status) slips past "
        "the check: 600 is an answer, 000 an interim one waited past",
    ),
    Mutant(
        name="status-line-after-the-answer-started",
        path="gateway/http/cycle.py",
        old="        line = status_line(status)\n        self.response_started = True\n",
        new="        self.response_started = True\n        line = status_line(status)\n",
        tests=(
            "tests/test_listener.py::test_an_answer_no_status_line_is_written_for_gets_a_problem",
        ),
        breaks="a status no line is written for fails after the answer counts as started: "
        "no 500 can follow, and the caller gets a connection closed without a byte",
    ),
]
