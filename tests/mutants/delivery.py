"""Broken builds of the delivery store: each must fail the contract suite."""

from tests.mutants import Mutant

C = "tests/test_store_contract.py::"

#: the accept-only gateway's test, in test_delivery.py
QUIET = "test_a_gateway_that_delivers_nothing_does_not_listen_for_delivery_notices"
#: the worker that goes on after its queue watch or rescan failed unforeseen
WATCHED = "test_a_fault_in_the_queue_watch_or_rescan_leaves_the_worker_delivering"

MUTANTS = [
    Mutant(
        name="memory-pick-not-due",
        path="gateway/store/memory.py",
        old="""        elif record.due_ms > now:
            why, due = "not_due", record.due_ms
""",
        new="",
        tests=(C + "test_pick_never_claims_a_delivery_that_is_not_due[memory]",),
        breaks="a delivery scheduled for later is attempted at once (Retry-After, backoff ignored)",
    ),
    Mutant(
        name="memory-accept-overwrites",
        path="gateway/store/memory.py",
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
        path="gateway/store/memory.py",
        old="        if record.attempts >= max_attempts:\n",
        new="        if False:\n",
        tests=(C + "test_pick_never_starts_an_attempt_over_the_limit[memory]",),
        breaks="a delivery is attempted more times than retry.attempts allows",
    ),
]

R = "[redis]"

MUTANTS += [
    Mutant(
        name="redis-pick-not-due",
        path="gateway/store/redis/lua/pick.lua",
        old="elseif tonumber(rec[2] or '0') > now then",
        new="elseif false then",
        tests=(C + "test_pick_never_claims_a_delivery_that_is_not_due" + R,),
        breaks="a delivery scheduled for later is attempted at once (Retry-After, backoff ignored)",
    ),
    Mutant(
        name="redis-accept-overwrites",
        path="gateway/store/redis/lua/accept.lua",
        old="if not state or state == 'released' then",
        new="if true then",
        tests=(C + "test_accept_never_overwrites_an_existing_key" + R,),
        breaks="a repeat on an async route queues the job again over the first one",
    ),
    Mutant(
        name="redis-accept-not-queued",
        path="gateway/store/redis/lua/accept.lua",
        old="  redis.call('ZADD', INDEX.queued, due, MEMBER)\n",
        new="",
        tests=(C + "test_accepted_delivery_is_listed_counted_and_announced" + R,),
        breaks="an accepted delivery is in no queue index: only a full rescan could find it",
    ),
    Mutant(
        name="redis-accept-uncounted",
        path="gateway/store/redis/lua/accept.lua",
        old="  count('queued', 1)\n",
        new="",
        tests=(C + "test_accepted_delivery_is_listed_counted_and_announced" + R,),
        breaks="an accepted delivery is not counted: admission (max_queued) and the queue "
        "gauges miss it, and the queue watch never sees its route's work",
    ),
    Mutant(
        name="redis-complete-keeps-request",
        path="gateway/store/redis/lua/complete.lua",
        old="  redis.call('DEL', RQ)\n",
        new="",
        tests=(C + "test_settling_a_delivery_deletes_its_request[complete-redis]",),
        breaks="a completed delivery's request (which may carry credentials) stays stored",
    ),
    Mutant(
        name="redis-pick-past-attempts",
        path="gateway/store/redis/lua/pick.lua",
        old="elseif tonumber(rec[3] or '0') >= tonumber(ARGV[5]) then",
        new="elseif false then",
        tests=(C + "test_pick_never_starts_an_attempt_over_the_limit" + R,),
        breaks="a delivery is attempted more times than retry.attempts allows",
    ),
    Mutant(
        name="redis-pick-without-claim",
        path="gateway/store/redis/lua/pick.lua",
        old="move(state, 'in_flight', now, lease)",
        new="redis.call('HSET', R, 's', 'in_flight')",
        tests=(C + "test_picked_delivery_is_not_picked_again" + R,),
        breaks="a picked delivery stays in its queue index: two replicas attempt it",
    ),
    Mutant(
        name="redis-retry-ignores-run-id",
        path="gateway/store/redis/lua/retry.lua",
        old="rec[2] ~= ARGV[3]",
        new="false",
        tests=(C + "test_stale_run_cannot_schedule_a_retry" + R,),
        breaks="a dead attempt's late retry reschedules a delivery another attempt holds",
    ),
    Mutant(
        name="redis-delivery-lease-released",
        path="gateway/store/redis/lua/_lib.lua",
        old="redis.call('HEXISTS', R, 'dl') == 1 then policy",
        new="false then policy",
        tests=(C + "test_expired_delivery_lease_is_never_retried_or_dropped[release-redis]",),
        breaks="a dead gateway's delivery is dropped when its lease runs out: accepted work lost",
    ),
]

D = "tests/test_delivery.py::"

MUTANTS += [
    Mutant(
        name="unknown-outcome-retried",
        path="gateway/delivery/attempt.py",
        old="""    async def lost(self, reason: str) -> None:
        await self.engine.unknown(self.route, self.ref, self.run_id, reason)
        self.result = "unknown_outcome"
""",
        new="""    async def lost(self, reason: str) -> None:
        await self.retry(reason)
""",
        tests=(
            D + "test_unknown_outcome_follows_policy[memory-park]",
            D + "test_unknown_outcome_follows_policy[memory-reconcile-done]",
        ),
        breaks="a delivery whose outcome is unknown is resent blind: the job may run twice",
    ),
    Mutant(
        name="backoff-without-jitter",
        path="gateway/delivery/retry.py",
        old="    return rand(0, ceiling)\n",
        new="    return ceiling\n",
        tests=(D + "test_next_delay_full_jitter_and_cap",),
        breaks="every delivery that failed together retries together: a thundering herd",
    ),
    Mutant(
        name="retry-after-ignored",
        path="gateway/delivery/retry.py",
        old="    if retry_after is not None:\n        return min(retry_after, retry.max_backoff)\n",
        new="",
        tests=(
            D + "test_next_delay_full_jitter_and_cap",
            D + "test_retry_after_sets_the_next_attempt[memory]",
        ),
        breaks="an upstream that asked for time (Retry-After) is hit again at once",
    ),
    Mutant(
        name="sigterm-keeps-picking",
        path="gateway/delivery/worker.py",
        old="        self.picking = False\n",
        new="        pass\n",
        tests=(D + "test_stop_picking_then_drain_leaves_nothing_lost[memory]",),
        breaks="a gateway shutting down starts new deliveries it will cut off at the grace",
    ),
    Mutant(
        name="drop-headers-stored",
        path="gateway/engine/accept.py",
        old="if n not in drop])",
        new="if True])",
        tests=(D + "test_stored_request_drops_headers_and_the_key[memory]",),
        breaks="headers the route says must never be stored (credentials) are kept with the job",
    ),
    Mutant(
        name="stored-key-header-case",
        path="gateway/engine/accept.py",
        old="drop_headers | {name.lower() for name in named if name}",
        new="drop_headers | {name for name in named if name}",
        tests=(D + "test_stored_request_keeps_what_the_set_filter_kept",),
        breaks="the key header (Idempotency-Key as configured) is stored with the job",
    ),
    Mutant(
        name="resync-strands-accepted-work",
        path="gateway/delivery/worker.py",
        old='if r.delivery.mode == "async" or r.name in self._pending',
        new='if r.delivery.mode == "async"',
        tests=(D + "test_work_accepted_before_a_reload_made_the_route_sync_is_delivered[memory]",),
        breaks="work answered 202 stays queued forever once a reload makes its route sync",
    ),
    Mutant(
        name="idle-process-hears-due-notices",
        path="gateway/store/redis/notices.py",
        old="channels = [*self._channels, *self._due_channels] if due else self._channels",
        new="channels = [*self._channels, *self._due_channels]",
        tests=(C + "test_delivery_notices_are_heard_only_while_a_worker_listens" + R,),
        breaks="a process that delivers nothing reads (and Redis writes it) a notice per accept",
    ),
    Mutant(
        name="due-listener-not-subscribed",
        path="gateway/store/redis/notices.py",
        old="        while not self._closing and due == self.due.listening:\n",
        new="        while not self._closing:\n",
        tests=(C + "test_delivery_notices_are_heard_only_while_a_worker_listens" + R,),
        breaks="a worker that starts listening (a reload that lets it deliver) hears no notice",
    ),
    Mutant(
        name="worker-listens-without-lanes",
        path="gateway/delivery/worker.py",
        old="        notices = bool(self.lanes)\n",
        new="        notices = True\n",
        tests=(D + QUIET + "[memory]",),
        breaks="an accept-only gateway still reads a delivery notice per accepted request",
    ),
    Mutant(
        name="reload-never-listens",
        path="gateway/delivery/worker.py",
        old="            found.route = route\n        self._listen()\n",
        new="            found.route = route\n",
        tests=(D + QUIET + "[memory]",),
        breaks="a reload that lets a gateway deliver leaves it deaf to notices (backstop only)",
    ),
    Mutant(
        name="queue-full-says-queued",
        path="gateway/engine/refusals.py",
        old='f"({route.delivery.max_queued}). This request was not queued and nothing was kept "',
        new='f"({route.delivery.max_queued}). This request is queued behind them "',
        tests=(
            "tests/test_delivery.py::"
            "test_an_accept_refused_at_the_bound_keeps_nothing_and_says_retry_later[memory]",
        ),
        breaks="a caller refused at max_queued is told its request is queued: it waits "
        "for a delivery that never comes instead of sending it again",
    ),
    Mutant(
        name="queue-watch-ends-on-an-unforeseen-fault",
        path="gateway/delivery/worker.py",
        old="""            except Exception:
                # One that nobody foresaw ends neither this loop nor, through run()'s
""",
        new="""            except NotImplementedError:
                # One that nobody foresaw ends neither this loop nor, through run()'s
""",
        tests=(D + WATCHED + "[queue_stats]",),
        breaks="a queue watch that meets an error nobody foresaw (a driver's own, after a "
        "failover) ends the worker: nothing is delivered again until a restart",
    ),
    Mutant(
        name="rescan-ends-on-an-unforeseen-fault",
        path="gateway/delivery/worker.py",
        old="""                except Exception as exc:
                    if isinstance(exc, StoreError):
""",
        new="""                except StoreError as exc:
                    if isinstance(exc, StoreError):
""",
        tests=(D + WATCHED + "[due_candidates]",),
        breaks="a rescan that meets an error nobody foresaw ends the worker: nothing is "
        "delivered again until a restart",
    ),
    Mutant(
        name="lane-holds-a-slot-while-it-waits",
        path="gateway/delivery/worker.py",
        old="""        while await self._ready(lane, loop):
            await process_slots.acquire()
            head = lane.head()
            if self.picking and head is not None and lane.ready(loop.time()):
                return head[0], lane.pop()
            process_slots.release()  # taken or dropped while this lane waited for the slot
        return None
""",
        new="""        await process_slots.acquire()
        while await self._ready(lane, loop):
            head = lane.head()
            if self.picking and head is not None and lane.ready(loop.time()):
                return head[0], lane.pop()
        process_slots.release()
        return None
""",
        tests=(
            "tests/test_delivery_lanes.py::"
            "test_a_waiting_route_does_not_hold_the_processs_delivery_slot[delayed]",
        ),
        breaks="a route whose delivery is due in an hour holds one of the process's "
        "max_deliveries slots while it waits: another route's due work is never attempted",
    ),
]
