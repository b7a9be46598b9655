from tests.mutants import Mutant

RESP = "tests/test_resp.py"

MUTANTS = [
    Mutant(
        name="resp-cancelled-reply-handed-on",
        path="gateway/store/resp.py",
        old="""            if waiter.done():  # its caller gave up (cancelled): drop the reply
                continue
""",
        new="",
        tests=(f"{RESP}::test_a_cancelled_call_does_not_shift_the_replies",),
        breaks="a cancelled store call's reply is handed to the next caller",
    ),
    Mutant(
        name="resp-no-watchdog",
        path="gateway/store/resp.py",
        old="protocol.loop.time() - protocol.pending[0][1] > self._timeout",
        new="protocol.loop.time() - protocol.pending[0][1] > 1e9",
        tests=(f"{RESP}::test_hung_redis_fails_calls_in_bounded_time_then_recovers",),
        breaks="a hung Redis hangs requests instead of failing them (503) in bounded time",
    ),
    Mutant(
        name="resp-noscript-not-reloaded",
        path="gateway/store/redis.py",
        old='if message.startswith("NOSCRIPT") and not loaded:',
        new="if False:",
        tests=(f"{RESP}::test_restarted_redis_gets_its_scripts_again",),
        breaks="after a Redis restart every keyed request fails until the gateway restarts",
    ),
    Mutant(
        name="resp-asyncio-only-transport",
        path="gateway/store/resp.py",
        old="self.transport = cast(asyncio.Transport, transport)",
        new="assert isinstance(transport, asyncio.Transport)\n        self.transport = transport",
        tests=(f"{RESP}::test_concurrent_calls_each_get_their_own_reply",),
        breaks="the store connection fails under uvloop, which the gateway runs on",
    ),
]

MUTANTS.append(
    Mutant(
        name="notice-without-response",
        path="gateway/store/lua/complete.lua",
        old="redis.call('SPUBLISH', CHANNEL, MEMBER .. '\\n' .. rec[5] .. '\\n' .. ARGV[4])",
        new="redis.call('SPUBLISH', CHANNEL, MEMBER)",
        tests=("tests/test_proxy.py::test_waiting_duplicate_costs_one_round_trip",),
        breaks="a duplicate waiting in another gateway reads the record again (2 round trips)",
    )
)
