"""The store side of hardening: plain records under encryption, framing headers on replay
and from operators, eviction policies, and the keys CLI's options."""

from tests.mutants import Mutant

E = "tests/test_encryption.py::"
H = "tests/test_stored_headers.py::"
S = "tests/test_store_info.py::"
C = "tests/test_keys_cli.py::"

MUTANTS = [
    Mutant(
        name="encryption-plain-read-with-a-key",
        path="gateway/encryption.py",
        old="        elif self._refuse_plain:\n",
        new="        elif False:\n",
        tests=(
            E + "test_plain_response_written_into_redis_is_not_replayed_with_a_key",
            E + "test_plain_completion_notice_does_not_wake_a_waiter_with_it",
            E + "test_memory_store_refuses_plain_responses_with_a_key",
        ),
        breaks="with a key set, a plain response written into Redis is replayed as the job's",
    ),
    Mutant(
        name="encryption-read-unencrypted-always-on",
        path="gateway/store/base.py",
        old="        read_plain=config.read_unencrypted,\n",
        new="        read_plain=True,\n",
        tests=(
            E + "test_codec_for_wires_read_unencrypted",
            E + "test_plain_response_written_into_redis_is_not_replayed_with_a_key",
        ),
        breaks="store.read_unencrypted is ignored: plain responses are read with a key set",
    ),
    Mutant(
        name="replay-keeps-stored-framing",
        path="gateway/engine/replay.py",
        old="    headers = _replayable(stored.headers)\n",
        new="    headers = list(stored.headers)\n",
        tests=(H + "test_replay_drops_stored_framing_and_hop_by_hop_headers",),
        breaks="a stored Content-Length or Transfer-Encoding frames the replay wrongly",
    ),
    Mutant(
        name="operator-response-unchecked",
        path="gateway/operators/actions.py",
        old="            check_response(answer, max_body, ref.route)\n",
        new="            pass\n",
        tests=(
            H + "test_operator_response_is_validated",
            "tests/test_admin.py::test_bad_bodies_are_refused_with_their_own_type[bad-response-memory]",
        ),
        breaks="an operator's Content-Length or CR/LF header is stored and replayed",
    ),
    Mutant(
        name="eviction-policy-ignored",
        path="gateway/records.py",
        old="        if not self.evicts or allow_eviction:\n",
        new="        if True:\n",
        tests=(S + "test_an_evicting_policy_fails_readiness_and_says_how_to_fix_it",),
        breaks="a Redis that may evict records reports ready, and evicted keys run again",
    ),
    Mutant(
        name="cluster-info-first-master-only",
        path="gateway/store/redis/info.py",
        old="found = reduce(StoreInfo.worse, masters)",
        new="found = masters[0]",
        tests=(S + "test_a_cluster_reports_its_worst_master",),
        breaks="one cluster master with an evicting policy goes unnoticed",
    ),
    Mutant(
        name="keys-cli-options-before-the-action-only",
        path="gateway/admin/client.py",
        old="    _shared_options(shared, defaults=False)\n",
        new="",
        tests=(C + "test_every_action_takes_the_options_in_either_place",),
        breaks="`keys list --json` is a usage error",
    ),
    Mutant(
        name="keys-cli-action-default-overwrites",
        path="gateway/admin/client.py",
        old="        default=url if defaults else argparse.SUPPRESS,\n",
        new="        default=url,\n",
        tests=(C + "test_a_value_before_the_action_is_not_overwritten_by_the_actions_default",),
        breaks="`keys --admin-url URL list` goes to the default URL instead",
    ),
    Mutant(
        name="cluster-script-loaded-per-caller",
        path="gateway/store/redis/scripts.py",
        old="        loading = self._loading.get(script.sha)\n",
        new="        loading = None\n",
        tests=(S + "test_a_cluster_loads_a_flushed_script_once_not_once_per_caller",),
        breaks="after NOSCRIPT every caller loads the script on every primary (a storm's herd)",
    ),
    Mutant(
        name="cluster-closed-connection-is-a-500",
        path="gateway/store/redis/topology.py",
        old="    except (AttributeError, RuntimeError) as exc:\n",
        new="    except NotImplementedError as exc:\n",
        tests=(S + "test_a_cluster_connection_closed_under_commands_is_a_store_error",),
        breaks="a command redis-py's cluster client closed under it escapes as a 500",
    ),
    Mutant(
        name="cluster-closed-connection-on-uvloop-is-a-500",
        path="gateway/store/redis/topology.py",
        old="    except (AttributeError, RuntimeError) as exc:\n",
        new="    except AttributeError as exc:\n",
        tests=(S + "test_a_cluster_connection_closed_under_commands_is_a_store_error",),
        breaks="on uvloop (the gateway's loop), a command redis-py's cluster client closed "
        "under it escapes as RuntimeError: a 500, and the delivery worker's queue watch "
        "ends on it",
    ),
    Mutant(
        name="cluster-unreachable-is-no-store-error",
        path="gateway/store/redis/topology.py",
        old="    except RedisClusterException as exc:\n",
        new="    except NotImplementedError as exc:\n",
        tests=(S + "test_a_cluster_no_node_answers_is_a_store_error_and_its_listener_lives",),
        breaks="with no cluster node answering, store calls raise redis-py's "
        "RedisClusterException (a 500; the delivery worker's queue watch ends on it)",
    ),
    Mutant(
        name="cluster-refresh-kills-the-listener",
        path="gateway/store/redis/topology.py",
        old="        with _closed_under_it():\n            return await super().initialize(",
        new="        if True:\n            return await super().initialize(",
        tests=(S + "test_a_cluster_no_node_answers_is_a_store_error_and_its_listener_lives",),
        breaks="the notifications listener ends on a topology refresh no node answers, and "
        "the store never subscribes again",
    ),
]
