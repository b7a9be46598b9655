"""Large responses against a real gateway process: streamed with back-pressure, held in
memory at most one read at a time, and given up on when their caller stops reading
(server.write_timeout), without changing what the key records.

Upstreams: the test job endpoint (tests/support/upstream_app.py, `?size=N`) and
tests/support/stream_upstream.py, whose bodies are bytes a hash can check and which
cuts a body off on demand. Callers are raw sockets where the point is that they do not
read, httpx elsewhere.
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.servers import Process, free_port, gateway_process, wait_for_port
from tests.support.stream_upstream import body, stream_upstream_server

pytestmark = [pytest.mark.process]

AREA = "large responses"
MiB = 1024 * 1024
#: server.write_timeout of the gateways here: short, so the tests see it act.
WRITE_TIMEOUT = 3.0
#: What the gateway logs when it gives up on a caller that stopped reading.
GIVEN_UP = "(server.write_timeout): connection closed"


@pytest.fixture(scope="module")
def streamer() -> Iterator[Process]:
    server = stream_upstream_server().start()
    yield server
    server.stop()


def _write_config(
    tmp: Path, upstream: Process, streamer: Process, **server: Any
) -> tuple[Path, int, int]:
    port, admin_port = free_port(), free_port()

    def keyed(name: str, upstream_url: str, **settings: Any) -> dict[str, Any]:
        return {
            "name": name,
            "match": {"path": f"/{name}/{{job}}"},
            "upstream": upstream_url,
            "key": {"header": "Idempotency-Key"},
            "fingerprint": "none",
            **settings,
        }

    config = {
        "server": {
            "listen": f"127.0.0.1:{port}",
            "shutdown_grace": "2s",
            "write_timeout": f"{WRITE_TIMEOUT}s",
            **server,
        },
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [
            keyed("big", upstream.url, upstream_timeout="60s"),
            keyed("stream", streamer.url, upstream_timeout="30s"),
            keyed("stored", streamer.url, upstream_timeout="30s", max_stored_body="16MiB"),
            # The reader's share of an 8 s deadline is 6 s.
            keyed("slow", streamer.url, upstream_timeout="8s"),
            {"name": "open", "match": {"path": "/open/{job}"}, "upstream": streamer.url},
            # Only test_last_success_is_an_answer_that_arrived_whole uses these two.
            keyed("gauge", streamer.url, upstream_timeout="30s"),
            {
                "name": "gauge-open",
                "match": {"path": "/gauge-open/{job}"},
                "upstream": streamer.url,
            },
        ],
    }
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port, admin_port


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, upstream: Process, streamer: Process
) -> Iterator[tuple[Process, int]]:
    path, port, admin_port = _write_config(tmp_path_factory.mktemp("streaming"), upstream, streamer)
    process = gateway_process(path, port).start()
    wait_for_port(admin_port)
    try:
        yield process, admin_port
    finally:
        process.stop()
    assert_clean_log(process)


def assert_clean_log(process: Process) -> None:
    """Nothing here is a bug of the gateway's: no traceback, and no response the server
    took for one the app forgot to finish."""
    output = process.output()
    for sign in ("Traceback", "Exception in ASGI", "without completing", "never retrieved"):
        assert sign not in output, output


def rss(process: Process) -> int:
    """The process's resident memory in bytes (VmRSS)."""
    assert process.proc is not None
    status = Path(f"/proc/{process.proc.pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M)
    assert match is not None, status
    return int(match.group(1)) * 1024


def metric(admin_port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match is not None, f"{name} not in the metrics"
    return float(match.group(1))


def buffered(admin_port: int) -> float:
    """The gauge of response bytes the gateway holds (0 when the gateway has none)."""
    try:
        return metric(admin_port, "idempotency_gateway_buffered_response_bytes")
    except AssertionError:
        return 0.0  # a gateway without the gauge: what it holds shows in its RSS


def upstream_stats(server: Process, key: str) -> dict[str, int]:
    doc: dict[str, int] = httpx.get(f"{server.url}/_count", params={"key": key}, timeout=10).json()
    return doc


def until(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def request_bytes(path: str, key: str | None, close: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: gateway.test", "content-length: 0"]
    if key is not None:
        lines.append(f"idempotency-key: {key}")
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def stalled_caller(port: int, path: str, key: str | None, close: bool = False) -> socket.socket:
    """A caller that sends its request and never reads, with a small receive buffer so
    the kernel does not take the answer off the gateway's hands for it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request_bytes(path, key, close))
    return sock


def read_to_close(sock: socket.socket, timeout: float = 30) -> tuple[bytes, bool]:
    """Everything the connection delivers until it closes (True) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    received = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(1024 * 1024)
        except TimeoutError:
            break
        except ConnectionResetError:
            return bytes(received), True
        if not chunk:
            return bytes(received), True
        received += chunk
    return bytes(received), False


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers, rest


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- callers that never read -------------------------------------------------------------


def test_callers_that_never_read_a_16_mib_answer(
    gateway: tuple[Process, int], upstream: Process, ledger: Ledger
) -> None:
    """The issue's case: twelve callers ask for a 16 MiB answer and never read. The
    gateway holds about one read of each, not the bodies; after write_timeout their
    connections are closed; each key's body is read to its end anyway, so the key is
    completed (headers only, as for any body over max_stored_body) and ran once."""
    process, admin_port = gateway
    callers, size = 12, 16 * MiB
    path = f"/big/job?size={size}"
    with httpx.Client(base_url=process.url, timeout=30) as client:  # warm up both paths
        warm = client.post(path, headers={"Idempotency-Key": unique("warm")})
        assert warm.status_code == 200 and len(warm.content) == size
        client.post("/big/job", headers={"Idempotency-Key": unique("warm")})
    before = rss(process)
    given_up = process.output().count(GIVEN_UP)
    keys = [unique("stalled") for _ in range(callers)]
    sockets = [stalled_caller(process.port, path, key) for key in keys]
    try:
        until(
            lambda: all(upstream_stats(upstream, key)["count"] == 1 for key in keys),
            "every request reached the upstream",
        )
        peak, held = before, 0.0
        watch_until = time.monotonic() + 1.5  # well inside write_timeout
        while time.monotonic() < watch_until:
            peak = max(peak, rss(process))
            held = max(held, buffered(admin_port))
            time.sleep(0.1)
        growth = peak - before
        figures = (
            f"{callers} x 16 MiB unread: RSS {before / MiB:.0f} -> {peak / MiB:.0f} MiB "
            f"(+{growth / MiB:.1f}); at most {held / MiB:.2f} MiB of response bytes held"
        )
        print(figures)
        assert growth < callers * size / 4, figures
        assert held > 0  # the gauge saw the parts waiting for the stalled callers
        process.wait_for_output(GIVEN_UP, count=given_up + callers, timeout=WRITE_TIMEOUT + 30)
        results = [read_to_close(sock) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    with httpx.Client(base_url=process.url, timeout=30) as client:
        repeats = [client.post(path, headers={"Idempotency-Key": key}) for key in keys]
    runs = [upstream_stats(upstream, key)["count"] for key in keys]
    until(lambda: buffered(admin_port) == 0, "the buffered bytes went back to 0")
    ledger.record(
        AREA,
        "callers that never read a 16 MiB answer",
        requests=2 * callers,
        faults=callers,
        upstream_duplicates=sum(max(0, n - 1) for n in runs),
        detail=figures,
    )
    for raw, closed in results:
        assert closed, "the gateway never closed a connection that stopped reading"
        status, headers, got = split_response(raw)
        assert status == 200 and int(headers["content-length"]) == size
        assert len(got) < size  # given up on: the response is visibly short
    for repeat in repeats:
        assert repeat.status_code == 200 and repeat.content == b""
        assert repeat.headers["idempotent-replayed"] == "true"
        assert repeat.headers["idempotent-body-omitted"] == "true"
    assert runs == [1] * callers


def test_a_caller_that_never_reads_a_stored_answer(
    gateway: tuple[Process, int], streamer: Process
) -> None:
    """An answer the route stores (12 MiB, max_stored_body 16 MiB here) is stored whole
    before it is written: its caller not reading changes nothing for the key, and the
    caller is let go after write_timeout."""
    process, _ = gateway
    key, size = unique("unread-stored"), 12 * MiB
    given_up = process.output().count(GIVEN_UP)
    sock = stalled_caller(process.port, f"/stored/job?size={size}", key)
    try:
        process.wait_for_output(GIVEN_UP, count=given_up + 1, timeout=WRITE_TIMEOUT + 30)
        raw, closed = read_to_close(sock)
    finally:
        sock.close()
    repeat = httpx.post(
        f"{process.url}/stored/job?size={size}", headers={"Idempotency-Key": key}, timeout=30
    )
    assert closed and len(split_response(raw)[2]) < size
    assert repeat.status_code == 200 and repeat.headers["idempotent-replayed"] == "true"
    assert digest(repeat.content) == digest(body(size))
    assert "idempotent-body-omitted" not in repeat.headers
    assert upstream_stats(streamer, key)["count"] == 1


@pytest.mark.parametrize("route", ["stream", "open"])
def test_a_caller_that_hangs_up_mid_stream(
    gateway: tuple[Process, int], streamer: Process, route: str
) -> None:
    """A caller that takes part of a streamed answer and hangs up: on a keyed route the
    body is read to its end anyway, as a forward is finished for a caller that hung up,
    and the key completes; without a key the upstream connection is closed."""
    process, admin_port = gateway
    key, size = unique(f"hangup-{route}"), 32 * MiB
    sock = socket.create_connection(("127.0.0.1", process.port))
    try:
        sock.sendall(request_bytes(f"/{route}/job?size={size}", key))
        got = 0
        while got < 2 * MiB:
            chunk = sock.recv(256 * 1024)
            assert chunk, "the gateway closed first"
            got += len(chunk)
    finally:
        sock.close()
    if route == "open":
        until(lambda: upstream_stats(streamer, key)["peer_closed"] == 1, "the upstream let go")
        assert upstream_stats(streamer, key)["complete"] == 0
    else:
        until(lambda: upstream_stats(streamer, key)["complete"] == 1, "the body read to its end")
        repeat = httpx.post(
            f"{process.url}/{route}/job?size={size}", headers={"Idempotency-Key": key}, timeout=30
        )
        assert repeat.status_code == 200 and repeat.headers["idempotent-body-omitted"] == "true"
    assert upstream_stats(streamer, key)["count"] == 1
    until(lambda: buffered(admin_port) == 0, "the buffered bytes went back to 0")


def last_success(admin_port: int, route: str) -> float | None:
    """The route's `_last_success_timestamp_seconds`, None while it has none."""
    name = f'idempotency_gateway_last_success_timestamp_seconds{{route="{route}"}}'
    try:
        return metric(admin_port, name) or None
    except AssertionError:
        return None  # no forward on the route yet


def test_last_success_is_an_answer_that_arrived_whole(
    gateway: tuple[Process, int], streamer: Process, ledger: Ledger
) -> None:
    """The last-success gauge (what the NoRecentSuccess alert watches) counts an answer
    once it is whole. A 200 streamed and cut off after its head is an unknown outcome,
    not a success: the gauge stays unset, keyed route or passthrough. A streamed 200 is
    a success at its end: not while its caller still holds the body back."""
    process, admin_port = gateway
    size, cut = 4 * MiB, 2 * MiB
    for route in ("gauge", "gauge-open"):
        sock = socket.create_connection(("127.0.0.1", process.port))
        try:
            sock.sendall(request_bytes(f"/{route}/job?size={size}&cut={cut}", unique("cut")))
            raw, closed = read_to_close(sock)
        finally:
            sock.close()
        assert closed and split_response(raw)[0] == 200  # the head came, then the cut
    cut_off = {route: last_success(admin_port, route) for route in ("gauge", "gauge-open")}
    key, size = unique("held"), 16 * MiB
    sock = stalled_caller(process.port, f"/gauge-open/job?size={size}", key, close=True)
    try:
        until(lambda: upstream_stats(streamer, key)["sent"] > 0, "the body began")
        time.sleep(0.5)  # the gateway has the head and parts of the body
        while_held = last_success(admin_port, "gauge-open")
        raw, closed = read_to_close(sock)
    finally:
        sock.close()
    ledger.record(
        AREA,
        "last success counted at the body's end",
        requests=3,
        faults=2,
        detail=f"cut off: {cut_off}; while the caller held the body back: {while_held}",
    )
    assert cut_off == {"gauge": None, "gauge-open": None}
    assert while_held is None
    assert len(split_response(raw)[2]) == size
    until(lambda: last_success(admin_port, "gauge-open") is not None, "the success counted")


# -- read normally -----------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_large_keyed_answer_arrives_whole_and_repeats_get_headers(
    gateway: tuple[Process, int], streamer: Process, chunked: bool
) -> None:
    process, admin_port = gateway
    key, size = unique("whole"), 8 * MiB + 12345
    query = f"size={size}" + ("&chunked=1" if chunked else "")
    with httpx.Client(base_url=process.url, timeout=30) as client:
        first = client.post(f"/stream/job?{query}", headers={"Idempotency-Key": key})
        repeat = client.post(f"/stream/job?{query}", headers={"Idempotency-Key": key})
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    assert digest(first.content) == digest(body(size))
    if chunked:
        assert first.headers["transfer-encoding"] == "chunked"
    else:
        assert first.headers["content-length"] == str(size)
    assert repeat.status_code == 200 and repeat.content == b""
    assert repeat.headers["idempotent-body-omitted"] == "true"
    assert repeat.headers["x-body-size"] == str(size)
    assert upstream_stats(streamer, key)["count"] == 1
    until(lambda: buffered(admin_port) == 0, "the buffered bytes went back to 0")


def test_passthrough_streams_a_large_body(gateway: tuple[Process, int], streamer: Process) -> None:
    process, _ = gateway
    size = 12 * MiB + 1
    response = httpx.post(f"{process.url}/open/job?size={size}", timeout=30)
    assert response.status_code == 200 and response.headers["content-length"] == str(size)
    assert digest(response.content) == digest(body(size))
    assert "idempotent-replayed" not in response.headers


def test_passthrough_caller_that_stops_reading_closes_the_upstream(
    gateway: tuple[Process, int], streamer: Process
) -> None:
    """Without a key nothing needs the rest of the body: the gateway lets go of the
    caller after write_timeout and closes the upstream connection."""
    process, _ = gateway
    key = unique("open-stalled")  # no key to the gateway; passed on, the upstream counts by it
    given_up = process.output().count(GIVEN_UP)
    sock = stalled_caller(process.port, f"/open/job?size={64 * MiB}", key)
    try:
        process.wait_for_output(GIVEN_UP, count=given_up + 1, timeout=WRITE_TIMEOUT + 30)
        _, closed = read_to_close(sock)
    finally:
        sock.close()
    assert closed
    until(lambda: upstream_stats(streamer, key)["peer_closed"] == 1, "the upstream was let go")
    stats = upstream_stats(streamer, key)
    assert stats["complete"] == 0 and stats["sent"] < 64 * MiB


# -- cut off -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_cut_after_streaming_began(
    gateway: tuple[Process, int], streamer: Process, chunked: bool, ledger: Ledger
) -> None:
    """The upstream sends 2 MiB of a 4 MiB body and hangs up. The caller already has
    the status and part of the body: its response ends short (no last chunk, or short
    of its Content-Length) with the connection closed, never completed. The key's
    outcome is unknown, as for any body cut off: repeats get 409."""
    process, _ = gateway
    key, size, cut = unique("cut"), 4 * MiB, 2 * MiB
    path = f"/stream/job?size={size}&cut={cut}" + ("&chunked=1" if chunked else "")
    sock = socket.create_connection(("127.0.0.1", process.port))
    try:
        sock.sendall(request_bytes(path, key))
        raw, closed = read_to_close(sock)
    finally:
        sock.close()
    repeat = httpx.post(f"{process.url}{path}", headers={"Idempotency-Key": key}, timeout=30)
    runs = upstream_stats(streamer, key)["count"]
    ledger.record(
        AREA,
        "body cut off after streaming began" + (" (chunked)" if chunked else ""),
        requests=2,
        faults=1,
        upstream_duplicates=max(0, runs - 1),
        detail=f"{cut} of {size} bytes, then FIN; the caller's response ended short",
    )
    status, headers, got = split_response(raw)
    assert closed and status == 200
    if chunked:
        assert headers["transfer-encoding"] == "chunked"
        assert not got.endswith(b"0\r\n\r\n")
        assert len(got) < size
    else:
        assert int(headers["content-length"]) == size
        assert 0 < len(got) < size
        assert got == body(size)[: len(got)]
    assert repeat.status_code == 409, repeat.text
    assert repeat.json()["type"].endswith("/outcome-pending")
    assert runs == 1


def test_body_cut_before_streaming_began_is_504_as_before(
    gateway: tuple[Process, int], streamer: Process
) -> None:
    """Cut within its first max_stored_body bytes, a body is still being read whole:
    the caller gets 504 outcome-unknown, exactly as before streaming existed."""
    process, _ = gateway
    key = unique("cut-early")
    path = f"/stream/job?size={4 * MiB}&cut={512 * 1024}"
    first = httpx.post(f"{process.url}{path}", headers={"Idempotency-Key": key}, timeout=30)
    assert first.status_code == 504 and first.json()["upstream_status"] == 200
    assert first.json()["type"].endswith("/outcome-unknown")


def test_a_slow_reader_of_a_keyed_answer_is_cut_and_the_key_completes(
    tmp_path: Path, upstream: Process, streamer: Process
) -> None:
    """A caller reading a keyed answer far too slowly to finish within the route's 8 s
    deadline (write_timeout is 30 s here, so only the deadline can act) holds the
    upstream read back for 6 s at most; then it is cut off and the rest is read at the
    upstream's pace, so the key completes instead of being left unknown (and parked)
    by the caller's slowness."""
    path, port, admin_port = _write_config(tmp_path, upstream, streamer, write_timeout="30s")
    process = gateway_process(path, port).start()
    key, size = unique("slow"), 24 * MiB
    try:
        wait_for_port(admin_port)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(request_bytes(f"/slow/job?size={size}", key))
        received, closed = 0, False
        deadline = time.monotonic() + 40
        try:
            while time.monotonic() < deadline:
                sock.settimeout(1)
                try:
                    chunk = sock.recv(16 * 1024)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    closed = True
                    break
                if not chunk:
                    closed = True
                    break
                received += len(chunk)
                time.sleep(0.05)  # about 300 KiB/s: 24 MiB would take over a minute
        finally:
            sock.close()
        repeat = httpx.post(
            f"{process.url}/slow/job?size={size}", headers={"Idempotency-Key": key}, timeout=30
        )
    finally:
        process.stop()
    assert_clean_log(process)
    assert "the caller read the body too slowly" in process.output()
    assert closed and received < size
    assert repeat.status_code == 200, repeat.text
    assert repeat.headers["idempotent-body-omitted"] == "true"
    assert upstream_stats(streamer, key) == {
        "count": 1,
        "sent": size,
        "complete": 1,
        "peer_closed": 0,
    }


# -- the budget --------------------------------------------------------------------------


def test_budget_streams_what_it_cannot_hold(
    tmp_path: Path, upstream: Process, streamer: Process
) -> None:
    """With server.max_buffered_responses at 512 KiB, an 800 KiB answer (under
    max_stored_body) cannot be held whole: it is streamed to its caller, whole, and the
    key records it without its body (never a wrong replay), counted as
    buffer_full{action="streamed"}. A smaller answer is stored as usual."""
    path, port, admin_port = _write_config(
        tmp_path, upstream, streamer, max_buffered_responses="512KiB"
    )
    process = gateway_process(path, port).start()
    try:
        wait_for_port(admin_port)
        big, small = unique("budget-big"), unique("budget-small")
        with httpx.Client(base_url=process.url, timeout=30) as client:
            first = client.post(f"/stream/job?size={800 * 1024}", headers={"Idempotency-Key": big})
            repeat = client.post(f"/stream/job?size={800 * 1024}", headers={"Idempotency-Key": big})
            stored = client.post(
                f"/stream/job?size={100 * 1024}", headers={"Idempotency-Key": small}
            )
            again = client.post(
                f"/stream/job?size={100 * 1024}", headers={"Idempotency-Key": small}
            )
        streamed = metric(admin_port, 'idempotency_gateway_buffer_full_total{action="streamed"}')
        held = metric(admin_port, "idempotency_gateway_buffered_response_bytes")
    finally:
        process.stop()
    assert_clean_log(process)
    assert digest(first.content) == digest(body(800 * 1024))
    assert repeat.headers["idempotent-body-omitted"] == "true" and repeat.content == b""
    assert stored.content == again.content == body(100 * 1024)
    assert again.headers["idempotent-replayed"] == "true"
    assert streamed == 1
    assert held == 0
