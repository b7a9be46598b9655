"""The console's form posts: sign in, sign out, claim (and take over), resolve; pause
and resume an async route (`pause_route`, from the overview); and a bulk action on a
route's parked deliveries (answered with its page: how many).

Each post is checked by console/access.py (Origin, session, CSRF token) before its
fields are read, acts through gateway/operators/actions.py (client "console": the log line and
the metric say so), and answers with a redirect to the key's page (post, redirect,
get: a reload never posts twice). A refused action draws the key's page again as it
is now, with why in words, and the refusal's status.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from gateway.console import pages
from gateway.console.access import (
    FORM_OVERHEAD,
    Visitor,
    check_origin,
    gateway_of,
    issue_session,
    posted_form,
    poster,
    scheme_of,
    secret_of,
)
from gateway.console.rendering import PREFIX, key_url, page
from gateway.console.session import clearing_header
from gateway.console.wording import Refusal, refusal_for
from gateway.digits import whole_number
from gateway.errors import BadOperatorRequest, BadResponse, OperatorRefusal
from gateway.operators import actions
from gateway.operators.identity import audit_sign_in
from gateway.records import KeyRef, State

#: The console asks for a note on every `done` (the API leaves it optional); said
#: before anything is asked of the store, so it is the console's own refusal.
NOTE_REQUIRED = Refusal(
    "A note is required to resolve done",
    "Say what you checked (the provider's dashboard, the ledger), so the next person "
    "knows why. Nothing was changed.",
)


async def signin(request: Request) -> Response:
    """A token for a session. The post has no session yet, so its Origin is what
    shows it came from the console's own sign-in form."""
    check_origin(request)
    gateway = gateway_of(request)
    secret_of(gateway)  # ConsoleOff before the form is read
    form = await posted_form(request, FORM_OVERHEAD)
    target = pages.safe_next(form.get("next"))
    operator = gateway.operators.by_token(form.get("token", "").strip())
    peer = request.client.host if request.client else None
    if operator is None or operator.via != "token":
        words = (
            "The shared admin.token is for scripts and the CLI; sign in with your own "
            "operator token (admin.operators)."
            if operator is not None
            else "That is not the token of any operator of this gateway."
        )
        refused = "shared-token" if operator is not None else "unauthorized"
        audit_sign_in("console", peer, None, refused, words)
        context = pages.base(None) | {"next": target}
        context["refusal"] = Refusal("Not signed in", words)
        return page(request, "signin.html", context, 401)
    cookie = await issue_session(gateway, operator.name, "token")
    audit_sign_in("console", peer, operator)
    return pages.signed_in(request, cookie, target)


async def signout(request: Request) -> Response:
    await poster(request)
    response = RedirectResponse(f"{PREFIX}/signin?notice=signed_out", 303)
    response.headers.append("set-cookie", clearing_header(scheme_of(request) == "https"))
    return response


async def _refused(
    request: Request, who: Visitor, ref: KeyRef, refusal: Refusal, status: int
) -> Response:
    """The key's page as it is now, with the refusal said in words."""
    try:
        record = await actions.show(gateway_of(request), ref)
    except OperatorRefusal as exc:
        context = pages.base(who, "keys") | {"refusal": refusal_for(exc)}
        return page(request, "missing.html", context, exc.status)
    context = await pages.key_context(request, who, record)
    context["refusal"] = refusal
    return page(request, "key.html", context, status)


async def claim(request: Request) -> Response:
    who, form = await poster(request)
    gateway = gateway_of(request)
    ref = pages.ref_of(request, form)
    force = form.get("force") == "1"
    if force:
        # The confirmation named a holder; if another operator took the key since, ask
        # again naming them, rather than take it from someone the operator never saw.
        record = await actions.show(gateway, ref)
        expected = form.get("holder", "")
        if record.state is State.CLAIMED and record.holder not in (expected, who.operator.name):
            context = pages.base(who, "keys") | {"record": record}
            context["refusal"] = Refusal(
                f"Not taken over: {record.holder} holds it now",
                f"{record.holder} took this key since you were asked about {expected}. "
                f"Nothing was changed. Take it over from {record.holder}?",
            )
            return page(request, "takeover.html", context, 409)
    try:
        record = await actions.claim(gateway, who.operator, ref, force, "console")
    except OperatorRefusal as exc:
        return await _refused(request, who, ref, refusal_for(exc), exc.status)
    taken = bool(record.history and record.history[-1].get("takeover_from"))
    notice = "taken_over" if taken else "claimed"
    return RedirectResponse(key_url(ref.route, ref.key, ref.digest) + f"&notice={notice}", 303)


async def bulk(request: Request) -> Response:
    """The confirmed bulk action: every parked delivery of the route its filters take
    now, resolved as the form says; the page says how many, and how many changed
    meanwhile and were skipped."""
    who, form = await poster(request)
    given = pages.bulk_filters(form)
    outcome, note = form.get("outcome", ""), form.get("note", "").strip()
    if outcome == "done" and not note:
        context, _ = await pages.bulk_context(request, who, given)
        context["refusal"] = NOTE_REQUIRED
        return page(request, "bulk.html", context, 400)
    try:
        age = actions.parse_age(given["older_than"])
        match = actions.parse_match(None, None, given["status"], None, given["reason"])
        done = await actions.bulk_resolve(
            gateway_of(request),
            who.operator,
            given["route"] or None,
            outcome,
            note,
            "console",
            older_than=age,
            match=match,
        )
    except OperatorRefusal as exc:
        context, _ = await pages.bulk_context(request, who, given)
        context["refusal"] = refusal_for(exc)
        return page(request, "bulk.html", context, exc.status)
    context, status = await pages.bulk_context(request, who, given, done)
    return page(request, "bulk.html", context, status)


def response_given(form: dict[str, str]) -> dict[str, Any] | None:
    """The response to replay, from the done form's three fields; None when all are
    empty. The values are checked by gateway/operators/response.py, like the API's."""
    status_text = form.get("response_status", "").strip()
    header_text = form.get("response_headers", "")
    body = form.get("response_body", "")
    if not status_text and not header_text.strip() and not body:
        return None
    given: dict[str, Any] = {"body": body}
    if status_text:
        status = whole_number(status_text)
        if status is None:
            raise BadResponse(
                f"The status {status_text!r} is not a number: give 200 to 599.",
                field="response.status",
            )
        given["status"] = status
    headers: dict[str, str] = {}
    for number, line in enumerate(header_text.splitlines(), start=1):
        if not line.strip():
            continue
        name, colon, value = line.partition(":")
        if not colon or not name.strip():
            raise BadResponse(
                f"Header line {number} is not `Name: value`.", field="response.headers"
            )
        headers[name.strip()] = value.strip()
    if headers:
        given["headers"] = headers
    return given


async def resolve(request: Request) -> Response:
    gateway = gateway_of(request)
    # Room for the largest response body a route stores, written into a text field
    # and form-encoded (up to 3 bytes per byte). The form's route is not known before
    # the form is read; actions.resolve holds the body to its own route's limit.
    largest = max((r.max_stored_body for r in gateway.config.routes), default=0)
    limit = 3 * largest + FORM_OVERHEAD
    who, form = await poster(request, limit)
    ref = pages.ref_of(request, form)
    outcome = form.get("outcome", "")
    note = form.get("note", "").strip()
    if outcome == "done" and not note:
        return await _refused(request, who, ref, NOTE_REQUIRED, 400)
    try:
        given = response_given(form) if outcome == "done" else None
        await actions.resolve(gateway, who.operator, ref, outcome, note, given, "console")
    except OperatorRefusal as exc:
        return await _refused(request, who, ref, refusal_for(exc), exc.status)
    notice = f"resolved_{outcome}"
    return RedirectResponse(key_url(ref.route, ref.key, ref.digest) + f"&notice={notice}", 303)


async def pause_route(request: Request) -> Response:
    """Pause or resume an async route from the overview, with why; back to the
    overview with a notice, or the overview again with the refusal in words."""
    who, form = await poster(request)
    gateway = gateway_of(request)
    move = form.get("move", "")
    route, why = form.get("route", ""), form.get("why", "").strip()
    try:
        if move not in ("pause", "resume"):
            raise BadOperatorRequest("The form says neither pause nor resume.", field="move")
        await actions.pause_route(
            gateway, who.operator, route, "pause" if move == "pause" else "resume", why, "console"
        )
    except OperatorRefusal as exc:
        context = await pages.overview_context(request, who)
        context["refusal"] = refusal_for(exc)
        return page(request, "overview.html", context, exc.status)
    return RedirectResponse(f"{PREFIX}/?notice=route_{move}d", 303)
