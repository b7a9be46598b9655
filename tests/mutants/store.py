from tests.mutants import Mutant

RESP = "tests/test_resp.py"
REPL = "tests/test_store_replication.py"

MUTANTS = [
    Mutant(
        name="resp-cancelled-reply-handed-on",
        path="gateway/store/redis/resp.py",
        old="""            if waiter.done():  # its caller gave up (cancelled): drop the reply
                continue
""",
        new="",
        tests=(f"{RESP}::test_a_cancelled_call_does_not_shift_the_replies",),
        breaks="a cancelled store call's reply is handed to the next caller",
    ),
    Mutant(
        name="resp-no-watchdog",
        path="gateway/store/redis/resp.py",
        old="protocol.loop.time() - protocol.pending[0][1] > self._timeout",
        new="protocol.loop.time() - protocol.pending[0][1] > 1e9",
        tests=(f"{RESP}::test_hung_redis_fails_calls_in_bounded_time_then_recovers",),
        breaks="a hung Redis hangs requests instead of failing them (503) in bounded time",
    ),
    Mutant(
        name="resp-noscript-not-reloaded",
        path="gateway/store/redis/store.py",
        old='if message.startswith("NOSCRIPT") and not loaded:',
        new="if False:",
        tests=(f"{RESP}::test_restarted_redis_gets_its_scripts_again",),
        breaks="after a Redis restart every keyed request fails until the gateway restarts",
    ),
    Mutant(
        name="resp-asyncio-only-transport",
        path="gateway/store/redis/resp.py",
        old="self.transport = cast(asyncio.Transport, transport)",
        new="assert isinstance(transport, asyncio.Transport)\n        self.transport = transport",
        tests=(f"{RESP}::test_concurrent_calls_each_get_their_own_reply",),
        breaks="the store connection fails under uvloop, which the gateway runs on",
    ),
]

FILTERED = (
    "tests/test_store_contract.py::test_a_filtered_page_reads_a_bounded_part_and_next_goes_on[{}]"
)

PACKED = f"{RESP}::test_every_script_call_is_packed_as_hiredis_and_redis_py_pack_it"

MUTANTS += [
    Mutant(
        name="redis-template-shared-across-buckets",
        path="gateway/store/redis/scripts.py",
        old="slot = (name, route, bucket)",
        new="slot = (name, route, 0)",
        tests=(
            PACKED,
            "tests/test_store_contract.py::test_concurrent_first_claims_one_wins[redis]",
        ),
        breaks="a script call writes another bucket's indexes: records the sweep never sees",
    ),
    Mutant(
        name="redis-template-shared-across-routes",
        path="gateway/store/redis/scripts.py",
        old="slot = (name, route, bucket)",
        new='slot = (name, "", bucket)',
        tests=(PACKED,),
        breaks="a delivery is queued in another route's index, under another route's member",
    ),
    Mutant(
        name="redis-template-digest-size-ignored",
        path="gateway/store/redis/scripts.py",
        old="template is None or template.hole_size != len(hole) or",
        new="template is None or",
        tests=(PACKED,),
        breaks="a digest of another length goes out with the lengths of the first: garbled RESP",
    ),
    Mutant(
        name="redis-template-keeps-a-stale-sha",
        path="gateway/store/redis/scripts.py",
        old="""            for key in [key for key in self._templates if key[0] == name]:
                del self._templates[key]
""",
        new="",
        tests=(f"{RESP}::test_a_reloaded_script_is_sent_with_the_sha_redis_gave_it",),
        breaks="after a reload, calls built before it send a sha Redis does not know: 503s",
    ),
]

MUTANTS.extend(
    [
        Mutant(
            name="notice-without-response",
            path="gateway/store/redis/lua/complete.lua",
            old="redis.call('SPUBLISH', CHANNEL, MEMBER .. '\\n' .. rec[5] .. '\\n' .. ARGV[4])",
            new="redis.call('SPUBLISH', CHANNEL, MEMBER)",
            tests=("tests/test_proxy.py::test_waiting_duplicate_costs_one_round_trip",),
            breaks="a duplicate waiting in another gateway reads the record again (2 round trips)",
        ),
        Mutant(
            name="retried-claim-skips-the-replicas",
            path="gateway/store/redis/store.py",
            old="        if ours and acked < self.wait_for_replicas:",
            new="        if record is None and acked < self.wait_for_replicas:",
            tests=(
                f"{REPL}::test_a_retried_claim_that_finds_its_own_claim_still_needs_the_replicas",
            ),
            breaks="a claim redis-py retried after a timeout is forwarded unconfirmed: a failover "
            "loses it and the key runs twice (seen in CI on Sentinel)",
        ),
        Mutant(
            name="retried-accept-skips-the-replicas",
            path="gateway/store/redis/delivery.py",
            old="and ours and acked < self.wait_for_replicas:",
            new="and record is None and acked < self.wait_for_replicas:",
            tests=(
                f"{REPL}::test_a_retried_accept_that_finds_its_own_delivery_still_needs_the_replicas",
            ),
            breaks="an accept redis-py retried after a timeout answers 202 unconfirmed: a "
            "failover loses the job",
        ),
        Mutant(
            name="wait-outlasts-the-socket",
            path="gateway/store/redis/store.py",
            old="int(config.socket_timeout * 500)",
            new="int(config.socket_timeout * 1000)",
            tests=(
                f"{REPL}::test_a_retried_claim_that_finds_its_own_claim_still_needs_the_replicas",
            ),
            breaks="WAIT's answer arrives after the read timed out: the claim is neither confirmed "
            "nor released, and redis-py retries it",
        ),
        Mutant(
            name="redis-listing-reads-unbounded",
            path="gateway/store/redis/listing.py",
            old="len(found) <= wanted and rounds < READ_ROUNDS:",
            new="len(found) <= wanted:",
            tests=(FILTERED.format("redis"), FILTERED.format("cluster")),
            breaks="a page of in-flight keys by age reads on past every key too young: one "
            "viewer's request costs a script per bucket per two keys in flight",
        ),
        Mutant(
            name="redis-listing-bounded-page-ends-the-walk",
            path="gateway/store/redis/listing.py",
            old="resume = at.position if more and at is not None and at is not start else None",
            new="resume = None",
            tests=(FILTERED.format("redis"), FILTERED.format("cluster")),
            breaks="a page that stops at its bound comes back empty with `next` empty while "
            "older keys follow: the console and the sweep stop short",
        ),
        Mutant(
            name="postgres-listing-reads-unbounded",
            path="gateway/store/postgres/listing.py",
            old="len(found) <= wanted and rounds < READ_ROUNDS:",
            new="len(found) <= wanted:",
            tests=(FILTERED.format("postgres"),),
            breaks="a page of in-flight keys by age reads on past every key too young: one "
            "viewer's request reads every in-flight row",
        ),
        Mutant(
            name="postgres-listing-bounded-page-ends-the-walk",
            path="gateway/store/postgres/listing.py",
            old="resume = at.position if more and at is not None and at is not start else None",
            new="resume = None",
            tests=(FILTERED.format("postgres"),),
            breaks="a page that stops at its bound comes back empty with `next` empty while "
            "older keys follow: the console and the sweep stop short",
        ),
        Mutant(
            name="sqlite-listing-short-page-ends-the-walk",
            path="gateway/store/sqlite/listing.py",
            old="return page_of(found, start, wanted, now, resume=bound)",
            new="return page_of(found, start, wanted, now)",
            tests=(FILTERED.format("sqlite"),),
            breaks="a page of in-flight keys by age whose read ends among keys too young says "
            "the walk ends while older keys follow",
        ),
        Mutant(
            name="memory-listing-reads-unbounded",
            path="gateway/store/memory.py",
            old="            if budget == 0:\n                break\n",
            new="",
            tests=(FILTERED.format("memory"),),
            breaks="a page of in-flight keys by age reads on past every key too young",
        ),
        Mutant(
            name="page-bounded-read-drops-its-resume",
            path="gateway/store/pages.py",
            old="        on = Cursor(resume) if resume is not None and not backward else None\n",
            new="        on = None\n",
            tests=(FILTERED.format("memory"), FILTERED.format("sqlite")),
            breaks="an empty page that stopped at its bound says the walk ends",
        ),
    ]
)
