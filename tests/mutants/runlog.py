from tests.mutants import Mutant

C = "tests/test_store_contract.py::"
MATCH = C + "test_pages_match_a_time_range_a_literal_key_prefix_and_a_status"
DONE = C + "test_completed_deliveries_are_listed_by_route_while_kept"
CLI = (
    "tests/test_keys_cli.py::"
    "test_the_run_log_lists_a_routes_deliveries_by_filter_and_shows_each_attempt"
)
ADMIN = "tests/test_admin.py::"
CONSOLE = (
    "tests/test_console_parts.py::"
    "test_the_keys_page_filters_the_run_log_and_a_key_shows_its_attempts"
)
RETRIES = "tests/test_delivery.py::test_retries_until_the_upstream_answers"

MUTANTS = [
    Mutant(
        name="listing-prefix-ignored",
        path="gateway/store/pages.py",
        old="if self.key_prefix and not record.key.startswith(self.key_prefix):",
        new="if False:",
        tests=(
            MATCH + "[memory]",
            C + "test_a_page_the_key_prefix_drops_reads_a_bounded_part[memory]",
        ),
        breaks="a listing for a key prefix shows every key",
    ),
    Mutant(
        name="listing-status-ignored",
        path="gateway/store/pages.py",
        old="return self.status is None or upstream_status(record) == self.status",
        new="return True",
        tests=(MATCH + "[memory]",),
        breaks="a listing for an upstream status shows every status",
    ),
    Mutant(
        name="memory-listing-floor-ignored",
        path="gateway/store/memory.py",
        old='bottom = 0 if floor is None else bisect.bisect_left(order, (floor, ""))',
        new="bottom = 0",
        tests=(MATCH + "[memory]",),
        breaks="a listing's time range shows records from before it starts",
    ),
    Mutant(
        name="redis-listing-floor-ignored",
        path="gateway/store/redis/lua/list.lua",
        old="local lo, hi = floor ~= '' and floor or '-inf', top ~= '' and top or '+inf'",
        new="local lo, hi = '-inf', top ~= '' and top or '+inf'",
        tests=(MATCH + "[redis]",),
        breaks="a listing's time range shows records from before it starts (Redis)",
    ),
    Mutant(
        name="pg-listing-until-ignored",
        path="gateway/store/postgres/listing.py",
        old='            ranged.append("r.{place} <= $6")\n',
        new="            pass\n",
        tests=(MATCH + "[postgres]",),
        breaks="a listing's time range shows records from after it ends (PostgreSQL)",
    ),
    Mutant(
        name="sqlite-listing-floor-ignored",
        path="gateway/store/sqlite/listing.py",
        old='            where.append("place >= ?")\n            args.append(floor)\n',
        new="            pass\n",
        tests=(MATCH + "[sqlite]",),
        breaks="a listing's time range shows records from before it starts (SQLite)",
    ),
    Mutant(
        name="listing-sync-completed",
        path="gateway/store/pages.py",
        old="return record.state is State.COMPLETED and record.delivery",
        new="return record.state is State.COMPLETED",
        tests=(DONE + "[memory]", DONE + "[sqlite]"),
        breaks="a route's completed listing shows sync keys, which have no run log",
    ),
    Mutant(
        name="redis-completion-unlisted",
        path="gateway/store/redis/lua/complete.lua",
        old="  list_completed(now, ttl)\n",
        new="",
        tests=(DONE + "[redis]",),
        breaks="a completed delivery is missing from its route's run log (Redis)",
    ),
    Mutant(
        name="pg-listing-shows-expired",
        path="gateway/store/postgres/listing.py",
        old='"(r.expires_ms IS NULL OR r.expires_ms > (SELECT now FROM t))"',
        new='"TRUE"',
        tests=(DONE + "[postgres]",),
        breaks="an expired completed delivery is still listed (PostgreSQL)",
    ),
    Mutant(
        name="sqlite-listing-shows-expired",
        path="gateway/store/sqlite/listing.py",
        old='where.append("(expires_ms IS NULL OR expires_ms > ?)")',
        new='where.append("(expires_ms IS NULL OR expires_ms > ? OR 1)")',
        tests=(DONE + "[sqlite]",),
        breaks="an expired completed delivery is still listed (SQLite)",
    ),
    Mutant(
        name="listing-status-any-digits",
        path="gateway/operators/actions.py",
        old="    status = whole_number(text, 3)\n",
        new="    status = int(text) if text.strip().isdigit() and len(text) < 9 else None\n",
        tests=(
            ADMIN + "test_bad_listing_filters_name_the_filter[memory]",
            "tests/test_operator_text.py::test_every_listing_filter_refuses_hostile_values_up_front",
        ),
        breaks="a status filter of another script's digits (٥٠٣) is read as 503",
    ),
    Mutant(
        name="listing-time-any-date",
        path="gateway/operators/actions.py",
        old="if 1 <= month <= 12 and 1 <= day <= calendar.monthrange(year, month)[1]:",
        new="if True:",
        tests=(CLI, ADMIN + "test_bad_listing_filters_name_the_filter[memory]"),
        breaks="a time range from a date that does not exist (February 30) is taken",
    ),
    Mutant(
        name="runs-replica-dropped",
        path="gateway/records.py",
        old='replica=str(event.get("replica", "")),',
        new='replica="",',
        tests=(CLI, CONSOLE, RETRIES),
        breaks="a key's attempts do not say which replica made each",
    ),
    Mutant(
        name="runs-next-due-dropped",
        path="gateway/records.py",
        old="next_due_ms=due if type(due) is int else 0,",
        new="next_due_ms=0,",
        tests=(RETRIES,),
        breaks="a key's attempts do not say when the next one is due",
    ),
    Mutant(
        name="console-run-log-unfiltered",
        path="gateway/console/pages.py",
        old="age, cursor, match=match)",
        new="age, cursor)",
        tests=(CONSOLE,),
        breaks="the console's key prefix, status and time range fields change nothing",
    ),
    Mutant(
        name="bulk-skips-nothing",
        path="gateway/operators/actions.py",
        old="if now is None or now.state is not State.PARKED or now.since_ms != listed.since_ms:",
        new="if now is None:",
        tests=(
            ADMIN + "test_a_bulk_retry_skips_and_counts_the_keys_that_changed_meanwhile[memory]",
        ),
        breaks="a bulk action acts on a key that changed since it was listed (claimed meanwhile)",
    ),
]
