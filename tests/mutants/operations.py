"""Broken builds of delivery's operations side: metrics, listing."""

from tests.mutants import Mutant

D = "tests/test_deploy.py::"
A = "tests/test_admin.py::"
S = "tests/test_store_contract.py::"

MUTANTS = [
    Mutant(
        name="queue-depth-wrong-state",
        path="gateway/metrics.py",
        old='            self.queue_depth.labels(stat.route, "retrying").set(stat.retrying)\n',
        new='            self.queue_depth.labels(stat.route, "retrying").set(stat.queued)\n',
        tests=(D + "test_queue_gauges_keep_each_state_apart",),
        breaks="the retrying gauge shows the queued count: a failing upstream looks slow",
    ),
    Mutant(
        name="exhausted-not-counted",
        path="gateway/metrics.py",
        old="        if result:\n            self.delivery_attempts",
        new='        if result not in ("", "exhausted"):\n            self.delivery_attempts',
        tests=(D + "test_delivery_metrics_count_each_attempt_once",),
        breaks="deliveries parked with no attempt left are never counted: DeliveriesExhausted "
        "never fires",
    ),
    Mutant(
        name="first-attempt-after-requeue",
        path="gateway/delivery/attempt.py",
        old="    if record.attempts == 1 and not record.last_attempt:",
        new="    if record.attempts == 1:",
        tests=(
            "tests/test_keys_cli.py::test_retry_queues_a_parked_delivery_and_it_is_delivered_once",
        ),
        breaks="an operator's requeue is observed as a first attempt hours after acceptance",
    ),
    Mutant(
        name="redis-listing-misses-retrying",
        path="gateway/store/redis/listing.py",
        old="_COUNTED_NAMES = {str(state): state for state in COUNTED_STATES}",
        new="_COUNTED_NAMES = {str(s): s for s in COUNTED_STATES if s is not State.RETRYING}",
        tests=(
            S + "test_open_records_lists_queued_and_retrying_from_the_due_indexes[redis]",
            A + "test_deliveries_are_listed_by_their_states[redis]",
        ),
        breaks="keys list --state retrying shows nothing on Redis, and retrying deliveries "
        "are not counted",
    ),
    Mutant(
        name="memory-listing-ignores-state",
        path="gateway/store/memory.py",
        old="            if state not in states or (route is not None and name != route):\n",
        new="            if route is not None and name != route:\n",
        tests=(S + "test_open_records_lists_queued_and_retrying_from_the_due_indexes[memory]",),
        breaks="every listing shows every waiting delivery, whatever state was asked for",
    ),
]
