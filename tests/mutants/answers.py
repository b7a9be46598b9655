"""Broken builds of what an upstream's answer means (a redirect is an answer; Retry-After
read as RFC 9110 writes it; no fault leaves a key in flight) and of the one reader of
numbers from outside (gateway/digits.py)."""

from tests.mutants import Mutant

PROXY = "tests/test_proxy.py::"
DELIVERY = "tests/test_delivery.py::"
CONFIG = "tests/test_config.py::"
DIGITS = "tests/test_digits.py::"

SYNC_REDIRECT = PROXY + "test_a_redirect_is_an_answer_stored_and_replayed[memory-303]"
ASYNC_REDIRECT = DELIVERY + "test_a_redirect_completes_the_delivery[memory-303]"
RULE = CONFIG + "test_the_default_cache_statuses_are_the_answers_that_mean_handled"
RFC_9110 = DELIVERY + "test_retry_after_is_read_as_rfc_9110_writes_it_and_nothing_else"
ANY_ANSWER = DELIVERY + "test_no_answer_leaves_a_delivery_in_flight"
SETTLING = "test_a_fault_while_settling_an_attempt_leaves_it_unresolved_not_in_flight"

MUTANTS = [
    Mutant(
        name="redirect-attempted-again",
        path="gateway/engine/core.py",
        old="        if response.status not in route.cache_statuses:\n",
        new="        if response.status not in route.cache_statuses or (\n"
        '            route.delivery.mode == "async" and 300 <= response.status < 400\n'
        "        ):\n",
        tests=(ASYNC_REDIRECT, DELIVERY + "test_a_redirect_completes_the_delivery[memory-301]"),
        breaks="an async route's 303 is attempted again: one accepted job runs "
        "retry.attempts times, then parks",
    ),
    Mutant(
        name="redirect-releases-the-key",
        path="gateway/engine/core.py",
        old="        if response.status not in route.cache_statuses:\n",
        new="        if response.status not in route.cache_statuses or (\n"
        '            route.delivery.mode == "sync" and 300 <= response.status < 400\n'
        "        ):\n",
        tests=(
            SYNC_REDIRECT,
            PROXY + "test_a_redirect_is_an_answer_stored_and_replayed[memory-308]",
        ),
        breaks="a sync route's 303 releases the key: the scheduler's retry runs the job again",
    ),
    Mutant(
        name="default-leaves-out-3xx",
        path="gateway/records.py",
        old="    return 200 <= status < 500 and status != 408 and status != 429\n",
        new="    return (status < 300 or status >= 400) and 200 <= status < 500 and status != 408 "
        "and status != 429\n",
        tests=(RULE, SYNC_REDIRECT, ASYNC_REDIRECT),
        breaks="3xx is outside the default cache_statuses: redirects run again on both paths",
    ),
    Mutant(
        name="429-is-a-success",
        path="gateway/records.py",
        old="    return 200 <= status < 500 and status != 408 and status != 429\n",
        new="    return 200 <= status < 500 and status != 408\n",
        tests=(
            RULE,
            PROXY + "test_the_last_success_gauge_counts_what_the_upstream_handled[memory]",
            "tests/test_store_contract.py::test_last_success_is_a_completion_the_upstream_handled"
            "[memory]",
        ),
        breaks="a 429 (not now) is stored and counts as the route's last success: the job "
        "never runs, and the alert for a stuck route stays quiet",
    ),
    Mutant(
        name="no-content-framed-as-empty",
        path="gateway/proxy/app.py",
        old="        if reply.status not in NO_CONTENT:\n",
        new="        if True:\n",
        tests=(PROXY + "test_an_answer_without_content_has_no_content_length[memory-304]",),
        breaks="a 304 (and a 204) carries Content-Length: 0, first answer and replay",
    ),
    Mutant(
        name="retry-after-isdigit",
        path="gateway/delivery/retry.py",
        old="    seconds = capped_number(value, RETRY_AFTER_CAP)\n",
        new="    seconds = float(value) if value.isdigit() else None\n",
        tests=(RFC_9110, ANY_ANSWER),
        breaks="Retry-After: ² raises inside the attempt (the delivery stays in flight); "
        "another script's digits are a delay",
    ),
    Mutant(
        name="retry-after-uncapped",
        path="gateway/digits.py",
        old="        return cap\n",
        new="        return int(significant)\n",
        tests=(RFC_9110, DIGITS + "test_a_capped_number_reads_any_length_and_saturates"),
        breaks="a Retry-After of 400 digits is a number no store's JSON holds (infinity, or "
        "an int() error past 4,300 digits) instead of 2^31",
    ),
    Mutant(
        name="http-date-any-script",
        path="gateway/headers.py",
        old='rf"{_DAY}, (?P<day>[0-9]{{2}}) {_MONTH} (?P<year>',
        new='rf"{_DAY}, (?P<day>\\d{{2}}) {_MONTH} (?P<year>',
        tests=(RFC_9110,),
        breaks="an HTTP-date written with another script's digits is a date",
    ),
    Mutant(
        name="settling-fault-strands-the-key",
        path="gateway/engine/settlement.py",
        old="    except Exception as exc:\n"
        '        log.exception("settling %s key %r failed", settle.route.name, settle.ref.key)\n',
        new="    except ZeroDivisionError as exc:\n"
        '        log.exception("settling %s key %r failed", settle.route.name, settle.ref.key)\n',
        tests=(
            DELIVERY + SETTLING + "[retry_later-fail_first=1&retry_after=1]",
            DELIVERY + SETTLING + "[complete-]",
            PROXY + "test_a_fault_while_completing_a_key_leaves_it_unresolved_and_answers",
        ),
        breaks="a fault while recording an answer leaves the key in flight until its lease "
        "runs out, then parked as if nobody had answered; a sync caller gets an error",
    ),
    Mutant(
        name="fault-before-building-strands-the-delivery",
        path="gateway/delivery/attempt.py",
        old="    except Exception as exc:  # a fault of the gateway's own, before anything "
        "was sent\n",
        new="    except ZeroDivisionError as exc:  # a fault, before anything was sent\n",
        tests=(
            DELIVERY + "test_a_fault_while_building_the_request_is_a_request_never_sent[memory]",
        ),
        breaks="a delivery whose request could not be built stays in flight until its lease, "
        "then parks as an unknown outcome, though nothing was sent",
    ),
    Mutant(
        name="fault-before-sending-unclassified",
        path="gateway/upstream/client.py",
        old="        except Exception as exc:  # a fault of the gateway's own: nothing has left\n",
        new="        except ZeroDivisionError as exc:  # nothing has left\n",
        tests=(
            PROXY + "test_a_fault_before_sending_is_never_sent_and_releases[memory]",
            DELIVERY + "test_a_fault_before_sending_schedules_the_next_attempt[memory]",
        ),
        breaks="an error before a byte left (a host label over 63 characters) escapes the "
        "client: the key stays in flight for its lease, then parks, though never sent",
    ),
    Mutant(
        name="fault-after-sending-unclassified",
        path="gateway/upstream/client.py",
        old="        except Exception as exc:  # a fault of the gateway's own, after the "
        "bytes left\n",
        new="        except ZeroDivisionError as exc:  # after the bytes left\n",
        tests=(PROXY + "test_a_fault_after_sending_is_an_unknown_outcome[memory]",),
        breaks="an error after the request left escapes the client: the caller gets an "
        "error and the key stays in flight for its lease",
    ),
    Mutant(
        name="digits-of-any-script",
        path="gateway/digits.py",
        old="    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():\n",
        new="    if 0 < len(text) <= max_digits and text.isdigit():\n",
        tests=(
            DIGITS + "test_only_ascii_digits_are_a_number",
            "tests/test_console_parts.py::test_a_response_status_is_read_as_ascii_digits_alone",
            CONFIG + "test_numbers_in_the_config_are_ascii_digits",
            "tests/test_process.py::test_numeric_arguments_are_ascii_digits",
            PROXY + "test_a_content_length_is_a_number_only_in_ascii_digits[memory]",
        ),
        breaks="`٢٠٠` is a status of 200 and `²` a 500 in the resolve form; another script's "
        "digits configure a port, a size, a count",
    ),
    Mutant(
        name="digits-unbounded",
        path="gateway/digits.py",
        old="    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():\n",
        new="    if 0 < len(text) and text.isascii() and text.isdigit():\n",
        tests=(DIGITS + "test_a_number_is_its_digits_within_the_bound",),
        breaks="5,000 digits reach int(), whose own ValueError (and advice) reaches the reader",
    ),
    Mutant(
        name="duration-of-any-script",
        path="gateway/config/units.py",
        old='DURATION_RE = re.compile(r"([0-9]+(?:\\.[0-9]+)?|\\.[0-9]+) *(ms|s|m|h|d)?")\n',
        new='DURATION_RE = re.compile(r"(\\d+(?:\\.\\d+)?|\\.\\d+) *(ms|s|m|h|d)?")\n',
        tests=("tests/test_admin.py::test_bad_listing_filters_name_the_filter[memory]",),
        breaks="older_than in Arabic-Indic digits lists keys older than ten minutes; a "
        "config duration in another script's digits is accepted",
    ),
]
