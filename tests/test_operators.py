"""gateway/operators/identity.py and gateway/config/admin.py: who an operator is.

Named tokens read from the environment or a file, roles, the shared token, and the
identity header believed from `admin.trusted_proxies` alone: on its own, and in real
gateway processes, where the client address is a real socket's (a connection from
127.0.0.1 and one bound to 127.0.0.2). Tokens are compared in constant time against
every configured one, and never reach check-config, a config error or a log line.
(What each role may do through the API is tests/test_admin.py's.)
"""

from __future__ import annotations

import hmac
import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway import cli
from gateway.config import AdminConfig, load_config, parse_config
from gateway.errors import (
    ConfigError,
    NotYourName,
    OperatorApiDisabled,
    OperatorRequired,
    Unauthorized,
)
from gateway.operators.identity import Operator, Operators, Role
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.servers import Process, RedisServer, free_port, gateway_process, wait_for_port

ALICE = "op-alice-7d3f9a1c2b4e5f60"
BOB = "op-bob-0a9b8c7d6e5f4a3b"
VERA = "op-vera-1f2e3d4c5b6a7980"
SHARED = "op-shared-5e6f7a8b9c0d1e2f"
TOKENS = (ALICE, BOB, VERA, SHARED)
ROUTES = [{"name": "r", "match": {"path": "/x"}, "upstream": "http://127.0.0.1:9"}]


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """ALICE_TOKEN and BOB_TOKEN in the environment; vera's token in a file (with the
    newline an editor leaves), whose path is returned."""
    monkeypatch.setenv("ALICE_TOKEN", ALICE)
    monkeypatch.setenv("BOB_TOKEN", BOB)
    monkeypatch.setenv("SESSION_SECRET", "s" * 40)
    vera = tmp_path / "vera.token"
    vera.write_text(VERA + "\n")
    return vera


def admin_section(vera: Path, **extra: Any) -> dict[str, Any]:
    return {
        "token": SHARED,
        "operators": [
            {"name": "alice", "role": "operator", "token_env": "ALICE_TOKEN"},
            {"name": "bob", "role": "operator", "token_env": "BOB_TOKEN"},
            {"name": "vera", "role": "viewer", "token_file": str(vera)},
        ],
        **extra,
    }


def operators(vera: Path, **extra: Any) -> Operators:
    return Operators(
        parse_config({"admin": admin_section(vera, **extra), "routes": ROUTES}, "t").admin
    )


# -- the config ------------------------------------------------------------------------


def test_operators_read_their_tokens_from_the_environment_or_a_file(tokens: Path) -> None:
    admin = parse_config(
        {"admin": admin_section(tokens, session_secret_env="SESSION_SECRET"), "routes": ROUTES},
        "t",
    ).admin
    assert [(op.name, op.role, op.token) for op in admin.operators] == [
        ("alice", "operator", ALICE),
        ("bob", "operator", BOB),
        ("vera", "viewer", VERA),  # the file's newline is not part of it
    ]
    assert admin.session_secret == "s" * 40
    shown = repr(admin)
    assert "alice" in shown and not any(token in shown for token in TOKENS)
    assert "s" * 40 not in shown


def test_check_config_names_operators_and_never_their_tokens(
    tokens: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gateway.yaml"
    admin = admin_section(
        tokens,
        identity_header="X-Auth-Request-User",
        trusted_proxies=["127.0.0.1"],
        session_secret_env="SESSION_SECRET",
    )
    path.write_text(yaml.safe_dump({"admin": admin, "routes": ROUTES}))
    assert cli.main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    line = next(line for line in out.out.splitlines() if line.startswith("admin:"))
    assert line == (
        "admin: listen 127.0.0.1:9090; operator API: shared token set; alice (operator, "
        "token from $ALICE_TOKEN); bob (operator, token from $BOB_TOKEN); vera (viewer, "
        f'token from "{tokens}"); identity header X-Auth-Request-User believed from '
        "127.0.0.1/32; console sessions signed with $SESSION_SECRET"
    )
    assert not any(token in out.out + out.err for token in TOKENS)


#: (what is wrong, the admin section, the YAML path and words of the message)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "both-sources",
        {
            "operators": [
                {"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN", "token_file": "/x"}
            ]
        },
        "admin.operators[0]",
        "give exactly one of token_env or token_file, not both",
    ),
    (
        "no-source",
        {"operators": [{"name": "a", "role": "viewer"}]},
        "admin.operators[0]",
        "give exactly one of token_env or token_file, not neither",
    ),
    (
        "no-role",
        {"operators": [{"name": "a", "token_env": "ALICE_TOKEN"}]},
        "admin.operators[0].role",
        "every operator needs a role; add role: operator",
    ),
    (
        "bad-role",
        {"operators": [{"name": "a", "role": "admin", "token_env": "ALICE_TOKEN"}]},
        "admin.operators[0].role",
        '"admin" is not a role',
    ),
    (
        "no-name",
        {"operators": [{"role": "viewer", "token_env": "ALICE_TOKEN"}]},
        "admin.operators[0].name",
        "every operator needs a name",
    ),
    (
        "bad-name",
        {"operators": [{"name": "a b", "role": "viewer", "token_env": "ALICE_TOKEN"}]},
        "admin.operators[0].name",
        '"a b" is not an operator name',
    ),
    (
        "unknown-setting",
        {"operators": [{"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN", "token": "x"}]},
        "admin.operators[0].token",
        'unknown setting; did you mean "token_env"?',
    ),
    (
        "unset-variable",
        {"operators": [{"name": "a", "role": "viewer", "token_env": "NO_SUCH_TOKEN"}]},
        "admin.operators[0].token_env",
        "the environment variable NO_SUCH_TOKEN is not set; export it",
    ),
    (
        "variable-written-as-its-value",
        {"operators": [{"name": "a", "role": "viewer", "token_env": "${IDENT_LIKE}"}]},
        "admin.operators[0].token_env",
        "no variable has the name given (not shown",
    ),
    (
        "path-written-as-a-token",
        {"operators": [{"name": "a", "role": "viewer", "token_file": "${ALICE_TOKEN}"}]},
        "admin.operators[0].token_file",
        "no file at the path given (not shown",
    ),
    (
        "token-not-a-name",
        {"operators": [{"name": "a", "role": "viewer", "token_env": "${SPACED}"}]},
        "admin.operators[0].token_env",
        "is not an environment variable name",
    ),
    (
        "short-token",
        {"operators": [{"name": "a", "role": "viewer", "token_env": "SHORT_TOKEN"}]},
        "admin.operators[0].token_env",
        "is shorter than 16 characters; make one with `idempotency-gateway keygen`",
    ),
    (
        "spaced-token",
        {"operators": [{"name": "a", "role": "viewer", "token_env": "SPACED"}]},
        "admin.operators[0].token_env",
        "has a space or a control character",
    ),
    (
        "missing-file",
        {"operators": [{"name": "a", "role": "viewer", "token_file": "/no/such/token"}]},
        "admin.operators[0].token_file",
        'no file at "/no/such/token"',
    ),
    (
        "same-name",
        {
            "operators": [
                {"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN"},
                {"name": "a", "role": "viewer", "token_env": "BOB_TOKEN"},
            ]
        },
        "admin.operators[1].name",
        '"a" is also operators[0]',
    ),
    (
        "same-token",
        {
            "operators": [
                {"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN"},
                {"name": "b", "role": "viewer", "token_env": "ALICE_TOKEN"},
            ]
        },
        "admin.operators[1].token_env",
        "holds the same token as operator a",
    ),
    (
        "shared-token-again",
        {
            "token": ALICE,
            "operators": [{"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN"}],
        },
        "admin.operators[0].token_env",
        "holds the same token as admin.token",
    ),
    (
        "identity-without-proxies",
        {
            "identity_header": "X-Auth-Request-User",
            "operators": [{"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN"}],
        },
        "admin.identity_header",
        "is believed only from admin.trusted_proxies, and none are listed",
    ),
    (
        "identity-without-operators",
        {"identity_header": "X-Auth-Request-User", "trusted_proxies": ["127.0.0.1"]},
        "admin.identity_header",
        "names an operator of admin.operators, and none are listed",
    ),
    (
        "proxies-without-identity",
        {"trusted_proxies": ["127.0.0.1"], "token": SHARED},
        "admin.trusted_proxies",
        "set identity_header too",
    ),
    (
        "identity-is-authorization",
        {
            "identity_header": "Authorization",
            "trusted_proxies": ["127.0.0.1"],
            "operators": [{"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN"}],
        },
        "admin.identity_header",
        "is the caller's own header, not one a proxy sets",
    ),
    (
        "bad-proxy",
        {
            "identity_header": "X-User",
            "trusted_proxies": ["proxy.local"],
            "operators": [{"name": "a", "role": "viewer", "token_env": "ALICE_TOKEN"}],
        },
        "admin.trusted_proxies[0]",
        "is not an IP address or CIDR block",
    ),
    (
        "unset-session-secret",
        {"session_secret_env": "NO_SUCH_SECRET", "token": SHARED},
        "admin.session_secret_env",
        "the environment variable NO_SUCH_SECRET is not set",
    ),
    (
        "short-session-secret",
        {"session_secret_env": "ALICE_TOKEN", "token": SHARED},
        "admin.session_secret_env",
        "is shorter than 32 characters",
    ),
]


@pytest.mark.parametrize(
    ("admin", "where", "words"), [case[1:] for case in BAD], ids=[case[0] for case in BAD]
)
def test_bad_operator_settings_name_the_place_and_the_fix_and_never_a_token(
    tokens: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    admin: dict[str, Any],
    where: str,
    words: str,
) -> None:
    spaced = "op with a space 0123456789"
    ident = "opTokenThatLooksLikeAName0123"  # written ${IDENT_LIKE}: it becomes the "name"
    monkeypatch.setenv("IDENT_LIKE", ident)
    monkeypatch.setenv("SHORT_TOKEN", "x7Kq9")
    monkeypatch.setenv("SPACED", spaced)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"admin": admin, "routes": ROUTES}, sort_keys=False))
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    text = str(raised.value)
    [line] = [line for line in text.splitlines() if f": {where}: " in line]
    assert line.startswith(f"{path}:") and line.split(":")[1].isdigit(), line  # file:line:col
    assert words in line, text
    assert not any(token in text for token in (*TOKENS, "x7Kq9", spaced, ident)), text


# -- authenticate ----------------------------------------------------------------------


def test_a_bearer_token_is_a_named_operator_the_shared_token_or_refused(tokens: Path) -> None:
    ops = operators(tokens)
    assert ops.authenticate({"authorization": f"Bearer {ALICE}"}, "10.0.0.9") == Operator(
        "alice", Role.OPERATOR, "token"
    )
    assert ops.authenticate({"authorization": f"bearer {VERA}"}, None) == Operator(
        "vera", Role.VIEWER, "token"
    )
    assert ops.authenticate({"authorization": f"Bearer {SHARED}"}, None) == Operator(
        "", Role.OPERATOR, "shared_token"
    )
    for given in (f"Bearer {ALICE[:-1]}", f"Bearer {ALICE}x", f"Basic {ALICE}", ALICE, "Bearer "):
        with pytest.raises(Unauthorized):
            ops.authenticate({"authorization": given}, "127.0.0.1")
    with pytest.raises(Unauthorized):
        ops.authenticate({}, "127.0.0.1")
    assert ops.by_token(BOB) == Operator("bob", Role.OPERATOR, "token")
    assert ops.by_token("nope") is None
    assert ops.by_name("vera") == Operator("vera", Role.VIEWER, "session")
    assert ops.by_name("mallory") is None and ops.by_name("") is None


def test_nobody_configured_means_the_api_is_off() -> None:
    ops = Operators(AdminConfig())
    assert not ops.enabled
    with pytest.raises(OperatorApiDisabled):
        ops.authenticate({"authorization": f"Bearer {SHARED}"}, "127.0.0.1")


def test_every_token_is_compared_whichever_matches(
    tokens: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No early exit: the first operator's token, the last one and a wrong one each
    cost four comparisons (three operators and the shared token), of digests of one
    length. With compare_digest saying no, nothing is accepted: it alone decides."""
    ops = operators(tokens)
    real = hmac.compare_digest
    calls: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for token in (ALICE, SHARED, "wrong"):
        calls.clear()
        ops.by_token(token)
        assert len(calls) == 4 and {len(a) for a, _ in calls} | {len(b) for _, b in calls} == {32}
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: False)
    assert ops.by_token(ALICE) is None and ops.by_token(SHARED) is None


USER = "x-auth-request-user"


def test_the_identity_header_is_believed_from_trusted_proxies_alone(tokens: Path) -> None:
    ops = operators(
        tokens, identity_header="X-Auth-Request-User", trusted_proxies=["10.0.0.0/8", "::1"]
    )
    alice = Operator("alice", Role.OPERATOR, "identity_header")
    assert ops.authenticate({USER: "alice"}, "10.1.2.3") == alice
    assert ops.authenticate({USER: " alice "}, "::1") == alice
    assert ops.authenticate({USER: "vera"}, "10.0.0.1").role is Role.VIEWER
    # A proxy that passes its own Authorization on: a token that is not ours is no veto.
    assert ops.authenticate({USER: "alice", "authorization": "Bearer oidc"}, "10.0.0.1") == alice
    # A token of ours wins over the header.
    assert ops.authenticate({USER: "alice", "authorization": f"Bearer {BOB}"}, "10.0.0.1").name == (
        "bob"
    )
    for host in ("127.0.0.1", "11.0.0.1", "::2", "", None, "unix:/run/admin.sock"):
        with pytest.raises(Unauthorized):
            ops.authenticate({USER: "alice"}, host)
    with pytest.raises(Unauthorized) as unknown:
        ops.authenticate({USER: "mallory"}, "10.0.0.1")
    assert "names no operator" in unknown.value.detail and "mallory" not in unknown.value.detail
    twice = httpx.Headers([(USER, "vera"), (USER, "alice")])
    with pytest.raises(Unauthorized) as repeated:
        ops.authenticate(twice, "10.0.0.1")
    assert "more than once" in repeated.value.detail


def test_acting_is_the_authenticated_name_or_a_refusal() -> None:
    alice = Operator("alice", Role.OPERATOR, "token")
    for given in (None, "", "alice", " alice "):
        assert alice.acting(given) is alice
    for given in ("bob", "Alice", 7, ["alice"]):
        with pytest.raises(NotYourName):
            alice.acting(given)
    assert alice.recorded == "alice"
    shared = Operator("", Role.OPERATOR, "shared_token")
    named = shared.acting(" carol ")
    assert named == Operator("carol", Role.OPERATOR, "shared_token")
    assert named.recorded == "carol (shared token)"
    for given in (None, "", "  ", 7):
        with pytest.raises(OperatorRequired):
            shared.acting(given)


# -- real processes, real client addresses ---------------------------------------------


@dataclass
class Running:
    process: Process
    admin: str
    proxy: str

    def parked(self) -> str:
        key = unique("ident")
        with httpx.Client(base_url=self.proxy, timeout=10) as client:
            answer = client.post("/jobs/x", json={"job_key": key}, params={"sleep": "0.4"})
        assert answer.status_code == 504, answer.text
        return key


def start(tmp_path: Path, upstream: Process, vera: Path, trusted: str) -> Running:
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s", "log_format": "json"},
        "admin": {
            "listen": f"127.0.0.1:{admin_port}",
            **admin_section(vera, identity_header="X-Auth-Request-User"),
            "trusted_proxies": [trusted],
        },
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "jobs",
                "match": {"methods": ["POST"], "path": "/jobs/x"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "upstream_timeout": "200ms",
            }
        ],
    }
    path = tmp_path / f"trusting-{trusted}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port, env={"ALICE_TOKEN": ALICE, "BOB_TOKEN": BOB}).start()
    wait_for_port(admin_port)
    return Running(process, f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{port}")


@pytest.fixture
def two_gateways(
    tmp_path: Path, upstream: Process, tokens: Path
) -> Iterator[tuple[Running, Running]]:
    """One gateway that trusts 127.0.0.1 (where its callers connect from), one that
    trusts 127.0.0.2 alone."""
    started: list[Running] = []
    try:
        for trusted in ("127.0.0.1", "127.0.0.2"):
            started.append(start(tmp_path, upstream, tokens, trusted))
        yield started[0], started[1]
    finally:
        for running in started:
            running.process.stop()


def admin_from(source: str, base: str) -> httpx.Client:
    """A client whose connections leave from `source` (any 127/8 address is local)."""
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=base, transport=transport, timeout=10)


@pytest.mark.process
def test_the_identity_header_is_believed_from_the_trusted_address_in_a_real_process(
    two_gateways: tuple[Running, Running],
) -> None:
    trusting, elsewhere = two_gateways
    user = {"X-Auth-Request-User": "alice"}
    key = trusting.parked()
    with admin_from("127.0.0.1", trusting.admin) as client:
        me = client.get("/admin/me", headers=user)
        assert me.json() == {"name": "alice", "role": "operator", "via": "identity_header"}
        claimed = client.post(f"/admin/keys/jobs/{key}/claim", headers=user, json={})
        assert claimed.status_code == 200 and claimed.json()["holder"] == "alice"
        viewer = client.post(
            f"/admin/keys/jobs/{key}/claim", headers={"X-Auth-Request-User": "vera"}, json={}
        )
        assert viewer.status_code == 403, viewer.text
        stranger = client.get("/admin/me", headers={"X-Auth-Request-User": "mallory"})
        assert stranger.status_code == 401
    other = elsewhere.parked()
    with admin_from("127.0.0.1", elsewhere.admin) as client:
        # From an address it does not trust, the header is nobody, forwarded or not.
        for headers in (user, {**user, "X-Forwarded-For": "127.0.0.2", "X-Real-IP": "127.0.0.2"}):
            assert client.get("/admin/me", headers=headers).status_code == 401
            refused = client.post(f"/admin/keys/jobs/{other}/claim", headers=headers, json={})
            assert refused.status_code == 401, refused.text
        # A token of one's own works from anywhere.
        token = client.get("/admin/me", headers={"Authorization": f"Bearer {BOB}"})
        assert token.json() == {"name": "bob", "role": "operator", "via": "token"}
    with admin_from("127.0.0.2", elsewhere.admin) as client:
        me = client.get("/admin/me", headers=user)
        assert me.json() == {"name": "alice", "role": "operator", "via": "identity_header"}
        claimed = client.post(f"/admin/keys/jobs/{other}/claim", headers=user, json={})
        assert claimed.status_code == 200 and claimed.json()["holder"] == "alice"
    for running in two_gateways:
        running.process.stop()
        output = running.process.output()
        assert not any(token in output for token in TOKENS)
        actions = [
            json.loads(line)
            for line in output.splitlines()
            if line.startswith("{") and '"logger": "gateway.operator"' in line
        ]
        done = [a for a in actions if "refused" not in a]
        assert [(a["operator"], a["via"], a["action"]) for a in done] == [
            ("alice", "identity_header", "claim")
        ]
        assert done[0]["client"] == "api" and done[0]["route"] == "jobs"


# -- console sessions end with the credential that opened them -------------------------


SESSION_SECRET = "session-secret-" + "q" * 32


@dataclass
class Reloadable:
    """A gateway process whose config a test rewrites and reloads (SIGHUP)."""

    running: Running
    path: Path
    doc: dict[str, Any]
    reloads: int = 0

    def reload(self, operators: list[dict[str, Any]]) -> None:
        self.doc["admin"]["operators"] = operators
        self.path.write_text(yaml.safe_dump(self.doc))
        self.reloads += 1
        self.running.process.signal(signal.SIGHUP)
        self.running.process.wait_for_output("config reloaded", self.reloads)


def reloadable(
    tmp_path: Path,
    upstream: Process,
    alice_file: Path,
    store: dict[str, Any] | None = None,
    name: str = "rotating",
) -> Reloadable:
    port, admin_port = free_port(), free_port()
    doc = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {
            "listen": f"127.0.0.1:{admin_port}",
            "operators": [
                {"name": "alice", "role": "operator", "token_file": str(alice_file)},
                {"name": "bob", "role": "operator", "token_env": "BOB_TOKEN"},
            ],
            "session_secret_env": "SESSION_SECRET",
        },
        "store": store or {"url": "memory://"},
        "routes": [
            {
                "name": "jobs",
                "match": {"methods": ["POST"], "path": "/jobs/x"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "upstream_timeout": "200ms",
            }
        ],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    env = {"BOB_TOKEN": BOB, "SESSION_SECRET": SESSION_SECRET}
    process = gateway_process(path, port, env=env).start()
    wait_for_port(admin_port)
    running = Running(process, f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{port}")
    return Reloadable(running, path, doc)


@contextmanager
def console_session(admin: str, token: str) -> Iterator[tuple[str, str]]:
    """The cookie of a console session signed in with `token`, and its CSRF token."""
    with httpx.Client(base_url=admin, headers={"Origin": admin}, timeout=10) as client:
        answer = client.post("/console/signin", data={"token": token})
        assert answer.status_code == 303, answer.text
        page = client.get("/console/")
        found = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert found, page.text
        yield client.cookies["console_session"], found.group(1)


def with_cookie(admin: str, cookie: str) -> httpx.Client:
    """A client that sends `cookie` on every request, whatever the answers say."""
    headers = {"Origin": admin, "Cookie": f"console_session={cookie}"}
    return httpx.Client(base_url=admin, headers=headers, timeout=10)


def record_of(admin: str, key: str) -> dict[str, Any]:
    answer = httpx.get(
        f"{admin}/admin/keys/jobs/{key}", headers={"Authorization": f"Bearer {BOB}"}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    doc: dict[str, Any] = answer.json()
    return {k: v for k, v in doc.items() if k not in ("age_seconds", "state_age_seconds")}


#: What the rotation test sent: requests, and of them the ones with a dead cookie.
SENT = {"requests": 0, "bad_inputs": 0}


def assert_signed_out(
    admin: str, session: tuple[str, str], keys: tuple[str, str], why: str
) -> None:
    """Every request a console session authorises, refused with `why`, and nothing
    changed: the pages, the live refresh, claim, take over, resolve (done with a forged
    replay body, and retry)."""
    SENT["requests"] += 10
    SENT["bad_inputs"] += 10
    cookie, csrf = session
    parked, held = keys
    before = {key: record_of(admin, key) for key in keys}
    ref = {"route": "jobs", "csrf": csrf}
    posts = {
        "claim": ("/console/claim", ref | {"key": parked}),
        "take over": ("/console/claim", ref | {"key": held, "force": "1", "holder": "alice"}),
        "resolve done": (
            "/console/resolve",
            ref | {"key": held, "outcome": "done", "note": "paid", "response_body": "forged"},
        ),
        "resolve retry": ("/console/resolve", ref | {"key": held, "outcome": "retry"}),
    }
    with with_cookie(admin, cookie) as client:
        for name, (path, form) in posts.items():
            answer = client.post(path, data=form)
            assert answer.status_code == 401, (name, answer.text)
            assert "Signed out" in answer.text and why in answer.text, (name, answer.text)
            assert "Nothing was changed" in answer.text, name
            assert "Max-Age=0" in answer.headers["set-cookie"], name  # the dead cookie goes
        for path in ("/console/", "/console/keys", f"/console/key?route=jobs&key={held}"):
            page = client.get(path)
            assert page.status_code == 303, (path, page.text)
            assert page.headers["location"].startswith("/console/signin?next="), path
        takeover = client.get("/console/takeover", params={"route": "jobs", "key": held})
        assert takeover.status_code == 303 and "/console/signin" in takeover.headers["location"]
        assert client.get("/console/keys/rows").status_code == 401
        # The cookie was never a credential of the operator API.
        assert client.get("/admin/me").status_code == 401
    assert {key: record_of(admin, key) for key in keys} == before


def signed_in(admin: str, session: tuple[str, str]) -> bool:
    with with_cookie(admin, session[0]) as client:
        return client.get("/console/").status_code == 200


ROTATED = "op-alice-rotated-4c5d6e7f8a9b"
ANEW = "op-alice-anew-0f1e2d3c4b5a6978"


@pytest.mark.process
def test_rotating_a_token_ends_the_sessions_it_opened(
    tmp_path: Path, upstream: Process, ledger: Ledger
) -> None:
    """alice signs in with her token; her token file is rotated and the gateway
    reloaded (SIGHUP). The old token gets 401, and the cookie it bought can no longer
    claim, take over or resolve (a forged replay body included): it is signed out, in
    words. bob's session, whose token did not change, holds. A sign-in with the new
    token works. Then alice is removed and re-added: with a new token, no cookie of
    hers comes back; nor when her token is rotated back to one she had before: a
    sign-in with it works, and nothing it opened before does."""
    alice_file = tmp_path / "alice.token"
    alice_file.write_text(ALICE + "\n")
    gateway = reloadable(tmp_path, upstream, alice_file)
    admin = gateway.running.admin
    try:
        parked, held = gateway.running.parked(), gateway.running.parked()
        operators = [dict(op) for op in gateway.doc["admin"]["operators"]]
        with console_session(admin, ALICE) as first, console_session(admin, BOB) as bob:
            with with_cookie(admin, first[0]) as client:
                claimed = client.post(
                    "/console/claim", data={"route": "jobs", "key": held, "csrf": first[1]}
                )
            assert claimed.status_code == 303, claimed.text
            assert record_of(admin, held)["holder"] == "alice"

            alice_file.write_text(ROTATED + "\n")
            gateway.reload(operators)
        old_token = httpx.get(f"{admin}/admin/me", headers={"Authorization": f"Bearer {ALICE}"})
        assert old_token.status_code == 401
        assert_signed_out(admin, first, (parked, held), "has changed since")
        assert signed_in(admin, bob)  # bob's token did not change

        with console_session(admin, ROTATED) as second:
            with with_cookie(admin, second[0]) as client:
                form = {"route": "jobs", "key": held, "outcome": "retry", "csrf": second[1]}
                answer = client.post("/console/resolve", data=form)
            assert answer.status_code == 303, answer.text
            assert record_of(admin, held)["state"] == "released"

        gateway.reload([op for op in operators if op["name"] != "alice"])
        assert_signed_out(admin, second, (parked, parked), "no longer an operator")
        alice_file.write_text(ANEW + "\n")
        gateway.reload(operators)
        for session in (first, second):
            assert_signed_out(admin, session, (parked, parked), "has changed since")
        with console_session(admin, ANEW) as third:
            assert signed_in(admin, third)

        # Her token rotated back to one she had before: what it opened stays over.
        alice_file.write_text(ROTATED + "\n")
        gateway.reload(operators)
        for session in (first, third):
            assert_signed_out(admin, session, (parked, parked), "has changed since")
        # second's token is hers again, and its cookie still counts for nothing.
        assert_signed_out(admin, second, (parked, parked), "since this session began")
        with console_session(admin, ROTATED) as fourth:
            assert signed_in(admin, fourth)
    finally:
        gateway.running.process.stop()
        ledger.record(
            "operator sessions",
            "test_rotating_a_token_ends_the_sessions_it_opened",
            requests=SENT["requests"],
            faults=gateway.reloads,
            bad_inputs=SENT["bad_inputs"],
            detail="a dead cookie against every page and form after rotation, removal, re-adding",
        )
    output = gateway.running.process.output()
    assert not any(token in output for token in (ALICE, BOB, ROTATED, ANEW))


def eventually(check: Callable[[], bool], timeout: float = 10) -> bool:
    """Whether `check` holds within `timeout` seconds (asked every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.process
@pytest.mark.redis
def test_a_re_added_operator_starts_with_no_sessions(
    tmp_path: Path, upstream: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """Two replicas on one Redis. alice signs in; replica A's config drops her, then
    takes her back with the very token she had (SIGHUP each time). The cookie she had
    is refused on A at once, and on B, whose config never changed, within the roster's
    refresh; B reloading later agrees. A fresh sign-in works on both replicas, and
    after every replica restarts the old cookie is still refused and the new one
    still good."""
    alice_file = tmp_path / "alice.token"
    alice_file.write_text(ALICE + "\n")
    store = {"url": redis_server.url, "prefix": unique("roster") + ":"}
    a = reloadable(tmp_path, upstream, alice_file, store, "replica-a")
    b = reloadable(tmp_path, upstream, alice_file, store, "replica-b")
    replicas = (a, b)
    requests, before = 0, dict(SENT)
    try:
        parked = a.running.parked()
        keys = (parked, parked)
        operators = [dict(op) for op in a.doc["admin"]["operators"]]
        with console_session(a.running.admin, ALICE) as old:
            assert signed_in(a.running.admin, old) and signed_in(b.running.admin, old)
            a.reload([op for op in operators if op["name"] != "alice"])
            a.reload(operators)  # the very token she had
            words = "since this session began"
            assert_signed_out(a.running.admin, old, keys, words)
            assert eventually(lambda: not signed_in(b.running.admin, old))
            assert_signed_out(b.running.admin, old, keys, words)
            requests += 4
        with console_session(a.running.admin, ALICE) as fresh:
            assert signed_in(a.running.admin, fresh) and signed_in(b.running.admin, fresh)
            b.reload(operators)  # a replica that reloads later agrees
            assert signed_in(b.running.admin, fresh)
            assert_signed_out(b.running.admin, old, keys, words)
            for replica in replicas:
                replica.running.process.stop()
            for replica in replicas:
                replica.running.process.start()
                wait_for_port(int(replica.running.admin.rpartition(":")[2]))
            for replica in replicas:
                assert signed_in(replica.running.admin, fresh)
                assert_signed_out(replica.running.admin, old, keys, words)
            requests += 6
    finally:
        for replica in replicas:
            replica.running.process.stop()
        ledger.record(
            "operator sessions",
            "test_a_re_added_operator_starts_with_no_sessions",
            requests=SENT["requests"] - before["requests"] + requests,
            faults=a.reloads + b.reloads + len(replicas),
            bad_inputs=SENT["bad_inputs"] - before["bad_inputs"],
            detail="an operator removed and re-added with the same token, two replicas on "
            "one Redis, reloads and restarts",
        )
