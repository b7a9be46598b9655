"""Broken builds the property tests must catch: store moves, windows, templates, config."""

from tests.mutants import Mutant

STATES = "tests/test_store_states.py::test_store_state_machine"
P = "tests/test_properties.py::"

MUTANTS = [
    # -- the store's state machine (both stores, model, invariants) --------------------
    Mutant(
        name="memory-release-unresolved",
        path="gateway/store/memory.py",
        old="if record.run_id != run_id or record.state is not State.IN_FLIGHT:",
        new="if record.run_id != run_id or record.state is State.COMPLETED:",
        tests=(STATES,),
        breaks="a run frees its unresolved key, so a request that may have run is sent again",
    ),
    Mutant(
        name="redis-release-any-run",
        path="gateway/store/redis/lua/release.lua",
        old="if state ~= 'in_flight' or redis.call('HGET', R, 'r') ~= ARGV[3] then return 0 end",
        new="if state ~= 'in_flight' then return 0 end",
        tests=(STATES,),
        breaks="a stale worker releases a key another run holds, and the key runs twice",
    ),
    Mutant(
        name="redis-expired-lease-freed",
        path="gateway/store/redis/lua/_lib.lua",
        old="if policy == 'release' then",
        new="if policy ~= 'parked' then",
        tests=(STATES,),
        breaks="a lease that ran out frees the key on a route that says unresolved",
    ),
    Mutant(
        name="redis-completed-response-overwritten",
        path="gateway/store/redis/lua/complete.lua",
        old="if state == 'completed' then return 1 end",
        new="if state == 'completed' then redis.call('HSET', R, 'resp', ARGV[4]) return 1 end",
        tests=(STATES,),
        breaks="a repeated completion overwrites the response repeats are replayed",
    ),
    Mutant(
        name="redis-operator-resolve-not-holder",
        path="gateway/store/redis/lua/op_resolve.lua",
        old="if holder ~= ARGV[3] then return {0, 'holder', holder} end",
        new="",
        tests=(STATES,),
        breaks="an operator resolves a key another operator holds",
    ),
    Mutant(
        name="redis-inconclusive-check-releases",
        path="gateway/store/redis/lua/check_end.lua",
        old="elseif ARGV[4] == 'not_done' then",
        new="elseif ARGV[4] ~= 'done' then",
        # The state machine reaches an inconclusive check on a sync key only for some
        # of its (derandomized) sequences, and each rule added to it moves them: the
        # contract test is the direct witness.
        tests=(
            "tests/test_store_contract.py::test_one_check_at_a_time_and_once_per_interval[redis]",
            STATES,
        ),
        breaks="an inconclusive check frees an unresolved key: resent blind",
    ),
    Mutant(
        name="redis-index-left-behind",
        path="gateway/store/redis/lua/_lib.lua",
        old="if INDEX[from] then redis.call('ZREM', INDEX[from], MEMBER) end",
        new="",
        tests=(STATES,),
        breaks="a record stays listed in its old state's index: in two states at once",
    ),
    # -- period windows ---------------------------------------------------------------
    Mutant(
        name="window-ignores-offset-change",
        path="gateway/keying.py",
        old="if _offset(start, zone) == offset:",
        new="if True:",
        tests=(P + "test_windows_around_every_offset_change_of_every_zone",),
        breaks="a window around a DST change names a start that is not in it",
    ),
    Mutant(
        name="window-off-by-one-at-spring-forward",
        path="gateway/keying.py",
        old="if offset > old_offset and floor >= wall_before_change:",
        new="if offset > old_offset and floor > wall_before_change:",
        tests=(P + "test_windows_around_every_offset_change_of_every_zone",),
        breaks="a window whose start the clock skips runs on a whole window too long",
    ),
    # -- templates and keys -------------------------------------------------------------
    Mutant(
        name="template-part-not-escaped",
        path="gateway/keying.py",
        old='pieces.append(value if piece.kind == "period" else _escape(value, escapes))',
        new="pieces.append(value)",
        tests=(P + "test_template_rendering_is_injective",),
        breaks='"{a}:{b}" gives a:b+c and a+b:c one key: one request replays another\'s response',
    ),
    Mutant(
        name="template-escape-char-not-escaped",
        path="gateway/config/templates.py",
        old="escapes=frozenset({ESCAPE, *firsts}) if firsts else frozenset(),",
        new="escapes=frozenset(firsts),",
        tests=(P + "test_template_rendering_is_injective",),
        breaks="a value's own backslash fakes an escape, and two requests share a key",
    ),
    Mutant(
        name="config-allows-glued-template-parts",
        path="gateway/config/templates.py",
        old="if not between or between.startswith(ESCAPE):",
        new="if False:",
        tests=(P + "test_config_refuses_templates_that_would_collide",),
        breaks="a template with parts side by side loads, and its keys collide",
    ),
    Mutant(
        name="quoted-header-escapes-kept",
        path="gateway/keying.py",
        old='return _SF_ESCAPE.sub(r"\\1", m.group(1))',
        new="return m.group(1)",
        tests=(P + "test_equivalent_requests_give_one_record",),
        breaks='a quoted key "a\\"b" and the bare a"b become two records',
    ),
    Mutant(
        name="scope-hash-skipped",
        path="gateway/keying.py",
        old="    if not spec.scope:\n",
        new="    if True:\n",
        tests=(P + "test_different_keys_and_tenants_never_share_a_record",),
        breaks="two tenants with the same key share a record: one gets the other's response",
    ),
    Mutant(
        name="record-name-holds-user-key",
        path="gateway/store/redis/store.py",
        old="return self._layout(bucket_of(ref.digest), ref.digest, ref.route)",
        new="return self._layout(bucket_of(ref.digest), ref.key, ref.route)",
        tests=(P + "test_record_names_are_hashed_and_tagged",),
        breaks="a user's key becomes a Redis name: ../*{x} keys can reach other records",
    ),
    # -- config -----------------------------------------------------------------------
    Mutant(
        name="config-listen-type-error-escapes",
        path="gateway/config/model.py",
        old="except (ValueError, TypeError, AttributeError):",
        new="except ValueError:",
        tests=(P + "test_config_parsing_answers_config_or_config_error",),
        breaks="a listen address that is not text crashes with a traceback, no YAML path",
    ),
]
