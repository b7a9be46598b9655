"""The console's app, mounted at /console/ on the admin listener: its routes, and how
each failure is drawn (signed out: to the sign-in form; forged: 403; the store down:
503; a page that is not there: 404; a method a page does not take: 405; an exception
no handler expected: 500, the cause in the log), always as a page with the console's
headers, never a traceback or Starlette's plain text.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.console import forms, pages
from gateway.console.access import ConsoleOff, Forged, SignedOut
from gateway.console.rendering import page
from gateway.console.wording import Refusal, refusal_for
from gateway.errors import OperatorRefusal, StoreError

if TYPE_CHECKING:
    from gateway.assembly import Gateway

log = logging.getLogger("gateway.admin")


async def _signed_out(request: Request, exc: Exception) -> Response:
    return pages.signed_out(request, str(exc))


async def _off(request: Request, exc: Exception) -> Response:
    return pages.html_off(request, str(exc))


async def _forged(request: Request, exc: Exception) -> Response:
    context = pages.base(None) | {"refusal": Refusal("Refused", f"{exc} Nothing was changed.")}
    return page(request, "refused.html", context, 403)


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OperatorRefusal)
    context = pages.base(None) | {"refusal": refusal_for(exc)}
    return page(request, "refused.html", context, exc.status)


async def _store_down(request: Request, exc: Exception) -> Response:
    log.error("store failed under a console request: %s", exc)  # the driver's words
    words = (
        "The store did not answer. Nothing was changed; try again shortly (the gateway's "
        "log says why)."
    )
    context = pages.base(None) | {"refusal": Refusal("The store is unreachable", words)}
    return page(request, "refused.html", context, 503)


async def _unmatched(request: Request, exc: Exception) -> Response:
    """What Starlette raises itself: no page at this path (404), or a method the page
    does not take (405, with Allow)."""
    assert isinstance(exc, HTTPException)
    headers: dict[str, str] = {}
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        headers["Allow"] = allow
        words = f"This page takes {allow or 'other methods'}; nothing was changed."
        refusal = Refusal("Not this way", words)
    elif exc.status_code == 404:
        refusal = Refusal("No such page", "The console has no page at this address.")
    else:  # nothing else is raised on these routes; drawn as a refusal all the same
        refusal = Refusal("Refused", f"{exc.detail}. Nothing was changed.")
    response = page(
        request, "refused.html", pages.base(None) | {"refusal": refusal}, exc.status_code
    )
    response.headers.update(headers)
    return response


async def _failed(request: Request, exc: Exception) -> Response:
    # The exception and its traceback are logged by the server it is raised on to.
    words = (
        "An unexpected error stopped this page; the gateway's log says which. An action "
        "may have been taken before it failed: open the key again before repeating it."
    )
    context = pages.base(None) | {"refusal": Refusal("Something went wrong", words)}
    return page(request, "refused.html", context, 500)


def create_console(gateway: Gateway) -> Starlette:
    app = Starlette(
        routes=[
            Route("/", pages.overview_page),
            Route("/signin", pages.signin_page),
            Route("/signin", forms.signin, methods=["POST"]),
            Route("/signout", forms.signout, methods=["POST"]),
            Route("/keys", pages.keys_page),
            Route("/keys/rows", pages.keys_rows),
            Route("/key", pages.key_page),
            Route("/takeover", pages.takeover_page),
            Route("/claim", forms.claim, methods=["POST"]),
            Route("/resolve", forms.resolve, methods=["POST"]),
            Route("/bulk", pages.bulk_page),
            Route("/bulk", forms.bulk, methods=["POST"]),
            Route("/route-pause", forms.pause_route, methods=["POST"]),
            Mount("/static", StaticFiles(packages=[("gateway.console", "static")])),
        ],
        exception_handlers={
            SignedOut: _signed_out,
            ConsoleOff: _off,
            Forged: _forged,
            OperatorRefusal: _refused,
            StoreError: _store_down,
            HTTPException: _unmatched,
            Exception: _failed,
        },
    )
    app.state.gateway = gateway
    return app
