"""The admin section: the admin listener and who may use the operator API.

`token` is the shared token of scripts. `operators` are people, each with a token of
their own (read from the environment or a file when the config loads, never written
in it) and a role. Behind a single-sign-on proxy, `identity_header` names the
operator, believed from `trusted_proxies` alone. `session_secret_env` names the
variable holding the console's cookie-signing secret.

Secrets read here are kept on the objects (`OperatorConfig.token`,
`AdminConfig.session_secret`, both `repr=False`) and never in a message: a problem
with one names where it comes from, never what it is.
"""

from __future__ import annotations

import re
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import TypeAdapter

from gateway.config.addresses import ListenAddress
from gateway.config.credentials import MIN_SECRET, MIN_TOKEN, read_secret, secret_problem
from gateway.config.http import Networks
from gateway.config.issues import Problems
from gateway.config.sections import Section, settings
from gateway.config.text import show
from gateway.config.types import AdminToken, Check, text

RoleName = Literal["viewer", "operator"]

_OPERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Headers a proxy cannot vouch for a person with: they are the caller's own.
_NOT_IDENTITY = {"authorization", "cookie", "host", "proxy-authorization", "forwarded"}


def _operator_name(value: object) -> str:
    if value is None:
        raise ValueError("every operator needs a name; add e.g. name: alice")
    name = text(value)
    if not _OPERATOR_NAME.fullmatch(name):
        raise ValueError(
            f"{show(name)} is not an operator name; use letters, digits and _ . @ + -, "
            "starting with a letter or digit, up to 100 characters, e.g. alice or "
            "alice@example.com"
        )
    return name


def _role(value: object) -> str:
    if value in ("viewer", "operator"):
        return str(value)
    fix = "role: operator (claims and resolves) or role: viewer (reads)"
    if value is None:
        raise ValueError(f"every operator needs a role; add {fix}")
    raise ValueError(f"{show(value)} is not a role; write {fix}")


def _env_name(value: object) -> str:
    name = text(value, secret=True)
    if not _ENV_NAME.fullmatch(name):
        # Never quoted: `token_env: ${ALICE_TOKEN}` makes the token itself the name.
        raise ValueError(
            "is not an environment variable name; write the variable's name, e.g. "
            "ALICE_TOKEN, not ${ALICE_TOKEN}"
        )
    return name


def _optional_text(value: object) -> str:
    return "" if value is None else text(value, empty_ok=True)


def _optional_env_name(value: object) -> str:
    return "" if value in (None, "") else _env_name(value)


def _header_name(value: object) -> str:
    if value in (None, ""):
        return ""
    name = text(value)
    if not _HEADER.fullmatch(name):
        raise ValueError(f"{show(name)} is not a header name; write e.g. X-Auth-Request-User")
    if name.lower() in _NOT_IDENTITY:
        raise ValueError(
            f"{name} is the caller's own header, not one a proxy sets; write the header "
            "your single-sign-on proxy sets, e.g. X-Auth-Request-User"
        )
    return name


_NAME_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}$"}
_ENV_SCHEMA = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}
OperatorName = Annotated[str, Check(_operator_name, _NAME_SCHEMA)]
EnvName = Annotated[str, Check(_env_name, _ENV_SCHEMA)]
OptionalEnvName = Annotated[str, Check(_optional_env_name, {"type": ["string", "null"]})]
IdentityHeader = Annotated[
    str, Check(_header_name, {"type": ["string", "null"], "description": "X-Auth-Request-User"})
]


@settings
class OperatorConfig(Section):
    example = "{name: alice, role: operator, token_env: ALICE_TOKEN}"
    none_is_empty = False

    name: OperatorName
    #: viewer: reads; operator: also claims and resolves
    role: Annotated[RoleName, Check(_role, {"enum": ["viewer", "operator"]})]
    token_env: OptionalEnvName = ""  # the variable holding the token
    token_file: Annotated[str, Check(_optional_text, {"type": "string"})] = ""
    #: read from token_env or token_file when the config loads; never from the file
    token: str = field(default="", repr=False)

    @classmethod
    def yaml_names(cls) -> tuple[str, ...]:
        return ("name", "role", "token_env", "token_file")

    @classmethod
    def from_yaml(cls, given: dict[str, Any], problems: Problems) -> dict[str, Any]:
        # Missing, they are None: their checks say what to add.
        return {"name": None, "role": None, **given}

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        sources = [name for name in ("token_env", "token_file") if given.get(name)]
        if len(sources) != 1:
            says = "both" if sources else "neither"
            problems.add(
                (),
                f"give exactly one of token_env or token_file, not {says}; e.g. "
                "token_env: ALICE_TOKEN (never the token itself)",
            )
            return {}
        env, file = values.get("token_env"), values.get("token_file")
        if env is None or file is None:
            return {}  # the setting itself is wrong, and said so
        token, problem = read_secret(env, file)
        where = f"the environment variable {env}" if env else f"the file {show(file)}"
        problem = problem or secret_problem(token, MIN_TOKEN, f"the token in {where}")
        if problem:
            problems.add((sources[0],), problem)
            return {}
        return {"token": token}


def _operators(value: object) -> tuple[OperatorConfig, ...]:
    if value is None:
        return ()
    if isinstance(value, tuple):
        return value  # from Python
    if not isinstance(value, list):
        raise ValueError(f"expected a list; write e.g. operators: [{OperatorConfig.example}]")
    adapter = TypeAdapter(OperatorConfig)
    problems = Problems()
    found = [problems.check(adapter, item, (i,)) for i, item in enumerate(value)]
    problems.raise_if_any()
    return tuple(found)


_OPERATOR_SCHEMA = {
    "type": "object",
    "properties": {
        "name": _NAME_SCHEMA,
        "role": {"enum": ["viewer", "operator"]},
        "token_env": _ENV_SCHEMA,
        "token_file": {"type": "string"},
    },
    "required": ["name", "role"],
    "oneOf": [{"required": ["token_env"]}, {"required": ["token_file"]}],
    "additionalProperties": False,
}
Operators = Annotated[
    tuple[OperatorConfig, ...],
    Check(_operators, {"anyOf": [{"type": "array", "items": _OPERATOR_SCHEMA}, {"type": "null"}]}),
]


@settings
class AdminConfig(Section):
    example = "admin: {...}"

    listen: ListenAddress = "127.0.0.1:9090"
    #: the shared token of scripts (empty, and no operators: the operator API is off)
    token: AdminToken = field(default="", repr=False)
    #: people, each with a token of their own and a role
    operators: Operators = ()
    #: behind a single-sign-on proxy: the header it names the signed-in operator in
    identity_header: IdentityHeader = ""
    #: the addresses identity_header is believed from (that proxy's)
    trusted_proxies: Networks = ()
    #: the environment variable holding the console's cookie-signing secret
    session_secret_env: OptionalEnvName = ""
    #: read from session_secret_env when the config loads
    session_secret: str = field(default="", repr=False)

    @classmethod
    def yaml_names(cls) -> tuple[str, ...]:
        return (
            "listen", "token", "operators", "identity_header", "trusted_proxies",
            "session_secret_env",
        )  # fmt: skip

    @classmethod
    def check(
        cls,
        values: dict[str, Any],
        given: dict[str, Any],
        inherited: frozenset[str],
        problems: Problems,
    ) -> dict[str, Any]:
        operators: tuple[OperatorConfig, ...] = values.get("operators") or ()
        _check_operators(operators, values.get("token") or "", problems)
        header, proxies = values.get("identity_header"), values.get("trusted_proxies")
        if header and "trusted_proxies" in values and not proxies:
            problems.add(
                ("identity_header",),
                "is believed only from admin.trusted_proxies, and none are listed; add the "
                'single-sign-on proxy\'s address, e.g. trusted_proxies: ["127.0.0.1"]',
            )
        if header and "operators" in values and not operators:
            problems.add(
                ("identity_header",),
                "names an operator of admin.operators, and none are listed; add them, e.g. "
                f"operators: [{OperatorConfig.example}]",
            )
        if proxies and "identity_header" in values and not header:
            problems.add(
                ("trusted_proxies",),
                "are the proxies admin.identity_header is believed from; set identity_header "
                "too (e.g. X-Auth-Request-User), or remove trusted_proxies",
            )
        env = values.get("session_secret_env")
        if not env:
            return {}
        secret, problem = read_secret(env, "")
        problem = problem or secret_problem(
            secret, MIN_SECRET, f"the secret in the environment variable {env}"
        )
        if problem:
            problems.add(("session_secret_env",), problem)
            return {}
        return {"session_secret": secret}


def _check_operators(
    operators: tuple[OperatorConfig, ...], shared: str, problems: Problems
) -> None:
    names: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for i, operator in enumerate(operators):
        if operator.name in names:
            problems.add(
                ("operators", i, "name"),
                f"{show(operator.name)} is also operators[{names[operator.name]}]; give "
                "each operator one entry",
            )
        names.setdefault(operator.name, i)
        source = "token_env" if operator.token_env else "token_file"
        if operator.token and operator.token in tokens:
            other = operators[tokens[operator.token]].name
            problems.add(
                ("operators", i, source),
                f"holds the same token as operator {other}; give each operator their own",
            )
        elif operator.token and operator.token == shared:
            problems.add(
                ("operators", i, source),
                "holds the same token as admin.token; give the operator their own",
            )
        tokens.setdefault(operator.token, i)
