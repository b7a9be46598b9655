"""A console session ends with the credential that opened it (gateway/console/access.py,
gateway/console/session.py, Operators.credential in gateway/operators/identity.py), and never
counts again once its operator left the roster or their credential changed
(gateway/operators/roster.py, the stores' record_roster), caught by tests/test_operators.py (real
processes, SIGHUP, two replicas on one Redis), tests/test_console_parts.py (in
process, over reloads, a Redis that is down), tests/test_store_contract.py (every
store) and tests/test_console.py (Chromium)."""

from tests.mutants import Mutant

OPS = "tests/test_operators.py::"
P = "tests/test_console_parts.py::"
C = "tests/test_console.py::"
CONTRACT = "tests/test_store_contract.py::"

MUTANTS = [
    Mutant(
        name="session-credential-unchecked",
        path="gateway/console/access.py",
        old="    if not holds(secret, session, gateway.operators.credential(session.name, "
        "session.made_by)):\n",
        new="    if False:\n",
        tests=(
            OPS + "test_rotating_a_token_ends_the_sessions_it_opened",
            P + "test_a_session_ends_with_the_credential_it_stands_on",
            C + "test_a_rotated_token_signs_its_browser_out",
        ),
        breaks="a cookie's credential goes unchecked: after alice's token is rotated only the "
        "roster's new time stops her old cookie (in words that do not say the token "
        "changed), and nothing stops it where the store's roster is not read",
    ),
    Mutant(
        name="session-credential-ignores-the-proxy",
        path="gateway/operators/identity.py",
        old="            return token + self._header_source if self.identity_header else None\n",
        new="            return token\n",
        tests=(P + "test_a_session_ends_with_the_credential_it_stands_on",),
        breaks="a session the identity header made survives a change of the proxies it is "
        "believed from, or the header being switched off",
    ),
    Mutant(
        name="session-credential-unkeyed",
        path="gateway/console/session.py",
        old='    key = derived_key(secret, "credential")\n',
        new='    key = b""\n',
        tests=(P + "test_a_session_holds_only_with_the_credential_it_was_signed_in_with",),
        breaks="the cookie's credential fingerprint is a plain hash of the token's digest: "
        "anyone can make it, and it stays the same under a new session secret",
    ),
    Mutant(
        name="session-roster-unchecked",
        path="gateway/console/access.py",
        old="    if since != session.since_ms:\n",
        new="    if False:\n",
        tests=(
            OPS + "test_a_re_added_operator_starts_with_no_sessions",
            OPS + "test_rotating_a_token_ends_the_sessions_it_opened",
        ),
        breaks="an operator removed and added back with the very token they had, or whose "
        "token is rotated back, gets every session from before back: the old cookie claims "
        "and resolves keys again",
    ),
    Mutant(
        name="roster-keeps-a-changed-entry-meanwhile",
        path="gateway/operators/roster.py",
        old="        self._loads += 1\n        self._keep(self._known)\n",
        new="        self._loads += 1\n",
        tests=(P + "test_reloads_while_the_store_is_down_never_revive_a_session",),
        breaks="until the store records a reload, a process keeps the time an operator had "
        "before being removed and added back: with the store down, the old cookie counts",
    ),
    Mutant(
        name="roster-records-only-the-last-config",
        path="gateway/operators/roster.py",
        old="        agreed = marks if self._agreed is None else self._agreed\n",
        new="        agreed = marks\n",
        tests=(P + "test_reloads_while_the_store_is_down_never_revive_a_session",),
        breaks="an operator removed and added back while the store was down never leaves "
        "the store's roster: when it answers, their old sessions count again",
    ),
    Mutant(
        name="memory-roster-keeps-removed-entries",
        path="gateway/store/memory.py",
        old="        entries: dict[str, RosterEntry] = {}\n",
        new="        entries: dict[str, RosterEntry] = dict(self._roster)\n",
        tests=(
            CONTRACT + "test_an_entry_that_comes_back_is_valid_from_a_new_time[memory]",
            OPS + "test_rotating_a_token_ends_the_sessions_it_opened",
        ),
        breaks="an operator who leaves the memory store's roster keeps their time there, and "
        "comes back to it: their old sessions count again",
    ),
    Mutant(
        name="redis-roster-keeps-removed-entries",
        path="gateway/store/redis/lua/roster.lua",
        old="  if wanted[stored[i]] == nil then redis.call('HDEL', KEYS[1], stored[i]) end\n",
        new="",
        tests=(
            CONTRACT + "test_an_entry_that_comes_back_is_valid_from_a_new_time[redis]",
            OPS + "test_a_re_added_operator_starts_with_no_sessions",
        ),
        breaks="on Redis an operator removed from the roster keeps their entry, and comes "
        "back to its time: their old sessions count again on every replica",
    ),
    Mutant(
        name="postgres-roster-keeps-removed-entries",
        path="gateway/store/postgres/roster.py",
        old="AND NOT entry = ANY($2::text[])",
        new="AND false",
        tests=(CONTRACT + "test_an_entry_that_comes_back_is_valid_from_a_new_time[postgres]",),
        breaks="on PostgreSQL an operator removed from the roster keeps their row, and comes "
        "back to its time",
    ),
    Mutant(
        name="memory-roster-reuses-a-time",
        path="gateway/store/memory.py",
        old="        since = max(now_ms(), self._roster_last_ms + 1)\n",
        new="        since = now_ms()\n",
        tests=(CONTRACT + "test_an_entry_that_comes_back_is_valid_from_a_new_time[memory]",),
        breaks="an entry renewed within the millisecond it last got a time (or after the "
        "clock stepped back) gets that time again, and a session from before matches it",
    ),
    Mutant(
        name="roster-wiped-by-a-replica-without-the-console",
        path="gateway/operators/identity.py",
        old="        if not self._session_secret:\n            return None\n",
        new="        if not self._session_secret:\n            return {}\n",
        tests=(P + "test_a_replica_without_the_console_leaves_the_roster_alone",),
        breaks="a replica whose config has no session secret empties the shared roster at "
        "each start and reload: every console session on the other replicas ends",
    ),
]
