"""Who an operator is and what they may do (gateway/operators/identity.py,
gateway/operators/actions.py, gateway/admin/api.py), caught by tests/test_operators.py and
tests/test_admin.py."""

from tests.mutants import Mutant

OPS = "tests/test_operators.py::"
A = "tests/test_admin.py::"

MUTANTS = [
    Mutant(
        name="identity-header-believed-from-anywhere",
        path="gateway/operators/identity.py",
        old="        if self.identity_header and self.trusts(client_host):\n",
        new="        if self.identity_header:\n",
        tests=(
            OPS + "test_the_identity_header_is_believed_from_trusted_proxies_alone",
            OPS + "test_the_identity_header_is_believed_from_the_trusted_address_in_a_real_process",
        ),
        breaks="anyone who can reach the admin listener signs in as any operator by sending "
        "X-Auth-Request-User",
    ),
    Mutant(
        name="identity-peer-from-x-forwarded-for",
        path="gateway/admin/api.py",
        old="    client = request.client.host if request.client is not None else None\n",
        new='    client = request.headers.get("x-forwarded-for") or (\n'
        "        request.client.host if request.client is not None else None\n"
        "    )\n",
        tests=(
            OPS + "test_the_identity_header_is_believed_from_the_trusted_address_in_a_real_process",
        ),
        breaks="a caller names a trusted proxy's address in X-Forwarded-For and its identity "
        "header is believed",
    ),
    Mutant(
        name="viewer-may-claim-and-resolve",
        path="gateway/operators/actions.py",
        old="    if operator.role is not Role.OPERATOR:\n",
        new="    if False:\n",
        tests=(
            A + "test_a_viewer_reads_everything_and_changes_nothing",
            OPS + "test_the_identity_header_is_believed_from_the_trusted_address_in_a_real_process",
        ),
        breaks="a viewer claims and resolves keys",
    ),
    Mutant(
        name="operator-field-overrides-the-authenticated-name",
        path="gateway/operators/identity.py",
        old='            if named is None or named == "" or named == self.name:\n'
        "                return self\n",
        new='            if named is None or named == "" or named == self.name:\n'
        "                return self\n"
        "            if isinstance(named, str):\n"
        "                return replace(self, name=named)\n",
        tests=(
            A + "test_an_operator_field_that_is_not_yours_is_forbidden",
            OPS + "test_acting_is_the_authenticated_name_or_a_refusal",
        ),
        breaks="an operator claims and resolves under another operator's name, and the "
        "history says that operator did it",
    ),
    Mutant(
        name="shared-token-recorded-as-the-name-given",
        path="gateway/operators/identity.py",
        old='        return self.name + SHARED_MARK if self.via == "shared_token" else self.name\n',
        new="        return self.name\n",
        tests=(
            A + "test_the_shared_token_is_recorded_as_such",
            OPS + "test_acting_is_the_authenticated_name_or_a_refusal",
        ),
        breaks="the shared token's actions are recorded as the named operator's own: anyone "
        "with it writes history in alice's name",
    ),
    Mutant(
        name="token-comparison-stops-at-the-first-match",
        path="gateway/operators/identity.py",
        old="            if hmac.compare_digest(given, digest) and found is None:\n"
        "                found = operator\n",
        new="            if hmac.compare_digest(given, digest):\n                return operator\n",
        tests=(OPS + "test_every_token_is_compared_whichever_matches",),
        breaks="the time an answer takes says which operator's token was sent",
    ),
    Mutant(
        name="reload-keeps-removed-operators",
        path="gateway/assembly.py",
        old="        self.operators = Operators(config.admin)\n"
        "        self.roster.configure(self.operators.roster())\n"
        "        self.engine.configure(config)\n",
        new="        self.engine.configure(config)\n",
        tests=(A + "test_a_removed_operator_is_refused_after_a_reload",),
        breaks="an operator removed from the config keeps acting until a restart",
    ),
    Mutant(
        name="operator-token-in-config-errors",
        path="gateway/config/credentials.py",
        old='        where = f"the path given {hidden}" if secret else show(file)\n',
        new="        where = show(file)\n",
        tests=(OPS + "test_bad_operator_settings_name_the_place_and_the_fix_and_never_a_token",),
        breaks="a token written as ${VAR} where a path belongs is printed in the error",
    ),
]

T = "tests/test_openapi.py::"

MUTANTS += [
    Mutant(
        name="openapi-document-wrong-about-a-claimed-record",
        path="gateway/openapi.yaml",
        old="        holder: {type: string, description: The operator who holds a claimed key}\n",
        new="        holder: {type: integer, description: The operator who holds a claimed key}\n",
        tests=(T + "test_schemathesis_finds_no_5xx_and_nothing_outside_the_document[operator]",),
        breaks="the document says something the API does not do, and nothing notices "
        "(the run reaches claimed records and checks their bodies)",
    ),
    Mutant(
        name="claim-with-a-bad-force-is-a-500",
        path="gateway/admin/api.py",
        old='        raise BadOperatorRequest("force is true or false.", field="force")\n',
        new='        raise RuntimeError("force is true or false.")\n',
        tests=(T + "test_schemathesis_finds_no_5xx_and_nothing_outside_the_document[operator]",),
        breaks="a claim with a force that is not true or false is a 500",
    ),
]
