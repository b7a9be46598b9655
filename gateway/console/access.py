"""Who a console request comes from, and whether a form post is really theirs.

A page is shown to a signed-in operator: a session cookie (console/session.py) that
the secret signed, that has not expired, whose name is in the current operator list
(`Gateway.operators`, rebuilt on reload), which also gives the role, whose
credential (the token, or the identity header's source, that signed them in) is
still theirs, and whose roster entry (gateway/operators/roster.py) still gives the time it gave
when the session began; behind a single-sign-on proxy, one whose name is the one the
proxy's header sends. A post needs that and more: an Origin that is the console's own and
the session's CSRF token (console/csrf.py), checked before the form is acted on.
Anything less is refused and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from starlette.requests import Request

from gateway.console import csrf
from gateway.console.session import COOKIE, Session, decode, holds, issue
from gateway.digits import whole_number
from gateway.errors import StoreError
from gateway.operators.identity import Operator, roster_entry

if TYPE_CHECKING:
    from gateway.assembly import Gateway

#: A console form is a note, a response to replay and a few names; the largest is a
#: resolve's response body, written into a text field.
FORM_OVERHEAD = 64 * 1024


class ConsoleOff(Exception):
    """The console cannot sign sessions: no admin.session_secret_env, or no operators."""


class SignedOut(Exception):
    """No valid session: none, forged, altered, expired, its operator was removed, the
    credential it was signed in with is no longer theirs, or their roster entry has a
    time other than the session's (they were removed and added back since)."""


class Forged(Exception):
    """A post the signed-in operator's own console page did not make (wrong or missing
    Origin, missing or wrong CSRF token), or one larger than any console form."""


@dataclass(frozen=True, slots=True)
class Visitor:
    """A signed-in operator, as the current config knows them."""

    operator: Operator
    session: Session
    csrf: str


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def secret_of(gateway: Gateway) -> bytes:
    admin = gateway.config.admin  # read on each request: a reload may change it
    if not admin.operators:
        raise ConsoleOff(
            "No operators are configured. List them in admin.operators, each with a "
            "token of their own and a role (viewer or operator); the shared admin.token "
            "does not open the console."
        )
    if not admin.session_secret:
        raise ConsoleOff(
            "Set admin.session_secret_env to the name of an environment variable that "
            "holds the cookie-signing secret (the same on every replica; for example the "
            "output of `idempotency-gateway keygen`)."
        )
    return admin.session_secret.encode()


def scheme_of(request: Request) -> str:
    """https when the browser reached the console over TLS: directly, or through a
    proxy of admin.trusted_proxies that says so in X-Forwarded-Proto."""
    if request.url.scheme == "https":
        return "https"
    host = request.client.host if request.client else None
    forwarded = request.headers.get("x-forwarded-proto", "").strip().lower()
    if forwarded == "https" and gateway_of(request).operators.trusts(host):
        return "https"
    return "http"


async def visitor(request: Request) -> Visitor:
    """The signed-in operator, or SignedOut. The name and the credential are looked up
    in the current operator list on every request, and the roster entry's time in
    this process's copy of the store's roster (read again first when the session is
    newer than the copy): removing an operator, or rotating their token, signs them
    out at their next click, and adding them back signs in none of their old
    sessions. StoreError when the store's roster cannot be read."""
    gateway = gateway_of(request)
    secret = secret_of(gateway)
    value = request.cookies.get(COOKIE)
    session = decode(secret, value) if value else None
    if session is None:
        raise SignedOut("Sign in with your operator token.")
    operator = gateway.operators.by_name(session.name)
    if operator is None:
        raise SignedOut(f"{session.name} is no longer an operator of this gateway.")
    if not holds(secret, session, gateway.operators.credential(session.name, session.made_by)):
        raise SignedOut(_credential_gone(session))
    entry = roster_entry(session.name, session.made_by)
    since = gateway.roster.since(entry)
    if since is None or since < session.since_ms:
        # A session newer than this process's copy of the roster (another replica
        # recorded a change this one has not read yet): read the store's first. Times
        # only grow, so an older session never costs this.
        await gateway.roster.refresh()
        since = gateway.roster.since(entry)
    if since is None and not gateway.roster.reachable:
        # Not known yet (the store has not answered since this process loaded its
        # config): nothing says the session is over, nor that it counts.
        raise StoreError("the operator roster could not be read from the store")
    if since != session.since_ms:
        raise SignedOut(
            f"{session.name} was removed from the operator list, or given another "
            "credential, since this session began; sign in again."
        )
    if _proxy_disowns(request, gateway, session):
        # Behind the single-sign-on proxy its header says who is at this browser now
        # (the proxy's session may have changed hands since this cookie was issued):
        # a cookie naming someone else must not let them act as that person.
        raise SignedOut(
            f"The single-sign-on proxy no longer names {session.name} at this browser; "
            "sign in again."
        )
    return Visitor(operator, session, csrf.token_for(secret, session))


def _credential_gone(session: Session) -> str:
    if session.made_by == "identity_header":
        return (
            f"The single-sign-on settings or {session.name}'s token has changed since this "
            "session began; sign in again."
        )
    return (
        f"The token {session.name} signed in with has changed since (a new token was "
        "given); sign in with the current one."
    )


async def issue_session(gateway: Gateway, name: str, made_by: str) -> str:
    """The cookie value of a new session for `name`, signed in by `made_by`, standing
    on the credential the current config gives them (`Operators.credential`) and the
    time their roster entry gives (recorded first if the store's roster does not hold
    it as this config has it; StoreError if the store does not answer)."""
    secret = secret_of(gateway)
    credential = gateway.operators.credential(name, made_by)
    if credential is None:
        raise SignedOut(f"{name} is no operator of this gateway.")
    since = await gateway.roster.confirmed(roster_entry(name, made_by))
    if since is None:
        raise SignedOut(f"{name} is no operator of this gateway.")
    _, value = issue(secret, name, credential, made_by=made_by, since_ms=since)
    return value


def _proxy_disowns(request: Request, gateway: Gateway, session: Session) -> bool:
    """Whether a trusted proxy's identity header says this session is not the
    browser's: it names several people, another operator of the list, or (for a
    session the header itself made) anyone but the session's operator. Without the
    header, or from an address that is no trusted proxy (where anyone can send it),
    the session is the cookie's; so is one a token made, while the header names
    nobody of the list (a proxy user who is no operator signed in with a token)."""
    operators = gateway.operators
    if not operators.identity_header:
        return False
    names = request.headers.getlist(operators.identity_header)
    host = request.client.host if request.client else None
    if not names or not operators.trusts(host):
        return False
    if len(names) > 1:
        return True
    named = names[0].strip()
    if named == session.name:
        return False
    return session.made_by == "identity_header" or operators.by_name(named) is not None


async def posted_form(request: Request, limit: int) -> dict[str, str]:
    """The post's fields (the first value of each), read to at most `limit` bytes."""
    declared = whole_number(request.headers.get("content-length", ""))
    if declared is not None and declared > limit:
        raise Forged(f"The form is larger than any console form ({limit} bytes).")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Forged(f"The form is larger than any console form ({limit} bytes).")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode()
        fields = parse_qs(text, keep_blank_values=True, max_num_fields=64)
    except (UnicodeDecodeError, ValueError):
        raise Forged("The form is not a form this console sent.") from None
    return {name: values[0] for name, values in fields.items()}


def check_origin(request: Request) -> None:
    if not csrf.origin_ok(request, scheme_of(request)):
        raise Forged(
            "The post did not come from a page of this console (its Origin is "
            f"{request.headers.get('origin') or 'missing'})."
        )


async def poster(request: Request, limit: int = FORM_OVERHEAD) -> tuple[Visitor, dict[str, str]]:
    """The operator who posted this form, and its fields; or SignedOut, or Forged.
    The Origin is checked first, then the session, then its CSRF token."""
    check_origin(request)
    who = await visitor(request)
    form = await posted_form(request, limit)
    if not csrf.token_ok(secret_of(gateway_of(request)), who.session, form.get(csrf.FIELD)):
        raise Forged("The form's CSRF token is missing or is not this session's.")
    return who, form
