"""How the console's pages are drawn: the Jinja2 environment and the headers of a page.

Everything on a page that is not the template's own text came from someone else:
keys, notes, reasons and headers are written by callers, upstreams and operators.
Autoescape is on for every template, and no template marks anything `|safe`, so a
key such as `"><img src=x onerror=alert(1)>` is drawn as those characters. Every value
a template draws has its invisible characters spelled out (`visible`: a right-to-left
override is drawn `⟨U+202E⟩` and reorders nothing, a zero-width space cannot make two
keys look alike); a form's hidden field that posts a key back takes it as it is
(`|exact`). The
Content-Security-Policy is the second wall: scripts and styles only from the console's
own static files (no inline script, no inline style, no `on...=` handler runs), no
frames, forms posting only to the console itself.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.templating import Jinja2Templates

from gateway.console.timeline import fields
from gateway.operators.text import is_invisible

PREFIX = "/console"

CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    ]
)

#: Sent with every console answer, pages, fragments and refusals alike.
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # same-origin, not no-referrer: with no-referrer a browser sends `Origin: null` on a
    # form post, which the Origin check (console/csrf.py) has to refuse.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def when(ms: int | float | None) -> str:
    """A store timestamp (ms since the epoch) as a person reads it, in UTC."""
    if not ms:
        return ""
    return datetime.fromtimestamp(float(ms) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(ms: int | float | None) -> str:
    if not ms:
        return ""
    return datetime.fromtimestamp(float(ms) / 1000, UTC).isoformat(timespec="milliseconds")


def age(seconds: float | None) -> str:
    """`45s`, `3m 12s`, `2h 5m`, `3d 4h`: how long, to the unit that matters."""
    if seconds is None:
        return ""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def visible(text: str) -> str:
    """`text` with each character that shows nothing of its own (format characters,
    line and paragraph separators: operator_text.INVISIBLE) spelled out as
    `⟨U+202E⟩`: drawn in the order it is stored, and as long as it is."""
    if text.isascii():
        return text  # no invisible character is ASCII
    return "".join(f"⟨U+{ord(c):04X}⟩" if is_invisible(c) else c for c in text)


def _drawn(value: Any) -> Any:
    """Jinja's `finalize`: what every `{{ ... }}` draws. Markup (`|exact`) is drawn as
    it is; other text is `visible`."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return visible(value)
    return value


def exact(value: Any) -> Markup:
    """A value drawn as it is, escaped: for a form field that posts it back."""
    return escape(value)


def key_url(route: str, key: str, digest: str) -> str:
    """A key's page. Route and key go in the query, not the path: a key may hold `/`,
    `..`, `?` or `#`, which a browser would resolve or cut in a path."""
    return f"{PREFIX}/key?" + urlencode({"route": route, "key": key, "digest": digest})


def environment() -> Environment:
    env = Environment(
        loader=PackageLoader("gateway.console", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_drawn,
    )
    env.filters.update(when=when, iso=iso, age=age, fields=fields, exact=exact)
    env.globals.update(key_url=key_url, prefix=PREFIX)
    return env


TEMPLATES = Jinja2Templates(env=environment())


def page(
    request: Request, template: str, context: dict[str, Any], status: int = 200
) -> HTMLResponse:
    """A template drawn for this request, with the console's headers."""
    response = TEMPLATES.TemplateResponse(request, template, context, status_code=status)
    response.headers.update(HEADERS)
    return response
