"""The console's app, mounted at /console/ on the admin listener: its routes, and how
each failure is drawn (signed out: to the sign-in form; forged: 403; the store down:
503), always as a page with the console's headers, never a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.applications import Starlette
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
    from gateway.app import Gateway


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
    words = f"The store did not answer ({exc}). Nothing was changed; try again shortly."
    context = pages.base(None) | {"refusal": Refusal("The store is unreachable", words)}
    return page(request, "refused.html", context, 503)


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
            Mount("/static", StaticFiles(packages=[("gateway.console", "static")])),
        ],
        exception_handlers={
            SignedOut: _signed_out,
            ConsoleOff: _off,
            Forged: _forged,
            OperatorRefusal: _refused,
            StoreError: _store_down,
        },
    )
    app.state.gateway = gateway
    return app
