"""The console's pages: what a GET shows. Posts are console/forms.py's.

Every page needs a signed-in operator (console/access.py); a viewer sees every page
an operator does, without the action forms. Reads go through gateway/operators/actions.py, the
same functions the operator API answers from, so the console and the API never
disagree about a key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.console.access import (
    SignedOut,
    Visitor,
    gateway_of,
    issue_session,
    scheme_of,
    secret_of,
    visitor,
)
from gateway.console.rendering import HEADERS, PREFIX, key_url, page
from gateway.console.session import clearing_header, cookie_header
from gateway.console.timeline import timeline
from gateway.console.wording import Refusal, notice_for, refusal_for
from gateway.errors import BadFilter, OperatorRefusal, Unauthorized
from gateway.operators import actions
from gateway.operators.identity import Role, audit_sign_in
from gateway.operators.redaction import ShownRequest, UnreadableRequest
from gateway.operators.text import NOTE_LIMIT
from gateway.records import KeyRef, Record, State, attempts_of, upstream_status
from gateway.store.pages import ANY

#: What the keys page shows when no state is ticked: the keys that wait for a person.
DEFAULT_STATES = ("unresolved", "parked", "claimed")


def base(who: Visitor | None, nav: str = "") -> dict[str, Any]:
    """What every page's frame needs: who is signed in (for the sign-out form) and
    which part of the console this is."""
    return {
        "me": who.operator if who else None,
        "csrf": who.csrf if who else "",
        "nav": nav,
        "notice": "",
        "refusal": None,
    }


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a console path, never another site."""
    if target and target.startswith(PREFIX + "/") and not target.startswith("//"):
        if "\\" not in target and not any(c.isspace() for c in target):
            return target
    return PREFIX + "/"


async def overview_context(request: Request, who: Visitor) -> dict[str, Any]:
    doc = await actions.overview(gateway_of(request))
    context = base(who, "overview") | {"store": doc["store"], "routes": doc["routes"]}
    context["open_states"] = DEFAULT_STATES
    context["can_act"] = who.operator.role is Role.OPERATOR
    return context


async def overview_page(request: Request) -> Response:
    who = await visitor(request)
    context = await overview_context(request, who)
    context["notice"] = notice_for(request.query_params.get("notice", ""))
    return page(request, "overview.html", context)


#: The run log's fields of the keys page's form, as the API names them.
MATCH_FIELDS = ("since", "until", "status", "key_prefix")


def _filters(request: Request) -> tuple[list[str], str, str, dict[str, str]]:
    query = request.query_params
    states = [s for s in query.getlist("state") if s] or list(DEFAULT_STATES)
    matched = {name: query.get(name, "") for name in MATCH_FIELDS}
    return states, query.get("route", ""), query.get("older_than", ""), matched


async def _rows(request: Request) -> tuple[dict[str, Any], int]:
    """One page of the keys the filters name (from `cursor`), how many there are in
    all, the links to the pages around it, and the page's status (400 for a bad
    filter). The store reads a page and its counts, whatever the number of keys."""
    gateway = gateway_of(request)
    states, route, older_than, matched = _filters(request)
    cursor = request.query_params.get("cursor", "")
    refusal: Refusal | None = None
    page = None
    total: int | None = None
    try:
        wanted = actions.parse_states(",".join(states))
        age = actions.parse_age(older_than)
        match = actions.parse_match(**matched)
        page = await actions.list_keys(gateway, wanted, route or None, age, cursor, match=match)
        if match == ANY:  # the counts are by state and route alone
            total = await actions.totals(gateway, wanted, route or None)
    except BadFilter as exc:
        refusal = refusal_for(exc)
    filters = [("state", s) for s in states] + [("route", route), ("older_than", older_than)]
    filters += [(name, value) for name, value in matched.items() if value]

    def at(where: str, path: str = "/keys") -> str:
        return f"{PREFIX}{path}?" + urlencode(filters + ([("cursor", where)] if where else []))

    context = {
        "rows": page.records if page is not None else [],
        "read_ms": page.now_ms if page is not None else 0,
        "total": total,
        "first_url": at("") if cursor else "",
        "prev_url": at(page.prev) if page is not None and page.prev else "",
        "next_url": at(page.next) if page is not None and page.next else "",
        "states": states,
        "route": route,
        "older_than": older_than,
        "matched": matched,
        "routes": [r.name for r in gateway.config.routes],
        "all_states": list(actions.LISTABLE),
        "fragment_url": at(cursor, "/keys/rows"),
        "refusal": refusal,
    }
    return context, 400 if refusal else 200


def rows_tag(context: dict[str, Any]) -> str:
    """An ETag of what the keys table shows but the ages (the live refresh counts those
    on in the browser): who is where since when, the total, the links."""
    shown = [
        (
            r.digest,
            str(r.state),
            r.since_ms,
            r.holder,
            r.holder_since_ms,
            r.reason,
            r.attempts,
            r.due_ms,
            r.last_check_ms,
            upstream_status(r),
        )
        for r in context["rows"]
    ]
    links = (context["first_url"], context["prev_url"], context["next_url"])
    text = json.dumps([shown, context["total"], links, bool(context["refusal"])])
    return '"' + hashlib.sha256(text.encode()).hexdigest()[:32] + '"'


async def keys_page(request: Request) -> Response:
    who = await visitor(request)
    rows, status = await _rows(request)
    rows["refresh_tag"] = rows_tag(rows)  # the live refresh's first If-None-Match
    return page(request, "keys.html", base(who, "keys") | rows, status)


async def keys_rows(request: Request) -> Response:
    """The keys table alone: what the live refresh (static/refresh.js) fetches, with
    an ETag; asked again with it, an unchanged table is 304 and nothing is drawn."""
    try:
        await visitor(request)
    except SignedOut as exc:
        # The live refresh stops on the status; the page says why to anyone else.
        context = base(None) | {"refusal": Refusal("Signed out", str(exc))}
        return page(request, "refused.html", context, 401)
    rows, status = await _rows(request)
    tag = rows_tag(rows)
    if status == 200 and request.headers.get("if-none-match") == tag:
        return Response(status_code=304, headers={**HEADERS, "ETag": tag})
    answer = page(request, "keys_table.html", rows, status)
    answer.headers["ETag"] = tag
    return answer


def ref_of(request: Request, source: dict[str, str] | None = None) -> KeyRef:
    """The record a page or form names: route, key and digest (from a listing)."""
    given = source if source is not None else dict(request.query_params)
    return actions.locate(
        gateway_of(request), given.get("route", ""), given.get("key", ""), given.get("digest")
    )


async def key_context(request: Request, who: Visitor, record: Record) -> dict[str, Any]:
    gateway = gateway_of(request)
    ref_query = urlencode({"route": record.route, "key": record.key, "digest": record.digest})
    stored = await actions.stored_request(gateway, record)
    return base(who, "keys") | {
        "record": record,
        "timeline": timeline(record),
        "runs": attempts_of(record) if record.delivery else [],
        "request_shown": stored if isinstance(stored, ShownRequest) else None,
        "request_unreadable": stored.reason if isinstance(stored, UnreadableRequest) else "",
        "response_headers": actions.stored_response_headers(gateway, record),
        "can_act": who.operator.role is Role.OPERATOR,
        "note_limit": NOTE_LIMIT,
        "ref_query": ref_query,
    }


async def key_page(request: Request) -> Response:
    who = await visitor(request)
    try:
        record = await actions.show(gateway_of(request), ref_of(request))
    except OperatorRefusal as exc:
        context = base(who, "keys") | {"refusal": refusal_for(exc)}
        return page(request, "missing.html", context, exc.status)
    context = await key_context(request, who, record)
    context["notice"] = notice_for(request.query_params.get("notice", ""))
    return page(request, "key.html", context)


def bulk_filters(fields: Mapping[str, str]) -> dict[str, str]:
    """A bulk action's route and filters, as given (query or form)."""
    return {name: fields.get(name, "") for name in ("route", "reason", "older_than", "status")}


async def bulk_context(
    request: Request, who: Visitor, given: dict[str, str], done: actions.Bulk | None = None
) -> tuple[dict[str, Any], int]:
    """The bulk page: the filters, how many parked deliveries they take now, and, for
    an operator, the form that confirms it; a bad filter is said, with status 400."""
    context = base(who, "keys") | given | {"count": None, "done": done}
    context["can_act"] = who.operator.role is Role.OPERATOR
    context["note_limit"] = NOTE_LIMIT
    try:
        age = actions.parse_age(given["older_than"])
        match = actions.parse_match(None, None, given["status"], None, given["reason"])
        context["count"] = await actions.bulk_count(
            gateway_of(request), given["route"] or None, age, match
        )
    except BadFilter as exc:
        context["refusal"] = refusal_for(exc)
        return context, 400
    return context, 200


async def bulk_page(request: Request) -> Response:
    who = await visitor(request)
    context, status = await bulk_context(request, who, bulk_filters(request.query_params))
    return page(request, "bulk.html", context, status)


async def takeover_page(request: Request) -> Response:
    """Asks to confirm a takeover, naming the holder and since when. Taking over is a
    post from this page (console/forms.py), never a link: a link can be followed by
    accident, or by a prefetch."""
    who = await visitor(request)
    gateway = gateway_of(request)
    try:
        record = await actions.show(gateway, ref_of(request))
    except OperatorRefusal as exc:
        context = base(who, "keys") | {"refusal": refusal_for(exc)}
        return page(request, "missing.html", context, exc.status)
    if record.state is not State.CLAIMED or record.holder == who.operator.name:
        # Nobody else holds it (any more): nothing to confirm.
        return RedirectResponse(key_url(record.route, record.key, record.digest), 303)
    return page(request, "takeover.html", base(who, "keys") | {"record": record})


async def signin_page(request: Request) -> Response:
    """The sign-in form; behind a single-sign-on proxy of admin.trusted_proxies whose
    identity header names an operator, a session at once, with no token typed."""
    gateway = gateway_of(request)
    target = safe_next(request.query_params.get("next"))
    operators = gateway.operators
    if operators.identity_header and request.headers.get(operators.identity_header):
        secret_of(gateway)  # ConsoleOff before a session is made
        host = request.client.host if request.client else None
        try:
            operator = operators.authenticate(request.headers, host)
        except Unauthorized as exc:
            operator = None
            if operators.trusts(host):  # the proxy named nobody; from elsewhere: ignored
                audit_sign_in("console", host, None, exc.slug, exc.detail or exc.title)
        if operator is not None and operator.via == "identity_header":
            value = await issue_session(gateway, operator.name, "identity_header")
            audit_sign_in("console", host, operator)
            return signed_in(request, value, target)
    try:
        who: Visitor | None = await visitor(request)
    except SignedOut:
        who = None
    if who is not None:
        return RedirectResponse(target, 303)
    context = base(None) | {"next": target}
    context["notice"] = notice_for(request.query_params.get("notice", ""))
    return page(request, "signin.html", context)


def signed_in(request: Request, cookie: str, target: str) -> Response:
    response = RedirectResponse(target, 303)
    response.headers.append("set-cookie", cookie_header(cookie, scheme_of(request) == "https"))
    return response


def signed_out(request: Request, why: str) -> Response:
    """A page asked for without a session: to the sign-in form, and back after it. A
    cookie that is no longer good is removed."""
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    response: Response = RedirectResponse(f"{PREFIX}/signin?" + urlencode({"next": target}), 303)
    if request.method == "POST":
        # A post is not repeated after signing in: its page is the one to go back to.
        context = base(None) | {"next": PREFIX + "/"}
        context["refusal"] = Refusal("Signed out", f"{why} Nothing was changed.")
        response = page(request, "signin.html", context, 401)
    response.headers.append("set-cookie", clearing_header(scheme_of(request) == "https"))
    return response


def html_off(request: Request, why: str) -> HTMLResponse:
    return page(request, "off.html", base(None) | {"why": why}, 503)
