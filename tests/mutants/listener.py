"""Broken builds for the proxy listener's guards (tests/test_listener.py)."""

from tests.mutants import Mutant

TESTS = "tests/test_listener.py"
SOURCE = "gateway/http/protocol.py"
CYCLE = "gateway/http/cycle.py"


def t(*names: str) -> tuple[str, ...]:
    return tuple(f"{TESTS}::{name}" for name in names)


MUTANTS = [
    Mutant(
        name="pathless-target-crashes",
        path=SOURCE,
        old="        if parsed_url is None or parsed_url.path is None:",
        new="        if parsed_url is None:",
        tests=t("test_a_target_without_a_path_is_refused_with_an_answer"),
        breaks="`GET http://host` crashes the listener's callback: no answer, a traceback",
    ),
    Mutant(
        name="trailers-become-headers",
        path=SOURCE,
        old="        if self._in_head:\n            name = name.lower()",
        new="        if True:\n            name = name.lower()",
        tests=t("test_trailers_never_reach_the_upstream_as_headers"),
        breaks="a trailer sent with the head reaches the upstream as a header (X-User: admin)",
    ),
    Mutant(
        name="trailers-unbounded",
        path=SOURCE,
        old="        if (self._in_head or self._trailing) and not self._stopped:",
        new="        if self._in_head and not self._stopped:",
        tests=t("test_trailer_section_is_bounded_like_a_head"),
        breaks="a trailer field that never ends is buffered without bound",
    ),
    Mutant(
        name="no-head-deadline",
        path=SOURCE,
        old="        timeout = self._server.header_timeout\n",
        new="        return\n",
        tests=t(
            "test_connection_that_never_sends_is_closed_quietly",
            "test_trickled_head_is_cut_at_the_head_deadline",
        ),
        breaks="a connection that never sends, or trickles its head, is held forever",
    ),
    Mutant(
        name="idle-connection-answered-408",
        path=SOURCE,
        old="        if not self._began:\n",
        new="        if False:\n",
        tests=t(
            "test_connection_that_never_sends_is_closed_quietly",
            "test_spare_connections_past_the_head_deadline_never_read_a_408",
            "test_a_real_client_never_reads_an_answer_it_did_not_cause",
        ),
        breaks="a connection opened ahead of its first request gets a 408 it did not cause, "
        "which its client reads as the answer to the request it writes next",
    ),
    Mutant(
        name="begun-head-closed-quietly",
        path=SOURCE,
        old="        self._in_head = self._began = True\n",
        new="        self._in_head = True\n",
        tests=t("test_a_head_begun_and_left_unfinished_gets_408"),
        breaks="a head that began and did not finish is closed without its 408",
    ),
    Mutant(
        name="began-outlives-its-request",
        path=SOURCE,
        old="        self._began = False\n",
        new="",
        tests=t("test_empty_lines_before_a_request_are_no_request"),
        breaks="empty lines after a request on a kept-alive connection get a 408 for a "
        "request that never began",
    ),
    Mutant(
        name="head-deadline-restarts-per-read",
        path=SOURCE,
        old="        if self._in_head and self._head_since is None:",
        new="        self._cancel_timer()\n        if self._in_head:",
        tests=t("test_trickled_head_is_cut_at_the_head_deadline"),
        breaks="a head trickled a byte at a time never meets its deadline",
    ),
    Mutant(
        name="no-body-timeout",
        path=SOURCE,
        old="        timeout = self._server.body_timeout\n",
        new="        return\n",
        tests=t("test_half_sent_body_gets_408_and_is_not_forwarded"),
        breaks="a half-sent body holds its connection forever",
    ),
    Mutant(
        name="body-timeout-is-a-deadline",
        path=SOURCE,
        old="        if idle < timeout:",
        new="        if False:",
        tests=t("test_slow_body_that_keeps_coming_is_read"),
        breaks="a body that keeps coming, slowly, is cut off",
    ),
    Mutant(
        name="no-connection-cap",
        path=SOURCE,
        old="if len(self.connections) > self._server.max_connections and not self._make_room():",
        new="if False:",
        tests=t("test_connection_over_the_cap_gets_503_and_idle_ones_make_room"),
        breaks="server.max_connections is not enforced",
    ),
    Mutant(
        name="idle-connections-keep-their-place",
        path=SOURCE,
        old="        while self.idle:",
        new="        while False:",
        tests=t("test_connection_over_the_cap_gets_503_and_idle_ones_make_room"),
        breaks="at the cap, idle kept-alive connections hold their place and callers get 503",
    ),
    Mutant(
        name="refusal-out-of-order",
        path=SOURCE,
        old="        if ready:\n            self._finish()",
        new="        self._finish()",
        tests=t("test_refusal_pipelined_after_a_good_request_waits_for_its_answer"),
        breaks="a malformed request pipelined after a good one is answered before it",
    ),
    Mutant(
        name="refusal-after-its-own-answer",
        path=SOURCE,
        old="            self._answer = False\n            ready = cycle.response_complete",
        new="            ready = cycle.response_complete",
        tests=t("test_refusal_of_a_request_already_answered_is_not_sent"),
        breaks="a request answered already gets a second answer, taken for the next one's",
    ),
    Mutant(
        name="expect-forwarded",
        path="gateway/config/http.py",
        old='        "expect",',
        new="",
        tests=t("test_expect_100_continue_is_answered_by_the_gateway_not_forwarded"),
        breaks="Expect: 100-continue reaches the upstream with the body already sent",
    ),
    Mutant(
        name="uninvited-body-kept-open",
        path=CYCLE,
        old="            if self.more_body and self.keep_alive:",
        new="            if False:",
        tests=t(
            "test_answer_before_the_body_gets_no_100_and_closes",
            "test_answer_before_the_body_ends_a_body_that_keeps_coming",
        ),
        breaks="after an answer before the body, the connection reads a discarded body "
        "forever, or the client's next bytes as that body",
    ),
    Mutant(
        name="two-dates",
        path="gateway/serve.py",
        old="        grace=grace + 5,\n",
        new="        grace=grace + 5,\n        date_header=True,\n",
        tests=t("test_every_answer_has_exactly_one_date"),
        breaks="forwarded and replayed responses carry two Date lines",
    ),
    Mutant(
        name="no-gateway-date",
        path="gateway/proxy/app.py",
        old='    headers.append((b"date", http_date()))',
        new="    pass",
        tests=t("test_every_answer_has_exactly_one_date"),
        breaks="the gateway's own answers, and upstream answers without one, have no Date",
    ),
    Mutant(
        name="keep-alive-5s",
        path="gateway/config/model.py",
        old="    keep_alive: Duration = 75.0",
        new="    keep_alive: Duration = 5.0",
        tests=t("test_clients_coming_back_just_after_5s_are_all_answered"),
        breaks="the listener closes idle connections as common clients reuse them",
    ),
    Mutant(
        name="keep-alive-closes-on-unread-request",
        path=SOURCE,
        old="        if _unread_bytes(self.transport):\n            return",
        new="",
        tests=t("test_keep_alive_expiry_with_a_request_waiting_answers_it"),
        breaks="a request that arrived as the keep-alive timer fired is reset unanswered",
    ),
    Mutant(
        name="hard-close",
        path=SOURCE,
        old="        transport.write_eof()\n",
        new="        transport.close()\n        return\n",
        tests=t(
            "test_keep_alive_expiry_half_closes_and_drains",
            "test_connection_over_the_cap_gets_503_and_idle_ones_make_room",
        ),
        breaks="the gateway's last close resets what crosses it, and can destroy its answer",
    ),
    Mutant(
        name="head-written-apart",
        path=CYCLE,
        old='            self._head = b"".join(content)  # written with the first body write',
        new='            self.transport.write(b"".join(content))',
        tests=t("test_whole_response_leaves_in_one_write"),
        breaks="a whole response leaves in two writes (two syscalls) again",
    ),
]
