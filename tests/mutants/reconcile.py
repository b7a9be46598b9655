"""Broken builds of the reconcile check and the status URL: a caller's key that moves a
check, a key spelled two ways, a sweep that floods the job service or holds the whole
backlog, a wrong status token that costs a record's read."""

from tests.mutants import Mutant

URLS = "tests/test_reconcile_urls.py::"
REFUSED = URLS + "test_a_value_that_would_move_the_check_is_refused"
PROPERTY = URLS + "test_no_value_changes_where_the_url_goes"
NGINX = "tests/test_reconcile_process.py::test_a_key_never_sends_its_check_to_another_location"
SPELLING = "tests/test_key_spelling.py::"
SWEEP = "tests/test_reconcile_sweep.py::"
STATUS = "tests/test_status_url.py::"

SLOW_ROUTE = (
    "tests/test_reconcile_process.py::test_a_slow_route_holds_up_no_other_and_not_the_lease_expiry"
)

MUTANTS = [
    Mutant(
        name="idle-sweep-reads-every-route-every-pass",
        path="gateway/reconcile.py",
        old="if now < due and counts[name] <= seen:",
        new="if False:",
        tests=(SWEEP + "test_an_idle_sweep_reads_each_route_once_per_every",),
        breaks="an idle sweep lists every route's backlog on every pass: one route with a "
        "short `every` makes the store read all of them each second",
    ),
    Mutant(
        name="idle-sweep-misses-a-new-unresolved-key",
        path="gateway/reconcile.py",
        old="if now < due and counts[name] <= seen:",
        new="if now < due:",
        tests=(SWEEP + "test_an_idle_sweep_reads_each_route_once_per_every",),
        breaks="a key newly unresolved waits for its route's last sweep's `every` instead "
        "of being checked at the next pass",
    ),
    Mutant(
        name="idle-sweep-skips-past-every",
        path="gateway/reconcile.py",
        old="    if _due(record, every):\n        return every\n",
        new="    if _due(record, every):\n        return 10 * every\n",
        tests=(SWEEP + "test_an_idle_sweep_reads_each_route_once_per_every",),
        breaks="a route's keys are checked again only well after their `every`",
    ),
    Mutant(
        name="sweep-pass-waits-for-every-route",
        path="gateway/reconcile.py",
        old="                    await self.start_sweep()\n",
        new="                    await self.sweep()\n",
        tests=(SLOW_ROUTE,),
        breaks="each pass waits for every route's sweep: a route whose status endpoint "
        "hangs holds up the other routes' checks and the opening of dead leases",
    ),
    Mutant(
        name="reconcile-dot-segment-placed",
        path="gateway/config/templates.py",
        old='        if bare in (".", ".."):\n',
        new="        if False:\n",
        tests=(REFUSED + "[..-dot_segment]", PROPERTY, NGINX + "[..]"),
        breaks="the key .. fills reconcile.url's path: nginx sends the check to another "
        "location, whose 404 releases the key, and the job runs again",
    ),
    Mutant(
        name="reconcile-separator-placed",
        path="gateway/config/templates.py",
        old='        if "/" in text or "\\\\" in text:\n',
        new="        if False:\n",
        tests=(REFUSED + "[a/b-separator]", PROPERTY, NGINX + "[a/b]"),
        breaks="a key holding / is sent as %2F, which nginx decodes and resolves: "
        "x/../../status checks another URL",
    ),
    Mutant(
        name="reconcile-decoded-once",
        path="gateway/config/templates.py",
        old='    while "%" in text:\n',
        new="    while False:\n",
        tests=(REFUSED + "[%2e%2E-dot_segment]", PROPERTY),
        breaks="a key spelled %2e%2E is placed whole in the path: a server that decodes "
        "twice resolves it as ..",
    ),
    Mutant(
        name="reconcile-empty-segment-placed",
        path="gateway/config/templates.py",
        old="        if not bare:\n",
        new="        if False:\n",
        tests=(REFUSED + "[-empty_segment]", PROPERTY),
        breaks="a key that leaves its path segment empty makes //, which servers merge: "
        "the check asks about a shorter path",
    ),
    Mutant(
        name="reconcile-placeholder-in-host",
        path="gateway/config/addresses.py",
        old='            if slot.place == "authority":\n',
        new="            if False:\n",
        tests=(URLS + "test_a_placeholder_in_the_host_is_refused",),
        breaks="a config with {key} in reconcile.url's host is accepted: a caller's key "
        "chooses the host its check goes to",
    ),
    Mutant(
        name="check-config-silent-on-path-key",
        path="gateway/config/addresses.py",
        old='    if slot is None or slot.place != "path":\n',
        new="    if True:\n",
        tests=(
            URLS + "test_check_config_warns_of_a_key_in_the_path",
            URLS + "test_check_config_prints_the_warning_and_passes",
        ),
        breaks="check-config passes {key} as a path segment without a word: keys such as "
        ".. are never checked and park, and nobody was told the query is the safe place",
    ),
    Mutant(
        name="forward-dot-parameter-passed",
        path="gateway/http/request.py",
        old='        if semicolon and unquote(head) in ("", ".", ".."):\n',
        new="        if False:\n",
        tests=("tests/test_paths.py::test_encoded_slash_or_backslash_on_a_keyed_route_is_refused",),
        breaks="a keyed route forwards /files/a/..;/other, which Tomcat serves as /files/other: "
        "the path keyed is not the path served",
    ),
    Mutant(
        name="cli-key-in-the-path",
        path="gateway/admin/client.py",
        old='    return f"/admin/key{action}?" + urlencode(query, quote_via=quote, safe="")\n',
        new="    return f\"/admin/keys/{route}/{quote(key, safe='')}{action}\"\n",
        tests=(
            "tests/test_keys_cli.py::test_a_key_that_would_change_the_path_addresses_only_itself",
        ),
        breaks="`keys claim charge x/../../charge/VICTIM` through a proxy that decodes and "
        "resolves paths claims VICTIM: the operator resolves a job they never looked at",
    ),
    Mutant(
        name="cli-key-query-unencoded",
        path="gateway/admin/client.py",
        old='urlencode(query, quote_via=quote, safe="")',
        new="urlencode(query, quote_via=lambda text, *_: text)",
        tests=(
            "tests/test_keys_cli.py::test_show_resolve_and_release_a_key_shaped_like_a_url[a#b]",
            "tests/test_keys_cli.py::test_show_resolve_and_release_a_key_shaped_like_a_url[%2F]",
        ),
        breaks="a key holding # or % goes into the query as it is: the listener reads "
        "another key (cut at #, or decoded)",
    ),
    Mutant(
        name="check-sends-the-raw-key",
        path="gateway/reconcile.py",
        old='        headers = with_key(route, [("accept", "application/json")], record.key)\n',
        new='        headers = [("accept", "application/json"), ("Idempotency-Key", record.key)]\n',
        tests=(SPELLING + "test_forward_delivery_and_check_spell_the_key_alike[memory]",),
        breaks="the check spells a Latin-1 key differently from the forward, and cannot send "
        "one beyond Latin-1 at all (it parks)",
    ),
    Mutant(
        name="key-spelling-ambiguous",
        path="gateway/keying.py",
        old='        and "%" not in key\n',
        new="",
        tests=(SPELLING + "test_two_keys_never_share_a_spelling",),
        breaks="the key 'café' and the ASCII key 'caf%C3%A9' reach the upstream as one "
        "Idempotency-Key, and its own dedupe merges two jobs",
    ),
    Mutant(
        name="key-spelling-a-quoted-string",
        path="gateway/keying.py",
        old="        and '\"' not in key\n",
        new="",
        tests=(SPELLING + "test_a_reader_of_the_header_tells_every_two_keys_apart",),
        breaks='the key \'"x"\' is sent as the quoted string "x", which a reader of the '
        "Idempotency-Key draft takes for the key 'x': two jobs look like one upstream",
    ),
    Mutant(
        name="reconcile-checks-unbounded",
        path="gateway/reconcile.py",
        old="        async with slots[1]:\n",
        new="        async with asyncio.Lock():\n",
        tests=(
            SWEEP + "test_a_backlog_clears_at_the_bound_never_faster",
            "tests/test_reconcile_process.py::test_checks_at_once_never_exceed_the_bound",
        ),
        breaks="a backlog's checks all go at once: the job service that has just come back "
        "gets hundreds of status requests together",
    ),
    Mutant(
        name="repeat-waits-for-a-check-slot",
        path="gateway/reconcile.py",
        old="        if not wait and slots[1].locked():\n",
        new="        if False:\n",
        tests=(SWEEP + "test_a_repeat_does_not_wait_for_a_slot",),
        breaks="a caller's repeat waits behind the sweep's backlog for its answer",
    ),
    Mutant(
        name="sweep-reads-the-whole-backlog",
        path="gateway/reconcile.py",
        old="PAGE = 100\n",
        new="PAGE = 1_000_000\n",
        tests=(SWEEP + "test_the_sweep_reads_the_backlog_a_page_at_a_time",),
        breaks="the sweep reads and holds every unresolved record at once: 20,000 after an "
        "outage, each with its history",
    ),
    Mutant(
        name="status-record-read-before-token",
        path="gateway/proxy/status.py",
        old="    if not hmac.compare_digest(token.encode(), given.encode()):\n        return None\n"
        "    record = await gateway.store.get(ref)\n",
        new="    record = await gateway.store.get(ref)\n",
        tests=(
            STATUS + "test_a_wrong_token_never_reads_the_stored_response_on_redis",
            STATUS + "test_a_wrong_token_never_reads_the_stored_response_on_postgres",
            STATUS + "test_a_wrong_token_for_a_large_record_is_as_fast_as_for_none",
        ),
        breaks="a wrong status token reads the whole record first: a guessed key that exists "
        "answers slower, and each guess moves its stored response out of the store",
    ),
    Mutant(
        name="status-missing-token-opens-nothing",
        path="gateway/store/base.py",
        old="        self.read_token(_NO_DIGEST, dummy[1])\n",
        new="",
        tests=(STATUS + "test_a_missing_token_costs_what_a_stored_one_does",),
        breaks="with store.encryption_key a guessed status URL for an existing key decrypts "
        "its token and one for an absent key does not: timing tells which keys exist",
    ),
]
