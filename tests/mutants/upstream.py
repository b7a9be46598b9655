"""Broken builds for upstream faults and clock skew (tests/test_upstream_faults.py,
tests/test_upstream_hostile.py, tests/test_clock.py)."""

from dataclasses import replace

from tests.mutants import Mutant
from tests.mutants.soak import RECONCILE_DONE_RERUNS

FAULTS = "tests/test_upstream_faults.py"
CLIENT = "tests/test_upstream.py"
CLOCK = "tests/test_clock.py"
HOSTILE = "tests/test_upstream_hostile.py"

TIMEOUT_NOT_SENT = Mutant(
    name="timeout-not-sent",
    path="gateway/upstream/client.py",
    old=(
        "            raise OutcomeLost(\n"
        '                f"no complete answer within {deadline:g}s'
        '{after_status(exchange.status)}",\n'
        "                exchange.status,\n"
        "            ) from None\n"
    ),
    new='            raise NotSent(f"no complete answer within {deadline:g}s") from None\n',
    tests=(f"{FAULTS}::test_slow_upstream_past_timeout_is_parked_never_resent",),
    breaks="a request past its deadline counts as never sent: the repeat runs it again",
)

MUTANTS = [
    Mutant(
        name="answer-out-of-step-reused",
        path="gateway/upstream/parser.py",
        old="return self.complete and self.keep_alive and not self.out_of_step and self.error",
        new="return self.complete and self.keep_alive and self.error",
        tests=(
            f"{HOSTILE}::test_a_response_after_a_204_is_never_the_next_answer",
            f"{HOSTILE}::test_answer_out_of_step_with_its_framing_is_not_reused",
            f"{FAULTS}::test_stray_bytes_after_a_204_are_never_the_next_answer",
        ),
        breaks="a connection with bytes after an answer (a forged response after a 204) is "
        "reused: the next request gets the forged answer, stored and replayed",
    ),
    Mutant(
        name="closed-connection-written-to",
        path="gateway/upstream/pool.py",
        old="            and not _readable(self.poller)\n",
        new="",
        tests=(
            f"{HOSTILE}::test_connection_closed_after_its_answer_is_never_written_to",
            f"{HOSTILE}::test_two_keyed_requests_on_a_pool_of_one_both_complete",
        ),
        breaks="a request is written to a connection whose FIN the loop has not read: it "
        "fails as an unknown outcome although it was never read, and the key is parked",
    ),
    Mutant(
        name="upstream-keep-alive-not-configured",
        path="gateway/assembly.py",
        old="Upstream(keepalive=config.server.upstream_keep_alive)",
        new="Upstream(keepalive=2.0)",
        tests=(
            f"{HOSTILE}::test_connections_are_retired_before_the_upstream_keep_alive",
            f"{HOSTILE}::test_upstream_keep_alive_setting_reaches_the_client",
        ),
        breaks="idle upstream connections live 2 s, as long as gunicorn's keep-alive: a "
        "request written as the upstream closes is lost and its key parked",
    ),
    Mutant(
        name="response-trailers-become-headers",
        path="gateway/upstream/parser.py",
        old="        if not self.in_body:\n            self.headers.append((name, value))\n",
        new="        self.headers.append((name, value))\n",
        tests=(f"{HOSTILE}::test_trailers_and_connection_named_headers_never_reach_the_caller",),
        breaks="a response trailer (location: evil) is stored and replayed as a header",
    ),
    Mutant(
        name="connection-named-response-headers-kept",
        path="gateway/headers.py",
        old="    if named:\n        return tuple(",
        new="    if False:\n        return tuple(",
        tests=(f"{HOSTILE}::test_trailers_and_connection_named_headers_never_reach_the_caller",),
        breaks="a header the upstream's Connection names (x-internal-token) reaches callers",
    ),
    Mutant(
        name="response-head-unbounded",
        path="gateway/upstream/parser.py",
        old="        if self.framing > MAX_RESPONSE_HEAD and",
        new="        if False and",
        tests=(f"{HOSTILE}::test_an_endless_field_line_is_cut_as_it_streams",),
        breaks="a header line that never ends is buffered until the deadline",
    ),
    Mutant(
        name="tls-cut-body-complete",
        path="gateway/upstream/pool.py",
        old='return cast(bytes, ssl_object.read(1)) == b""',
        new="return True",
        tests=(f"{HOSTILE}::test_tls_body_until_close_needs_close_notify",),
        breaks="a TLS body ended by a TCP close without close_notify is stored as whole "
        "(asyncio's SSL transport reports it as a clean EOF)",
    ),
    Mutant(
        name="client-resends-on-broken-connection",
        path="gateway/upstream/client.py",
        old="        except Broken as exc:\n",
        new=(
            "        except Broken as exc:\n"
            "            if exc.status is None:\n"
            "                return await self.forward(\n"
            "                    method, url, headers, body, deadline, max_body\n"
            "                )\n"
        ),
        tests=(
            f"{FAULTS}::test_broken_answer_is_never_resent[reset-PUT]",
            f"{FAULTS}::test_broken_answer_is_never_resent[reset-POST]",
        ),
        breaks="a request whose connection broke after it was sent is resent by the client",
    ),
    Mutant(
        name="mid-body-reset-not-sent",
        path="gateway/upstream/parser.py",
        old='self.fail(Broken(f"the body was cut off{after}{detail}", self.status))',
        new=(
            "from gateway.errors import NotSent  # exchange.py raises neither class\n"
            '            self.future.set_exception(NotSent("the body was cut off"))'
        ),
        tests=(f"{FAULTS}::test_broken_answer_is_never_resent[reset_mid_body-POST]",),
        breaks="a body cut off by RST counts as never sent: the key is released and rerun",
    ),
    Mutant(
        name="cut-off-body-complete",
        path="gateway/upstream/parser.py",
        old='self.fail(Broken(f"the body was cut off{after}{detail}", self.status))',
        new="self._finish(keep_alive=False)",
        tests=(f"{FAULTS}::test_broken_answer_is_never_resent[close_mid_body-POST]",),
        breaks="a response whose body was cut off is stored and replayed as complete",
    ),
    Mutant(
        name="half-sent-response-complete",
        path="gateway/upstream/parser.py",
        old=(
            "            self.fail(Broken("
            'f"the upstream closed the connection{after}", self.status))\n'
        ),
        new=(
            "            if self.status is not None:\n"
            "                self.future.set_result(UpstreamResponse(self.status, (), b''))\n"
            "            self.fail(Broken("
            'f"the upstream closed the connection{after}", self.status))\n'
        ),
        tests=(f"{FAULTS}::test_broken_answer_is_never_resent[half_headers-POST]",),
        breaks="a status line without its headers or body is taken for a complete answer",
    ),
    TIMEOUT_NOT_SENT,
    Mutant(
        name="refused-unknown",
        path="gateway/upstream/pool.py",
        old='raise NotSent(f"could not connect to {self.host}:{self.port}: {exc}") from exc',
        new=(
            "from gateway.errors import OutcomeLost  # pool.py raises NotSent alone\n"
            "                raise OutcomeLost("
            'f"could not connect to {self.host}:{self.port}: {exc}") from exc'
        ),
        tests=(f"{FAULTS}::test_connection_refused_releases_and_the_retry_runs_once",),
        breaks="a refused connection parks the key although nothing was sent",
    ),
    Mutant(
        name="no-response-body-cap",
        path="gateway/upstream/parser.py",
        old="        if size > self.limit:\n",
        new="        if False:\n",
        tests=(f"{FAULTS}::test_endless_flood_and_oversized_bodies_stop_at_max_response_body",),
        breaks="a never-ending body is read into memory until the deadline",
    ),
    Mutant(
        name="header-line-breaks-sent",
        path="gateway/upstream/client.py",
        old='    if text.count("\\n") != breaks or text.count("\\r") != breaks:\n',
        new="    if False:\n",
        tests=(f"{CLIENT}::test_unsendable_request_is_not_sent",),
        breaks="a CR or LF in a header value is sent: a header or request smuggled upstream",
    ),
    Mutant(
        name="head-answer-waits-for-body",
        path="gateway/upstream/parser.py",
        old="        if self.head:\n",
        new="        if False:\n",
        tests=(f"{CLIENT}::test_head_answer_has_no_body",),
        breaks="the answer to a HEAD waits for the body its Content-Length announces",
    ),
    Mutant(
        name="lost-answer-released",
        path="gateway/engine/core.py",
        old="                await guarded(settle.lost(exc.reason), settle)\n",
        new="                await guarded(settle.retry(exc.reason), settle)\n",
        tests=(f"{FAULTS}::test_broken_answer_is_never_resent[reset-POST]",),
        breaks="a key whose answer was lost is freed, so the repeat resends it blind",
    ),
    Mutant(
        name="5xx-cached",
        path="gateway/engine/core.py",
        old="        if response.status not in route.cache_statuses:\n",
        new="        if response.status >= 600:\n",
        tests=(f"{FAULTS}::test_5xx_storm_releases_and_retries_one_at_a_time",),
        breaks="a 500/503 is stored and replayed: the key is never retried",
    ),
    Mutant(
        name="lease-deadline-from-local-clock",
        path="gateway/store/redis/store.py",
        old="args = (run_id, fingerprint, duration_ms(lease), ref.route, ref.key, expired)",
        # The lease ends at the gateway's time.time() + lease, re-based on Redis's clock.
        new=(
            "args = (run_id, fingerprint, duration_ms(lease)"
            " + int(__import__('time').time() * 1000)"
            " - int(__import__('time').clock_gettime(0) * 1000), ref.route, ref.key, expired)"
        ),
        tests=(
            f"{CLOCK}::test_skewed_gateways_keep_each_others_healthy_leases",
            f"{CLOCK}::test_killed_gateways_lease_runs_out_on_redis_time",
        ),
        breaks="a skewed gateway's leases end minutes early (healthy keys parked) or late",
    ),
    replace(
        TIMEOUT_NOT_SENT,
        name="trickle-deadline-not-sent",
        tests=(f"{FAULTS}::test_endless_trickle_ends_at_the_deadline_and_stays_open",),
        breaks="a body that never ends, cut off at the deadline, counts as never sent: the "
        "key is freed and the repeat runs it again",
    ),
    replace(
        RECONCILE_DONE_RERUNS,
        name="reconcile-done-releases",
        tests=(f"{FAULTS}::test_slow_upstream_reconciled_once_it_finished",),
        breaks="the upstream's status says the slow request ran, and the key is released "
        "anyway: the repeat runs it a second time",
    ),
    Mutant(
        name="oversized-response-stored",
        path="gateway/engine/replay.py",
        old="if response.rest is not None or len(response.body) > route.max_stored_body:",
        new="if False:",
        tests=(f"{FAULTS}::test_response_larger_than_max_stored_body",),
        breaks="a response over max_stored_body is recorded as if it were whole: repeats "
        "get an empty body without Idempotent-Body-Omitted",
    ),
]
