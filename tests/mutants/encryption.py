from tests.mutants import Mutant

T = "tests/test_encryption.py::"

MUTANTS = [
    Mutant(
        name="encryption-associated-data-dropped",
        path="gateway/encryption.py",
        old="    return header + digest.encode()",
        new="    return header",
        tests=(
            T + "test_envelope_is_bound_to_its_record",
            T + "test_ciphertext_moved_to_another_record_does_not_open",
        ),
        breaks="a sealed response copied into another record's field is replayed to its caller",
    ),
    Mutant(
        name="encryption-nonce-fixed",
        path="gateway/encryption.py",
        old="        nonce = os.urandom(NONCE_BYTES)",
        new="        nonce = bytes(NONCE_BYTES)",
        tests=(T + "test_envelope_layout_round_trip_and_fresh_nonces",),
        breaks="every record reuses one nonce under one key, which breaks AES-GCM",
    ),
    Mutant(
        name="encryption-key-id-ignored-on-read",
        path="gateway/encryption.py",
        old="        aead = self._readers.get(header[1:])",
        new="        aead = self._writer[1] if self._writer else None",
        tests=(
            T + "test_reading_picks_the_key_by_its_id",
            T + "test_rotation_reads_old_keys_writes_the_new_one_and_never_deletes",
        ),
        breaks="after a rotation, records sealed with a previous key are no longer replayed",
    ),
    Mutant(
        name="encryption-redis-complete-writes-plaintext",
        path="gateway/store/redis/store.py",
        old="                self.codec.encode(ref.digest, response),\n",
        new="                response.encode(),\n",
        tests=(T + "test_redis_holds_no_plaintext_and_replays",),
        breaks="with a key set, Redis still holds the response body and headers in clear",
    ),
    Mutant(
        name="encryption-memory-store-keeps-plaintext",
        path="gateway/store/memory.py",
        old="        if response is None or not self.codec.encrypting:",
        new="        if True:",
        tests=(T + "test_memory_store_seals_and_refuses_alike",),
        breaks="the memory store keeps responses unsealed although a key is set",
    ),
    Mutant(
        name="encryption-unreadable-not-answered",
        path="gateway/engine/core.py",
        old="                if record.unreadable:\n",
        new="                if False:\n",
        tests=(T + "test_tampered_ciphertext_gives_the_problem_not_a_wrong_replay",),
        breaks="an undecryptable record leaves its caller waiting, then 409, not the clear problem",
    ),
    Mutant(
        name="encryption-duplicate-keys-accepted",
        path="gateway/config/store.py",
        old="        if other == key:",
        new="        if False:",
        tests=(T + "test_config_errors_name_the_place_and_the_fix_never_the_key",),
        breaks="a key listed twice passes check-config",
    ),
    Mutant(
        name="encryption-check-config-shows-the-key",
        path="gateway/config/summary.py",
        old="new responses sealed with key id {key_id(store.encryption_key).hex()}",
        new="new responses sealed with key id {store.encryption_key.hex()}",
        tests=(T + "test_keys_come_from_the_environment_and_stay_out_of_cli_output",),
        breaks="check-config prints the encryption key",
    ),
    Mutant(
        name="encryption-config-error-quotes-the-key",
        path="gateway/config/store.py",
        old="""'expected a list; write e.g. previous_encryption_keys: ["${OLD_KEY}"]'""",
        new='f"expected a list, got {show(value)}"',
        tests=(T + "test_config_errors_name_the_place_and_the_fix_never_the_key",),
        breaks="a key written without [brackets] is quoted in the config error",
    ),
]

# Stored data that cannot be read (a request sealed with a key no longer configured or
# stored plain, a damaged history or response) never stops an operator surface:
# gateway/operators/actions.py, gateway/records.py, gateway/store/redis/lua/_lib.lua.
PLAIN_OPENS = T + "test_a_delivery_stored_plain_opens_after_encryption_is_turned_on"
RECORD = "tests/test_redis_record.py::"

MUTANTS += [
    Mutant(
        name="unreadable-request-is-a-500",
        path="gateway/operators/actions.py",
        old="    except Unreadable as exc:\n        return UnreadableRequest(str(exc))\n",
        new="    except ZeroDivisionError as exc:\n        return UnreadableRequest(str(exc))\n",
        tests=(PLAIN_OPENS,),
        breaks="a delivery whose stored request cannot be opened answers the key page, the "
        "API and keys show with a 500: nobody can claim or resolve it",
    ),
    Mutant(
        name="damaged-history-raises",
        path="gateway/records.py",
        old="    if isinstance(value, (str, bytes)):\n        value = stored_json(value)\n"
        "    if isinstance(value, list)",
        new="    if isinstance(value, (str, bytes)):\n        value = json.loads(value)\n"
        "    if isinstance(value, list)",
        tests=(RECORD + "test_a_record_whose_json_was_damaged_is_read_and_says_so",),
        breaks="a history changed in the store into text that is not JSON makes every read "
        "of the record fail: a 500 on the proxy and every operator surface",
    ),
    Mutant(
        name="lua-damaged-history-stops-the-record",
        path="gateway/store/redis/lua/_lib.lua",
        old="  if raw then list = history_of(raw) end\n",
        new="  if raw then list = cjson.decode(raw) end\n",
        tests=(PLAIN_OPENS,),
        breaks="a record whose history is damaged cannot move: claiming it fails in the "
        "script, so a person cannot resolve it",
    ),
    Mutant(
        name="stored-response-status-unchecked",
        path="gateway/records.py",
        old="        if type(status) is not int or not 100 <= status <= 599 or not isinstance("
        "origin, str):\n",
        new="        if not isinstance(origin, str):\n",
        tests=(RECORD + "test_a_stored_response_that_is_no_response_is_unreadable",),
        breaks="a stored response whose status is no status (text, true, 600) is replayed",
    ),
    Mutant(
        name="unreadable-token-says-the-response-ran",
        path="gateway/engine/core.py",
        old="                raise token_unreadable(route, ref, record)\n",
        new="                raise unreadable(route, ref, record)\n",
        tests=(PLAIN_OPENS,),
        breaks="a repeat of a parked delivery whose status token cannot be opened is told "
        "that its request ran and its response is stored",
    ),
]
