"""Broken builds of delayed delivery: a due time the store does not keep (so a restart,
or any rescan, delivers early), the delivery-time headers sent upstream, values read
more loosely than a duration, the cap unchecked, a repeat answered with its own delay,
a delivery-time header that is also the key's or a framing header, a leap second
read a second early. Each must fail
tests/test_delivery_delay.py, tests/test_config.py or the store contract."""

from tests.mutants import Mutant

T = "tests/test_delivery_delay.py::"
C = "tests/test_store_contract.py::test_a_delayed_accept_is_never_picked_before_its_due_time"
HOSTILE = T + "test_hostile_delivery_times_are_refused_and_nothing_is_queued"
WAITED = T + "test_a_delivery_delay_is_waited_for_then_delivered_once"
NOT_BEFORE = T + "test_a_route_delay_and_a_not_before_time"
LEAP = T + "test_a_leap_second_not_before_is_the_next_minute_never_the_second_before"
HEADERS = (
    "tests/test_config.py::test_delivery_time_headers_are_no_key_framing_or_each_others_header"
)

MUTANTS = [
    Mutant(
        name="delay-dropped-on-restart",
        path="gateway/store/sqlite/delivery.py",
        old="delivery.fingerprint, now, request, token, bound, due),",
        new="delivery.fingerprint, now, request, token, bound, now),",
        tests=(T + "test_a_delay_outlasts_a_gateway_restart[sqlite]", C + "[sqlite]"),
        breaks="the due time lives in the accepting process's timer alone: a gateway "
        "started after the 202 delivers at once",
    ),
    Mutant(
        name="memory-delay-not-kept",
        path="gateway/store/memory.py",
        old="        due = now + delivery.delay_ms\n",
        new="        due = now\n",
        tests=(C + "[memory]",),
        breaks="a delayed delivery is picked before its due time",
    ),
    Mutant(
        name="redis-delay-not-indexed",
        path="gateway/store/redis/lua/accept.lua",
        old="  redis.call('ZADD', INDEX.queued, due, MEMBER)\n",
        new="  redis.call('ZADD', INDEX.queued, at, MEMBER)\n",
        tests=(C + "[redis]",),
        breaks="the due index says a delayed delivery is due at once: a rescan hands it "
        "to a worker early",
    ),
    Mutant(
        name="pg-delay-not-kept",
        path="gateway/store/postgres/sql/007_delayed_delivery.sql",
        old="CASE WHEN p_delivery THEN t + p_delay_ms ELSE 0 END, p_token, p_request)",
        new="CASE WHEN p_delivery THEN t ELSE 0 END, p_token, p_request)",
        tests=(C + "[postgres]",),
        breaks="a new key's delay is not written in PostgreSQL: picked at once",
    ),
    Mutant(
        name="delay-header-forwarded",
        path="gateway/engine/accept.py",
        old="        delivery.delay_header,\n        delivery.not_before_header,\n",
        new="        delivery.not_before_header,\n",
        tests=(WAITED,),
        breaks="the caller's Delivery-Delay is stored with the job and sent upstream",
    ),
    Mutant(
        name="not-before-header-forwarded",
        path="gateway/engine/accept.py",
        old="        delivery.not_before_header,\n    )\n",
        new="    )\n",
        tests=(NOT_BEFORE,),
        breaks="the caller's Delivery-Not-Before is stored with the job and sent upstream",
    ),
    Mutant(
        name="past-not-before-negative",
        path="gateway/engine/accept.py",
        old="        seconds = max(0.0, when - now)\n",
        new="        seconds = when - now\n",
        tests=(NOT_BEFORE,),
        breaks="a not-before time already past is a negative delay: the 202 names a due "
        "time in the past instead of none",
    ),
    Mutant(
        name="delay-header-isdigit",
        path="gateway/engine/accept.py",
        old="    if not DURATION_RE.fullmatch(trim(value)):\n",
        new="    if not (DURATION_RE.fullmatch(trim(value)) or value.isdigit()):\n",
        tests=(HOSTILE,),
        breaks="Delivery-Delay: \u00b2 is read as a number (a delay too long) instead of "
        "refused as no duration",
    ),
    Mutant(
        name="max-delay-unchecked",
        path="gateway/engine/accept.py",
        old="    if seconds > delivery.max_delay:\n",
        new="    if seconds > 100 * 365 * 86400:\n",
        tests=(HOSTILE,),
        breaks="a request holds its job back longer than delivery.max_delay allows",
    ),
    Mutant(
        name="repeat-reports-its-own-delay",
        path="gateway/engine/core.py",
        old="            due_ms = record.due_ms if waiting else 0\n",
        new="            due_ms = due_ms if waiting else 0\n",
        tests=(WAITED,),
        breaks="a repeat's 202 names the delay it asked for, not the first request's due "
        "time the delivery keeps",
    ),
    Mutant(
        name="time-header-may-be-the-key-header",
        path="gateway/config/delivery.py",
        old="        why = taken.get(lowered)\n",
        new="        why = None\n",
        tests=(HEADERS,),
        breaks="a delay header named as the key's header reads a key 3600 as an hour's "
        "delay, and two delivery-time headers of one name read a date as a duration",
    ),
    Mutant(
        name="time-header-may-be-a-framing-header",
        path="gateway/config/delivery.py",
        old="        if why is None and lowered in HOP_BY_HOP:\n",
        new="        if False:\n",
        tests=(HEADERS,),
        breaks="delay_header: Content-Length reads the body's length as seconds to wait",
    ),
    Mutant(
        name="leap-second-read-as-the-second-before",
        path="gateway/headers.py",
        old="    return when.timestamp() + leap\n",
        new="    return when.timestamp()\n",
        tests=(LEAP,),
        breaks="Delivery-Not-Before at HH:MM:60 is due at HH:MM:59, a second before the time asked",
    ),
    Mutant(
        name="second-past-60-read-as-a-time",
        path="gateway/headers.py",
        old='    second = int(parts["second"])\n',
        new='    second = min(int(parts["second"]), 60)\n',
        tests=(HOSTILE,),
        breaks="an HTTP-date with second 61 or more is read as a time, not refused",
    ),
]
