"""Broken builds of async delivery that only real processes show: work lost
between a killed gateway, a restarted Redis and the next replica, and a shutdown that
frees what it cut off. Each must fail tests/test_delivery_process.py."""

from tests.mutants import Mutant

P = "tests/test_delivery_process.py::"

MUTANTS = [
    Mutant(
        name="accept-enqueue-dropped",
        path="gateway/store/redis/lua/accept.lua",
        old="  redis.call('ZADD', INDEX.queued, due, MEMBER)\n",
        new="",
        tests=(
            P + "test_redis_aof_restart_between_accept_and_delivery",
            P + "test_sigkill_before_pickup_other_replica_delivers",
        ),
        breaks="a 202'd job is in no queue: once its notice is gone, no replica ever delivers it",
    ),
    Mutant(
        name="rescan-finds-nothing",
        path="gateway/delivery/worker.py",
        old="                    if due.ref.digest not in lane.live:\n"
        "                        self._hint(lane, due)\n",
        new="                    pass\n",
        tests=(P + "test_sigkill_before_pickup_other_replica_delivers",),
        breaks="work queued by a gateway killed before it picked it up is never found by "
        "the replicas started after it",
    ),
    Mutant(
        name="sigterm-delivery-released",
        path="gateway/delivery/attempt.py",
        old="""    async def lost(self, reason: str) -> None:
        await self.engine.unknown(self.route, self.ref, self.run_id, reason)
        self.result = "unknown_outcome"
""",
        new="""    async def lost(self, reason: str) -> None:
        await self.engine.release(self.route, self.ref, self.run_id, reason)
        self.result = "unknown_outcome"
""",
        tests=(P + "test_sigterm_stops_picking_then_marks_unresolved",),
        breaks="a SIGTERM past the grace frees the deliveries it cut off: the job the "
        "upstream may have run is forgotten, or sent again",
    ),
    Mutant(
        name="sigterm-keeps-picking-process",
        path="gateway/delivery/worker.py",
        old="        self.picking = False\n",
        new="        pass\n",
        tests=(P + "test_sigterm_stops_picking_then_marks_unresolved",),
        breaks="a gateway shutting down picks queued work after the grace and cuts it off",
    ),
]
