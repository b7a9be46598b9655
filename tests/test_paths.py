"""Paths: what a route matches is what the upstream gets.

Dot-segments (`.`, `..`, either dot as %2E) are removed from the raw path (RFC 3986
5.2.4) before matching, and that normalised path is matched, keyed, fingerprinted and
forwarded. On keyed routes %2F, %5C and a backslash are refused: servers disagree on
whether they separate segments. The process-level tests send raw requests to a real
gateway and read the path the echo upstream received.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import yaml

from gateway.routes import Router, remove_dot_segments
from tests.conftest import config_for, unique
from tests.support.ledger import Ledger
from tests.support.rawhttp import RawResponse, exchange
from tests.support.rawhttp import request as http_request
from tests.support.servers import Process, free_port, gateway_process

PROBLEMS = "https://idempotency-gateway.dev/problems/"

# --- remove_dot_segments, unit ----------------------------------------------------------

#: RFC 3986 5.4.1 and 5.4.2 against the base http://a/b/c/d;p?q, the examples whose
#: result comes from a merged path (5.2.3: the base path up to its last "/", then the
#: reference) or an absolute one: reference -> the target's path.
RFC_3986_5_4 = {
    "g": "/b/c/g",
    "./g": "/b/c/g",
    "g/": "/b/c/g/",
    "/g": "/g",
    ";x": "/b/c/;x",
    "g;x": "/b/c/g;x",
    ".": "/b/c/",
    "./": "/b/c/",
    "..": "/b/",
    "../": "/b/",
    "../g": "/b/g",
    "../..": "/",
    "../../": "/",
    "../../g": "/g",
    # 5.4.2, abnormal examples
    "../../../g": "/g",
    "../../../../g": "/g",
    "/./g": "/g",
    "/../g": "/g",
    "g.": "/b/c/g.",
    ".g": "/b/c/.g",
    "g..": "/b/c/g..",
    "..g": "/b/c/..g",
    "./../g": "/b/g",
    "./g/.": "/b/c/g/",
    "g/./h": "/b/c/g/h",
    "g/../h": "/b/c/h",
    "g;x=1/./y": "/b/c/g;x=1/y",
    "g;x=1/../y": "/b/c/y",
}


@pytest.mark.parametrize("reference", list(RFC_3986_5_4))
def test_rfc_3986_examples(reference: str) -> None:
    merged = reference if reference.startswith("/") else "/b/c/" + reference
    assert remove_dot_segments(merged) == RFC_3986_5_4[reference]


def test_rfc_3986_5_2_4_example_and_edges() -> None:
    assert remove_dot_segments("/a/b/c/./../../g") == "/a/g"
    assert remove_dot_segments("/") == "/"
    assert remove_dot_segments("/..") == "/"
    assert remove_dot_segments("/.") == "/"
    assert remove_dot_segments("/a//../b") == "/a/b"  # an empty segment is a segment
    assert remove_dot_segments("/jobs/x/../../admin") == "/admin"
    assert remove_dot_segments("*") == "*"  # not a path: left alone


def test_percent_encoded_dots_are_dots() -> None:
    for encoded in ("%2e", "%2E", ".%2e", "%2E.", "%2e%2E"):
        dots = len(encoded.lower().replace("%2e", "."))
        assert remove_dot_segments(f"/a/b/{encoded}/c") == ("/a/b/c" if dots == 1 else "/a/c")
    assert remove_dot_segments("/a/%2e%2e%2e/b") == "/a/%2e%2e%2e/b"  # three dots: a name
    assert remove_dot_segments("/a/x%2E/b") == "/a/x%2E/b"
    # Other segments stay byte for byte, escapes and case included.
    assert remove_dot_segments("/A%41/./%2f/../b%3F") == "/A%41/b%3F"


def test_untouched_paths_are_the_same_object() -> None:
    """The fast path: nothing to remove, no new string."""
    for path in ("/jobs/send-reminder", "/a.b/c.d", "/x%20y", "/v1.2/x", "/a/b..", "/a/x%2e"):
        assert remove_dot_segments(path) is path


def test_router_matches_the_normalised_path() -> None:
    config = config_for(
        "http://127.0.0.1:1",
        [
            {"name": "jobs", "match": {"path": "/jobs/{name}"}, "key": {"header": "K"}},
            {"name": "admin", "match": {"path": "/admin"}},
        ],
    )
    router = Router(config.routes)
    for sent in ("/jobs/x/../../admin", "/jobs/%2e%2e/admin", "/../admin", "/./admin"):
        match = router.match("POST", remove_dot_segments(sent))
        assert match is not None and match.route.name == "admin", sent


# --- over real sockets ------------------------------------------------------------------


class PathGateway:
    def __init__(self, process: Process, port: int, upstream: Process) -> None:
        self.process, self.port, self.upstream = process, port, upstream

    def post(self, target: str, key: str | None = None) -> RawResponse:
        headers = [("Idempotency-Key", key)] if key is not None else []
        return exchange(self.port, http_request("POST", target, headers, b"{}"))

    def count(self, key: str) -> int:
        response = httpx.get(f"{self.upstream.url}/_count", params={"key": key}, timeout=10)
        return int(response.json()["count"])


@pytest.fixture(scope="module")
def path_gateway(
    upstream: Process, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PathGateway]:
    """Each route forwards the key under a header of its own, so the upstream can tell
    which route sent a request."""
    port, admin_port = free_port(), free_port()

    def keyed(name: str, path: str) -> dict[str, object]:
        return {
            "name": name,
            "match": {"path": path},
            "key": {"header": "Idempotency-Key"},
            "forward_key_header": f"X-Via-{name}",
            "upstream": upstream.url,
        }

    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "2s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [
            keyed("jobs", "/jobs/{name}"),
            keyed("files", "/files/{rest:path}"),
            keyed("other", "/other"),
            {"name": "open", "match": {"path": "/open/{rest:path}"}, "upstream": upstream.url},
        ],
    }
    path = tmp_path_factory.mktemp("paths") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port).start()
    try:
        yield PathGateway(process, port, upstream)
    finally:
        assert process.stop() == 0, process.output()[-3000:]


def seen_by_upstream(answer: RawResponse) -> tuple[str, str]:
    """(the path the upstream got, the route that sent it)"""
    assert answer.status == 200, answer.raw[:500]
    doc = json.loads(answer.body)
    via = [name[len("x-via-") :] for name in doc["headers"] if name.startswith("x-via-")]
    return doc["raw_path"], ",".join(via) or "passthrough"


CLIMBS = {
    "/files/a/../../other": ("/other", "other"),
    "/files/a/%2e%2e/%2E%2E/other": ("/other", "other"),
    "/jobs/x/../../other": ("/other", "other"),
    "/jobs/a/../b": ("/jobs/b", "jobs"),
    "/../other": ("/other", "other"),
    "/files/../../../other": ("/other", "other"),
    "/open/a/./../b/%2e/": ("/open/b/", "passthrough"),
}


@pytest.mark.parametrize("target", list(CLIMBS))
def test_a_path_is_forwarded_as_it_was_matched(
    path_gateway: PathGateway, ledger: Ledger, target: str
) -> None:
    """Never matched as one route and forwarded to another path: the route that answers
    is the one for the path the upstream gets."""
    answer = path_gateway.post(target, key=unique())
    ledger.record("hostile input", "dot-segment paths", requests=1, bad_inputs=1)
    assert seen_by_upstream(answer) == CLIMBS[target]


@pytest.mark.parametrize("target", ["/jobs/./b/.", "/other/.", "/files/.."])
def test_a_path_that_normalises_to_no_route_is_404(path_gateway: PathGateway, target: str) -> None:
    """/jobs/b/, /other/ and / are no route: the route of the path as sent is not used."""
    key = unique()
    answer = path_gateway.post(target, key)
    assert answer.status == 404, answer.raw[:300]
    assert path_gateway.count(key) == 0


def test_dot_segment_spellings_share_one_key(path_gateway: PathGateway) -> None:
    """/jobs/b, /jobs/./b and /jobs/a/../b are one request: one run, then replays."""
    key = unique()
    answers = [path_gateway.post(t, key) for t in ("/jobs/a/../b", "/jobs/b", "/jobs/./b")]
    assert [a.status for a in answers] == [200, 200, 200], answers[-1].raw[:300]
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    assert path_gateway.count(key) == 1


@pytest.mark.parametrize(
    "target",
    [
        "/files/a%2Fb",
        "/files/a%2f..%2f..%2fother",
        "/files/a%5Cb",
        "/jobs/a%5c..",
        "/files/a\\b",
        # `..;x` is `..` to servers that drop path parameters first (Tomcat, Jetty)
        "/files/a/..;/other",
        "/files/a/..;jsessionid=1/other",
        "/files/a/%2E%2e;x/other",
        "/files/a/.;/other",
        "/files/a/..%3B/other",
        "/files/a/;x/other",
        "/jobs/..;",
    ],
)
def test_encoded_slash_or_backslash_on_a_keyed_route_is_refused(
    path_gateway: PathGateway, ledger: Ledger, target: str
) -> None:
    key = unique()
    answer = path_gateway.post(target, key)
    ledger.record("hostile input", "encoded separators on keyed routes", requests=1, bad_inputs=1)
    assert answer.status == 400, answer.raw[:300]
    assert answer.problem()["type"] == PROBLEMS + "ambiguous-path"
    assert answer.problem()["route"] in ("files", "jobs")
    assert path_gateway.count(key) == 0


def test_passthrough_routes_forward_encoded_separators_as_sent(path_gateway: PathGateway) -> None:
    for target, path in {
        "/open/a%2Fb": "/open/a%2Fb",
        "/open/x/../a%5Cb": "/open/a%5Cb",
        "/open/a%2F..%2Fb": "/open/a%2F..%2Fb",  # one segment: %2F is not a separator here
    }.items():
        assert seen_by_upstream(path_gateway.post(target)) == (path, "passthrough")
