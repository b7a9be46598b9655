"""What makes a form post the operator's own: the CSRF token and the Origin.

A session cookie alone proves that the browser belongs to an operator, not that the
operator meant to send this post: another site's page could submit a form to the
console. So every post must carry both

- the session's CSRF token, HMAC(secret, "csrf", nonce), in the form field `csrf`:
  a page of another site cannot read it (the console's pages are not readable
  cross-origin), and it is worth nothing with another session's cookie; and
- an `Origin` that is the console's own (scheme and host as the browser addressed
  it). Browsers send Origin on every POST; one that is missing is refused too, since
  only a client that is not a browser leaves it out, and those use the operator API.

SameSite=Strict on the cookie is a third wall, but not one to lean on alone (older
browsers, same-site subdomains). The sign-in form has no session yet: its post is
checked by Origin alone.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.requests import Request

from gateway.console.session import Session, derived_key

FIELD = "csrf"


def token_for(secret: bytes, session: Session) -> str:
    return hmac.new(derived_key(secret, "csrf"), session.nonce.encode(), "sha256").hexdigest()


def token_ok(secret: bytes, session: Session, given: object) -> bool:
    if not isinstance(given, str) or not given:
        return False
    return hmac.compare_digest(given.encode(), token_for(secret, session).encode())


def own_origin(request: Request, scheme: str) -> str:
    """The console's origin as this request addressed it: `scheme://host[:port]`."""
    host = request.headers.get("host", "")
    return f"{scheme}://{host}".lower()


def origin_ok(request: Request, scheme: str) -> bool:
    """The post's Origin is the console's own. A `null` Origin (a sandboxed frame, a
    page with no referrer) and a missing one are refused."""
    given = request.headers.get("origin", "")
    if not given or given == "null":
        return False
    parts = urlsplit(given.lower())
    if parts.path or parts.query or not parts.netloc:
        return False
    return f"{parts.scheme}://{parts.netloc}" == own_origin(request, scheme)
