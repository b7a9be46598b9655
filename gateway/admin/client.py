"""`idempotency-gateway keys ...`: the operator API from a terminal.

A client of the admin listener (stdlib HTTP: nothing to install on an operator's
laptop beyond the package), doing what the console does: `overview`, `list` (by
state, route, age; a page at a time, `--cursor` to go on, `--all` for every page),
`show` (the record and its history as a timeline), `claim`
(`--force` takes it over), `resolve done|retry` (a note, a response to replay),
`retry`, and `whoami`; `--json` prints the API's JSON. The token comes from the
environment, never from a flag, so it stays out of shell history:
GATEWAY_OPERATOR_TOKEN (your own, from admin.operators), else GATEWAY_ADMIN_TOKEN
(the shared one). With your own token the record keeps your name; with the shared
one, `--operator` (default $USER), marked "(shared token)".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, urlencode

from gateway.operators.redaction import ShownValue, query_line
from gateway.operators.text import character_name
from gateway.records import describe_event

#: The most digits of a number in --response: the bound Python's int() keeps against
#: quadratic conversion, said in the CLI's words rather than Python's advice.
MAX_DIGITS = 4300

#: Sent as the User-Agent, so the gateway's log says the action came from the CLI.
USER_AGENT = "idempotency-gateway-cli/1"


class AdminClient:
    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        try:
            request = urllib.request.Request(self.base_url + path, data=data, method=method)
        except ValueError as exc:  # not a URL at all
            raise Unreachable(f"{self.base_url!r} is not an http(s) URL: {exc}") from None
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("User-Agent", USER_AGENT)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            try:
                doc = json.loads(payload)
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                doc = {"title": payload.decode(errors="replace")[:200]}
            return exc.code, doc
        except (urllib.error.URLError, OSError, ValueError, UnicodeError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Unreachable(
                f"cannot reach the admin listener at {self.base_url}: {reason}"
            ) from None
        try:
            doc = json.loads(payload)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            raise NotTheApi(self.base_url, f"answered {status} with {_shown(payload)}")
        return status, doc


class Unreachable(Exception):
    """No answer from the admin listener (refused, timed out, a wrong --admin-url)."""


class NotTheApi(Exception):
    """An answer, but not the operator API's: --admin-url names another server (a login
    page, a proxy's placeholder), or one whose JSON has another shape."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(
            f"{url} {what}, which is not the operator API's answer; give --admin-url the "
            "admin listener's address (admin.listen)"
        )


class BadArgument(Exception):
    """Input the CLI refuses before it sends anything."""


def _shown(payload: bytes) -> str:
    text = payload[:60].decode(errors="replace")
    return repr(text + ("..." if len(payload) > 60 else "")) if payload else "no body"


def _check_arguments(args: argparse.Namespace) -> None:
    """Every argument is text the API can be sent: a terminal hands bytes that are not
    UTF-8 over as lone surrogates, which no URL and no JSON string can carry."""
    for name, value in vars(args).items():
        if not isinstance(value, str):
            continue
        bad = next((i for i, c in enumerate(value) if "\ud800" <= c <= "\udfff"), None)
        if bad is not None:
            positional = name in ("route", "key", "outcome") and args.keys_command != "list"
            what = name if positional else "--" + name.replace("_", "-")
            raise BadArgument(
                f"the {what} argument is not UTF-8 text (a byte \\x{ord(value[bad]) & 0xFF:02x} "
                f"at character {bad + 1}); nothing was sent"
            )


def _check_token(token: str, source: str) -> None:
    """A token is printable ASCII (config/credentials.py): anything else is no token
    the gateway has, and no HTTP header can carry a line break."""
    bad = next((c for c in token if not "\x21" <= c <= "\x7e"), None)
    if bad is None:
        return
    if "\ud800" <= bad <= "\udfff":
        what = f"a byte that is not UTF-8 (\\x{ord(bad) & 0xFF:02x})"
    else:
        what = character_name(bad)
    raise BadArgument(f"{source} holds {what}; a token is printable ASCII; nothing was sent")


def _response_json(text: str) -> Any:
    """--response as JSON, its numbers bounded and finite."""

    def whole(digits: str) -> int:
        count = len(digits.lstrip("-"))
        if count > MAX_DIGITS:
            raise BadArgument(
                f"--response holds a number of {count} digits; write at most {MAX_DIGITS}"
            )
        return int(digits)

    def fraction(digits: str) -> float:
        number = float(digits)
        if not math.isfinite(number):
            raise BadArgument(f"--response holds {digits}, a number too large to send")
        return number

    def constant(name: str) -> Any:
        raise BadArgument(f"--response holds {name}, which is not JSON")

    try:
        return json.loads(text, parse_int=whole, parse_float=fraction, parse_constant=constant)
    except ValueError as exc:
        raise BadArgument(f"--response is not JSON: {exc}") from None


def _key_url(route: str, key: str, digest: str | None, action: str = "") -> str:
    """The operator API's address of a key: its route, key and digest in the query,
    every character of each percent-encoded (a key is a caller's: `/`, `..`, `?`,
    `#` or `%` in it never changes which resource is addressed, even through a proxy
    that decodes and resolves paths)."""
    query = {"route": route, "key": key, **({"digest": digest} if digest else {})}
    return f"/admin/key{action}?" + urlencode(query, quote_via=quote, safe="")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _when(ms: int | None) -> str:
    if not ms:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + "Z"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _print_record(doc: dict[str, Any]) -> None:
    print(f"route:    {doc['route']}")
    print(f"key:      {doc['key']}")
    state_age, age = _age(doc["state_age_seconds"]), _age(doc["age_seconds"])
    print(f"state:    {doc['state']} for {state_age} (age {age})")
    print(f"run id:   {doc['run_id']}")
    if doc.get("reason"):
        print(f"reason:   {doc['reason']}")
    if doc.get("holder"):
        print(f"holder:   {doc['holder']} since {_when(doc.get('holder_since_ms'))}")
    if doc.get("reconcile"):
        print(f"last check: {json.dumps(doc['reconcile'])}")
    if doc.get("delivery"):
        delivery = doc["delivery"]
        due = delivery.get("next_attempt_ms")
        print(f"attempts: {delivery['attempts']}" + (f", next {_when(due)}" if due else ""))
        if delivery.get("last_attempt"):
            print(f"last attempt: {json.dumps(delivery['last_attempt'])}")
        if delivery.get("runs"):
            print("runs:")
            print(_indented(_table(_run_rows(delivery["runs"]), _RUN_HEADER)))
    response = doc.get("response")
    if response and "status" in response:
        omitted = ", body omitted" if response.get("body_omitted") else ""
        print(f"response: {response['status']} (from the {response['origin']}{omitted})")
    elif response:
        print(f"response: unreadable: {response.get('unreadable')}")
    if doc.get("request") and "unreadable" in doc["request"]:
        print(f"request:  unreadable: {doc['request']['unreadable']}")
    elif doc.get("request"):
        request = doc["request"]
        query = query_line(
            ShownValue(p["name"], None if p["hidden"] else p["value"], p["length"])
            for p in request["query"]
        )
        print(f"request:  {request['method']} {request['path']}" + (f"?{query}" if query else ""))
        for header in request["headers"]:
            value = header["value"]
            if header["hidden"]:
                value = f"(hidden, {header['length']} characters)"
            print(f"  {header['name']}: {value}")
    print("history:")
    for event in doc.get("history", []):
        print(f"  {_when(event['at_ms'])}  {describe_event(event)}")


_RUN_HEADER = [
    "#", "STARTED", "REPLICA", "TOOK", "OUTCOME", "STATUS", "FAILURE", "NEXT DUE", "DETAIL",
]  # fmt: skip


def _run_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """A delivery's attempts as `keys show` prints them: when, which replica, how long,
    the status or the failure's class, the next due time."""
    rows = []
    for run in runs:
        took = run.get("duration_ms")
        rows.append(
            [
                str(run["attempt"]),
                _when(run.get("started_ms")),
                run.get("replica") or "",
                "" if took is None else f"{took} ms",
                run["outcome"],
                "" if run.get("status") is None else str(run["status"]),
                run.get("failure") or "",
                _when(run.get("next_due_ms")),
                run.get("detail") or "",
            ]
        )
    return rows


def _indented(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _print_overview(doc: dict[str, Any]) -> None:
    store = doc["store"]
    print("store: " + ("reachable" if store["reachable"] else f"unreachable: {store['error']}"))
    states = ("unresolved", "parked", "claimed")
    rows = []
    for row in doc["routes"]:
        keys, queue = row["keys"] or {}, row["queue"]
        cells = [row["route"] + ("" if row["configured"] else " (not configured)")]
        for state in states:
            figures = keys.get(state)
            if figures is None:  # the store did not answer
                cells.append("?")
            elif figures["count"]:
                cells.append(f"{figures['count']} ({_age(figures['oldest_age_seconds'])})")
            else:
                cells.append("0")
        cells.append(f"{queue['queued']}" if queue else "-")
        cells.append(f"{queue['retrying']}" if queue else "-")
        since = row["last_success_age_seconds"]
        cells.append("never" if since is None else f"{_age(since)} ago")
        rows.append(cells)
    header = ["ROUTE", "UNRESOLVED", "PARKED", "CLAIMED", "QUEUED", "RETRYING", "LAST SUCCESS"]
    print(_table(rows, header))


def _token() -> tuple[str, str]:
    """The token and the variable it came from."""
    own = os.environ.get("GATEWAY_OPERATOR_TOKEN")
    if own:
        return own, "GATEWAY_OPERATOR_TOKEN"
    return os.environ.get("GATEWAY_ADMIN_TOKEN", ""), "GATEWAY_ADMIN_TOKEN"


def run(args: argparse.Namespace) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A key or a note the terminal's encoding cannot show is shown escaped.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    token, source = _token()
    if not token:
        print(
            "error: set GATEWAY_OPERATOR_TOKEN to your operator token (admin.operators), "
            "or GATEWAY_ADMIN_TOKEN to the shared admin.token",
            file=sys.stderr,
        )
        return 2
    try:
        _check_token(token, source)
        _check_arguments(args)
        return _run(args, AdminClient(args.admin_url, token))
    except BadArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Unreachable as exc:
        print(f"error: {exc} (give --admin-url or set GATEWAY_ADMIN_URL)", file=sys.stderr)
        return 1
    except NotTheApi as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _named(args: argparse.Namespace, client: AdminClient) -> dict[str, Any]:
    """The body's "operator": left out with a token of one's own (the gateway records
    its name; one given must be it), the name to record with the shared token."""
    if args.operator:
        return {"operator": args.operator}
    status, me = client.call("GET", "/admin/me")
    if status == 200 and me.get("via") == "shared_token":
        return {"operator": os.environ.get("USER", "")}
    return {}


def _run(args: argparse.Namespace, client: AdminClient) -> int:
    command = args.keys_command
    if command == "list":
        status, doc = _list(args, client)
    elif command == "bulk":
        status, doc = _bulk(args, client)
    elif command == "overview":
        status, doc = client.call("GET", "/admin/overview")
    elif command == "whoami":
        status, doc = client.call("GET", "/admin/me")
    elif command == "show":
        status, doc = client.call("GET", _key_url(args.route, args.key, args.digest))
    elif command == "retry":
        status, doc = _retry(args, client)
    elif command in ("pause", "resume"):
        body: dict[str, Any] = {**_named(args, client), "why": args.why}
        route = quote(args.route, safe="")
        status, doc = client.call("POST", f"/admin/routes/{route}/{command}", body)
    elif command == "claim":
        body = {**_named(args, client), "force": args.force}
        status, doc = client.call(
            "POST", _key_url(args.route, args.key, args.digest, "/claim"), body
        )
    else:
        response = _response_json(args.response) if args.response else None
        body = {**_named(args, client), "outcome": args.outcome, "note": args.note or ""}
        if response is not None:
            body["response"] = response
        status, doc = client.call(
            "POST", _key_url(args.route, args.key, args.digest, "/resolve"), body
        )
    if args.json:
        print(json.dumps(doc, indent=2))
        return 1 if status >= 400 else 0
    try:
        shown = _shown_doc(command, status, doc)
    except (KeyError, TypeError, AttributeError, ValueError, OverflowError, OSError):
        raise NotTheApi(client.base_url, "answered JSON of another shape") from None
    print(shown, file=sys.stderr if status >= 400 else sys.stdout)
    return 1 if status >= 400 else 0


def _shown_doc(command: str, status: int, doc: dict[str, Any]) -> str:
    """What a call prints, whole, before any of it is: an answer of another shape fails
    here, not halfway through the output."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if status >= 400:
            _print_problem(status, doc)
        elif command == "list":
            _print_list(doc)
        elif command == "bulk":
            _print_bulk(doc)
        elif command == "overview":
            _print_overview(doc)
        elif command in ("pause", "resume"):
            _print_pause(doc)
        elif command == "whoami":
            name = doc["name"] or "(the shared token: no name)"
            print(f"{name}: {doc['role']}, via {doc['via'].replace('_', ' ')}")
        else:
            _print_record(doc)
    return printed.getvalue().removesuffix("\n")


def _print_pause(doc: dict[str, Any]) -> None:
    paused = doc["paused"]
    if paused is None:
        print(f"route {doc['route']}: delivering (resumed by {doc['by']}: {doc['why']})")
        return
    print(
        f"route {doc['route']}: paused since {_when(paused['since_ms'])} by {paused['by']}: "
        f"{paused['why']}"
    )


def _print_problem(status: int, doc: dict[str, Any]) -> None:
    print(f"error {status}: {doc.get('title', '')}")
    if str(doc.get("type", "")).endswith("/held-by-another-operator"):
        # The API's detail speaks JSON ("force": true); the CLI's words are its flags.
        print(
            f"  {doc['holder']} holds it since {_when(doc.get('holder_since_ms'))}. "
            "Take it over with --force; the takeover is recorded."
        )
    elif doc.get("detail"):
        print(f"  {doc['detail']}")


def _list(args: argparse.Namespace, client: AdminClient) -> tuple[int, Any]:
    """A page of keys (`--limit`, from `--cursor`), or with `--all` every page after
    it, walked with the pages' next_cursor: one document of every row."""
    query = {"state": args.state}
    if args.route:
        query["route"] = args.route
    if args.older_than:
        query["older_than"] = args.older_than
    for name in ("since", "until", "status", "key_prefix"):
        if getattr(args, name) is not None:
            query[name] = getattr(args, name)
    if args.limit is not None:
        query["limit"] = str(args.limit)
    cursor = args.cursor or ""
    rows: list[Any] = []
    while True:
        status, doc = client.call("GET", "/admin/keys?" + urlencode({**query, "cursor": cursor}))
        if status >= 400 or not args.all:
            return status, doc
        rows += doc["keys"]
        if not doc.get("next_cursor"):
            return status, {**doc, "keys": rows, "count": len(rows)}
        cursor = doc["next_cursor"]


def _print_list(doc: dict[str, Any]) -> None:
    rows = [
        [
            k["route"],
            k["key"],
            k["state"],
            _age(k["state_age_seconds"]),
            k.get("holder") or "",
            _when(k.get("holder_since_ms")),
            k.get("reason") or "",
            json.dumps(k["last_reconcile"]) if k.get("last_reconcile") else "",
        ]
        for k in doc["keys"]
    ]
    header = ["ROUTE", "KEY", "STATE", "FOR", "HOLDER", "SINCE", "REASON", "LAST CHECK"]
    if any(k.get("attempts") is not None for k in doc["keys"]):  # deliveries listed
        header[4:4] = ["ATTEMPTS", "NEXT", "STATUS"]
        for row, k in zip(rows, doc["keys"], strict=True):
            attempts, due = k.get("attempts"), k.get("next_attempt_ms")
            status = k.get("upstream_status")
            row[4:4] = [
                "" if attempts is None else str(attempts),
                _when(due) if due else "",
                "" if status is None else str(status),
            ]
    print(_table(rows, header))
    print(f"\n{doc['count']} key(s)", end="")
    if doc.get("next_cursor"):
        print(f"; more after these: --cursor {doc['next_cursor']} (or --all)")
    else:
        print()


def _bulk(args: argparse.Namespace, client: AdminClient) -> tuple[int, Any]:
    """Without --yes, how many parked deliveries the action would take; with it, the
    action itself (each key through the per-key claim and resolve)."""
    filters = {"route": args.route}
    for name in ("reason", "older_than", "status"):
        if getattr(args, name) is not None:
            filters[name] = getattr(args, name)
    if not args.yes:
        status, doc = client.call("GET", "/admin/bulk?" + urlencode(filters))
        if status < 400 and isinstance(doc, dict):
            doc = {**doc, "outcome": args.outcome, "dry_run": True}
        return status, doc
    body: dict[str, Any] = {**filters, **_named(args, client), "outcome": args.outcome}
    body["note"] = args.note or ""
    return client.call("POST", "/admin/bulk", body)


def _print_bulk(doc: dict[str, Any]) -> None:
    word = "retried" if doc["outcome"] == "retry" else "resolved done"
    if doc.get("dry_run"):
        count = int(doc["count"])
        print(
            f"{count} parked deliver{'y' if count == 1 else 'ies'} of {doc['route']} match; "
            f"nothing changed. Run again with --yes to have them {word}."
        )
        return
    print(f"{word}: {int(doc['acted'])}; skipped (changed meanwhile): {int(doc['skipped'])}")


def _retry(args: argparse.Namespace, client: AdminClient) -> tuple[int, Any]:
    """Claim (never by force: someone else's claim is theirs to resolve), then resolve
    `retry`: a parked delivery is queued again with fresh attempts, a sync key is freed
    for its caller's next request."""
    named = _named(args, client)
    claim = _key_url(args.route, args.key, args.digest, "/claim")
    status, doc = client.call("POST", claim, {**named, "force": False})
    if status >= 400:
        return status, doc
    body = {**named, "outcome": "retry", "note": args.note or ""}
    return client.call("POST", _key_url(args.route, args.key, args.digest, "/resolve"), body)


def _shared_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The options of `keys` itself, which every action takes too: `keys --json list`
    and `keys list --json` alike. Only `keys` has the defaults; an action's copy is
    SUPPRESSed unless given, so it never overwrites a value given before the action."""
    url = os.environ.get("GATEWAY_ADMIN_URL", "http://127.0.0.1:9090")
    parser.add_argument(
        "--admin-url",
        default=url if defaults else argparse.SUPPRESS,
        help="the admin listener (default: $GATEWAY_ADMIN_URL or http://127.0.0.1:9090)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="print the API's JSON",
    )


def add_parser(sub: Any) -> None:
    keys = sub.add_parser(
        "keys",
        help="overview, list, show, claim and resolve keys; pause and resume routes "
        "(the operator API)",
    )
    _shared_options(keys, defaults=True)
    keys.set_defaults(func=run)
    shared = argparse.ArgumentParser(add_help=False)
    _shared_options(shared, defaults=False)
    actions = keys.add_subparsers(dest="keys_command", required=True)
    listing = actions.add_parser("list", help="keys that need attention", parents=[shared])
    listing.add_argument(
        "--state",
        default="unresolved,parked,claimed",
        help="comma-separated: in_flight, unresolved, parked, claimed, queued, retrying, "
        "completed (with --route: a route's completed deliveries)",
    )
    listing.add_argument("--route")
    listing.add_argument("--older-than", help="e.g. 10m")
    listing.add_argument(
        "--since", help="placed at or after: UTC as 2026-12-04T17:05:00Z, or epoch ms"
    )
    listing.add_argument("--until", help="placed at or before: as --since")
    listing.add_argument("--status", help="the upstream's status at the last attempt, e.g. 503")
    listing.add_argument("--key-prefix", help="keys starting with these characters (no wildcards)")
    listing.add_argument(
        "--limit", type=int, help="keys a page (1 to 1000; the gateway's default: 100)"
    )
    listing.add_argument(
        "--cursor", help="the page after this one: the cursor a page printed (next_cursor)"
    )
    listing.add_argument(
        "--all", action="store_true", help="every page from here on (they are read in turn)"
    )
    bulk = actions.add_parser(
        "bulk",
        help="retry, or resolve done, every parked delivery of a route matching filters",
        parents=[shared],
    )
    bulk.add_argument("route")
    bulk.add_argument("outcome", choices=["retry", "done"])
    bulk.add_argument("--reason", help="keys whose reason holds this text")
    bulk.add_argument("--older-than", help="parked at least this long, e.g. 10m")
    bulk.add_argument("--status", help="the upstream's status at the last attempt, e.g. 503")
    bulk.add_argument("--note", help="what you found (required with done)")
    bulk.add_argument(
        "--operator", help="with the shared token: the name to record (default $USER)"
    )
    bulk.add_argument(
        "--yes", action="store_true", help="act; without it, only count what would be taken"
    )
    actions.add_parser(
        "overview",
        help="per route: keys by state and the oldest's age, deliveries, last success",
        parents=[shared],
    )
    actions.add_parser("whoami", help="who your token says you are", parents=[shared])
    for name, text in (
        ("pause", "pause an async route: nothing is delivered until a resume"),
        ("resume", "resume an async route, however it was paused"),
    ):
        action = actions.add_parser(name, help=text, parents=[shared])
        action.add_argument("route")
        action.add_argument("--why", required=True, help="why (recorded with your name)")
        action.add_argument(
            "--operator",
            help="with the shared token: the name to record (default $USER); with "
            "your own token, leave it out",
        )
    for name, text in (
        ("show", "a key with its history"),
        ("claim", "take a key to work on"),
        ("resolve", "decide a key you hold"),
        ("retry", "claim and resolve retry: a parked delivery is queued again"),
    ):
        action = actions.add_parser(name, help=text, parents=[shared])
        action.add_argument("route")
        action.add_argument("key")
        action.add_argument("--digest", help="for scoped routes: the digest from `keys list`")
        if name in ("claim", "resolve", "retry"):
            action.add_argument(
                "--operator",
                help="with the shared token: the name to record (default $USER); with "
                "your own token, leave it out",
            )
        if name == "claim":
            action.add_argument("--force", action="store_true", help="take it over (recorded)")
        if name in ("resolve", "retry"):
            action.add_argument("--note", help="what you found")
        if name == "resolve":
            action.add_argument("outcome", choices=["done", "retry"])
            action.add_argument("--response", help='JSON {"status": 200, "body": ...} to replay')
