"""Who is calling the operator API, and what they may do.

An operator is authenticated one of three ways, from the current config
(`admin.operators`, `admin.token`, `admin.identity_header`; rebuilt on reload, so a
removed operator is refused on their next call):

- `Authorization: Bearer <token>`: an operator's own token, or the shared
  `admin.token`. The token given is compared, in constant time, against every
  configured token, so neither its content nor which operator's it is shows in the
  time an answer takes.
- the identity header (`admin.identity_header`, e.g. `X-Auth-Request-User` from
  oauth2-proxy), believed only from a peer address in `admin.trusted_proxies` and
  only when it names an operator of the list. From any other address it is ignored:
  anyone can send a header.
- a console session (the console sets `via="session"` from its signed cookie, after
  checking on every request, with `by_name` and `credential`, that the name is still
  an operator's and the credential that signed them in is still theirs).

The shared token proves no name. An action taken with it is recorded under the
name the caller gives, marked: `alice (shared token)` (`Operator.recorded`), so the
history never passes it off as alice's own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from ipaddress import ip_address
from typing import Literal

from gateway.config import AdminConfig
from gateway.errors import NotYourName, OperatorApiDisabled, OperatorRequired, Unauthorized
from gateway.operators.text import check_name

Via = Literal["token", "shared_token", "identity_header", "session"]

log = logging.getLogger("gateway.operator")

#: How the shared token's actions are recorded: `alice (shared token)`.
SHARED_MARK = " (shared token)"


class Role(StrEnum):
    #: reads keys, their records and the overview
    VIEWER = "viewer"
    #: also claims, takes over and resolves
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Operator:
    #: the authenticated name; with the shared token, the name the caller gave ("" until
    #: `acting` is told one)
    name: str
    role: Role
    via: Via

    @property
    def recorded(self) -> str:
        """The name a record's holder and history keep."""
        return self.name + SHARED_MARK if self.via == "shared_token" else self.name

    def acting(self, given: object) -> Operator:
        """The operator an action is recorded under, given the request's `"operator"`
        field (None: left out). A named operator may leave it out or repeat their own
        name; any other is NotYourName. The shared token needs one (OperatorRequired),
        which is kept as given: InvalidText if no store could keep it."""
        named = given.strip() if isinstance(given, str) else given
        if self.via != "shared_token":
            if named is None or named == "" or named == self.name:
                return self
            raise NotYourName(
                f'You are authenticated as {self.name}; leave "operator" out, or give '
                f'"{self.name}".'
            )
        if isinstance(given, str):
            # Checked as given: str.strip() also drops C1 controls (U+0085), the
            # separators U+001C-U+001F and U+2028/U+2029, which would otherwise be
            # accepted silently at either end of a name the rules refuse them in. What
            # is kept (`named`) is a part of what is checked here.
            check_name(given.strip(" "))
        if not isinstance(named, str) or not named:
            raise OperatorRequired(
                'Send {"operator": "your name"}: the shared token does not say who you '
                "are; the record keeps the name given, marked (shared token). A token of "
                "your own (admin.operators) needs no name."
            )
        return replace(self, name=named)


def _digest(token: str) -> bytes:
    # Compared as digests: equal lengths, so compare_digest's time says nothing of
    # the token's length either.
    return hashlib.sha256(token.encode()).digest()


class Operators:
    """The operators of one config: `authenticate` a request, or look one up."""

    def __init__(self, admin: AdminConfig) -> None:
        self._roles = {op.name: Role(op.role) for op in admin.operators}
        self._tokens: list[tuple[bytes, Operator]] = [
            (_digest(op.token), Operator(op.name, Role(op.role), "token")) for op in admin.operators
        ]
        if admin.token:
            self._tokens.append((_digest(admin.token), Operator("", Role.OPERATOR, "shared_token")))
        self.identity_header = admin.identity_header.lower()
        self._header_name = admin.identity_header  # as configured, for messages
        self._proxies = admin.trusted_proxies
        self._credentials = {op.name: _digest(op.token) for op in admin.operators}
        proxies = sorted(str(network) for network in self._proxies)
        self._header_source = _digest(json.dumps([self.identity_header, proxies]))
        self._session_secret = admin.session_secret.encode()

    @property
    def enabled(self) -> bool:
        """Whether anyone can use the operator API (a token or an operator configured)."""
        return bool(self._tokens)

    def by_name(self, name: str, via: Via = "session") -> Operator | None:
        """The operator of this name in the current list (a console session's check)."""
        role = self._roles.get(name)
        return None if role is None else Operator(name, role, via)

    def credential(self, name: str, made_by: str) -> bytes | None:
        """What a console session of `name` stands on, as the current config has it:
        the operator's token (as a digest), and for a session the identity header made
        ("identity_header"), also the header's name and the proxies it is believed
        from. None when `name` is no operator, or the identity header is not
        configured any more. The console keeps this, keyed, in the cookie
        (console/session.py) and compares it on every request: a token rotated, or the
        single-sign-on settings changed, and a reload ends every session they opened."""
        token = self._credentials.get(name)
        if token is None:
            return None
        if made_by == "identity_header":
            return token + self._header_source if self.identity_header else None
        return token

    def roster(self) -> dict[str, str] | None:
        """The operator roster this config asks the store to keep (gateway/operators/roster.py):
        an entry per way an operator signs in to the console, `token:NAME`, and with
        the identity header configured `identity_header:NAME`, each marked with a
        fingerprint of what `credential` gives it, keyed under the session secret (the
        store learns nothing of a token); empty with no operators. None without a
        session secret: the console is off here, and the roster is other replicas'."""
        if not self._session_secret:
            return None
        key = hmac.new(self._session_secret, b"idempotency-gateway roster", "sha256").digest()
        roster = {}
        for name in self._credentials:
            for made_by in ("token", "identity_header"):
                credential = self.credential(name, made_by)
                if credential is not None:
                    mark = hmac.new(key, credential, hashlib.sha256).hexdigest()[:32]
                    roster[roster_entry(name, made_by)] = mark
        return roster

    def by_token(self, token: str) -> Operator | None:
        """The operator whose token this is: a named one (via "token"), or the shared
        token's (via "shared_token", name ""). Every token is compared, in constant
        time each, whichever matches."""
        given = _digest(token)
        found: Operator | None = None
        for digest, operator in self._tokens:
            if hmac.compare_digest(given, digest) and found is None:
                found = operator
        return found

    def trusts(self, client_host: str | None) -> bool:
        """Whether the peer at `client_host` is one admin.trusted_proxies lists."""
        if not client_host:
            return False
        try:
            address = ip_address(client_host)
        except ValueError:
            return False  # a unix socket's peer, or no address
        return any(address in network for network in self._proxies)

    def authenticate(self, headers: Mapping[str, str], client_host: str | None) -> Operator:
        """The operator a request comes from, or a refusal (OperatorApiDisabled,
        Unauthorized). `headers` are looked up by lower-case name; `client_host` is
        the connection's peer (never X-Forwarded-For: the admin listener believes no
        forwarding header)."""
        if not self.enabled:
            raise OperatorApiDisabled("Set admin.operators or admin.token in the config.")
        given = headers.get("authorization")
        if given is not None:
            scheme, _, token = given.partition(" ")
            # A token in the query string is never accepted: it would end up in logs.
            found = self.by_token(token) if scheme.lower() == "bearer" else None
            if found is not None:
                return found
        # A proxy that signs people in may pass their own Authorization on (oauth2-proxy's
        # --pass-authorization-header): a token that is not ours does not stop the header.
        if self.identity_header and self.trusts(client_host):
            names = _values(headers, self.identity_header)
            if len(names) > 1:
                raise Unauthorized(f"The {self._header_name} header is sent more than once.")
            operator = self.by_name(names[0].strip(), "identity_header") if names else None
            if operator is not None:
                return operator
            if names:
                raise Unauthorized(
                    f"The {self._header_name} header names no operator of admin.operators."
                )
        raise Unauthorized("Send Authorization: Bearer <your operator token>.")


def roster_entry(name: str, made_by: str) -> str:
    """The roster's entry for `name` signed in by `made_by` ("token", "identity_header")."""
    return f"{made_by}:{name}"


def _values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of a header: Starlette's and httpx's Headers keep repeats."""
    getlist = getattr(headers, "getlist", None) or getattr(headers, "get_list", None)
    if getlist is not None:
        return list(getlist(name))
    value = headers.get(name)
    return [] if value is None else [value]


def audit_sign_in(
    client: str, peer: str | None, operator: Operator | None, refused: str = "", why: str = ""
) -> None:
    """One log line per console sign-in (info), and per sign-in or API call whose
    credentials were refused (a warning). Nothing throttles a guess, so these lines
    are what shows someone trying tokens: from which address, through which client,
    why. Never a token: `why` is the refusal's own words, which quote none."""
    fields = {
        "action": "sign_in",
        "operator": operator.name if operator is not None else "",
        "via": operator.via if operator is not None else "",
        "client": client,
        "peer": peer or "",
    }
    if refused:
        fields["refused"] = refused
        log.warning(
            "%s: credentials refused from %s: %s",
            client,
            peer or "unknown",
            why,
            extra={"fields": fields},
        )
    else:
        log.info(
            "operator %s signed in to the %s from %s (via %s)",
            fields["operator"],
            client,
            peer or "unknown",
            fields["via"],
            extra={"fields": fields},
        )
