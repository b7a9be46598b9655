"""What operators do, in one place: the JSON API (gateway/admin/api.py), the console and
the `keys` CLI (through the API) all come here.

Reads: `list_keys` (one page, from a cursor), `totals`, `overview`, `show`: each
reads a page or the counts the store keeps, never every waiting record. Changes:
`claim`, `resolve` and `pause_route` (pause or resume an async route), for an
authenticated `Operator` (gateway/operators/identity.py) and the client it came from
("console", "cli" or "api"). A change is allowed to the operator role alone
(`permit`), recorded under the authenticated name (`Operator.recorded`), counted in
`idempotency_gateway_operator_actions_total{action, role}` and written as one JSON log
line: who, role, what, route, key, client. Every refusal is an `OperatorRefusal`
(gateway.errors), raised before anything changes.
"""

from __future__ import annotations

import calendar
import dataclasses
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gateway.config import Config, parse_duration
from gateway.config import Route as RouteConfig
from gateway.digits import whole_number
from gateway.encryption import Unreadable
from gateway.errors import (
    BadFilter,
    BadOperatorRequest,
    BadOutcome,
    DigestRequired,
    HeldByAnother,
    InvalidTransition,
    NotTheHolder,
    OperatorRefusal,
    StoreError,
    UnknownKey,
    UnknownRoute,
    ViewerCannotAct,
)
from gateway.keying import record_digest
from gateway.logs import shown_key
from gateway.metrics import Metrics
from gateway.operators.identity import Operator, Role
from gateway.operators.redaction import (
    ShownRequest,
    ShownValue,
    UnreadableRequest,
    shown_names,
    shown_parameters,
    shown_request,
    shown_response,
)
from gateway.operators.response import check_response, operator_response
from gateway.operators.text import check_note
from gateway.records import DIGEST, OPEN_STATES, QUEUE_STATES, KeyRef, Record, State
from gateway.shared_read import SharedRead
from gateway.store.base import Counts, OperatorResult, Store
from gateway.store.pages import ANY, MAX_PAGE_SIZE, PAGE_SIZE, InvalidCursor, Match, Page
from gateway.store.route_pauses import PauseMove, PauseState

log = logging.getLogger("gateway.operator")


class Parts(Protocol):
    """What an action reads of the running gateway: its config, its store, its metrics
    (gateway/assembly.py's `Gateway` is one)."""

    @property
    def config(self) -> Config: ...

    @property
    def store(self) -> Store: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def counts(self) -> SharedRead[Counts]: ...


Client = Literal["console", "cli", "api"]
CLIENTS: tuple[Client, ...] = ("console", "cli", "api")
Outcome = Literal["done", "retry"]

#: The states a listing may ask for, by name.
LISTABLE = {
    "in_flight": State.IN_FLIGHT,
    "unresolved": State.UNRESOLVED,
    "parked": State.PARKED,
    "claimed": State.CLAIMED,
    "queued": State.QUEUED,  # deliveries of async routes, from the due indexes
    "retrying": State.RETRYING,
    "completed": State.COMPLETED,  # a route's completed deliveries, while kept
}
DEFAULT_STATES = frozenset(OPEN_STATES)
#: A record's id as `keys.record_digest` makes it and a listing gives it.
#: The actions counted, each with every role that may take it.
ACTIONS = ("claim", "resolve_done", "resolve_retry")


def _route_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(RouteConfig) if f.name == name)


#: For a record whose route a reload removed: a route's declared defaults (read from
#: the model, not a made-up route that has to validate).
_DEFAULT_MAX_STORED_BODY = int(_route_default("max_stored_body"))
_DEFAULT_RESPONSE_TTL = float(_route_default("response_ttl"))


def route_limits(gateway: Parts, name: str) -> tuple[float, int]:
    """A route's response_ttl and max_stored_body (the defaults for one a reload removed)."""
    route = gateway.config.route(name)
    if route is None:
        return _DEFAULT_RESPONSE_TTL, _DEFAULT_MAX_STORED_BODY
    return route.response_ttl, route.max_stored_body


# -- reading ---------------------------------------------------------------------------


def parse_states(text: str) -> frozenset[State]:
    """`unresolved,parked`: the states a listing filter names, or BadFilter."""
    states: set[State] = set()
    for name in text.split(","):
        if name not in LISTABLE:
            raise BadFilter(
                f"Unknown state {name!r}: state is one or more of {', '.join(LISTABLE)}.",
                field="state",
            )
        states.add(LISTABLE[name])
    return frozenset(states)


def parse_age(text: str | None) -> float:
    """`10m`: a listing's older_than filter in seconds (0 when not given), or BadFilter."""
    if text is None or text == "":
        return 0.0
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise BadFilter(f"older_than is not a duration: {exc}", field="older_than") from None


_LIMIT = re.compile(r"[0-9]{1,4}")
#: A route's name as the config allows one (gateway/config/types.py), bounded.
_ROUTE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,999}")


def parse_route(text: str | None) -> str | None:
    """A listing's route filter (None when not given), or BadFilter: a route's name is
    letters, digits, `_` `.` `-`, so anything else (a NUL byte, which PostgreSQL
    refuses in text, a control character, a megabyte) names no route and never
    reaches the store."""
    if text is None or text == "":
        return None
    if not _ROUTE.fullmatch(text):
        raise BadFilter(
            "route is a route's name: letters, digits, _ . and -, starting with a letter "
            "or digit, at most 1000 characters.",
            field="route",
        )
    return text


def parse_limit(text: str | None) -> int:
    """`250`: a listing's page size (PAGE_SIZE when not given), or BadFilter. ASCII
    digits only: `int()` would take `٢٠٠` or `1_0`, and `str.isdigit()` takes `²`."""
    if text is None or text == "":
        return PAGE_SIZE
    if not _LIMIT.fullmatch(text) or not 1 <= int(text) <= MAX_PAGE_SIZE:
        raise BadFilter(
            f"limit is a whole number of rows from 1 to {MAX_PAGE_SIZE}.", field="limit"
        )
    return int(text)


#: A time as `keys` prints one (UTC), or as a browser's datetime-local field sends it:
#: 2026-12-04T17:05 or 2026-12-04 17:05:09Z. ASCII digits only.
_TIME = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})[T ]([0-9]{2}):([0-9]{2})(?::([0-9]{2}))?Z?")
#: Milliseconds since the epoch as a listing's time may be given: at most 15 digits.
_MS_DIGITS = 15
#: The longest key prefix a listing takes (a key of a `hash` source is 71 characters;
#: the longest a template makes is bounded by the request's own limits).
MAX_KEY_PREFIX = 1024


def parse_time(text: str | None, name: str) -> int:
    """A listing's `since` or `until` (`name`): milliseconds since the epoch (ASCII
    digits), or a UTC time as `keys` prints it (2026-12-04T17:05, seconds and `Z`
    optional, a space for `T`); 0 when not given. BadFilter for anything else."""
    if text is None or text == "":
        return 0
    ms = whole_number(text, _MS_DIGITS)
    if ms is not None:
        return ms
    match = _TIME.fullmatch(text)
    if match is not None:
        year, month, day, hour, minute = (int(part) for part in match.groups()[:5])
        second = int(match[6] or 0)
        if 1 <= month <= 12 and 1 <= day <= calendar.monthrange(year, month)[1]:
            if hour < 24 and minute < 60 and second < 60 and year >= 1970:
                moment = (year, month, day, hour, minute, second)
                return calendar.timegm((*moment, 0, 0, 0)) * 1000
    raise BadFilter(
        f"{name} is a time: milliseconds since the epoch, or UTC as "
        "2026-12-04T17:05:00Z (seconds and Z optional).",
        field=name,
    )


def parse_status(text: str | None) -> int | None:
    """A listing's upstream status filter (None when not given): 100 to 599, three
    ASCII digits; BadFilter otherwise."""
    if text is None or text == "":
        return None
    status = whole_number(text, 3)
    if status is None or not 100 <= status <= 599:
        raise BadFilter("status is an HTTP status: three digits, 100 to 599.", field="status")
    return status


def parse_key_prefix(text: str | None) -> str:
    """A listing's key prefix ("" when not given), taken as the characters it is: no
    character in it is a pattern. BadFilter past MAX_KEY_PREFIX characters."""
    if text is None:
        return ""
    if len(text) > MAX_KEY_PREFIX:
        raise BadFilter(f"key_prefix is at most {MAX_KEY_PREFIX} characters.", field="key_prefix")
    return text


def parse_match(
    since: str | None,
    until: str | None,
    status: str | None,
    key_prefix: str | None,
    reason: str | None = None,
) -> Match:
    """A listing's match from its fields as given (query parameters, form fields):
    BadFilter for any that is not valid, or a range that ends before it starts."""
    if reason is not None and len(reason) > MAX_KEY_PREFIX:
        raise BadFilter(f"reason is at most {MAX_KEY_PREFIX} characters.", field="reason")
    match = Match(
        since_ms=parse_time(since, "since"),
        until_ms=parse_time(until, "until"),
        status=parse_status(status),
        key_prefix=parse_key_prefix(key_prefix),
        reason=reason or "",
    )
    if match.since_ms and match.until_ms and match.until_ms < match.since_ms:
        raise BadFilter("until is before since: the range is empty.", field="until")
    return match


async def list_keys(
    gateway: Parts,
    states: Iterable[State] = DEFAULT_STATES,
    route: str | None = None,
    older_than: float = 0.0,
    cursor: str = "",
    limit: int = PAGE_SIZE,
    match: Match = ANY,
) -> Page:
    """One page of the records in `states`, of `route` if given, in their state at
    least `older_than` seconds (a waiting delivery: due that long ago) and kept by
    `match`; the longest waiting first, from `cursor` (a page's `next` or `prev`; ""
    for the first). BadFilter for a cursor no listing gave, a route no route's name,
    or completed keys without a route."""
    route = parse_route(route)
    states = frozenset(states)
    if State.COMPLETED in states and route is None:
        raise BadFilter(
            "Completed keys are listed by route: add route=<name> (a route's completed "
            "deliveries, while their records are kept).",
            field="route",
        )
    try:
        return await gateway.store.list_records(
            states, route=route, older_than=older_than, cursor=cursor, limit=limit, match=match
        )
    except InvalidCursor:
        raise BadFilter(
            "The cursor is not one a listing gave: pass a page's next_cursor or "
            "prev_cursor as it is, or leave it out for the first page.",
            field="cursor",
        ) from None


async def totals(gateway: Parts, states: Iterable[State], route: str | None = None) -> int | None:
    """How many records are in `states` (of `route` if given), from the counts the
    store keeps (whatever their age); None when an in-flight or completed state is
    asked for (neither is counted)."""
    route = parse_route(route)
    wanted = frozenset(states)
    if State.IN_FLIGHT in wanted or State.COMPLETED in wanted:
        return None
    total = 0
    if wanted & OPEN_STATES:
        total += sum(
            s.count
            for s in await gateway.store.stats()
            if s.state in wanted and (route is None or s.route == route)
        )
    if wanted & QUEUE_STATES:
        for queue in await gateway.store.queue_stats():
            if route is None or queue.route == route:
                total += queue.queued if State.QUEUED in wanted else 0
                total += queue.retrying if State.RETRYING in wanted else 0
    return total


async def overview(gateway: Parts) -> dict[str, Any]:
    """Per route: open keys by state with the oldest's age, queued and retrying
    deliveries, and the last success's age; and whether the store answered. The
    figures are the gauges' (`idempotency_gateway_keys`, `_oldest_key_age_seconds`,
    `_queue_depth`), read from the store, so every replica shows the same.

    The last success is the more recent of two: the store's (`Store.last_successes`:
    a keyed request or delivery any replica completed with a success) and this
    process's gauge (`_last_success_timestamp_seconds`: any success it forwarded,
    which adds what the store never sees: routes without keys, requests without
    one, statuses the route does not cache, requests past a store that was down).
    So replicas agree on keyed routes, and a route the store never saw still shows
    this replica's own. A success is records.is_success: 2xx, 3xx, or 4xx but 408
    and 429. Null before either; this process's alone (perhaps null)
    while the store does not answer."""
    store: dict[str, Any] = {"reachable": True, "error": None}
    stats, queues, successes = [], [], {}
    pauses: dict[str, PauseState] = {}
    try:
        counts = await gateway.counts.get()  # shared with scrapes, at most 1 s old
        stats, queues, successes = counts.stats, counts.queues, counts.successes
        pauses = counts.pauses
    except StoreError as exc:
        log.warning("overview: the store did not answer: %s", exc)
        store = {
            "reachable": False,
            "error": "the store did not answer; the gateway's log says why",
        }
    configured = {r.name: r for r in gateway.config.routes}
    names = list(configured)
    names += sorted({s.route for s in stats} | {q.route for q in queues} - set(configured))
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        route = configured.get(name)
        is_async = route is not None and route.delivery.mode == "async"
        rows[name] = {
            "route": name,
            "configured": route is not None,
            "delivery": route.delivery.mode if route is not None else None,
            "keys": {
                str(state): {"count": 0, "oldest_age_seconds": 0.0} for state in sorted(OPEN_STATES)
            }
            if store["reachable"]
            else None,
            "queue": {"queued": 0, "retrying": 0, "oldest_wait_seconds": 0.0}
            if is_async and store["reachable"]
            else None,
            "max_queued": route.delivery.max_queued if is_async and route is not None else None,
            "last_success_age_seconds": _latest(
                successes.get(name), gateway.metrics.last_success_age(name)
            ),
            "paused": pause_json(pauses[name]) if name in pauses else None,
        }
    for stat in stats:
        keys = rows[stat.route]["keys"]
        keys[str(stat.state)] = {
            "count": stat.count,
            "oldest_age_seconds": round(stat.oldest_seconds, 3),
        }
    for queue in queues:
        rows[queue.route]["queue"] = {
            "queued": queue.queued,
            "retrying": queue.retrying,
            "oldest_wait_seconds": round(queue.oldest_wait_seconds, 3),
        }
    return {"store": store, "routes": list(rows.values())}


def pause_json(state: PauseState) -> dict[str, Any] | None:
    """A route's pause as operators read it: None when it is not paused."""
    if not state.paused:
        return None
    return {
        "since_ms": state.since_ms,
        "by": state.by,
        "why": state.why,
        "next_probe_ms": state.probe_ms or None,
        "failures": state.failures,
    }


async def pause_route(
    gateway: Parts,
    operator: Operator,
    route: str,
    move: Literal["pause", "resume"],
    why: object,
    client: Client,
    *,
    given: object = None,
) -> dict[str, Any]:
    """Pause an async route by hand (nothing is delivered, no probe goes out, until a
    resume), or resume one however it was paused; who and `why` are recorded on the
    route's row and in the audit line. `given` as for `claim`."""
    with _audited(gateway, operator, f"{move}_route", KeyRef("", route, ""), client) as line:
        permit(operator)
        operator = operator.acting(given)
        line["operator"] = operator.recorded
        config = gateway.config.route(route)
        # A route a reload made sync still delivers what it queued while async, and its
        # pause still holds that work: a resume of any configured route is taken.
        if config is None or (move == "pause" and config.delivery.mode != "async"):
            raise UnknownRoute(
                f"{route!r} is not a configured delivery: async route: only those deliver, "
                "so only those pause.",
                route=route,
            )
        if not isinstance(why, str) or not why.strip():
            raise BadOperatorRequest(f"Say why the route is to {move}.", field="why")
        check_note(why, "why")
        line["why"] = why
        state, _ = await gateway.store.change_pause(
            route, PauseMove(move, by=operator.recorded, why=why)
        )
        gateway.metrics.operator_action(f"{move}_route", operator.role)
        return {
            "route": route,
            "paused": pause_json(state),
            "by": state.by,
            "why": state.why,
            "changed_ms": state.changed_ms,
        }


def _latest(*ages: float | None) -> float | None:
    """The youngest of the ages known (None if none is)."""
    known = [age for age in ages if age is not None]
    return round(min(known), 3) if known else None


def locate(gateway: Parts, route: str, key: str, digest: str | None = None) -> KeyRef:
    """Where the record of `route` and `key` lives; a scoped route's records need the
    `digest` a listing gave (DigestRequired)."""
    if digest is not None and not DIGEST.fullmatch(digest):
        # The caller writes `?digest=` (or the console's form field): one that is no
        # record id crashed the Redis store's bucket lookup (a 500, the connection
        # reset) or read a key of the store's that no record id names.
        raise BadOperatorRequest(
            "The digest is not a record id: give the 32 lowercase hexadecimal "
            "characters a listing gave as `digest`.",
            field="digest",
        )
    if digest is None:
        config = gateway.config.route(route)
        if config is not None and config.key is not None and config.key.scope:
            raise DigestRequired(
                "Address the record with ?digest=<digest> from the listing.",
                route=route,
                key=key,
            )
        digest = record_digest(route, "", key)
    return KeyRef(digest, route, key)


async def show(gateway: Parts, ref: KeyRef) -> Record:
    """The record `ref` names, or UnknownKey."""
    record = await gateway.store.get(ref)
    # A digest is the caller's to give: it must be this route's and this key's record.
    if record is None or record.route != ref.route or record.key != ref.key:
        raise UnknownKey(route=ref.route, key=ref.key)
    return record


async def stored_request(gateway: Parts, record: Record) -> ShownRequest | UnreadableRequest | None:
    """A delivery's stored request as an operator may see it (gateway/operators/redaction.py:
    harmless headers' and parameters' values, the length alone of the rest), or why it
    cannot be opened (it is never sent; the record is shown all the same, so a person
    can claim and resolve it). None for a sync key, or once it settled."""
    if not record.delivery:
        return None
    ref = KeyRef(record.digest, record.route, record.key)
    try:
        request = await gateway.store.get_request(ref)
    except Unreadable as exc:
        return UnreadableRequest(str(exc))
    if request is None:
        return None
    route, admin = gateway.config.route(record.route), gateway.config.admin
    return shown_request(request, shown_names(route, admin), shown_parameters(route, admin))


def stored_response_headers(gateway: Parts, record: Record) -> tuple[ShownValue, ...]:
    """A stored response's headers as an operator may see them (gateway/operators/redaction.py);
    none when the record holds no response."""
    if record.response is None:
        return ()
    return shown_response(record.response.headers, gateway.config.admin)


# -- changing --------------------------------------------------------------------------


def permit(operator: Operator) -> None:
    """Claims and resolves need the operator role; a viewer's is ViewerCannotAct."""
    if operator.role is not Role.OPERATOR:
        raise ViewerCannotAct(
            f"{operator.name} is a viewer: they read keys. Claiming and resolving need "
            "role: operator in admin.operators."
        )


def may(gateway: Parts, operator: Operator, action: str, ref: KeyRef, client: Client) -> None:
    """`permit`, logged when refused: for a caller that checks the role before it
    reads what the action is to be (the API, before a request's body)."""
    with _audited(gateway, operator, action, ref, client, only_refusals=True):
        permit(operator)


async def claim(
    gateway: Parts,
    operator: Operator,
    ref: KeyRef,
    force: bool,
    client: Client,
    *,
    given: object = None,
) -> Record:
    """Take the key for `operator`; with `force`, from another operator (a recorded
    takeover). HeldByAnother names the holder otherwise. `given` is the name the
    request gave, if any (`Operator.acting`: the shared token's name, or a check)."""
    with _audited(gateway, operator, "claim", ref, client) as line:
        permit(operator)
        operator = operator.acting(given)
        line["operator"] = operator.recorded
        await show(gateway, ref)
        claimed = await gateway.store.operator_claim(ref, operator.recorded, force)
        if not claimed.ok:
            raise refusal(claimed, ref)
        after = await show(gateway, ref)
        taken = after.history[-1].get("takeover_from") if after.history else None
        if taken:
            line["takeover_from"] = taken
        gateway.metrics.operator_action("claim", operator.role)
        return after


async def resolve(
    gateway: Parts,
    operator: Operator,
    ref: KeyRef,
    outcome: str,
    note: str,
    response: Any,
    client: Client,
    *,
    given: object = None,
) -> Record:
    """Decide a key `operator` holds: `done` (repeats get `response`, checked first,
    or a 2xx saying an operator resolved it) or `retry` (the next request runs it; a
    delivery is queued again). `given` as for `claim`."""
    with _audited(gateway, operator, f"resolve_{outcome}", ref, client) as line:
        permit(operator)
        operator = operator.acting(given)
        line["operator"] = operator.recorded
        if outcome not in ("done", "retry"):
            raise BadOutcome(
                "done: it ran, and repeats get the response given (or a 2xx saying so); "
                "retry: it did not run, and the next request runs it."
            )
        if not isinstance(note, str):
            raise BadOperatorRequest("The note must be text.", field="note")
        check_note(note)
        ttl, max_body = route_limits(gateway, ref.route)
        answer = response if outcome == "done" else None
        if answer is not None:
            check_response(answer, max_body, ref.route)
        record = await show(gateway, ref)
        name = operator.recorded
        stored = operator_response(answer, record, name) if outcome == "done" else None
        resolved = await gateway.store.operator_resolve(ref, name, outcome, note, stored, ttl)
        if not resolved.ok:
            raise refusal(resolved, ref)
        gateway.metrics.operator_action(f"resolve_{outcome}", operator.role)
        return await show(gateway, ref)


#: What a bulk action walks: the parked deliveries of one route.
_PARKED = frozenset({State.PARKED})


@dataclass(frozen=True, slots=True)
class Bulk:
    """What a bulk action did: `acted` keys resolved `outcome`, `skipped` keys that
    changed meanwhile (no longer parked as listed, or taken by someone) and were left
    as they were."""

    outcome: str
    acted: int
    skipped: int

    def to_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "acted": self.acted, "skipped": self.skipped}


async def bulk_count(
    gateway: Parts, route: str | None, older_than: float = 0.0, match: Match = ANY
) -> int:
    """How many parked deliveries of `route` a bulk action with these filters would take
    now, walked a page at a time (what the console asks an operator to confirm)."""
    route = _bulk_route(route)
    count, cursor = 0, ""
    while True:
        page = await gateway.store.list_records(
            _PARKED,
            route=route,
            older_than=older_than,
            cursor=cursor,
            limit=MAX_PAGE_SIZE,
            match=match,
        )
        count += len(page.records)
        if not page.next:
            return count
        cursor = page.next


async def bulk_resolve(
    gateway: Parts,
    operator: Operator,
    route: str | None,
    outcome: str,
    note: str,
    client: Client,
    *,
    older_than: float = 0.0,
    match: Match = ANY,
    given: object = None,
) -> Bulk:
    """Resolve `outcome` ("retry": queued again with fresh attempts; "done", with a note:
    completed with an operator's 2xx) every delivery of `route` parked when the action
    starts and matching the filters, walked page by page, each with the per-key claim
    and resolve (each key's move the store's own atomic one, its history naming the
    operator and the note). A key that changed meanwhile (no longer parked since the
    time it was listed with, or claimed by anyone, the operator included) is skipped
    and counted, never acted on."""
    permit(operator)
    route = _bulk_route(route)
    if outcome not in ("done", "retry"):
        raise BadOutcome("done: they ran; retry: they did not, and are queued again.")
    if not isinstance(note, str):
        raise BadOperatorRequest("The note must be text.", field="note")
    if outcome == "done" and not note.strip():
        raise BadOperatorRequest("Say what was checked: a note is required.", field="note")
    check_note(note)
    acted = skipped = 0
    cursor, started = "", 0
    while True:
        page = await gateway.store.list_records(
            _PARKED, route=route, older_than=older_than, cursor=cursor, limit=PAGE_SIZE,
            match=match,
        )  # fmt: skip
        if not started:
            # Parked after the action began (a retried key that failed again): not
            # taken, or a walk behind a failing upstream would never end.
            started = page.now_ms
            match = dataclasses.replace(match, until_ms=min(match.until_ms or started, started))
        for listed in page.records:
            if listed.since_ms > started:
                continue
            if await _bulk_one(gateway, operator, listed, outcome, note, client, given):
                acted += 1
            else:
                skipped += 1
        if not page.next:
            return Bulk(outcome, acted, skipped)
        cursor = page.next


def _bulk_route(route: str | None) -> str:
    name = parse_route(route)
    if name is None:
        raise BadFilter(
            "A bulk action takes one route's parked deliveries: name it.", field="route"
        )
    return name


async def _bulk_one(
    gateway: Parts,
    operator: Operator,
    listed: Record,
    outcome: str,
    note: str,
    client: Client,
    given: object,
) -> bool:
    """One key of a bulk action: False, nothing done, when it changed since listed."""
    ref = KeyRef(listed.digest, listed.route, listed.key)
    now = await gateway.store.get(ref)
    if now is None or now.state is not State.PARKED or now.since_ms != listed.since_ms:
        return False
    try:
        await claim(gateway, operator, ref, False, client, given=given)
        await resolve(gateway, operator, ref, outcome, note, None, client, given=given)
    except (HeldByAnother, InvalidTransition, NotTheHolder, UnknownKey):
        return False  # taken by someone between the read and the claim
    return True


class _audited:
    """One log line per action, whatever its result: who, role, what, route, key,
    client, and `refused` (the problem's slug) if it was refused. The key is shown as
    the access log shows it (a hash on routes with sensitive_keys)."""

    def __init__(
        self,
        gateway: Parts,
        operator: Operator,
        action: str,
        ref: KeyRef,
        client: Client,
        only_refusals: bool = False,
    ) -> None:
        self.only_refusals = only_refusals
        config = gateway.config.route(ref.route)
        hashed = config is not None and config.sensitive_keys
        self.fields: dict[str, Any] = {
            "operator": operator.recorded,
            "role": str(operator.role),
            "via": operator.via,
            "action": action,
            "route": ref.route,
            "key": shown_key(ref.key, hashed),
            "client": client if client in CLIENTS else "api",
        }

    def __enter__(self) -> dict[str, Any]:
        return self.fields

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None and self.only_refusals:
            return  # `may`: the action's own line follows
        if exc is not None and not isinstance(exc, OperatorRefusal):
            return  # a store that failed: the caller gets 503; nothing was decided
        if isinstance(exc, OperatorRefusal):
            self.fields["refused"] = exc.slug
        fields = self.fields
        what = f"refused {fields['action']} ({fields['refused']})" if exc else fields["action"]
        log.info(
            "operator %s (%s, via %s, %s) %s: route %s key %s",
            fields["operator"],
            fields["role"],
            fields["via"],
            fields["client"],
            what,
            fields["route"],
            fields["key"],
            extra={"fields": fields},
        )


def refusal(result: OperatorResult, ref: KeyRef) -> OperatorRefusal:
    """What the store's refusal of a claim or resolve means to the operator."""
    if result.refused == "missing":
        return UnknownKey(route=ref.route, key=ref.key)
    if result.refused == "held":
        return HeldByAnother(
            f"{result.holder} holds it since {result.holder_since_ms} (ms since epoch). "
            'Send "force": true to take it over; the takeover is recorded.',
            holder=result.holder,
            holder_since_ms=result.holder_since_ms,
            route=ref.route,
            key=ref.key,
        )
    if result.refused == "holder":
        return NotTheHolder(
            f"{result.holder} holds it; claim it first.",
            holder=result.holder,
            route=ref.route,
            key=ref.key,
        )
    return InvalidTransition(
        f"The key is {result.state}.", state=result.state, route=ref.route, key=ref.key
    )
