"""The console's session: a signed, expiring cookie that names an operator and the
credential they signed in with.

    value = base64url(JSON [version, name, issued_s, expires_s, nonce, made_by, credential,
                            since_ms]) "." base64url(MAC)
    MAC   = HMAC-SHA256(key, payload), key = HMAC-SHA256(secret, "... session")

The secret is `admin.session_secret` (read from the environment variable that
`admin.session_secret_env` names, the same on every replica), so a cookie one replica
signed is good on all of them, and a new secret signs everyone out. The cookie says
only who signed in and until when: what they may do (their role), and whether they
still may at all, is looked up in the current operator list on every request
(console/access.py), so removing an operator and reloading signs them out at their
next click.

The nonce ties the CSRF token (console/csrf.py) to this one session: a token taken
from an earlier session, or from another operator's, is worth nothing here.

`made_by` says what signed the operator in: their token ("token"), or the
single-sign-on proxy's identity header ("identity_header"), whose word a session it
made depends on for as long as it lasts (console/access.py).

`credential` is a fingerprint of what the session stands on: the operator's token,
and for a session the identity header made, the header's source too
(`Operators.credential`), keyed under the secret so the cookie tells nothing of the
token. Every request compares it with the current config's: rotate a token (or
change the single-sign-on settings) and reload, and every session it opened is over
on each replica that reloaded.

`since_ms` is the time the operator's roster entry (gateway/operators/roster.py: the store's
answer, the same on every replica) gave when the session began. A session counts only
while the entry still gives that time: an operator removed and added back, or whose
token is rotated and rotated back, has a new time, and no session from before counts
again, whatever token they come back with.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

#: How long a sign-in lasts. Not sliding: an operator signs in again after a shift.
SESSION_TTL = 8 * 3600
#: A cookie issued this far in the future still counts: replicas' clocks differ a little.
CLOCK_SKEW = 60
COOKIE = "console_session"
#: The cookie is sent to the console's own paths only, never to /admin or /metrics.
COOKIE_PATH = "/console/"
#: The cookie's layout (its fields as `encode` writes them); any other is refused.
_VERSION = 3


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    issued_s: int
    expires_s: int
    #: random, per sign-in: what the CSRF token is bound to
    nonce: str
    #: "token" or "identity_header": what signed the operator in
    made_by: str = "token"
    #: `fingerprint` of the credential that signed them in
    credential: str = ""
    #: the time (ms, the store's) the operator's roster entry gave when it began
    since_ms: int = 0


def derived_key(secret: bytes, purpose: str) -> bytes:
    """One key per use of the secret, so a MAC made for one use never passes for another."""
    return hmac.new(secret, f"idempotency-gateway console {purpose}".encode(), "sha256").digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, payload: str) -> bytes:
    return hmac.new(derived_key(secret, "session"), payload.encode(), hashlib.sha256).digest()


def fingerprint(secret: bytes, name: str, made_by: str, credential: bytes) -> str:
    """What a cookie carries of the credential `name` signed in with (made_by): keyed
    under the secret, so it can be neither read back nor made without it."""
    key = derived_key(secret, "credential")
    message = json.dumps([name, made_by]).encode() + b"\n" + credential
    return _b64(hmac.new(key, message, hashlib.sha256).digest()[:16])


def issue(
    secret: bytes,
    name: str,
    credential: bytes,
    now: float | None = None,
    made_by: str = "token",
    since_ms: int = 0,
) -> tuple[Session, str]:
    """A new session for `name`, signed in by `made_by` with `credential`
    (`Operators.credential`) while their roster entry gives `since_ms`, and the cookie
    value that carries it."""
    issued = int(time.time() if now is None else now)
    held = fingerprint(secret, name, made_by, credential)
    nonce = secrets.token_urlsafe(16)
    session = Session(name, issued, issued + SESSION_TTL, nonce, made_by, held, since_ms)
    return session, encode(secret, session)


def holds(secret: bytes, session: Session, credential: bytes | None) -> bool:
    """Whether `session` was signed in with `credential` (the current config's; None:
    there is none), compared in constant time."""
    if credential is None:
        return False
    expected = fingerprint(secret, session.name, session.made_by, credential)
    return hmac.compare_digest(expected.encode(), session.credential.encode())


def encode(secret: bytes, session: Session) -> str:
    doc = [
        _VERSION, session.name, session.issued_s, session.expires_s, session.nonce,
        session.made_by, session.credential, session.since_ms,
    ]  # fmt: skip
    payload = _b64(json.dumps(doc, separators=(",", ":")).encode())
    return f"{payload}.{_b64(_mac(secret, payload))}"


def decode(secret: bytes, value: str, now: float | None = None) -> Session | None:
    """The session a cookie carries, or None if it is forged, altered or expired.

    The MAC is checked (in constant time) before the payload is parsed at all: nothing
    in a cookie is read until it is known to be one the secret's holder wrote.
    """
    payload, dot, mac = value.partition(".")
    if not dot or not payload or not mac:
        return None
    # Compared as text: base64 has several spellings of one MAC (the last character's
    # spare bits), and a cookie changed anywhere is refused, not read as the same.
    if not hmac.compare_digest(mac.encode(), _b64(_mac(secret, payload)).encode()):
        return None
    try:
        doc = json.loads(_unb64(payload))
        version, name, issued, expires, nonce, made_by, credential, since = doc
    except (ValueError, TypeError):
        return None
    if version != _VERSION or not isinstance(name, str) or not isinstance(nonce, str):
        return None
    if not isinstance(credential, str) or type(since) is not int:
        return None
    if made_by not in ("token", "identity_header"):
        return None
    if not isinstance(issued, int) or not isinstance(expires, int):
        return None
    moment = time.time() if now is None else now
    if not issued - CLOCK_SKEW <= moment < expires:
        return None
    return Session(name, issued, expires, nonce, made_by, credential, since)


def cookie_header(value: str, secure: bool, max_age: int = SESSION_TTL) -> str:
    """The Set-Cookie value: HttpOnly (no script reads it), SameSite=Strict (no other
    site's page makes the browser send it), Secure when the console is served over TLS."""
    parts = [
        f"{COOKIE}={value}",
        f"Path={COOKIE_PATH}",
        f"Max-Age={max_age}",
        "HttpOnly",
        "SameSite=Strict",
    ]
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def clearing_header(secure: bool) -> str:
    """The Set-Cookie value that removes the session (sign-out, or a dead session)."""
    return cookie_header("", secure, max_age=0)
