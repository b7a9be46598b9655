"""Broken builds of the delivery store (issue 14): each must fail the contract suite."""

from tests.mutants import Mutant

C = "tests/test_store_contract.py::"

MUTANTS = [
    Mutant(
        name="memory-pick-not-due",
        path="gateway/store/memory_delivery.py",
        old="""        elif record.due_ms > now:
            why, due = "not_due", record.due_ms
""",
        new="",
        tests=(C + "test_pick_never_claims_a_delivery_that_is_not_due[memory]",),
        breaks="a delivery scheduled for later is attempted at once (Retry-After, backoff ignored)",
    ),
    Mutant(
        name="memory-accept-overwrites",
        path="gateway/store/memory_delivery.py",
        old="        if record is not None and record.state is not State.RELEASED:\n",
        new="        if False:\n",
        tests=(C + "test_accept_never_overwrites_an_existing_key[memory]",),
        breaks="a repeat on an async route queues the job again over the first one",
    ),
    Mutant(
        name="memory-settled-request-kept",
        path="gateway/store/memory.py",
        old="            self._requests.pop(record.digest, None)  # a settled delivery",
        new="            pass  #",
        tests=(C + "test_settling_a_delivery_deletes_its_request[complete-memory]",),
        breaks="a completed delivery's request (which may carry credentials) stays stored",
    ),
    Mutant(
        name="memory-pick-past-attempts",
        path="gateway/store/memory_delivery.py",
        old="        if record.attempts >= max_attempts:\n",
        new="        if False:\n",
        tests=(C + "test_pick_never_starts_an_attempt_over_the_limit[memory]",),
        breaks="a delivery is attempted more times than retry.attempts allows",
    ),
]
