"""Broken builds for large responses: streaming, back-pressure, server.write_timeout and
the response budget (tests/test_streaming.py, tests/test_body_stream.py)."""

from tests.mutants import Mutant

STREAMING = "tests/test_streaming.py"
STREAMS = "tests/test_body_stream.py"

MUTANTS = [
    Mutant(
        name="no-back-pressure",
        path="gateway/upstream/response.py",
        old=(
            "        if self._queued < STREAM_HIGH and budget.held <= budget.limit:\n"
            "            return\n"
        ),
        new="        if True:\n            return\n",
        tests=(
            f"{STREAMS}::test_a_reader_that_is_behind_pauses_the_upstream_read",
            f"{STREAMING}::test_callers_that_never_read_a_16_mib_answer",
        ),
        breaks="a caller that does not read makes the gateway hold the whole body",
    ),
    Mutant(
        name="no-write-timeout",
        path="gateway/http/protocol.py",
        old="        if self._stall is None:\n",
        new="        if False:\n",
        tests=(f"{STREAMING}::test_a_caller_that_never_reads_a_stored_answer",),
        breaks="a caller that stops reading keeps its connection and buffers forever",
    ),
    Mutant(
        name="cut-stream-completed",
        path="gateway/proxy/app.py",
        old="        _cut_off(transport, exc.reason)\n",
        new='        await send({"type": "http.response.body", "body": b"", "more_body": False})\n',
        tests=(f"{STREAMING}::test_body_cut_after_streaming_began[chunked]",),
        breaks="a streamed body cut off upstream reaches its caller as a complete response",
    ),
    Mutant(
        name="keyed-stream-closed-with-its-caller",
        path="gateway/upstream/response.py",
        old="        if self._read_to_end:\n            self._discarding = True\n",
        new="        if False:\n            self._discarding = True\n",
        tests=(
            f"{STREAMS}::test_a_keys_body_is_read_to_its_end_when_its_reader_goes",
            f"{STREAMING}::test_callers_that_never_read_a_16_mib_answer",
        ),
        breaks="a caller that goes away leaves its key unresolved although the upstream "
        "answered whole",
    ),
    Mutant(
        name="budget-ignored",
        path="gateway/upstream/parser.py",
        old="            if size > self.hold or budget.held + len(body) > budget.limit:\n",
        new="            if size > self.hold:\n",
        tests=(f"{STREAMING}::test_budget_streams_what_it_cannot_hold",),
        breaks="server.max_buffered_responses does not bound the bodies held whole",
    ),
    Mutant(
        name="slow-reader-holds-the-key",
        path="gateway/upstream/response.py",
        old=(
            "        self._late = True\n"
            "        self._timer = loop.call_at(self._give_up, self._expire)\n"
            "        if self._paused:\n"
            "            self._drop_reader()\n"
        ),
        new="        self._timer = loop.call_at(self._give_up, self._expire)\n",
        tests=(f"{STREAMING}::test_a_slow_reader_of_a_keyed_answer_is_cut_and_the_key_completes",),
        breaks="a caller reading slowly makes its key's outcome unknown (parked)",
    ),
    Mutant(
        name="reader-time-counted-as-upstream",
        path="gateway/upstream/response.py",
        old="        if not self._read_to_end and self._timer is not None:\n",
        new="        if False:\n",
        tests=(f"{STREAMS}::test_time_paused_for_a_reader_is_not_the_upstreams",),
        breaks="a passthrough caller reading slower than the deadline is cut off as if the "
        "upstream were late",
    ),
]
