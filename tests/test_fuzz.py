"""A fuzz run over raw HTTP bytes through a real gateway process.

Hypothesis builds requests from hostile parts (methods, targets with stray escapes,
framing headers with conflicting values, non-UTF-8 bytes, JSON and not-JSON bodies,
bare LF line ends) and mutates well-formed ones byte by byte. Each goes to a real
`python -m gateway run` on its own connection. The promise under fuzz: never a 500,
never a traceback in the log, and the process still serves a normal request after.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.rawhttp import RawResponse, connect, read_response, request
from tests.support.servers import Process, free_port, gateway_process

pytestmark = pytest.mark.process

ROUTE = {"max_request_body": "4KB", "upstream_timeout": "10s"}


@dataclass
class FuzzTarget:
    process: Process
    port: int
    upstream: Process
    tried: int = 0
    answered: dict[str, int] = field(default_factory=dict)  # status and problem -> count

    def send(self, data: bytes) -> RawResponse:
        """Send one input; read its answer if one comes soon (an incomplete request
        gets none until it is finished, which it never is)."""
        self.tried += 1
        with connect(self.port) as sock:
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                answer = read_response(sock, 0.3)
            except OSError:
                answer = RawResponse(None)
        if data.lstrip(b"\r\n").startswith(b"HEAD "):
            # The answer to a HEAD has no body: what the reader took for one is the
            # start of the next answer (a pipelined request's refusal, say).
            answer.body = b""
            answer.headers.pop("content-type", None)
        if answer.status is not None:
            kind = str(answer.status)
            if answer.headers.get("content-type") == "application/problem+json":
                kind += " " + json.loads(answer.body)["type"].rsplit("/", 1)[-1]
            self.answered[kind] = self.answered.get(kind, 0) + 1
        return answer

    def alive(self) -> None:
        assert self.process.proc is not None and self.process.proc.poll() is None
        key = unique("after-fuzz")
        data = request("POST", "/h", [("Idempotency-Key", key)], b"{}")
        answers = []
        for _ in range(2):
            with connect(self.port) as sock:
                sock.sendall(data)
                answers.append(read_response(sock, 10))
        first, again = answers
        assert first.status == 200 and "idempotent-replayed" not in first.headers, first
        assert again.headers.get("idempotent-replayed") == "true", again
        count = httpx.get(f"{self.upstream.url}/_count", params={"key": key}, timeout=10)
        assert count.json()["count"] == 1

    def log_problems(self) -> list[str]:
        return [
            line
            for line in self.process.output().splitlines()
            if "Traceback" in line or "Exception in ASGI" in line or '"status": 500' in line
        ]


@pytest.fixture(scope="module")
def fuzz_target(
    upstream: Process, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FuzzTarget]:
    port, admin_port = free_port(), free_port()
    routes = [
        {"name": "h", "match": {"path": "/h"}, "key": {"header": "Idempotency-Key"}},
        {"name": "b", "match": {"path": "/b"}, "key": {"body": "job_key"}},
        {"name": "q", "match": {"path": "/q"}, "key": {"query": "k"}},
        {
            "name": "t",
            "match": {"path": "/t/{name}"},
            "key": {"template": "{path.name}:{body.user_id}:{header.X-Day}"},
        },
        {
            "name": "hash",
            "match": {"path": "/hash"},
            "key": {"hash": ["method", "path", "query", "body"]},
        },
        {"name": "jobs", "match": {"path": "/jobs/{name}"}, "key": {"header": "Idempotency-Key"}},
        {"name": "open", "match": {"path": "/open/{rest:path}"}},
    ]
    config = {
        "server": {
            "listen": f"127.0.0.1:{port}",
            "shutdown_grace": "2s",
            "max_header_bytes": "4KB",
        },
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [{"upstream": upstream.url, **ROUTE, **r} for r in routes],
    }
    path = tmp_path_factory.mktemp("fuzz") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = gateway_process(path, port).start()
    try:
        yield FuzzTarget(process, port, upstream)
    finally:
        assert process.stop() == 0, process.output()[-3000:]


# --- strategies ------------------------------------------------------------------------


def mostly(
    common: st.SearchStrategy[bytes], rare: st.SearchStrategy[bytes]
) -> st.SearchStrategy[bytes]:
    """`common` four times in five: most inputs must get past the parser to test the
    layers behind it."""
    return st.one_of(common, common, common, common, rare)


#: Text the parser passes on and the gateway must handle: escapes, glob and path tricks.
ESCAPES = st.sampled_from(
    [
        b"%",
        b"%FF",
        b"%C3",
        b"%00",
        b"%0D%0A",
        b"%2F",
        b"..",
        b"*",
        b"{",
        b"}",
        b":",
        b"?",
        b"#",
        b"%D0%BA",
        b"%E2%80%A8",
        b"%C2%85",
        b"\\",
        b'"',
    ]
)
#: Bytes the parser refuses in most places (in header values 0x80+ is allowed).
RAW = st.sampled_from([b" ", b"\t", b"\x00", b"\xff", b"\r", b"\n", b"\x85", "ключ".encode()])
SAFE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.~", max_size=12).map(str.encode)
PIECE = mostly(st.one_of(SAFE, ESCAPES), RAW)
WORD = st.lists(PIECE, max_size=6).map(b"".join)


METHODS = mostly(
    st.sampled_from([b"POST", b"POST", b"GET", b"PUT", b"DELETE", b"HEAD"]), st.binary(max_size=8)
)
PATHS = st.sampled_from(
    [b"/h", b"/b", b"/q", b"/t/", b"/hash", b"/jobs/", b"/open/", b"/", b"*", b"http://x/h", b""]
)
QUERY = st.one_of(
    st.just(b""),
    st.lists(st.tuples(st.sampled_from([b"k", b"a", b"n", b""]), WORD), max_size=3).map(
        lambda pairs: b"?" + b"&".join(k + b"=" + v for k, v in pairs)
    ),
)
TARGETS = st.builds(lambda p, w, q: p + w + q, PATHS, WORD, QUERY)
VERSIONS = mostly(
    st.just(b"HTTP/1.1"), st.sampled_from([b"HTTP/1.0", b"HTTP/1.x", b"HTTP/2.0", b""])
)
HEADER_NAMES = mostly(
    st.sampled_from(
        [
            b"Content-Length",
            b"Transfer-Encoding",
            b"Idempotency-Key",
            b"Content-Type",
            b"X-Day",
            b"Host",
            b"Connection",
            b"Expect",
            b"Transfer-Encoding ",
            b"content-length",
        ]
    ),
    st.binary(min_size=1, max_size=12),
)
HEADER_VALUES = mostly(
    st.one_of(
        st.sampled_from(
            [
                b"chunked",
                b"gzip, chunked",
                b"chunked, gzip",
                b"0",
                b"-1",
                b"5",
                b"99999999999999999999",
                b"application/json",
                b"application/x-www-form-urlencoded",
                b"100-continue",
                b"close",
                b'"quoted"',
                b'"bad',
                b"",
            ]
        ),
        WORD,
    ),
    st.binary(max_size=30),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
BODIES = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda key, extra: json.dumps({"job_key": key, "user_id": key, **extra}).encode(),
        st.one_of(st.text(max_size=20), st.integers(), st.none()),
        st.dictionaries(st.text(max_size=5), JSON, max_size=2),
    ),
    JSON.map(lambda doc: json.dumps(doc).encode()),
    st.integers(min_value=1, max_value=3000).map(lambda n: b"[" * n),
    st.just(b'{"job_key": "a", "job_key": "b"}'),
    st.just(b'{"job_key": "\\ud800"}'),
)


@st.composite
def structured(draw: st.DrawFn) -> bytes:
    eol = draw(mostly(st.just(b"\r\n"), st.just(b"\n")))
    body = draw(BODIES)
    lines = [draw(METHODS) + b" " + draw(TARGETS) + b" " + draw(VERSIONS), b"Host: fuzz"]
    for name, value in draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=5)):
        lines.append(name + b": " + value)
    if draw(mostly(st.just(True), st.just(False))):
        lines.append(b"Content-Length: " + str(len(body)).encode())
    if draw(st.booleans()) and b"Idempotency-Key" not in b"".join(lines):
        lines.append(b"Idempotency-Key: " + draw(WORD))
    return eol.join(lines) + eol + eol + body


CLEAN_WORD = st.lists(st.one_of(SAFE, ESCAPES), max_size=6).map(b"".join)
OBS_TEXT = st.sampled_from([b"\xff", b"\x85", "ключ…".encode(), b"\xc3", b"\t"])
VALUE = st.lists(st.one_of(SAFE, ESCAPES, OBS_TEXT), max_size=6).map(b"".join)


@st.composite
def framed(draw: st.DrawFn) -> bytes:
    """Framing the parser accepts; hostile keys, paths, queries and bodies behind it."""
    body = draw(BODIES)
    target = draw(
        st.sampled_from([b"/h", b"/b", b"/q", b"/t/", b"/hash", b"/jobs/", b"/open/"])
    ) + draw(CLEAN_WORD)
    if draw(st.booleans()):
        target += b"?k=" + draw(CLEAN_WORD) + b"&n=" + draw(CLEAN_WORD)
    lines = [draw(st.sampled_from([b"POST", b"PUT", b"GET"])) + b" " + target + b" HTTP/1.1"]
    lines.append(b"Host: fuzz")
    names = [b"Idempotency-Key", b"X-Day", b"Content-Type", b"X-Other", b"Idempotency-Key"]
    for name in draw(st.lists(st.sampled_from(names), max_size=3)):
        lines.append(name + b": " + draw(st.one_of(VALUE, st.just(b"application/json"))))
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A well-formed keyed request with a few bytes replaced, inserted or dropped."""
    target = draw(st.sampled_from(["/h", "/b", "/q?k=abc", "/t/x", "/hash", "/jobs/x", "/open/x"]))
    body = json.dumps({"job_key": "fuzz", "user_id": "u"}).encode()
    data = bytearray(
        request(
            "POST",
            target,
            [("Idempotency-Key", "fuzz-key"), ("Content-Type", "application/json"), ("X-Day", "1")],
            body,
        )
    )
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        byte = draw(st.binary(min_size=1, max_size=3))
        if op == "replace":
            data[at : at + len(byte)] = byte
        elif op == "insert":
            data[at:at] = byte
        else:
            del data[at]
    return bytes(data)


FUZZ_SETTINGS = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def _check(answer: RawResponse) -> None:
    if answer.status is None:
        return  # incomplete on purpose (a longer Content-Length than sent), or refused by close
    assert answer.status != 500 and answer.status < 502, answer.raw[:500]
    if answer.headers.get("content-type") == "application/problem+json":
        answer.problem()


@pytest.mark.parametrize(
    "strategy", [structured(), framed(), mutated()], ids=["structured", "framed", "mutated"]
)
def test_fuzz_raw_http_never_a_500(
    fuzz_target: FuzzTarget, ledger: Ledger, strategy: st.SearchStrategy[bytes]
) -> None:
    before = fuzz_target.tried

    @FUZZ_SETTINGS
    @given(data=strategy)
    def run(data: bytes) -> None:
        _check(fuzz_target.send(data))

    try:
        run()
    finally:
        problems = fuzz_target.log_problems()
        ledger.record(
            "fuzz",
            f"raw HTTP through a real gateway: {strategy}",
            requests=fuzz_target.tried - before,
            bad_inputs=fuzz_target.tried - before,
            detail=f"answers so far: {dict(sorted(fuzz_target.answered.items()))}; "
            f"log problems: {len(problems)}",
        )
    assert not problems, problems[:5]
    fuzz_target.alive()
