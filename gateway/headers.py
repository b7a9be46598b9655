"""Headers across the hop, each way: what the upstream is told about the caller, and
which of the upstream's header fields reach the caller.

Towards the upstream (`forwarded_headers`): hop-by-hop headers (HOP_BY_HOP, and any the
Connection header names) are removed, and what the gateway knows of the caller is put
in place of what the caller said about itself (X-Forwarded-*, Forwarded, X-Real-IP),
unless the caller is one of `server.trusted_proxies` (`TrustedProxies`). `valid_host` is
the Host grammar, for X-Forwarded-Host here and for the caller's Host in the app.

`http_date` reads an HTTP-date (RFC 9110 5.6.7), as a Retry-After or a delivery's
not-before header writes it.

Towards the caller (`response_headers`): the upstream's hop-by-hop fields, and any its
Connection header names, are dropped before an answer is stored or written.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from datetime import UTC, datetime

from gateway.config.http import HOP_BY_HOP, IPNetwork
from gateway.config.types import HTTP_TOKEN

#: Headers that tell the upstream who the caller is. From a caller that is not a trusted
#: proxy they are the caller's own say-so: dropped, and the gateway's view put in place
#: of X-Forwarded-For/-Proto/-Host, Forwarded and X-Real-IP. Every `x-forwarded-*`
#: counts too (-Port, -Prefix, -Ssl move the URLs frameworks build).
CLIENT_CLAIMS = frozenset(
    {
        "forwarded",
        "x-real-ip",
        "true-client-ip",
        "x-client-ip",
        "cf-connecting-ip",
        "fastly-client-ip",
        "x-cluster-client-ip",
    }
)

#: RFC 9110 7.2: uri-host [":" port] (RFC 3986 3.2.2), an IP literal or a reg-name of
#: unreserved, pct-encoded and sub-delims characters; but not the comma, which no
#: registered name has and which would make X-Forwarded-Host read as a list.
_HOST = re.compile(
    r"(?:\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[A-Za-z0-9._~!$&'()*+;=:-]+)\]"
    r"|(?:[A-Za-z0-9._~!$&'()*+;=-]|%[0-9A-Fa-f]{2})*)"
    r"(?::[0-9]*)?"
)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: Peers whose trust is remembered; past it the memory starts over (a caller with many
#: addresses costs an address parse per request, never memory).
_TRUST_MEMORY = 4096


def valid_host(value: str) -> bool:
    """Whether `value` is a valid Host field value (empty is: RFC 9112 3.2). Asked on
    every request, of a handful of distinct values: each is matched once."""
    known = _VALID_HOSTS.get(value)
    if known is None:
        known = _HOST.fullmatch(value) is not None
        if len(_VALID_HOSTS) >= _TRUST_MEMORY:
            _VALID_HOSTS.clear()
        _VALID_HOSTS[value] = known
    return known


_VALID_HOSTS: dict[str, bool] = {}


class TrustedProxies:
    """`server.trusted_proxies`: whether a peer address is one whose forwarding headers
    are believed. Asked on every forward, so each address string is parsed once."""

    __slots__ = ("_known", "networks")

    def __init__(self, networks: Iterable[IPNetwork] = ()) -> None:
        self.networks = tuple(networks)
        self._known: dict[str, bool] = {}

    def __contains__(self, address: object) -> bool:
        if not self.networks or not isinstance(address, str):
            return False
        known = self._known.get(address)
        if known is None:
            known = self._check(address)
            if len(self._known) >= _TRUST_MEMORY:
                self._known.clear()
            self._known[address] = known
        return known

    def _check(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.strip())
        except ValueError:
            return False  # "unknown", a port, junk: not an address of ours
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # a dual-stack listener reports IPv4 callers this way
        return any(ip in network for network in self.networks)

    def client_of(self, chain: str) -> str:
        """The caller's address from an X-Forwarded-For chain that ends at a trusted
        peer: the nearest hop that is not itself a trusted proxy (or the farthest)."""
        hops = [hop.strip() for hop in chain.split(",")]
        for hop in reversed(hops):
            if hop and hop not in self:
                return hop
        return next((hop for hop in hops if hop), "")


#: No proxy is trusted: the default, and what in-process callers get.
NO_PROXIES = TrustedProxies()


def forwarded_headers(
    headers: list[tuple[str, str]],
    client: str | None,
    scheme: str,
    proxies: TrustedProxies = NO_PROXIES,
) -> list[tuple[str, str]]:
    """The caller's headers as the upstream should see them: hop-by-hop ones (and any
    the Connection header names) removed, and what the gateway knows of the caller.

    `client` is the immediate peer's address. Unless it is in `proxies`, whatever the
    caller said about itself (CLIENT_CLAIMS, X-Forwarded-*) is dropped and replaced by
    what the gateway saw: X-Forwarded-For the peer, -Proto the scheme, -Host the Host,
    X-Real-IP the peer, and one Forwarded element. From a trusted proxy the
    X-Forwarded-For chain (every line, in order) is extended with the peer, and
    Forwarded with the gateway's element; X-Forwarded-Proto/-Host keep the proxy's
    last value (if valid), X-Real-IP the proxy's (else the chain's nearest untrusted
    hop); other claims pass as sent. Each goes upstream as exactly one line.
    """
    trusted = client in proxies
    named = {
        token.strip().lower()
        for name, value in headers
        if name == "connection"
        for token in value.split(",")
    }
    out: list[tuple[str, str]] = []
    host = ""
    chain: list[str] = []
    forwarded: list[str] = []
    proto = forwarded_host = real_ip = ""
    for name, value in headers:
        if name in HOP_BY_HOP or name in named:
            if name == "host":
                host = value
        elif name in CLIENT_CLAIMS or name.startswith("x-forwarded-"):
            if not trusted:
                continue
            if name == "x-forwarded-for":
                if value.strip():
                    chain.append(value.strip())
            elif name == "x-forwarded-proto":
                proto = value
            elif name == "x-forwarded-host":
                forwarded_host = value
            elif name == "forwarded":
                if value.strip():
                    forwarded.append(value.strip())
            elif name == "x-real-ip":
                real_ip = value.strip()
            else:
                out.append((name, value))
        else:
            out.append((name, value))
    if not trusted:
        # What the gateway saw replaces every claim: the same few lines for each
        # (peer, scheme, Host), built once.
        key = (client, scheme, host)
        tail = _UNTRUSTED_TAILS.get(key)
        if tail is None:
            tail = _untrusted_tail(client, scheme, host)
            if len(_UNTRUSTED_TAILS) >= _TRUST_MEMORY:
                _UNTRUSTED_TAILS.clear()
            _UNTRUSTED_TAILS[key] = tail
        out += tail
        return out
    assert client is not None
    chain.append(client)
    proto = _last(proto)
    if _SCHEME.fullmatch(proto) is None:
        proto = scheme
    forwarded_host = _last(forwarded_host)
    if not forwarded_host or not valid_host(forwarded_host):
        forwarded_host = host
    real_ip = real_ip or proxies.client_of(", ".join(chain))
    return out + _tail(chain, proto, forwarded_host, forwarded, real_ip, client, scheme, host)


_UNTRUSTED_TAILS: dict[tuple[str | None, str, str], list[tuple[str, str]]] = {}


def _untrusted_tail(client: str | None, scheme: str, host: str) -> list[tuple[str, str]]:
    chain = [client] if client else []
    return _tail(chain, scheme, host, [], client or "", client, scheme, host)


def _tail(
    chain: list[str],
    proto: str,
    forwarded_host: str,
    forwarded: list[str],
    real_ip: str,
    client: str | None,
    scheme: str,
    host: str,
) -> list[tuple[str, str]]:
    """The lines that say who the caller is, the gateway's own Forwarded element last."""
    out: list[tuple[str, str]] = []
    element = f"for={_node(client)};proto={_forwarded_value(scheme)}"
    if host:
        element += f";host={_forwarded_value(host)}"
    forwarded = [*forwarded, element]
    if chain:
        out.append(("x-forwarded-for", ", ".join(chain)))
    out.append(("x-forwarded-proto", proto.lower()))
    if forwarded_host:
        out.append(("x-forwarded-host", forwarded_host))
    out.append(("forwarded", ", ".join(forwarded)))
    if real_ip:
        out.append(("x-real-ip", real_ip))
    return out


def _last(value: str) -> str:
    """The last element of a comma-separated value: the one the nearest hop wrote."""
    return value.rpartition(",")[2].strip()


def _node(client: str | None) -> str:
    """A Forwarded `for=` node (RFC 7239 6): an IPv6 address in brackets, quoted."""
    if not client:
        return "unknown"
    if ":" in client:
        return _forwarded_value(f"[{client}]")
    return _forwarded_value(client)


def _forwarded_value(text: str) -> str:
    """A token as is, anything else as a quoted-string (RFC 7239 4)."""
    if HTTP_TOKEN.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: Connection values that name no header: the usual ones, skipped without a split.
_PLAIN_CONNECTION = frozenset({"keep-alive", "close", "upgrade"})


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    """The upstream's header fields as the caller (and the store) should see them:
    hop-by-hop ones removed, and any the response's Connection header names (they were
    meant for this hop only: an upstream's `Connection: x-internal-token` says that
    header is not for the caller)."""
    # llhttp strips a value's leading whitespace, not its trailing (RFC 9110 5.5: neither
    # is part of the value). One pass; a second only when a Connection header names more.
    out: list[tuple[str, str]] = []
    named: set[str] | None = None
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        if name not in HOP_BY_HOP:
            out.append((name, raw_value.decode("latin-1").rstrip(" \t")))
        elif name == "connection":
            value = raw_value.decode("latin-1").lower()
            if value not in _PLAIN_CONNECTION:
                named = named or set()
                named.update(token.strip() for token in value.split(","))
    if named:
        return tuple((name, value) for name, value in out if name not in named)
    return tuple(out)


_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = "(?P<month>" + "|".join(_MONTHS) + ")"
_TIME = r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"
#: RFC 9110 5.6.7's three formats, exactly: IMF-fixdate, rfc850-date, asctime-date.
#: Case-sensitive, ASCII digits only, GMT.
_HTTP_DATES = (
    re.compile(rf"{_DAY}, (?P<day>[0-9]{{2}}) {_MONTH} (?P<year>[0-9]{{4}}) {_TIME} GMT"),
    re.compile(
        r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), "
        rf"(?P<day>[0-9]{{2}})-{_MONTH}-(?P<yy>[0-9]{{2}}) {_TIME} GMT"
    ),
    re.compile(rf"{_DAY} {_MONTH} (?P<day>[0-9]{{2}}| [0-9]) {_TIME} (?P<year>[0-9]{{4}})"),
)


def http_date(text: str, now: float) -> float | None:
    """An HTTP-date (RFC 9110 5.6.7) as a POSIX time, or None. `now` places an
    rfc850-date's two-digit year: one more than 50 years ahead is in the past."""
    for pattern in _HTTP_DATES:
        found = pattern.fullmatch(text)
        if found is not None:
            break
    else:
        return None
    parts = found.groupdict()
    if parts.get("yy") is not None:
        this_year = datetime.fromtimestamp(now, UTC).year
        year = this_year - this_year % 100 + int(parts["yy"])
        if year > this_year + 50:
            year -= 100
    else:
        year = int(parts["year"])
    # 60 is a leap second, which comes after :59: read as the next minute's :00, the
    # POSIX time it ends at, so a time asked as "not before" is never a second early.
    second = int(parts["second"])
    leap = 1 if second == 60 else 0  # 61 and more: no time (the ValueError below)
    try:
        when = datetime(
            year,
            _MONTHS.index(parts["month"]) + 1,
            int(parts["day"]),
            int(parts["hour"]),
            int(parts["minute"]),
            second - leap,
            tzinfo=UTC,
        )
    except ValueError:  # 31 Feb, hour 24, year 0
        return None
    return when.timestamp() + leap
