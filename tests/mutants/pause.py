"""Broken builds of an async route's pause: the store's rows and moves (every store),
the worker that reads them before each attempt, and who may lift a pause."""

from tests.mutants import Mutant

C = "tests/test_store_contract.py::"
P = "tests/test_delivery_pause.py::"
AUTO_PAUSE = P + "test_a_refusing_upstream_pauses_the_route_and_a_probe_resumes_it[3s-outage]"
COUNTS = (
    "tests/test_delivery.py::"
    "test_the_pause_counts_refusals_not_unknown_outcomes_and_an_answer_resets_it[memory]"
)
MANUAL_PAUSE = P + "test_an_operator_pauses_and_resumes_a_route_through_the_cli_and_the_api"
LONG_PAUSE = P + "test_a_long_pause_parks_nothing_for_exhaustion"
UNCOUNTED = "test_an_uncounted_retry_gives_back_the_attempt_its_pick_counted"

MUTANTS = [
    Mutant(
        name="paused-attempt-counted",
        path="gateway/delivery/worker.py",
        old='        if verdict == "closed":  # never sent: it counts as no attempt, '
        "nor takes a token\n",
        new="        if False:\n",
        tests=(AUTO_PAUSE, MANUAL_PAUSE),
        breaks="a paused route's deliveries are attempted all the same, using up their "
        "attempts until they are parked",
    ),
    Mutant(
        name="pause-kept-per-process",
        path="gateway/store/redis/pauses.py",
        old='        self.key = f"{prefix}{{pauses}}:routes"\n',
        new='        self.key = f"{prefix}{{pauses}}:routes:{id(self)}"\n',
        tests=(C + "test_every_process_shares_the_pause[redis]", AUTO_PAUSE),
        breaks="each replica counts and probes a route on its own: pause_after refusals "
        "per replica, a probe per replica per interval, a resume seen by one",
    ),
    Mutant(
        name="probe-success-does-not-resume",
        path="gateway/store/route_pauses.py",
        old="        if s.paused and s.by == AUTO:\n",
        new="        if False:\n",
        tests=(
            C + "test_a_route_pauses_after_its_failures_and_a_probe_answered_resumes_it[memory]",
            C + "test_a_route_pauses_after_its_failures_and_a_probe_answered_resumes_it[sqlite]",
        ),
        breaks="an automatic pause is never lifted by an answered probe: the route waits "
        "for an operator",
    ),
    Mutant(
        name="redis-probe-success-does-not-resume",
        path="gateway/store/redis/lua/pause.lua",
        old="  if s.since_ms > 0 and s.by == 'auto' then\n",
        new="  if false then\n",
        tests=(
            C + "test_a_route_pauses_after_its_failures_and_a_probe_answered_resumes_it[redis]",
            AUTO_PAUSE,
        ),
        breaks="an automatic pause is never lifted by an answered probe (Redis)",
    ),
    Mutant(
        name="probe-taken-twice",
        path="gateway/store/route_pauses.py",
        old='        return dataclasses.replace(s, probe_ms=now + move.probe_every_ms), "probe"\n',
        new='        return s, "probe"\n',
        tests=(
            C + "test_a_route_pauses_after_its_failures_and_a_probe_answered_resumes_it[memory]",
        ),
        breaks="every worker that looks takes the probe: a paused route gets a burst, "
        "not one probe every probe_every",
    ),
    Mutant(
        name="manual-pause-probed",
        path="gateway/store/route_pauses.py",
        old="        if self.by == AUTO and self.now_ms >= self.probe_ms:\n",
        new="        if self.now_ms >= self.probe_ms:\n",
        tests=(C + "test_a_manual_pause_is_lifted_by_a_manual_resume_alone[memory]",),
        breaks="an operator's pause sends probes, and an answered one lifts it",
    ),
    Mutant(
        name="unknown-outcome-counted-as-refused",
        path="gateway/delivery/attempt.py",
        old='        self.upstream = ""  # sent, maybe taken: no word on whether it refuses\n',
        new='        self.upstream = "refused"\n',
        tests=(COUNTS,),
        breaks="a timeout after sending counts toward the pause, though the upstream took "
        "the request",
    ),
    Mutant(
        name="5xx-taken-as-an-answer",
        path="gateway/delivery/attempt.py",
        old="    return response is None or response.status >= 500 or response.status == 429\n",
        new="    return response is None\n",
        tests=(COUNTS,),
        breaks="an upstream answering 503 to every attempt never pauses its route",
    ),
    Mutant(
        name="console-pause-without-csrf",
        path="gateway/console/forms.py",
        old='    overview with a notice, or the overview again with the refusal in words."""\n'
        "    who, form = await poster(request)\n",
        new='    overview with a notice, or the overview again with the refusal in words."""\n'
        "    who, form = await pages.visitor(request), await posted_form(request, FORM_OVERHEAD)\n",
        tests=(
            "tests/test_console_parts.py::"
            "test_an_operator_pauses_and_resumes_a_route_from_the_overview",
        ),
        breaks="another site's form pauses a route in a signed-in operator's name",
    ),
    Mutant(
        name="resume-refused-for-a-route-made-sync",
        path="gateway/operators/actions.py",
        old='        if config is None or (move == "pause" and config.delivery.mode != "async"):\n',
        new='        if config is None or config.delivery.mode != "async":\n',
        tests=(
            "tests/test_delivery_lanes.py::"
            "test_a_paused_route_made_sync_can_be_resumed_and_delivers_its_queue",
        ),
        breaks="a paused route a reload made sync cannot be resumed: what it queued is "
        "held for ever",
    ),
    Mutant(
        name="probe-refusal-counted",
        path="gateway/delivery/worker.py",
        old="                    self.engine, route, due.ref, self.replica, run_id, "
        'verdict == "probe"\n',
        new="                    self.engine, route, due.ref, self.replica, run_id, False\n",
        tests=(
            LONG_PAUSE,
            "tests/test_delivery.py::test_a_refused_probe_is_not_an_attempt_of_its_delivery[memory]",
        ),
        breaks="a refused probe uses up an attempt of its delivery: an outage longer than "
        "retry.attempts probes parks it for exhaustion",
    ),
    Mutant(
        name="answered-probe-uncounted",
        path="gateway/delivery/attempt.py",
        old="        uncounted = self.probe and refused(response)\n",
        new="        uncounted = self.probe\n",
        tests=(
            "tests/test_delivery.py::"
            "test_a_probe_answered_with_a_status_not_cached_is_an_attempt[memory]",
        ),
        breaks="a probe the upstream answered with a status not cached gives its attempt "
        "back: the delivery is attempted more often than retry.attempts",
    ),
    Mutant(
        name="memory-uncounted-ignored",
        path="gateway/store/memory.py",
        old="        attempts = max(0, record.attempts - 1) if uncounted else record.attempts\n",
        new="        attempts = record.attempts\n",
        tests=(C + UNCOUNTED + "[memory]",),
        breaks="an uncounted retry (a refused probe) keeps its pick's attempt (memory)",
    ),
    Mutant(
        name="sqlite-uncounted-ignored",
        path="gateway/store/sqlite/delivery.py",
        old="            attempts = max(0, record.attempts - 1) if uncounted "
        "else record.attempts\n",
        new="            attempts = record.attempts\n",
        tests=(C + UNCOUNTED + "[sqlite]",),
        breaks="an uncounted retry (a refused probe) keeps its pick's attempt (SQLite)",
    ),
    Mutant(
        name="redis-uncounted-ignored",
        path="gateway/store/redis/lua/retry.lua",
        old="if ARGV[8] == '1' then\n",
        new="if false then\n",
        tests=(C + UNCOUNTED + "[redis]",),
        breaks="an uncounted retry (a refused probe) keeps its pick's attempt (Redis)",
    ),
    Mutant(
        name="pg-uncounted-ignored",
        path="gateway/store/postgres/sql/retry.sql",
        old="        attempts = CASE WHEN $7::boolean THEN greatest(r.attempts - 1, 0) "
        "ELSE r.attempts END,\n",
        new="        attempts = r.attempts,\n",
        tests=(C + UNCOUNTED + "[postgres]",),
        breaks="an uncounted retry (a refused probe) keeps its pick's attempt (PostgreSQL)",
    ),
]
