"""The console's pages: what a GET shows. Posts are console/forms.py's.

Every page needs a signed-in operator (console/access.py); a viewer sees every page
an operator does, without the action forms. Reads go through gateway/actions.py, the
same functions the operator API answers from, so the console and the API never
disagree about a key.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway import actions
from gateway.console.access import (
    SignedOut,
    Visitor,
    gateway_of,
    scheme_of,
    secret_of,
    visitor,
)
from gateway.console.rendering import PREFIX, key_url, page
from gateway.console.session import clearing_header, cookie_header, issue
from gateway.console.timeline import timeline
from gateway.console.wording import Refusal, notice_for, refusal_for
from gateway.errors import BadFilter, OperatorRefusal, Unauthorized
from gateway.operators import Role, audit_sign_in
from gateway.records import KeyRef, Record, State

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


async def overview_page(request: Request) -> Response:
    who = visitor(request)
    doc = await actions.overview(gateway_of(request))
    context = base(who, "overview") | {"store": doc["store"], "routes": doc["routes"]}
    context["open_states"] = DEFAULT_STATES
    return page(request, "overview.html", context)


def _filters(request: Request) -> tuple[list[str], str, str]:
    query = request.query_params
    states = [s for s in query.getlist("state") if s] or list(DEFAULT_STATES)
    return states, query.get("route", ""), query.get("older_than", "")


async def _rows(request: Request) -> tuple[dict[str, Any], int]:
    """The keys the filters name, and the page's status (400 for a bad filter)."""
    gateway = gateway_of(request)
    states, route, older_than = _filters(request)
    refusal: Refusal | None = None
    rows: list[Record] = []
    try:
        wanted = actions.parse_states(",".join(states))
        age = actions.parse_age(older_than)
    except BadFilter as exc:
        refusal = refusal_for(exc)
    else:
        rows = await actions.list_keys(gateway, wanted, route or None, age)
    query = urlencode(
        [("state", s) for s in states] + [("route", route), ("older_than", older_than)]
    )
    context = {
        "rows": rows,
        "read_ms": rows[0].now_ms if rows else 0,
        "states": states,
        "route": route,
        "older_than": older_than,
        "routes": [r.name for r in gateway.config.routes],
        "all_states": list(actions.LISTABLE),
        "fragment_url": f"{PREFIX}/keys/rows?{query}",
        "refusal": refusal,
    }
    return context, 400 if refusal else 200


async def keys_page(request: Request) -> Response:
    who = visitor(request)
    rows, status = await _rows(request)
    return page(request, "keys.html", base(who, "keys") | rows, status)


async def keys_rows(request: Request) -> Response:
    """The keys table alone: what the live refresh (static/refresh.js) fetches."""
    try:
        visitor(request)
    except SignedOut:
        return Response("signed out", status_code=401, media_type="text/plain")
    rows, status = await _rows(request)
    return page(request, "keys_table.html", rows, status)


def ref_of(request: Request, source: dict[str, str] | None = None) -> KeyRef:
    """The record a page or form names: route, key and digest (from a listing)."""
    given = source if source is not None else dict(request.query_params)
    return actions.locate(
        gateway_of(request), given.get("route", ""), given.get("key", ""), given.get("digest")
    )


async def key_context(request: Request, who: Visitor, record: Record) -> dict[str, Any]:
    gateway = gateway_of(request)
    ref_query = urlencode({"route": record.route, "key": record.key, "digest": record.digest})
    return base(who, "keys") | {
        "record": record,
        "timeline": timeline(record),
        "request_shown": await actions.stored_request(gateway, record),
        "can_act": who.operator.role is Role.OPERATOR,
        "ref_query": ref_query,
    }


async def key_page(request: Request) -> Response:
    who = visitor(request)
    try:
        record = await actions.show(gateway_of(request), ref_of(request))
    except OperatorRefusal as exc:
        context = base(who, "keys") | {"refusal": refusal_for(exc)}
        return page(request, "missing.html", context, exc.status)
    context = await key_context(request, who, record)
    context["notice"] = notice_for(request.query_params.get("notice", ""))
    return page(request, "key.html", context)


async def takeover_page(request: Request) -> Response:
    """Asks to confirm a takeover, naming the holder and since when. Taking over is a
    post from this page (console/forms.py), never a link: a link can be followed by
    accident, or by a prefetch."""
    who = visitor(request)
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
        secret = secret_of(gateway)
        host = request.client.host if request.client else None
        try:
            operator = operators.authenticate(request.headers, host)
        except Unauthorized as exc:
            operator = None
            if operators.trusts(host):  # the proxy named nobody; from elsewhere: ignored
                audit_sign_in("console", host, None, exc.slug, exc.detail or exc.title)
        if operator is not None and operator.via == "identity_header":
            _, value = issue(secret, operator.name, made_by="identity_header")
            audit_sign_in("console", host, operator)
            return signed_in(request, value, target)
    try:
        who: Visitor | None = visitor(request)
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
