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
        path="gateway/store/redis.py",
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
        path="gateway/engine.py",
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
