"""Broken builds of the operator surfaces at scale and of the queue's bound: counts that
drift from the records, pages that skip or repeat a record, a page that reads every
record, a live refresh that misses a change, and admission that is not the store's."""

from tests.mutants import Mutant

C = "tests/test_store_contract.py::"
D = "tests/test_delivery.py::"
P = "tests/test_delivery_process.py::"
BURST = "test_a_burst_over_every_replica_and_worker_queues_exactly_max_queued"

MUTANTS = [
    Mutant(
        name="redis-count-not-decremented",
        path="gateway/store/redis/lua/_lib.lua",
        old="    if COUNTED[from] then count(from, -1) end\n",
        new="",
        tests=(C + "test_counts_follow_every_move[redis]",),
        breaks="a key that leaves a state stays counted in it: the overview, the gauges and "
        "/metrics say keys wait that were resolved long ago",
    ),
    Mutant(
        name="redis-late-answer-uncounted",
        path="gateway/store/redis/lua/complete.lua",
        old="if state == 'unresolved' then count('unresolved', -1) end  -- a late answer\n",
        new="",
        tests=(C + "test_counts_follow_every_move[redis]",),
        breaks="an unresolved key that a late answer completed is counted unresolved for ever",
    ),
    Mutant(
        name="memory-order-keeps-the-old-place",
        path="gateway/store/memory.py",
        old="        self._unfile(record.digest)\n        if record.state in _LISTED or",
        new="        if record.state in _LISTED or",
        tests=(
            C + "test_counts_follow_every_move[memory]",
            C + "test_pages_cover_every_record_exactly_once_while_others_change_state[memory]",
        ),
        breaks="a key that moved stays filed where it was: counted and listed in both states",
    ),
    Mutant(
        name="postgres-count-trigger-never-decrements",
        path="gateway/store/postgres/sql/005_counts.sql",
        old="        PERFORM gateway_count(OLD.prefix, OLD.route, OLD.state, -1);\n",
        new="",
        tests=(C + "test_counts_follow_every_move[postgres]",),
        breaks="on PostgreSQL a key that leaves a state stays counted in it (and its route's "
        "queue never drains below the bound: every new key is refused)",
    ),
    Mutant(
        name="redis-page-skips-ties",
        path="gateway/store/redis/lua/list.lua",
        old="  return place > at or (place == at and digest > after)\n",
        new="  return place > at\n",
        tests=(C + "test_pages_break_ties_by_digest[redis]",),
        breaks="the next page starts after the cursor's millisecond: keys parked in the same "
        "millisecond as a page's last one are never listed",
    ),
    Mutant(
        name="memory-page-skips-one",
        path="gateway/store/memory.py",
        old="max(bottom, bisect.bisect_right(order, at)), top)\n",
        new="max(bottom, bisect.bisect_right(order, at) + 1), top)\n",
        tests=(C + "test_pages_list_every_record_once_in_place_order[memory]",),
        breaks="each page skips the key after the cursor: walked page by page, keys are missed",
    ),
    Mutant(
        name="postgres-page-skips-ties",
        path="gateway/store/postgres/listing.py",
        old='conditions += [f"r.{place} {edge} $2", f"(r.{place}, r.digest) {beyond} ($2, $3)"]',
        new='conditions += [f"r.{place} {beyond} $2"]',
        tests=(C + "test_pages_break_ties_by_digest[postgres]",),
        breaks="on PostgreSQL the next page starts after the cursor's millisecond: keys parked "
        "in it are never listed",
    ),
    Mutant(
        name="redis-page-ends-at-a-dropped-entry",
        path="gateway/store/redis/listing.py",
        old="more = len(candidates) > wanted",
        new="more = len(found) > wanted",
        tests=(C + "test_a_page_that_drops_an_entry_still_leads_on[redis]",),
        breaks="a page that drops an entry whose record moved under it says nothing follows: "
        "the walk ends there and every key after it goes unlisted",
    ),
    Mutant(
        name="postgres-page-sorts-every-row",
        path="gateway/store/postgres/listing.py",
        old='f"ORDER BY r.{place} {order}, r.digest {order} LIMIT $1"',
        new='f"ORDER BY r.key {order} LIMIT $1"',
        tests=(
            "tests/test_store_postgres.py::"
            "test_a_page_and_the_counts_read_a_page_of_50000_parked_rows",
        ),
        breaks="on PostgreSQL a page sorts every waiting row before it returns 100",
    ),
    Mutant(
        name="postgres-oldest-without-its-index",
        path="gateway/store/postgres/sql/stats.sql",
        old="            AND r.state IN ('unresolved', 'parked', 'claimed'))) AS oldest_ms",
        new=")) AS oldest_ms",
        tests=(
            "tests/test_store_postgres.py::"
            "test_a_page_and_the_counts_read_a_page_of_50000_parked_rows",
        ),
        breaks="on PostgreSQL each scrape reads every waiting row for the oldest's age",
    ),
    Mutant(
        name="redis-list-reads-one-chunk",
        path="gateway/store/redis/lua/list.lua",
        old="    if #chunk < 2 * CHUNK then break end\n",
        new="    break\n",
        tests=("tests/test_scale.py::test_a_walk_through_the_pages_lists_each_of_50000_keys_once",),
        breaks="a bucket asked for more than 64 candidates gives 64 and looks exhausted: "
        "pages of 1,000 skip keys",
    ),
    Mutant(
        name="memory-page-reads-everything",
        path="gateway/store/memory.py",
        old="            if len(found) > wanted:\n                break\n",
        new="",
        tests=("tests/test_scale.py::test_operator_surfaces_hold_at_50000_parked_keys[memory]",),
        breaks="a page reads (and copies) every waiting key: at 50,000 the keys page holds the "
        "event loop and the memory",
    ),
    Mutant(
        name="admission-not-the-stores",
        path="gateway/engine/core.py",
        old="                route.delivery.max_queued,\n",
        new="                None,\n",
        tests=(
            D + "test_a_burst_of_new_keys_is_admitted_up_to_max_queued_exactly",
            D + "test_queue_full_refuses_new_keys_only",
        ),
        breaks="the accept never asks the store for the bound: a burst is accepted whole",
    ),
    Mutant(
        name="redis-accept-ignores-the-marks",
        path="gateway/store/redis/lua/accept.lua",
        old="redis.call('ZCARD', ADMITTED) < limit",
        new="redis.call('ZCARD', ADMITTED) < limit + 1000",
        tests=(C + "test_accept_admits_exactly_the_limit_of_a_burst[redis]",),
        breaks="on one Redis the accept queues past max_queued",
    ),
    Mutant(
        name="cluster-accept-takes-no-mark",
        path="gateway/store/redis/delivery.py",
        old='await self._accept(delivery, "" if taken else "0")',
        new='await self._accept(delivery, "")',
        tests=(
            C + "test_accept_admits_exactly_the_limit_of_a_burst[cluster]",
            P + BURST + "[cluster]",
        ),
        breaks="on a Cluster a full route still queues every new key",
    ),
    Mutant(
        name="cluster-failed-accept-keeps-the-mark",
        path="gateway/store/redis/delivery.py",
        old="        keep = False\n        try:\n",
        new="        keep = True\n        try:\n",
        tests=(
            C + "test_accepts_that_fail_leave_the_whole_bound[cluster]",
            C + "test_accepts_that_fail_leave_the_whole_bound[cluster+wait]",
        ),
        breaks="on a Cluster each accept that fails keeps its place in the bound: after "
        "max_queued failures every new key is refused, until the repair",
    ),
    Mutant(
        name="cluster-pick-keeps-the-mark",
        path="gateway/store/redis/delivery.py",
        old="            await self.admission.drop(hint.route, hint.digest)\n",
        new="            pass\n",
        tests=(C + "test_accept_admits_exactly_the_limit_of_a_burst[cluster]",),
        breaks="on a Cluster a picked delivery keeps its place in the bound: the queue looks "
        "full while it is empty, until the repair",
    ),
    Mutant(
        name="postgres-admission-takes-no-turn",
        path="gateway/store/postgres/sql/005_counts.sql",
        old="hashtext(p_prefix || '/' || p_route));",
        new="pg_backend_pid());",
        tests=(
            P + BURST + "[postgres]",
            C + "test_accept_admits_exactly_the_limit_of_a_burst[postgres]",
        ),
        breaks="on PostgreSQL accepts of one route count the queue at once, each before the "
        "others commit: a burst over replicas passes the bound",
    ),
    Mutant(
        name="console-etag-blind-to-the-rows",
        path="gateway/console/pages.py",
        old='text = json.dumps([shown, context["total"], links, bool(context["refusal"])])',
        new='text = json.dumps([context["total"], links, bool(context["refusal"])])',
        tests=("tests/test_console_parts.py::test_the_live_refresh_asks_only_for_what_changed",),
        breaks="the live refresh answers 304 after another operator claimed a key (the count "
        "of keys is the same): the list never shows it held",
    ),
    Mutant(
        name="refresh-asks-for-everything",
        path="gateway/console/static/refresh.js",
        old='      headers["If-None-Match"] = element.refreshTag;\n',
        new="",
        tests=(
            "tests/test_console.py::"
            "test_the_live_refresh_gets_304_while_nothing_changes_and_counts_ages_on",
        ),
        breaks="every live refresh of every open keys tab has the whole table drawn again",
    ),
    Mutant(
        name="refresh-ages-stand-still",
        path="gateway/console/static/refresh.js",
        old="        cells[i].textContent = age((now - since) / 1000);\n",
        new="",
        tests=(
            "tests/test_console.py::"
            "test_the_live_refresh_gets_304_while_nothing_changes_and_counts_ages_on",
        ),
        breaks="while nothing changes the keys list shows the ages it was drawn with, for ever",
    ),
    Mutant(
        name="redis-recount-mends-nothing",
        path="gateway/store/redis/lua/recount.lua",
        old="    if kept ~= n then\n",
        new="    if false then\n",
        tests=(C + "test_repair_mends_counts_and_marks_left_apart[redis]",),
        breaks="a count a failed script left wrong stays wrong for ever",
    ),
    Mutant(
        name="admission-marks-never-repaired",
        path="gateway/store/redis/admission.py",
        old="        if int(await client.zcard(key)) == waiting:\n",
        new="        if True:\n",
        tests=(C + "test_repair_mends_counts_and_marks_left_apart[redis]",),
        breaks="an admission mark a crash left behind (or never made) moves the bound for ever",
    ),
    Mutant(
        name="scrape-reads-the-store-itself",
        path="gateway/assembly.py",
        old="            counts = await self.counts.get()\n",
        new="            counts = await self._read_counts()\n",
        tests=("tests/test_scrape_storm.py::test_a_scrape_storm_costs_one_store_read",),
        breaks="each of 50 concurrent /metrics reads every route's counts from the store: "
        "a hundred times the round trips, on the proxy's event loop",
    ),
    Mutant(
        name="shared-read-kept-for-no-one",
        path="gateway/shared_read.py",
        old="        if kept is not None and time.monotonic() < kept[0]:\n",
        new="        if False:\n",
        tests=(
            "tests/test_shared_read.py::"
            "test_an_answer_serves_later_readers_for_its_ttl_then_is_read_again",
        ),
        breaks="concurrent scrapes share a read but the next ones read again at once: a "
        "scrape storm reads the store back to back",
    ),
]
