"""A stand-in for oauth2-proxy behind nginx's `auth_request`, run under uvicorn in a
process of its own, and another site's page.

    GET /oauth2/auth       202 with `X-Auth-Request-User: NAME` when the request (the
                           browser's, as nginx passes it on) carries the cookie
                           `sso_user=NAME`; 401 without it. What oauth2-proxy's
                           `--set-xauthrequest` answers for a signed-in user.
    GET /oauth2/sign_in    403: where nginx sends a browser that is not signed in.
    GET /evil?target=URL   a page of another origin (same site: another port of the
                           same host) with a form that posts `text/plain` to URL, its
                           body `{"force": true, "x": "="}`: JSON, as a form can make it.
"""

from __future__ import annotations

import html
import sys

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route


async def auth(request: Request) -> Response:
    user = request.cookies.get("sso_user")
    if not user:
        return Response(status_code=401)
    return Response(status_code=202, headers={"X-Auth-Request-User": user})


async def sign_in(request: Request) -> Response:
    return HTMLResponse("<p>sign in with the single-sign-on provider</p>", status_code=403)


async def evil(request: Request) -> Response:
    target = html.escape(request.query_params["target"])
    return HTMLResponse(
        f'<form method="post" action="{target}" enctype="text/plain">'
        '<input type="hidden" name=\'{"force": true, "x": "\' value=\'"}\'>'
        '<button type="submit">Win a prize</button></form>'
    )


app = Starlette(
    routes=[
        Route("/oauth2/auth", auth),
        Route("/oauth2/sign_in", sign_in),
        Route("/evil", evil),
    ]
)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
