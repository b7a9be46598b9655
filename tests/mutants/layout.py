"""Broken builds of the package's shape: a foundation that reaches up a layer, a
type-only import that closes a cycle, a name private to one module used from another,
a design map that names a module gone or leaves out a store, and a listener override
uvicorn no longer calls (tests/test_layout.py, tests/test_listener.py)."""

from tests.mutants import Mutant

L = "tests/test_layout.py::"

MUTANTS = [
    Mutant(
        name="foundation-imports-the-engine",
        path="gateway/routes.py",
        old="from gateway.config.paths import compile_path_pattern\n",
        new="from gateway.config.paths import compile_path_pattern\n"
        "from gateway.engine import refusals  # noqa: F401\n",
        tests=(L + "test_the_layers_contract_holds",),
        breaks="a foundation depends on the core above it: the layers no longer say what "
        "may be changed without touching what",
    ),
    Mutant(
        name="type-only-import-cycle",
        path="gateway/upstream/response.py",
        old="from gateway.errors import OutcomeLost\n",
        new="import typing\n\nfrom gateway.errors import OutcomeLost\n\n"
        "if typing.TYPE_CHECKING:\n"
        "    from gateway.upstream.parser import Exchange  # noqa: F401\n",
        tests=(L + "test_no_import_cycles_type_only_imports_included",),
        breaks="the body stream and the parser name each other again: a cycle hidden "
        "behind TYPE_CHECKING",
    ),
    Mutant(
        name="private-method-called-across-modules",
        path="gateway/upstream/client.py",
        old="response.rest.begin(give_up, deadline)",
        new="response.rest._begin(give_up, deadline)",
        tests=(L + "test_no_module_uses_another_modules_private_names",),
        breaks="the client reaches into the body stream's private method",
    ),
    Mutant(
        name="design-map-names-a-module-gone",
        path="README.md",
        old="- the retry schedule (backoff, jitter, Retry-After): `delivery/retry`\n",
        new="- the retry schedule (backoff, jitter, Retry-After): `delivery/backoff`\n",
        tests=(L + "test_the_design_map_names_modules_that_exist",),
        breaks="the README's map sends a newcomer to a module that does not exist",
    ),
    Mutant(
        name="design-map-without-the-sqlite-store",
        path="README.md",
        old="`sqlite/`: `store` (the `Store`: one file on this host), ",
        new="",
        tests=(L + "test_the_design_map_names_each_store_and_its_modules",),
        breaks="the README's store row says nothing of the SQLite store's modules; its "
        "`schema` and `database` pass for the PostgreSQL store's",
    ),
    Mutant(
        name="listener-override-uvicorn-never-calls",
        path="gateway/http/protocol.py",
        old="    def timeout_keep_alive_handler(self) -> None:",
        new="    def keep_alive_expired(self) -> None:",
        tests=(
            "tests/test_listener.py::"
            "test_every_uvicorn_method_the_listener_overrides_still_exists_with_its_parameters",
        ),
        breaks="an override uvicorn does not call: the keep-alive close it held is "
        "uvicorn's again, with no error",
    ),
]
