"""A small keep-alive HTTP/1.1 load generator, the fallback when `wrk` is not installed.

Raw asyncio streams (uvloop when importable), a fixed number of connections, each sending one
request at a time and reading the whole response before the next one (like `wrk -c N`). Only
loopback targets are accepted. Every request carries a unique header value so that
idempotency-aware servers see unique keys.

Library use (from another benchmark)::

    from loadgen import run_load_sync
    result = run_load_sync("127.0.0.1", 8000, duration=8.0, connections=32)
    print(result.rps, result.p50_ms, result.p99_ms, result.non_2xx, result.socket_errors)

CLI (prints one JSON object; pin it with `taskset -c 1` to keep it off the server's core)::

    python tests/benchmarks/loadgen.py --port 8000 --duration 8 --connections 32 --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BODY = b'{"amount":100,"currency":"EUR","note":"benchmark"}'


@dataclass(frozen=True)
class LoadResult:
    """Outcome of one load run: `requests` completed within `duration_s`, like wrk.

    Latency percentiles are of completed responses only.
    """

    requests: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int = 0
    socket_errors: int = 0
    timeouts: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoadResult:
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclass
class _Counters:
    latencies: list[float] = field(default_factory=list)
    non_2xx: int = 0
    socket_errors: int = 0
    timeouts: int = 0
    in_window: int = 0  # responses completed before the end of the run


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Read one full response; return (status, connection reusable)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"bad status line {lines[0]!r}")
    status = int(parts[1])
    keep_alive = parts[0] == b"HTTP/1.1"
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            if b"close" in value:
                keep_alive = False
            elif b"keep-alive" in value:
                keep_alive = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                break
            await reader.readexactly(size + 2)
    elif length is not None:
        if length:
            await reader.readexactly(length)
    elif status not in (204, 304) and not 100 <= status < 200:
        await reader.read()  # body delimited by EOF
        keep_alive = False
    return status, keep_alive


def _check_loopback(host: str) -> None:
    if host == "localhost":
        return
    try:
        ip = ipaddress.ip_address(host)
    except ValueError as exc:
        raise ValueError(f"loadgen only targets loopback addresses, got {host!r}") from exc
    if not ip.is_loopback:
        raise ValueError(f"loadgen only targets loopback addresses, got {host!r}")


async def run_load(
    host: str,
    port: int,
    *,
    path: str = "/",
    method: str = "POST",
    body: bytes = DEFAULT_BODY,
    headers: Mapping[str, str] | None = None,
    connections: int = 32,
    duration: float = 8.0,
    timeout: float = 5.0,
    unique_header: str | None = "Idempotency-Key",
    key_prefix: str | None = None,
) -> LoadResult:
    """Drive `connections` keep-alive connections for `duration` seconds; bounded in time.

    The run ends by itself after at most `duration + timeout + 1` seconds.
    """
    _check_loopback(host)
    all_headers = {"Host": f"{host}:{port}", "User-Agent": "bench-loadgen"}
    if body or method in ("POST", "PUT", "PATCH"):
        all_headers["Content-Type"] = "application/json"
        all_headers["Content-Length"] = str(len(body))
    all_headers.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(
        f"{k}: {v}\r\n".encode("latin-1") for k, v in all_headers.items()
    )
    prefix = key_prefix or f"lg{os.getpid()}-{time.time_ns()}"
    counters = _Counters()
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + duration

    async def worker(worker_id: int) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        sent = 0

        def drop() -> None:
            nonlocal conn
            if conn is not None:
                conn[1].close()
            conn = None

        try:
            while loop.time() < stop_at:
                if conn is None:
                    try:
                        conn = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
                    except (OSError, TimeoutError):
                        counters.socket_errors += 1
                        await asyncio.sleep(0.01)
                        continue
                conn_reader, conn_writer = conn
                sent += 1
                request = head
                if unique_header:
                    request += f"{unique_header}: {prefix}-{worker_id}-{sent}\r\n".encode()
                request += b"\r\n" + body
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(timeout):
                        conn_writer.write(request)
                        status, reusable = await _read_response(conn_reader)
                except TimeoutError:
                    counters.timeouts += 1
                    drop()
                    continue
                except (
                    OSError,
                    asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError,
                    ValueError,
                ):
                    counters.socket_errors += 1
                    drop()
                    continue
                counters.latencies.append(time.perf_counter() - t0)
                if loop.time() <= stop_at:
                    counters.in_window += 1
                if not 200 <= status < 300:
                    counters.non_2xx += 1
                if not reusable:
                    drop()
        finally:
            drop()

    tasks = [asyncio.create_task(worker(i)) for i in range(connections)]
    try:
        async with asyncio.timeout(duration + timeout + 1.0):
            await asyncio.gather(*tasks)
    except TimeoutError:
        pass
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    lat = sorted(counters.latencies)
    return LoadResult(
        requests=counters.in_window,
        duration_s=duration,
        p50_ms=percentile(lat, 50) * 1000.0,
        p99_ms=percentile(lat, 99) * 1000.0,
        non_2xx=counters.non_2xx,
        socket_errors=counters.socket_errors,
        timeouts=counters.timeouts,
    )


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_load_sync(host: str, port: int, **kwargs: Any) -> LoadResult:
    """Run `run_load` in a fresh event loop (uvloop when importable)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(run_load(host, port, **kwargs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/")
    parser.add_argument("--method", default="POST")
    parser.add_argument("--body", default=DEFAULT_BODY.decode())
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run_load_sync(
        args.host,
        args.port,
        path=args.path,
        method=args.method,
        body=args.body.encode(),
        connections=args.connections,
        duration=args.duration,
        timeout=args.timeout,
    )
    if args.json:
        print(result.to_json())
    else:
        print(
            f"{result.rps:,.0f} req/s  p50 {result.p50_ms:.2f} ms  p99 {result.p99_ms:.2f} ms  "
            f"requests {result.requests}  non-2xx {result.non_2xx}  "
            f"socket errors {result.socket_errors}  timeouts {result.timeouts}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
