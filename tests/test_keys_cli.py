"""`idempotency-gateway keys ...` against a real admin listener: the options of
`keys` (--json, --admin-url) work before the action and after it, as people type
them, for every action; and the CLI does what the console does (overview, list with
filters, show with its timeline, claim, take over, resolve done and retry, whoami)
with an operator's own token from the environment."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway import cli
from tests.conftest import unique
from tests.support.nginx import access_lines, nginx_front
from tests.support.servers import ROOT, Process, free_port, gateway_process, wait_for_port

pytestmark = pytest.mark.process

TOKEN = "cli-admin-token"
#: Named operators (admin.operators); the gateway reads their tokens from its environment.
OPERATORS = {
    "alice": ("operator", "cli-alice-token-0123456789"),
    "bob": ("operator", "cli-bob-token-0123456789abc"),
    "vera": ("viewer", "cli-vera-token-0123456789ab"),
}
ROUTE = "charge"
DELIVERED = "deliver"


class Admin:
    def __init__(self, url: str, proxy: str, process: Process, upstream_url: str = "") -> None:
        self.url = url
        self.proxy = proxy
        self.process = process
        self.upstream_url = upstream_url

    def parked_key(self, key: str = "") -> str:
        key = key or unique("charge")
        with httpx.Client(base_url=self.proxy, timeout=10) as client:
            answer = client.post("/jobs/charge", json={"job_key": key}, params={"sleep": "0.4"})
        assert answer.status_code == 504, answer.text
        return key

    def parked_delivery(self) -> tuple[str, str]:
        """A delivery whose one attempt got 503 (the upstream's first run of the key
        fails; the second succeeds): its key and status URL."""
        return self.parked_delivery_as(unique("deliver"))

    def parked_delivery_as(self, key: str) -> tuple[str, str]:
        with httpx.Client(base_url=self.proxy, timeout=10) as client:
            answer = client.post("/jobs/deliver", json={"job_key": key}, params={"fail_first": "1"})
            assert answer.status_code == 202, answer.text
            status = answer.headers["location"]
            self.until(client, status, "parked")
        return key, status

    def until(self, client: httpx.Client, status: str, state: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while (doc := client.get(status).json())["state"] != state:
            assert time.monotonic() < deadline, doc
            time.sleep(0.05)
        return dict(doc)


@pytest.fixture(scope="module")
def admin(tmp_path_factory: pytest.TempPathFactory, upstream: Process) -> Iterator[Admin]:
    port, admin_port = free_port(), free_port()
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {
            "listen": f"127.0.0.1:{admin_port}",
            "token": TOKEN,
            "operators": [
                {"name": name, "role": role, "token_env": f"CLI_{name.upper()}_TOKEN"}
                for name, (role, _) in OPERATORS.items()
            ],
        },
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": ROUTE,
                "match": {"methods": ["POST"], "path": "/jobs/charge"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "fingerprint": ["method", "path", "body"],
                "upstream_timeout": "200ms",
            },
            {  # one attempt: a delivery that fails it is parked at once
                "name": DELIVERED,
                "match": {"methods": ["POST"], "path": "/jobs/deliver"},
                "upstream": upstream.url,
                "key": {"body": "job_key"},
                "fingerprint": ["method", "path", "body"],
                "delivery": "async",
                "retry": {"attempts": 1},
            },
        ],
    }
    path = tmp_path_factory.mktemp("cli") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {f"CLI_{name.upper()}_TOKEN": token for name, (_, token) in OPERATORS.items()}
    gateway = gateway_process(path, port, env=env).start()
    try:
        wait_for_port(admin_port)
        yield Admin(
            f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{port}", gateway, upstream.url
        )
    finally:
        gateway.stop()


@pytest.fixture
def dead_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token, and a default admin URL where nothing listens: only an --admin-url
    that took effect reaches the gateway."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("GATEWAY_OPERATOR_TOKEN", raising=False)
    monkeypatch.setenv("GATEWAY_ADMIN_URL", f"http://127.0.0.1:{free_port()}")


#: Where each of --json and --admin-url goes: before the action, or after it.
PLACES = list(itertools.product(("before", "after"), repeat=2))


def keys(admin_url: str, json_at: str, url_at: str, action: list[str]) -> list[str]:
    before: list[str] = []
    after: list[str] = []
    (before if json_at == "before" else after).append("--json")
    (before if url_at == "before" else after).extend(["--admin-url", admin_url])
    return ["keys", *before, *action, *after]


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Any:
    code = cli.main(argv)
    out = capsys.readouterr()
    assert code == 0, (argv, out.err)
    return json.loads(out.out)


@pytest.mark.usefixtures("dead_default")
def test_every_action_takes_the_options_in_either_place(
    admin: Admin, capsys: pytest.CaptureFixture[str]
) -> None:
    shown, resolving = admin.parked_key(), [admin.parked_key() for _ in PLACES]
    seen: list[str] = []
    for (json_at, url_at), key in zip(PLACES, resolving, strict=True):
        where = f"--json {json_at}, --admin-url {url_at}"
        listing = run_json(keys(admin.url, json_at, url_at, ["list", "--state", "parked"]), capsys)
        assert shown in [k["key"] for k in listing["keys"]], where
        record = run_json(keys(admin.url, json_at, url_at, ["show", ROUTE, shown]), capsys)
        assert record["key"] == shown and record["state"] == "parked", where
        claim = ["claim", ROUTE, key, "--operator", "alice"]
        held = run_json(keys(admin.url, json_at, url_at, claim), capsys)["holder"]
        assert held == "alice (shared token)"
        resolve = ["resolve", ROUTE, key, "done", "--operator", "alice", "--note", where]
        resolved = run_json(keys(admin.url, json_at, url_at, resolve), capsys)
        assert resolved["state"] == "completed", where
        assert resolved["history"][-1]["note"] == where
        seen.append(where)
    assert len(seen) == 4


@pytest.mark.usefixtures("dead_default")
def test_a_value_before_the_action_is_not_overwritten_by_the_actions_default(
    admin: Admin, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given before the action only, --admin-url and --json hold; given in both
    places, the later one wins, as with any repeated option."""
    assert "keys" in run_json(["keys", "--admin-url", admin.url, "--json", "list"], capsys)
    dead = os.environ["GATEWAY_ADMIN_URL"]
    argv = ["keys", "--admin-url", dead, "--json", "list", "--admin-url", admin.url]
    assert "keys" in run_json(argv, capsys)
    code = cli.main(["keys", "--admin-url", admin.url, "list", "--admin-url", dead])
    assert code == 1 and "cannot reach the admin listener" in capsys.readouterr().err
    # Without --json anywhere, the table.
    assert cli.main(["keys", "--admin-url", admin.url, "list"]) == 0
    assert capsys.readouterr().out.startswith("ROUTE")


def test_typed_as_people_type_it(admin: Admin) -> None:
    """The installed command's way: a process, the options after the action."""
    key = admin.parked_key()
    env = {**os.environ, "GATEWAY_ADMIN_TOKEN": TOKEN}
    env.pop("GATEWAY_ADMIN_URL", None)
    typed = ["keys", "show", ROUTE, key, "--json", "--admin-url", admin.url]
    result = subprocess.run(
        [sys.executable, "-m", "gateway", *typed],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["key"] == key


@pytest.mark.usefixtures("dead_default")
def test_an_unreachable_admin_listener_is_an_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["keys", "list", "--json"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the admin listener at http://127.0.0.1:")
    assert "Traceback" not in err
    assert cli.main(["keys", "list", "--admin-url", "not-a-url"]) == 1
    assert "is not an http(s) URL" in capsys.readouterr().err


@pytest.mark.usefixtures("dead_default")
def test_retry_queues_a_parked_delivery_and_it_is_delivered_once(
    admin: Admin, capsys: pytest.CaptureFixture[str]
) -> None:
    key, status = admin.parked_delivery()
    listing = run_json(
        ["keys", "--admin-url", admin.url, "list", "--state", "parked", "--json"], capsys
    )
    [row] = [k for k in listing["keys"] if k["key"] == key]
    assert row["attempts"] == 1 and row["reason"].startswith("attempts exhausted (1)")
    assert cli.main(["keys", "--admin-url", admin.url, "list", "--state", "parked"]) == 0
    table = capsys.readouterr().out
    assert table.split("\n")[0].split() == [
        "ROUTE",
        "KEY",
        "STATE",
        "FOR",
        "ATTEMPTS",
        "NEXT",
        "STATUS",
        "HOLDER",
        "SINCE",
        "REASON",
        "LAST",
        "CHECK",
    ]
    # Someone else's claim is theirs: retry never takes it over.
    retry = ["keys", "--admin-url", admin.url, "retry", DELIVERED, key]
    assert cli.main([*retry[:3], "claim", DELIVERED, key, "--operator", "bob"]) == 0
    capsys.readouterr()
    assert cli.main([*retry, "--operator", "alice"]) == 1
    assert "bob (shared token) holds it" in capsys.readouterr().err
    done = run_json([*retry, "--operator", "bob", "--note", "upstream fixed", "--json"], capsys)
    assert done["state"] == "queued" and done["delivery"]["attempts"] == 0
    assert done["history"][-1]["note"] == "upstream fixed"
    with httpx.Client(base_url=admin.proxy, timeout=10) as client:
        delivered = admin.until(client, status, "completed")
    assert delivered["attempts"] == 1
    record = run_json(["keys", "--admin-url", admin.url, "show", DELIVERED, key, "--json"], capsys)
    assert [e["event"] for e in record["history"]].count("attempt") == 2  # one before, one after
    # The histogram is acceptance to the first attempt: the requeued one's is not another.
    metrics = httpx.get(admin.url + "/metrics", timeout=10).text
    first = "idempotency_gateway_delivery_first_attempt_delay_seconds_count"
    assert f'{first}{{route="{DELIVERED}"}} 1.0' in metrics, metrics
    attempts = "idempotency_gateway_delivery_attempts_total"
    assert f'{attempts}{{result="exhausted",route="{DELIVERED}"}} 1.0' in metrics
    assert f'{attempts}{{result="completed",route="{DELIVERED}"}} 1.0' in metrics


# -- what the console does, the CLI does: with a token of one's own --------------------


class As:
    """`keys ...` as one operator: their token in GATEWAY_OPERATOR_TOKEN (and the
    shared one in GATEWAY_ADMIN_TOKEN, which the operator's own wins over)."""

    def __init__(
        self, admin: Admin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        self.admin, self.monkeypatch, self.capsys = admin, monkeypatch, capsys
        monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
        monkeypatch.setenv("GATEWAY_ADMIN_URL", admin.url)

    def __call__(self, name: str, *argv: str) -> tuple[int, str, str]:
        self.monkeypatch.setenv("GATEWAY_OPERATOR_TOKEN", OPERATORS[name][1])
        code = cli.main(["keys", *argv])
        out = self.capsys.readouterr()
        return code, out.out, out.err

    def json(self, name: str, *argv: str) -> Any:
        code, out, err = self(name, *argv, "--json")
        assert code == 0, (argv, err, out)
        return json.loads(out)


@pytest.fixture
def as_(admin: Admin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> As:
    return As(admin, monkeypatch, capsys)


def test_whoami_and_the_overview(admin: Admin, as_: As) -> None:
    key = admin.parked_key()
    assert as_.json("alice", "whoami") == {"name": "alice", "role": "operator", "via": "token"}
    code, out, _ = as_("vera", "whoami")
    assert code == 0 and out.strip() == "vera: viewer, via token"
    overview = as_.json("vera", "overview")
    assert overview["store"] == {"reachable": True, "error": None}
    [row] = [r for r in overview["routes"] if r["route"] == ROUTE]
    assert row["keys"]["parked"]["count"] >= 1 and row["keys"]["parked"]["oldest_age_seconds"] > 0
    [delivered] = [r for r in overview["routes"] if r["route"] == DELIVERED]
    assert delivered["queue"] is not None and delivered["delivery"] == "async"
    code, out, _ = as_("vera", "overview")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "store: reachable"
    assert lines[1].split() == [
        "ROUTE", "UNRESOLVED", "PARKED", "CLAIMED", "QUEUED", "RETRYING", "LAST", "SUCCESS",
    ]  # fmt: skip
    charge = next(line for line in lines if line.startswith(ROUTE + " "))
    parked = row["keys"]["parked"]["count"]
    # parked: its count and the oldest's age; no queue on a sync route
    assert f" {parked} (" in charge and re.search(r"\s-\s+-\s", charge), charge
    assert key in [k["key"] for k in as_.json("vera", "list", "--state", "parked")["keys"]]


def test_list_filters_by_state_route_and_age(admin: Admin, as_: As) -> None:
    key = admin.parked_key()

    def listed(*filters: str) -> list[str]:
        return [k["key"] for k in as_.json("vera", "list", *filters)["keys"]]

    assert key in listed("--state", "parked", "--route", ROUTE, "--older-than", "1ms")
    assert key in listed()  # unresolved, parked and claimed by default
    assert key not in listed("--state", "parked", "--older-than", "1h")
    assert key not in listed("--state", "parked", "--route", DELIVERED)
    assert key not in listed("--state", "claimed")
    code, _, err = as_("vera", "list", "--state", "done")
    assert code == 1 and "error 400: A listing filter is not valid" in err


@pytest.mark.usefixtures("dead_default")
def test_list_shows_a_page_and_walks_on_with_cursor_or_all(admin: Admin, as_: As) -> None:
    mine = {admin.parked_key() for _ in range(3)}
    code, out, _ = as_("vera", "list", "--state", "parked", "--limit", "1")
    assert code == 0 and "1 key(s); more after these: --cursor " in out
    cursor = out.rsplit("--cursor ", 1)[1].split()[0]
    page = as_.json("vera", "list", "--state", "parked", "--limit", "1", "--cursor", cursor)
    assert page["count"] == 1 and page["prev_cursor"]
    walked = as_.json("vera", "list", "--state", "parked", "--limit", "1", "--all")
    keys = [k["key"] for k in walked["keys"]]
    assert mine <= set(keys) and len(keys) == len(set(keys)) == walked["count"]
    assert walked["next_cursor"] is None
    whole = as_.json("vera", "list", "--state", "parked")
    assert [k["key"] for k in whole["keys"]] == keys  # the same order, page by page
    code, _, err = as_("vera", "list", "--limit", "0")
    assert code == 1 and "limit is a whole number of rows from 1 to 1000" in err
    code, _, err = as_("vera", "list", "--cursor", "made-up")
    assert code == 1 and "The cursor is not one a listing gave" in err


def test_claim_take_over_and_resolve_with_ones_own_name(admin: Admin, as_: As) -> None:
    """The console's handoff, from the terminal: each operator's own name recorded,
    the takeover named and forced, the refusals in words, the note and response kept."""
    key = admin.parked_key()
    assert as_.json("alice", "claim", ROUTE, key)["holder"] == "alice"
    code, _, err = as_("bob", "claim", ROUTE, key)
    assert code == 1 and err.startswith("error 409: Another operator holds this key")
    assert "alice holds it since 20" in err and "Take it over with --force" in err
    taken = as_.json("bob", "claim", ROUTE, key, "--force")
    assert taken["holder"] == "bob" and taken["history"][-1]["takeover_from"] == "alice"
    code, _, err = as_("alice", "resolve", ROUTE, key, "done", "--note", "mine")
    assert code == 1 and "bob holds it; claim it first." in err
    code, _, err = as_("vera", "resolve", ROUTE, key, "done", "--note", "looked")
    assert code == 1 and "vera is a viewer" in err
    code, _, err = as_("alice", "claim", ROUTE, key, "--operator", "bob", "--force")
    assert code == 1 and "You are authenticated as alice" in err
    response = '{"status": 200, "headers": {"X-Checked": "bob"}, "body": {"charged": true}}'
    note = ["--note", "the provider shows charge ch_1", "--response", response]
    done = as_.json("bob", "resolve", ROUTE, key, "done", *note)
    assert done["state"] == "completed" and done["response"]["origin"] == "operator"
    code, out, _ = as_("vera", "show", ROUTE, key)
    timeline = out[out.index("history:") :].splitlines()[1:]
    assert code == 0 and [line.split("  ", 2)[-1] for line in timeline] == [
        f"forwarded to the upstream (run {done['run_id']})",
        "outcome unknown: " + done["history"][1]["reason"],
        "parked: route policy: park",
        "claimed by alice",
        "taken over by bob from alice",
        "resolved done by bob: the provider shows charge ch_1",
    ]
    assert "response: 200 (from the operator)" in out and "holder" not in out
    with httpx.Client(base_url=admin.proxy, timeout=10) as client:
        repeat = client.post("/jobs/charge", json={"job_key": key}, params={"sleep": "0.4"})
    assert repeat.json() == {"charged": True} and repeat.headers["x-checked"] == "bob"
    # The gateway's log says who did each, through which client.
    lines = [json.loads(line) for line in admin.process.output().splitlines() if key in line]
    actions = [
        (line["operator"], line["action"], line["client"], line.get("refused"))
        for line in lines
        if line.get("logger") == "gateway.operator"
    ]
    assert actions == [
        ("alice", "claim", "cli", None),
        ("bob", "claim", "cli", "held-by-another-operator"),
        ("bob", "claim", "cli", None),
        ("alice", "resolve_done", "cli", "not-the-holder"),
        ("vera", "resolve", "cli", "viewer-cannot-act"),
        ("alice", "claim", "cli", "not-your-name"),
        ("bob", "resolve_done", "cli", None),
    ]
    assert not any(token in admin.process.output() for _, token in OPERATORS.values())


def test_resolve_retry_and_retry_with_ones_own_token(admin: Admin, as_: As) -> None:
    key = admin.parked_key()
    as_.json("alice", "claim", ROUTE, key)
    released = as_.json("alice", "resolve", ROUTE, key, "retry", "--note", "never reached")
    assert released["state"] == "released"
    assert released["history"][-1] == {
        "at_ms": released["history"][-1]["at_ms"],
        "event": "resolved",
        "operator": "alice",
        "outcome": "retry",
        "note": "never reached",
    }
    delivery, status = admin.parked_delivery()
    queued = as_.json("bob", "retry", DELIVERED, delivery, "--note", "upstream back")
    assert queued["state"] == "queued" and queued["history"][-1]["operator"] == "bob"
    with httpx.Client(base_url=admin.proxy, timeout=10) as client:
        assert admin.until(client, status, "completed")["attempts"] == 1


def test_the_shared_token_records_the_name_given_marked(
    admin: Admin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key = admin.parked_key()
    monkeypatch.delenv("GATEWAY_OPERATOR_TOKEN", raising=False)
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("USER", "carol")
    held = run_json(["keys", "--admin-url", admin.url, "claim", ROUTE, key, "--json"], capsys)
    assert held["holder"] == "carol (shared token)"
    assert cli.main(["keys", "--admin-url", admin.url, "whoami"]) == 0
    assert (
        capsys.readouterr().out.strip() == "(the shared token: no name): operator, via shared token"
    )


def test_a_key_that_would_change_the_path_addresses_only_itself(
    admin: Admin,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A caller's key is written in the query, every character encoded. Through a
    stock nginx in front of the admin listener (proxy_pass with a path: it decodes %2F
    and resolves `..` in the path), `keys claim charge x/../../charge/VICTIM` asks for
    the key named so, which does not exist (404): VICTIM stays parked and unclaimed."""
    victim = admin.parked_key()
    locations = f"    location / {{ proxy_pass {admin.url}/; }}\n"
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("GATEWAY_OPERATOR_TOKEN", raising=False)
    with nginx_front(tmp_path, locations) as nginx:
        for hostile in (f"x/../../{ROUTE}/{victim}", f"../{ROUTE}/{victim}", "%2E%2E"):
            argv = ["keys", "--admin-url", nginx.url, "claim", ROUTE, hostile, "--operator", "eve"]
            code = cli.main(argv)
            err = capsys.readouterr().err
            assert code == 1 and err.startswith("error 404"), err
        sent = access_lines(nginx)
        deadline = time.monotonic() + 5
        while len(sent) < 3 and time.monotonic() < deadline:  # nginx writes its log after
            time.sleep(0.05)  # the answer: the last line may come a moment later
            sent = access_lines(nginx)
        assert len(sent) == 3 and all("/admin/key/claim?route=" in line for line in sent), sent
    with httpx.Client(base_url=admin.url, headers={"authorization": f"Bearer {TOKEN}"}) as client:
        doc = client.get(f"/admin/keys/{ROUTE}/{victim}").json()
    assert doc["state"] == "parked" and not doc.get("holder"), doc


#: Keys holding what a URL gives meaning to: separators, dot segments, the query's
#: and fragment's marks, escapes, and what looks like another key's path.
URL_SHAPED_KEYS = ["a/b", "..", ".", "a?b=c", "a#b", "50%", "%2F", "%2e%2E", "x/../../y", "a;b"]


@pytest.mark.parametrize("shape", URL_SHAPED_KEYS)
def test_show_resolve_and_release_a_key_shaped_like_a_url(
    admin: Admin, as_: As, tmp_path: Path, shape: str
) -> None:
    """Each key is shown, claimed, resolved done and released as itself, straight to
    the admin listener and through nginx, and each action names it exactly."""
    key = admin.parked_key(shape + unique("-"))
    shown = as_.json("vera", "show", ROUTE, key)
    assert (shown["key"], shown["state"]) == (key, "parked")
    assert as_.json("alice", "claim", ROUTE, key)["key"] == key
    released = as_.json("alice", "resolve", ROUTE, key, "retry", "--note", "back")
    assert (released["key"], released["state"]) == (key, "released")
    other = admin.parked_key(shape + unique("-"))
    locations = f"    location / {{ proxy_pass {admin.url}/; }}\n"
    with nginx_front(tmp_path, locations) as nginx:
        through = ["--admin-url", nginx.url]
        assert as_.json("bob", "show", ROUTE, other, *through)["key"] == other
        done = as_.json("bob", "retry", ROUTE, other, *through)
        assert (done["key"], done["state"]) == (other, "released")


# -- bad input, from a terminal or an answer: one line, never a traceback ---------------


def typed(argv: list[str | bytes], token: bytes = TOKEN.encode()) -> tuple[int, str, str]:
    """`python -m gateway keys ...` as a process, with argv and the token as bytes a
    terminal or an environment may hold. Nothing listens at the default admin URL."""
    env = {k: v for k, v in os.environb.items() if not k.startswith(b"GATEWAY_")}
    env[b"GATEWAY_ADMIN_TOKEN"] = token
    env[b"GATEWAY_ADMIN_URL"] = f"http://127.0.0.1:{free_port()}".encode()
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "keys", *argv],
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=30,
    )
    return result.returncode, result.stdout.decode(errors="replace"), result.stderr.decode()


def assert_one_line_error(code: int, out: str, err: str, expected: int, *words: str) -> None:
    assert (code, out) == (expected, ""), (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in ("Traceback", "sys.", "int_max_str_digits", "Exception"):
        assert word not in err, err
    for word in words:
        assert word in err, (word, err)


#: (what, argv, token, words of the error): input refused before anything is sent.
REFUSED_INPUT: list[tuple[str, list[str | bytes], bytes, tuple[str, ...]]] = [
    ("key-not-utf8", ["show", ROUTE, b"k\xff"], TOKEN.encode(), ("key", "UTF-8")),
    ("route-not-utf8", ["list", "--route", b"r\xfe"], TOKEN.encode(), ("--route", "UTF-8")),
    (
        "digest-not-utf8",
        ["claim", ROUTE, "k", "--digest", b"\xff", "--operator", "x"],
        TOKEN.encode(),
        ("--digest", "UTF-8"),
    ),
    (
        "note-not-utf8",
        ["resolve", ROUTE, "k", "done", "--operator", "x", "--note", b"\xc3"],
        TOKEN.encode(),
        ("--note", "UTF-8"),
    ),
    ("token-line-break", ["whoami"], b"cli-admin\ntoken", ("GATEWAY_ADMIN_TOKEN", "LINE FEED")),
    ("token-euro", ["whoami"], "cli-\u20ac-token".encode(), ("GATEWAY_ADMIN_TOKEN", "EURO")),
    ("token-not-utf8", ["whoami"], b"cli-\xff-token", ("GATEWAY_ADMIN_TOKEN", "UTF-8")),
    (
        "response-long-number",
        [
            "resolve",
            ROUTE,
            "k",
            "done",
            "--operator",
            "x",
            "--response",
            '{"status": 1%s}' % ("0" * 5000),
        ],
        TOKEN.encode(),
        ("--response", "5001 digits"),
    ),
    (
        "response-infinite",
        ["resolve", ROUTE, "k", "done", "--operator", "x", "--response", '{"status": 1e999}'],
        TOKEN.encode(),
        ("--response", "too large"),
    ),
]


@pytest.mark.parametrize(
    ("argv", "token", "words"),
    [case[1:] for case in REFUSED_INPUT],
    ids=[case[0] for case in REFUSED_INPUT],
)
def test_bad_input_is_one_line_and_nothing_is_sent(
    argv: list[str | bytes], token: bytes, words: tuple[str, ...]
) -> None:
    """Bytes that are not UTF-8 in an argument (a terminal's), a token no HTTP header
    can carry, a number no JSON reader should take: `error: ...`, one line, exit 2,
    before anything is sent (nothing listens at the admin URL: a request would say
    it cannot reach it)."""
    assert_one_line_error(*typed(argv, token), 2, *words)


class _Answers(http.server.BaseHTTPRequestHandler):
    """An HTTP server that is not the admin listener: every request gets 200 and the
    class's `body`."""

    body = b""
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_POST = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize(
    "body",
    [b"<html>a login page</html>", b"[]", b"{}", b'{"keys": 1, "count": 1}', b"7"],
    ids=["html", "list", "empty", "other-shape", "number"],
)
@pytest.mark.parametrize(
    "action",
    [["overview"], ["list"], ["whoami"], ["show", ROUTE, "k"], ["claim", ROUTE, "k"]],
    ids=["overview", "list", "whoami", "show", "claim"],
)
def test_an_answer_that_is_not_the_apis_is_one_line(body: bytes, action: list[str]) -> None:
    """--admin-url names something that answers 200 but is not the operator API (a
    login page, a proxy's placeholder, JSON of another shape): one line that says so,
    exit 1, as for an admin listener that cannot be reached."""
    assert_one_line_error(*answered_by(body, 200, action), 1, "not the operator API")


def answered_by(body: bytes, status: int, action: list[str]) -> tuple[int, str, str]:
    """`keys ACTION` against a server that answers every request `status` and `body`."""
    handler = type("Answers", (_Answers,), {"body": body, "status": status})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            return typed([*action, "--admin-url", url])
        finally:
            server.shutdown()


def test_a_refusal_of_another_shape_is_one_line() -> None:
    """A 409 that says held-by-another-operator without naming the holder: one line."""
    body = b'{"type": "https://x/held-by-another-operator", "title": "held"}'
    assert_one_line_error(*answered_by(body, 409, ["claim", ROUTE, "k"]), 1, "not the operator API")


@pytest.mark.usefixtures("dead_default")
def test_the_run_log_lists_a_routes_deliveries_by_filter_and_shows_each_attempt(
    admin: Admin, capsys: pytest.CaptureFixture[str]
) -> None:
    """`keys list` with the run log's filters (completed deliveries of a route, a key
    prefix taken literally, the upstream status, a time range) and `keys show`'s
    attempts: when, which replica, how long, the status or the failure's class."""
    prefix = unique("run%_*")
    parked, _ = admin.parked_delivery_as(prefix + "-parked")
    done = prefix + "-done"
    with httpx.Client(base_url=admin.proxy, timeout=10) as client:
        answer = client.post("/jobs/deliver", json={"job_key": done})
        assert answer.status_code == 202, answer.text
        admin.until(client, answer.headers["location"], "completed")
    states = ["--state", "completed,parked,queued,retrying,in_flight"]
    table_of = ["keys", "--admin-url", admin.url, "list", "--route", DELIVERED, *states]
    runs = [*table_of, "--json"]

    def keys(*extra: str) -> list[str]:
        return [row["key"] for row in run_json([*runs, *extra], capsys)["keys"]]

    assert keys("--key-prefix", prefix) == [parked, done]
    assert keys("--key-prefix", "run_") == []  # `_` is no wildcard: "run%" is no match
    assert keys("--key-prefix", prefix, "--status", "503") == [parked]
    assert keys("--key-prefix", prefix, "--status", "200") == [done]
    listing = run_json([*runs, "--key-prefix", prefix], capsys)
    assert [row["upstream_status"] for row in listing["keys"]] == [503, 200]
    [completed] = [row for row in listing["keys"] if row["state"] == "completed"]
    placed = run_json(["keys", "--admin-url", admin.url, "show", DELIVERED, done, "--json"], capsys)
    since = placed["history"][-1]["at_ms"]
    assert keys("--key-prefix", prefix, "--since", str(since)) == [done]
    assert keys("--key-prefix", prefix, "--until", str(since - 1)) == [parked]
    assert keys("--key-prefix", prefix, "--since", "2999-01-01T00:00Z") == []
    assert completed["attempts"] == 1
    shown = run_json(
        ["keys", "--admin-url", admin.url, "show", DELIVERED, parked, "--json"], capsys
    )
    [attempt] = shown["delivery"]["runs"]
    assert attempt["attempt"] == 1 and attempt["replica"]
    assert attempt["outcome"] == "parked" and attempt["status"] == 503
    assert attempt["failure"] == "status" and attempt["next_due_ms"] is None
    assert 0 <= attempt["duration_ms"] == attempt["ended_ms"] - attempt["started_ms"]
    assert cli.main(["keys", "--admin-url", admin.url, "show", DELIVERED, parked]) == 0
    text = capsys.readouterr().out
    runs_at = text.index("runs:\n")
    assert text[runs_at:].split("\n")[1].split() == [
        "#", "STARTED", "REPLICA", "TOOK", "OUTCOME", "STATUS", "FAILURE", "NEXT", "DUE", "DETAIL",
    ]  # fmt: skip
    assert " parked " in text[runs_at:] and " 503 " in text[runs_at:]
    assert cli.main([*table_of, "--key-prefix", prefix]) == 0  # the table: its status
    table = capsys.readouterr().out.split("\n")
    assert table[0].split()[4:7] == ["ATTEMPTS", "NEXT", "STATUS"]
    assert table[1].split()[2] == "parked" and " 503 " in table[1]
    # Bad filters: one line each, naming the filter; completed keys need a route.
    for extra, said in (
        (["--status", "٥٠٣"], "status is an HTTP status"),
        (["--status", "600"], "status is an HTTP status"),
        (["--since", "yesterday"], "since is a time"),
        (["--since", "2026-02-30T00:00Z"], "since is a time"),
        (["--since", "2000", "--until", "1000"], "until is before since"),
    ):
        assert cli.main(["keys", "--admin-url", admin.url, "list", *extra]) == 1
        assert said in capsys.readouterr().err, extra
    assert cli.main(["keys", "--admin-url", admin.url, "list", "--state", "completed"]) == 1
    assert "listed by route" in capsys.readouterr().err


@pytest.mark.usefixtures("dead_default")
def test_a_bulk_retry_counts_first_then_delivers_each_parked_key_once(
    admin: Admin, capsys: pytest.CaptureFixture[str]
) -> None:
    """`keys bulk ROUTE retry` counts the parked deliveries its filters take and changes
    nothing; with --yes it retries them, each key's history naming the operator and
    the note, and each is delivered once. A key bob holds is not taken."""
    parked = [admin.parked_delivery()[0] for _ in range(4)]
    held = admin.parked_delivery()[0]
    bulk = ["keys", "--admin-url", admin.url, "bulk", DELIVERED, "retry", "--status", "503"]
    claim = ["keys", "--admin-url", admin.url, "claim", DELIVERED, held, "--operator", "bob"]
    assert cli.main(claim) == 0
    capsys.readouterr()
    counted = run_json([*bulk, "--json"], capsys)
    assert counted["dry_run"] and counted["count"] >= 4
    assert cli.main([*bulk, "--reason", "no such reason"]) == 0
    assert "0 parked deliveries of deliver match; nothing changed" in capsys.readouterr().out
    assert cli.main(bulk) == 0
    assert "Run again with --yes" in capsys.readouterr().out
    act = [*bulk, "--yes", "--operator", "alice", "--note", "upstream back"]
    assert cli.main(act) == 0
    said = capsys.readouterr().out
    assert said.startswith("retried: ") and "skipped (changed meanwhile): 0" in said
    assert int(said.split()[1].rstrip(";")) >= 4
    with httpx.Client(base_url=admin.proxy, timeout=10) as client:
        for key in parked:
            record = run_json(
                ["keys", "--admin-url", admin.url, "show", DELIVERED, key, "--json"], capsys
            )
            resolved = [e for e in record["history"] if e["event"] == "resolved"]
            assert [(e["operator"], e["outcome"], e["note"]) for e in resolved] == [
                ("alice (shared token)", "retry", "upstream back")
            ]
        deadline = time.monotonic() + 10
        for key in parked:
            while True:
                show = ["keys", "--admin-url", admin.url, "show", DELIVERED, key, "--json"]
                if run_json(show, capsys)["state"] == "completed":
                    break
                assert time.monotonic() < deadline, key
                time.sleep(0.05)
        counts = client.get(f"{admin.upstream_url}/_counts", params={"prefix": "deliver"}).json()
    for key in parked:
        assert counts["answers"][key] == {"503": 1, "200": 1}, key  # delivered once
    still = run_json(["keys", "--admin-url", admin.url, "show", DELIVERED, held, "--json"], capsys)
    assert still["state"] == "claimed" and still["holder"] == "bob (shared token)"
