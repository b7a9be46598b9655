"""Broken builds of copying a store (`store copy`): each must fail the contract suite's
round trip or the process test of the CLI."""

from tests.mutants import Mutant

C = "tests/test_store_contract.py::test_export_then_import_recreates_every_record_as_it_was"
P = "tests/test_store_copy.py::"

MUTANTS = [
    Mutant(
        name="redis-import-uncounted",
        path="gateway/store/redis/lua/import.lua",
        old="if COUNTED[state] then count(state, 1) end\n",
        new="",
        tests=(C + "[redis]",),
        breaks="a copied parked or queued key is missing from the overview's counts and the "
        "route's bound",
    ),
    Mutant(
        name="sqlite-import-ttl-restarted",
        path="gateway/store/sqlite/store.py",
        old="ttl = None if item.ttl_ms is None else item.ttl_ms / 1000",
        new="ttl = None if item.ttl_ms is None else 86400.0",
        tests=(C + "[sqlite]",),
        breaks="a copied completed key keeps its response past its response_ttl",
    ),
    Mutant(
        name="postgres-export-skips-settled",
        path="gateway/store/postgres/sql/export.sql",
        old="WHERE r.prefix = @prefix AND r.digest > $1",
        new="WHERE r.prefix = @prefix AND r.expires_ms IS NULL AND r.digest > $1",
        tests=(C + "[postgres]",),
        breaks="completed keys are left behind by a copy: their repeats run again",
    ),
    Mutant(
        name="copy-overwrites-a-store-with-keys",
        path="gateway/store/copy.py",
        old="    if await destination.holds_keys():\n",
        new="    if False:\n",
        tests=(P + "test_sqlite_to_redis_and_back",),
        breaks="a copy into a store that holds keys mixes two stores' records",
    ),
]
