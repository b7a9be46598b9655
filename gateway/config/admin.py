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
from typing import Annotated, Any, Literal, get_args

from pydantic import TypeAdapter

from gateway.config.addresses import ListenAddress
from gateway.config.credentials import MIN_SECRET, MIN_TOKEN, read_secret, secret_problem
from gateway.config.http import HeaderNames, Networks, QueryNames
from gateway.config.issues import Problems
from gateway.config.sections import Section, settings
from gateway.config.text import show
from gateway.config.types import AdminToken, Check, either, text

RoleName = Literal["viewer", "operator"]

_OPERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Request headers whose values no operator sees: admin.show_headers cannot list them.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
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
OperatorName = Annotated[str, Check(_operator_name, _NAME_SCHEMA, written="name")]
EnvName = Annotated[str, Check(_env_name, _ENV_SCHEMA, written="environment variable name")]
OptionalEnvName = Annotated[
    str,
    Check(_optional_env_name, {"type": ["string", "null"]}, written="environment variable name"),
]
IdentityHeader = Annotated[
    str,
    Check(
        _header_name,
        {"type": ["string", "null"], "description": "X-Auth-Request-User"},
        written="header name",
    ),
]


@settings
class OperatorConfig(Section):
    """A person who uses the operator API or the console, with a token of their own,
    read from the environment (`token_env`) or a file (`token_file`) when the config
    loads or reloads; give exactly one. `idempotency-gateway keygen` makes a token (at
    least 16 characters). The record keeps the authenticated name, so a history's
    "claimed by alice" is true."""

    example = "{name: alice, role: operator, token_env: ALICE_TOKEN}"
    none_is_empty = False

    name: OperatorName
    """The operator's name, as records, logs and the console show it, and as
    `identity_header` names them (a user name, or an email): letters, digits and
    `_ . @ + -`, up to 100 characters."""
    role: Annotated[
        RoleName, Check(_role, {"enum": ["viewer", "operator"]}, written=either(get_args(RoleName)))
    ]
    """`viewer` reads; `operator` also claims and resolves keys."""
    token_env: OptionalEnvName = ""
    """The environment variable holding this operator's token (`ALICE_TOKEN`, never
    `${ALICE_TOKEN}`: that would write the token itself into the config)."""
    token_file: Annotated[str, Check(_optional_text, {"type": "string"}, written="file path")] = ""
    """A file holding this operator's token, a mounted secret say; a trailing newline
    is not part of it."""
    token: str = field(default="", repr=False)
    """Read from `token_env` or `token_file` when the config loads; never from the
    file."""

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


#: An operator's mapping, as the JSON Schema describes it (gateway.config.schema adds
#: each setting's description).
OPERATOR_SCHEMA = {
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
    Check(
        _operators,
        {"anyOf": [{"type": "array", "items": OPERATOR_SCHEMA}, {"type": "null"}]},
        written="list of operators",
    ),
]


@settings
class AdminConfig(Section):
    """`admin:`, the admin listener's settings (described at `Config.admin`)."""

    example = "admin: {...}"

    listen: ListenAddress = "127.0.0.1:9090"
    """The admin listener's address: `/healthz`, `/readyz`, `/metrics`, the operator
    API under `/admin/` and the console under `/console/`. Its own port, never
    `server.listen`'s; keep it on an address only operators (or their single-sign-on
    proxy) reach."""
    token: AdminToken = field(default="", repr=False)
    """The shared token of scripts (write `${GATEWAY_ADMIN_TOKEN}`). It proves no name:
    an action taken with it is recorded under the `operator` the call gives, marked
    `(shared token)`, and it does not open the console. With neither this nor
    `operators`, the operator API is off and the log says so."""
    operators: Operators = ()
    """People, each with a name, a role and a token of their own (below)."""
    identity_header: IdentityHeader = ""
    """Behind a single-sign-on proxy (oauth2-proxy, say): the header that proxy names
    the signed-in operator in, e.g. `X-Auth-Request-User`. It must name one of
    `operators`, and is believed only from `trusted_proxies`; from anywhere else it is
    ignored."""
    trusted_proxies: Networks = ()
    """The addresses `identity_header` is believed from: the single-sign-on proxy's, and
    no other (anything else that can connect from there could send the header too).
    Such a proxy's `X-Forwarded-Proto: https` also marks the console's cookie
    `Secure`. Only with `identity_header`; `X-Forwarded-For` never makes an address
    trusted."""
    session_secret_env: OptionalEnvName = ""
    """The environment variable holding the console's cookie-signing secret: at least
    32 bytes (`idempotency-gateway keygen` makes one), the same on every replica. A new
    secret signs everyone out. Unset: the console is off."""
    session_secret: str = field(default="", repr=False)
    """Read from `session_secret_env` when the config loads; never from the file."""
    show_headers: HeaderNames = frozenset()
    """Header names whose values operators see in a delivery's stored request and a
    stored response, besides `content-type`, `content-length`, `user-agent` and the
    route's key header (a response: its content, date and caching headers too); every
    other value is shown hidden, with its length. Credential headers (`Authorization`,
    `Proxy-Authorization`, `Cookie`) cannot be named."""
    show_query: QueryNames = frozenset()
    """Query parameter names whose values operators see in a delivery's stored request,
    besides the route's key parameter, as they read decoded (case counts); every
    other value is shown hidden, with its length, names and order kept."""

    @classmethod
    def yaml_names(cls) -> tuple[str, ...]:
        return (
            "listen", "token", "operators", "identity_header", "trusted_proxies",
            "session_secret_env", "show_headers", "show_query",
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
        for name in sorted(CREDENTIAL_HEADERS & (values.get("show_headers") or frozenset())):
            problems.add(("show_headers",), f"{name} carries credentials and is always hidden")
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
