"""What the upstream is told about the caller (X-Forwarded-*, Forwarded, X-Real-IP)
and the Host the gateway accepts.

Unit tests hold `forwarded_headers` to its rule: only an immediate peer in
`server.trusted_proxies` may extend the X-Forwarded-For chain or state the scheme and
host; from any other peer those claims are replaced by what the gateway saw. The
process-level tests send raw requests over real sockets to real gateways (uvicorn +
gateway/http/protocol.py) and read what the echo upstream received, line by line.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.admin.listener import admin_protocol
from gateway.config import ServerConfig
from gateway.headers import TrustedProxies, forwarded_headers, valid_host
from gateway.http.protocol import protocol_for
from gateway.serve import uvicorn_server
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.rawhttp import RawResponse, read_response
from tests.support.servers import Process, free_port, gateway_process

PROBLEMS = "https://idempotency-gateway.dev/problems/"

FORWARDING = {"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded", "x-real-ip"}


def trusting(*networks: str) -> TrustedProxies:
    return TrustedProxies(ipaddress.ip_network(n) for n in networks)


def told(out: list[tuple[str, str]]) -> dict[str, str]:
    """The forwarding headers of `out`; each must be there once at most."""
    lines = [(n, v) for n, v in out if n in FORWARDING]
    assert len({n for n, _ in lines}) == len(lines), lines
    return dict(lines)


CLAIMS = [
    ("host", "gateway.test"),
    ("x-forwarded-for", "6.6.6.6"),
    ("x-forwarded-for", "7.7.7.7, 8.8.8.8"),
    ("x-forwarded-proto", "https"),
    ("x-forwarded-host", "evil.example"),
    ("x-forwarded-port", "443"),
    ("x-forwarded-prefix", "/admin"),
    ("forwarded", "for=6.6.6.6;proto=https;host=evil.example"),
    ("x-real-ip", "6.6.6.6"),
    ("true-client-ip", "6.6.6.6"),
    ("cf-connecting-ip", "6.6.6.6"),
    ("x-custom", "kept"),
]


# --- forwarded_headers, unit ------------------------------------------------------------


def test_untrusted_peer_claims_are_replaced_by_what_the_gateway_saw() -> None:
    for proxies in (TrustedProxies(), trusting("10.0.0.0/8")):
        out = forwarded_headers(CLAIMS, "203.0.113.9", "http", proxies)
        assert told(out) == {
            "x-forwarded-for": "203.0.113.9",
            "x-forwarded-proto": "http",
            "x-forwarded-host": "gateway.test",
            "forwarded": "for=203.0.113.9;proto=http;host=gateway.test",
            "x-real-ip": "203.0.113.9",
        }
        names = [n for n, _ in out]
        for dropped in ("x-forwarded-port", "x-forwarded-prefix", "true-client-ip", "host"):
            assert dropped not in names
        assert ("x-custom", "kept") in out


def test_trusted_peer_extends_the_chain_and_keeps_its_claims() -> None:
    out = forwarded_headers(CLAIMS, "10.1.2.3", "http", trusting("10.0.0.0/8"))
    assert told(out) == {
        # every line of the repeated header, in order, then the peer
        "x-forwarded-for": "6.6.6.6, 7.7.7.7, 8.8.8.8, 10.1.2.3",
        "x-forwarded-proto": "https",
        "x-forwarded-host": "evil.example",
        "forwarded": "for=6.6.6.6;proto=https;host=evil.example, "
        "for=10.1.2.3;proto=http;host=gateway.test",
        "x-real-ip": "6.6.6.6",
    }
    assert ("x-forwarded-port", "443") in out
    assert ("true-client-ip", "6.6.6.6") in out


def test_trusted_peer_one_value_for_proto_and_host_the_nearest_hops() -> None:
    """X-Forwarded-Proto and -Host go upstream as one value: the last one the trusted
    peer sent (the one the nearest hop wrote), or the gateway's own if it is not valid."""
    proxies = trusting("10.0.0.0/8")
    headers = [
        ("host", "gateway.test"),
        ("x-forwarded-proto", "http"),
        ("x-forwarded-proto", "ftp, HTTPS"),
        ("x-forwarded-host", "a.example"),
        ("x-forwarded-host", "b.example, c.example:8443"),
    ]
    seen = told(forwarded_headers(headers, "10.0.0.1", "http", proxies))
    assert seen["x-forwarded-proto"] == "https"
    assert seen["x-forwarded-host"] == "c.example:8443"
    bad = [("host", "gateway.test"), ("x-forwarded-proto", "h t"), ("x-forwarded-host", "a/b")]
    seen = told(forwarded_headers(bad, "10.0.0.1", "https", proxies))
    assert seen["x-forwarded-proto"] == "https"
    assert seen["x-forwarded-host"] == "gateway.test"


def test_trusted_peer_without_claims_gets_the_gateway_view() -> None:
    proxies = trusting("10.0.0.0/8")
    seen = told(forwarded_headers([("host", "h.test")], "10.0.0.1", "http", proxies))
    assert seen == {
        "x-forwarded-for": "10.0.0.1",
        "x-forwarded-proto": "http",
        "x-forwarded-host": "h.test",
        "forwarded": "for=10.0.0.1;proto=http;host=h.test",
        "x-real-ip": "10.0.0.1",
    }


def test_x_real_ip_behind_trusted_proxies_is_the_nearest_untrusted_hop() -> None:
    proxies = trusting("10.0.0.0/8", "192.168.0.0/16")
    headers = [
        ("host", "h"),
        ("x-forwarded-for", "6.6.6.6, 198.51.100.7"),
        ("x-forwarded-for", "10.9.9.9"),
    ]
    seen = told(forwarded_headers(headers, "192.168.1.1", "http", proxies))
    assert seen["x-forwarded-for"] == "6.6.6.6, 198.51.100.7, 10.9.9.9, 192.168.1.1"
    assert seen["x-real-ip"] == "198.51.100.7"  # 6.6.6.6 is only what that caller said
    every_hop_trusted = [("host", "h"), ("x-forwarded-for", "10.0.0.5")]
    assert (
        told(forwarded_headers(every_hop_trusted, "10.0.0.1", "http", proxies))["x-real-ip"]
        == "10.0.0.5"
    )


def test_forwarded_quotes_ipv6_and_hosts_with_ports() -> None:
    seen = told(forwarded_headers([("host", "gw.test:8080")], "::1", "http"))
    assert seen["forwarded"] == 'for="[::1]";proto=http;host="gw.test:8080"'
    assert seen["x-forwarded-for"] == "::1"  # X-Forwarded-For carries bare addresses
    assert seen["x-real-ip"] == "::1"
    seen = told(forwarded_headers([("host", "[2001:db8::1]:80")], "2001:db8::2", "https"))
    assert seen["forwarded"] == 'for="[2001:db8::2]";proto=https;host="[2001:db8::1]:80"'


def test_ipv6_trusted_peer_and_ipv4_mapped_addresses() -> None:
    proxies = trusting("::1/128", "127.0.0.0/8")
    headers = [("host", "h"), ("x-forwarded-for", "2001:db8::9")]
    seen = told(forwarded_headers(headers, "::1", "http", proxies))
    assert seen["x-forwarded-for"] == "2001:db8::9, ::1"
    assert seen["forwarded"] == 'for="[::1]";proto=http;host=h'
    assert seen["x-real-ip"] == "2001:db8::9"
    # A dual-stack listener reports an IPv4 caller as ::ffff:a.b.c.d.
    assert "::ffff:127.0.0.1" in proxies
    assert "::ffff:10.0.0.1" not in proxies


def test_no_peer_address() -> None:
    """An ASGI server that reports no client (a unix socket): nothing is made up."""
    headers = [("host", "h"), ("x-forwarded-for", "6.6.6.6"), ("x-real-ip", "6.6.6.6")]
    seen = told(forwarded_headers(headers, None, "http", trusting("0.0.0.0/0")))
    assert seen == {
        "x-forwarded-proto": "http",
        "x-forwarded-host": "h",
        "forwarded": "for=unknown;proto=http;host=h",
    }


def test_hop_by_hop_rules_still_hold() -> None:
    headers = [
        ("host", "h"),
        ("connection", "keep-alive, X-Hop, X-Forwarded-For"),
        ("x-hop", "secret"),
        ("x-forwarded-for", "10.0.0.7"),
        ("transfer-encoding", "chunked"),
        ("x-forwarded-for", ""),
    ]
    out = forwarded_headers(headers, "10.0.0.1", "http", trusting("10.0.0.0/8"))
    names = [n for n, _ in out]
    assert "x-hop" not in names and "transfer-encoding" not in names and "connection" not in names
    # the trusted proxy named it hop-by-hop: its value is not passed on; an empty line adds nothing
    assert told(out)["x-forwarded-for"] == "10.0.0.1"


def test_trusted_proxies_membership_is_parsed_once_per_peer() -> None:
    proxies = trusting("10.0.0.0/8")
    assert "10.0.0.1" in proxies
    assert "10.0.0.1" in proxies
    assert "11.0.0.1" not in proxies
    assert "unknown" not in proxies and "10.0.0.1:80" not in proxies and None not in proxies
    assert proxies._known == {
        "10.0.0.1": True,
        "11.0.0.1": False,
        "unknown": False,
        "10.0.0.1:80": False,
    }
    nobody = TrustedProxies()
    assert "127.0.0.1" not in nobody and nobody._known == {}  # nothing trusted: no work at all
    for i in range(5000):  # memory stays bounded whatever the callers' addresses
        _ = f"10.{i // 256 % 256}.{i % 256}.9" in proxies
    assert len(proxies._known) <= 4096


@pytest.mark.parametrize(
    "value",
    [
        "gateway.test",
        "gateway.test:8080",
        "127.0.0.1:1",
        "[::1]",
        "[::1]:80",
        "",
        "ex%41mple",
        "a-b.c_d~",
    ],
)
def test_valid_hosts(value: str) -> None:
    assert valid_host(value)


@pytest.mark.parametrize(
    "value",
    [
        "a b",
        "evil.example/x",
        "user@host",
        "a,b",
        "[::1",
        "::1",
        "host:80:81",
        "h:port",
        "ex%zzmple",
        "h\\x",
        '"h"',
    ],
)
def test_invalid_hosts(value: str) -> None:
    assert not valid_host(value)


def test_neither_listener_takes_proxy_headers_from_uvicorn() -> None:
    """uvicorn's proxy-headers middleware would let any loopback caller set the client
    address and scheme (FORWARDED_ALLOW_IPS defaults to 127.0.0.1): both listeners
    are built by uvicorn_server, and it turns that off."""
    for protocol in (protocol_for(ServerConfig), admin_protocol(ServerConfig)):
        server = uvicorn_server(object(), "127.0.0.1:1", protocol)
        assert server.config.proxy_headers is False


# --- over real sockets ------------------------------------------------------------------


@dataclass
class Gateway:
    process: Process
    host: str
    port: int
    upstream: Process

    def send(self, data: bytes, source: str | None = None) -> RawResponse:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            if source is not None:
                sock.bind((source, 0))
            sock.connect((self.host, self.port))
            sock.sendall(data)
            return read_response(sock, 10)

    def count(self, key: str) -> int:
        response = httpx.get(f"{self.upstream.url}/_count", params={"key": key}, timeout=10)
        return int(response.json()["count"])


def _gateway(
    upstream: Process, where: Path, host: str = "127.0.0.1", **server: Any
) -> Iterator[Gateway]:
    port, admin_port = free_port(), free_port()
    shown = f"[{host}]" if ":" in host else host
    config = {
        "server": {"listen": f"{shown}:{port}", "shutdown_grace": "2s", **server},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "keyed",
                "match": {"path": "/jobs/{name}"},
                "key": {"header": "Idempotency-Key"},
                "upstream": upstream.url,
            },
            {"name": "open", "match": {"path": "/open/{rest:path}"}, "upstream": upstream.url},
        ],
    }
    path = where / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port).start(wait=False)
    try:
        _wait_listening(process, host, port)
        yield Gateway(process, host, port, upstream)
    finally:
        assert process.stop() == 0, process.output()[-3000:]


def _wait_listening(process: Process, host: str, port: int) -> None:
    deadline = time.monotonic() + 20
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        assert process.proc is not None and process.proc.poll() is None, process.output()
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.2)
                sock.connect((host, port))
                return
        except OSError:
            assert time.monotonic() < deadline, process.output()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def plain_gateway(upstream: Process, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The default config: no proxy is trusted, loopback included."""
    yield from _gateway(upstream, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def trusting_gateway(
    upstream: Process, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    yield from _gateway(
        upstream, tmp_path_factory.mktemp("trusting"), trusted_proxies=["127.0.0.1"]
    )


def raw_request(
    target: str, lines: list[str], *, version: str = "HTTP/1.1", key: str | None = None
) -> bytes:
    """A POST with exactly these header lines (no Host unless given), keyed if asked."""
    all_lines = [f"POST {target} {version}", *lines]
    if key is not None:
        all_lines.append(f"Idempotency-Key: {key}")
    all_lines.append("Content-Length: 2")
    return ("\r\n".join(all_lines) + "\r\n\r\n").encode("latin-1") + b"{}"


SPOOFED = [
    "X-Forwarded-For: 6.6.6.6",
    "X-Forwarded-For: 7.7.7.7",
    "X-Forwarded-Proto: https",
    "X-Forwarded-Host: evil.example",
    "X-Forwarded-Port: 443",
    "Forwarded: for=6.6.6.6;proto=https",
    "X-Real-IP: 6.6.6.6",
    "True-Client-IP: 6.6.6.6",
]


def upstream_saw(answer: RawResponse) -> dict[str, list[str]]:
    """Every header line the upstream received, by name."""
    assert answer.status == 200, answer.raw[:500]
    lines: dict[str, list[str]] = {}
    for name, value in json.loads(answer.body)["header_lines"]:
        lines.setdefault(name, []).append(value)
    return lines


def test_a_loopback_caller_cannot_say_who_it_is(plain_gateway: Gateway, ledger: Ledger) -> None:
    """With no trusted proxies, a caller on 127.0.0.1 sends every forwarding header it
    likes: the upstream sees the socket's peer, the listener's scheme, the Host line, one
    line each, and none of the caller's claims."""
    key = unique()
    host = f"gateway.test:{plain_gateway.port}"
    answer = plain_gateway.send(raw_request("/jobs/x", [f"Host: {host}", *SPOOFED], key=key))
    seen = upstream_saw(answer)
    ledger.record("hostile input", "spoofed forwarding headers", requests=1, bad_inputs=1)
    assert seen["x-forwarded-for"] == ["127.0.0.1"]
    assert seen["x-forwarded-proto"] == ["http"]
    assert seen["x-forwarded-host"] == [host]
    assert seen["forwarded"] == [f'for=127.0.0.1;proto=http;host="{host}"']
    assert seen["x-real-ip"] == ["127.0.0.1"]
    assert "x-forwarded-port" not in seen and "true-client-ip" not in seen
    assert plain_gateway.count(key) == 1


def test_a_trusted_proxy_extends_the_chain(trusting_gateway: Gateway) -> None:
    """127.0.0.1 is a trusted proxy here: its X-Forwarded-For lines are joined and
    extended with its address, its scheme and host are kept, Forwarded gets the
    gateway's element after the proxy's."""
    lines = [
        "Host: gateway.test",
        "X-Forwarded-For: 203.0.113.5",
        "X-Forwarded-For: 198.51.100.7, 10.0.0.2",
        "X-Forwarded-Proto: https",
        "X-Forwarded-Host: shop.example",
        "Forwarded: for=203.0.113.5;proto=https",
        "X-Forwarded-Port: 443",
    ]
    seen = upstream_saw(trusting_gateway.send(raw_request("/open/a", lines)))
    assert seen["x-forwarded-for"] == ["203.0.113.5, 198.51.100.7, 10.0.0.2, 127.0.0.1"]
    assert seen["x-forwarded-proto"] == ["https"]
    assert seen["x-forwarded-host"] == ["shop.example"]
    assert seen["forwarded"] == [
        "for=203.0.113.5;proto=https, for=127.0.0.1;proto=http;host=gateway.test"
    ]
    assert seen["x-real-ip"] == ["10.0.0.2"]  # the nearest hop that is not trusted
    assert seen["x-forwarded-port"] == ["443"]


def test_trust_is_per_peer_address(trusting_gateway: Gateway) -> None:
    """The same gateway, reached from 127.0.0.2 (not in trusted_proxies): replaced."""
    lines = ["Host: gateway.test", *SPOOFED]
    seen = upstream_saw(trusting_gateway.send(raw_request("/open/a", lines), source="127.0.0.2"))
    assert seen["x-forwarded-for"] == ["127.0.0.2"]
    assert seen["x-forwarded-proto"] == ["http"]
    assert seen["x-forwarded-host"] == ["gateway.test"]
    assert seen["forwarded"] == ["for=127.0.0.2;proto=http;host=gateway.test"]
    assert seen["x-real-ip"] == ["127.0.0.2"]


@pytest.fixture(scope="module")
def ipv6_gateway(upstream: Process, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    yield from _gateway(upstream, tmp_path_factory.mktemp("ipv6"), host="::1")


def test_an_ipv6_peer_in_forwarded_is_quoted(ipv6_gateway: Gateway) -> None:
    seen = upstream_saw(
        ipv6_gateway.send(raw_request("/open/a", ["Host: [::1]", "X-Forwarded-For: 6.6.6.6"]))
    )
    assert seen["x-forwarded-for"] == ["::1"]
    assert seen["forwarded"] == ['for="[::1]";proto=http;host="[::1]"']
    assert seen["x-forwarded-host"] == ["[::1]"]


# --- Host -------------------------------------------------------------------------------

BAD_HOSTS = {
    "two Host lines": ["Host: gateway.test", "Host: evil.example"],
    "two identical Host lines": ["Host: gateway.test", "Host: gateway.test"],
    "no Host": [],
    "a path in Host": ["Host: evil.example/x"],
    "userinfo in Host": ["Host: user@gateway.test"],
    "a list in Host": ["Host: gateway.test, evil.example"],
    "a space in Host": ["Host: gateway test"],
    "a bad port": ["Host: gateway.test:80:81"],
    "an open IPv6 literal": ["Host: [::1"],
}


@pytest.mark.parametrize("case", list(BAD_HOSTS))
def test_missing_repeated_or_invalid_host_is_refused(
    plain_gateway: Gateway, ledger: Ledger, case: str
) -> None:
    """RFC 9112 3.2: 400, before a key is claimed or anything is forwarded, on a keyed
    route, a passthrough one and one that does not exist."""
    for target in ("/jobs/x", "/open/x", "/nowhere"):
        key = unique()
        answer = plain_gateway.send(raw_request(target, BAD_HOSTS[case], key=key))
        assert answer.status == 400, (target, answer.raw[:400])
        assert answer.problem()["type"] == PROBLEMS + "bad-host"
        assert plain_gateway.count(key) == 0
        if target == "/jobs/x":  # nothing was claimed: the key runs once it is sent right
            again = plain_gateway.send(raw_request(target, ["Host: gateway.test"], key=key))
            assert again.status == 200 and "idempotent-replayed" not in again.headers
            assert plain_gateway.count(key) == 1
    ledger.record("hostile input", f"Host: {case}", requests=4, bad_inputs=3)


def test_http_1_0_without_host_is_forwarded_without_forwarded_host(plain_gateway: Gateway) -> None:
    """HTTP/1.0 predates Host: such a request is accepted, and the upstream is told no
    host (there is none to tell)."""
    key = unique()
    answer = plain_gateway.send(raw_request("/jobs/x", [], version="HTTP/1.0", key=key))
    seen = upstream_saw(answer)
    assert "x-forwarded-host" not in seen
    assert seen["forwarded"] == ["for=127.0.0.1;proto=http"]
    assert plain_gateway.count(key) == 1
    two = plain_gateway.send(
        raw_request("/jobs/x", ["Host: a", "Host: b"], version="HTTP/1.0", key=unique())
    )
    assert two.status == 400 and two.problem()["type"] == PROBLEMS + "bad-host"


def test_a_second_host_line_in_a_later_packet_is_refused_too(plain_gateway: Gateway) -> None:
    """The check runs on the whole head, however it was cut into packets."""
    key = unique()
    data = raw_request("/jobs/x", ["Host: gateway.test", "Host: evil.example"], key=key)
    cut = data.index(b"Host: evil")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(("127.0.0.1", plain_gateway.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in (data[: cut + 3], data[cut + 3 : cut + 9], data[cut + 9 :]):
            sock.sendall(piece)
            time.sleep(0.05)
        answer = read_response(sock, 10)
    assert answer.status == 400 and answer.problem()["type"] == PROBLEMS + "bad-host"
    assert plain_gateway.count(key) == 0
