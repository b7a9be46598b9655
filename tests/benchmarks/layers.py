"""Where a first request's CPU goes: the gateway's layers, measured in one process.

    .venv/bin/python tests/benchmarks/layers.py [--requests 4000] [--rounds 7]

gateway.py measures whole processes under wrk, where one run and the next differ by
20% on a shared VM. This takes the server and the load generator out of the way: it
drives ASGI apps in this process with one in-process caller (32 requests at a time,
each a POST with a new Idempotency-Key), in alternation, and reads this process's CPU
time per request. Every row pays the same caller and the same upstream client, so the
differences between rows are the layers' own cost. Rows:

  bare         the bare Starlette proxy with the gateway's client (proxy_app.py)
  passthrough  the gateway, on a route without a key
  no store     the gateway, keyed; the store's claim and complete answer at once
  memory       the gateway, keyed, memory://
  redis        the gateway, keyed, Redis (a redis-server of its own); its CPU is
               reported too: on 2 cores it competes with the gateway for the same time

A second table isolates the store's two scripts per first request (claim, complete)
against scripts that only `return 1` with the same keys and arguments: Redis's fixed
cost per EVALSHA and the cost of the scripts' own commands, on both sides.

The upstream is nginx `return 200` when nginx is installed, else the Python upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# This directory holds gateway.py (the benchmark), which would shadow the package.
sys.path[:] = [str(ROOT), *[p for p in sys.path if Path(p or ".").resolve() != HERE], str(HERE)]
os.environ.setdefault("BENCH_GATEWAY_SRC", str(ROOT))

import _harness as h  # noqa: E402
import proxy_app  # noqa: E402
import uvloop  # noqa: E402
import yaml  # noqa: E402

from gateway.config import StoreConfig, parse_config  # noqa: E402
from gateway.proxy.app import ProxyApp, create_app  # noqa: E402
from gateway.records import KeyRef, StoredResponse  # noqa: E402
from gateway.store.redis import RedisStore  # noqa: E402

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
PATH = "/jobs/run"
BODY = b'{"job":"nightly"}'
CONCURRENCY = 32


async def drive(app: App, requests: int, tag: str) -> int:
    """`requests` POSTs with new keys, CONCURRENCY at a time; returns the non-200 count."""
    numbers = iter(range(requests))
    failed = 0

    async def one(i: int) -> int:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": PATH,
            "raw_path": PATH.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"127.0.0.1:8080"),
                (b"content-type", b"application/json"),
                (b"idempotency-key", f"{tag}-{i}".encode()),
                (b"content-length", str(len(BODY)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8080),
            "state": {},
        }
        sent = False
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await asyncio.Event().wait()  # never disconnects
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    async def caller() -> None:
        nonlocal failed
        for i in numbers:
            if await one(i) != 200:
                failed += 1

    await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
    return failed


def gateway_app(upstream_port: int, store_url: str, keyed: bool) -> ProxyApp:
    key = "key: {header: Idempotency-Key}" if keyed else ""
    text = f"""
server: {{listen: "127.0.0.1:8080"}}
store: {{url: "{store_url}", prefix: "layers:"}}
routes:
  - name: bench
    match: {{path: "/{{rest:path}}"}}
    upstream: http://127.0.0.1:{upstream_port}
    {key}
    fingerprint: none
"""
    return create_app(parse_config(yaml.safe_load(text), "layers.py"))


def without_store(app: ProxyApp) -> None:
    """Claim answers "yours" and complete "done" at once, without a round trip."""

    async def claim(*args: Any, **kwargs: Any) -> None:
        return None

    async def complete(*args: Any, **kwargs: Any) -> bool:
        return True

    store: Any = app.gateway.store
    store.claim, store.complete = claim, complete


class CollectorClock:
    """CPU time spent in the garbage collector: a request that leaves reference cycles
    behind shows here (it cost 8% of a first request until an upstream exchange and
    its parser stopped pointing at each other)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.seconds += time.process_time() - self._started


async def layers(
    args: argparse.Namespace, upstream_port: int, redis_port: int, redis_pid: int
) -> None:
    apps: dict[str, App] = {}
    gateways = {
        "passthrough": gateway_app(upstream_port, "memory://", keyed=False),
        "no store": gateway_app(upstream_port, "memory://", keyed=True),
        "memory": gateway_app(upstream_port, "memory://", keyed=True),
        "redis": gateway_app(upstream_port, f"redis://127.0.0.1:{redis_port}/0", keyed=True),
    }
    without_store(gateways["no store"])
    bare = proxy_app.create_app(f"http://127.0.0.1:{upstream_port}", "gateway-128")
    async with bare.router.lifespan_context(bare):
        apps["bare"] = bare
        for name, app in gateways.items():
            await app.gateway.start()
            apps[name] = app
        cpu: dict[str, list[float]] = {name: [] for name in apps}
        collector: dict[str, list[float]] = {name: [] for name in apps}
        clock = CollectorClock()
        redis_cpu: list[float] = []
        for name, app in apps.items():  # warm up: connections, caches, first allocations
            await drive(app, 1000, f"warm-{name}-{secrets.token_hex(3)}")
        for round_ in range(args.rounds):
            for name, app in apps.items():
                redis_before = h.cpu_seconds([redis_pid])
                before, collecting = time.process_time(), clock.seconds
                failed = await drive(app, args.requests, secrets.token_hex(4))
                cpu[name].append((time.process_time() - before) / args.requests * 1e6)
                collector[name].append((clock.seconds - collecting) / args.requests * 1e6)
                if name == "redis":
                    used = h.cpu_seconds([redis_pid]) - redis_before
                    redis_cpu.append(used / args.requests * 1e6)
                if failed:
                    raise SystemExit(f"{name}: {failed} requests did not get 200")
            print(f"round {round_ + 1}: " + "  ".join(f"{n} {v[-1]:.0f}" for n, v in cpu.items()))
        for app in gateways.values():
            await app.gateway.close()
    print()
    print(f"CPU per request in this process, {args.rounds} rounds x {args.requests} requests.")
    print("The fastest round is the least disturbed by the machine's neighbours; the")
    print("median shows what a typical round paid.")
    print()
    print(
        "| layers | CPU us/req, fastest | bare / this | CPU us/req, median | bare / this "
        "| in the collector, us/req |"
    )
    print("|---|--:|--:|--:|--:|--:|")
    fastest, typical = min(cpu["bare"]), statistics.median(cpu["bare"])
    for name, values in cpu.items():
        low, mid = min(values), statistics.median(values)
        gc_us = statistics.median(collector[name])
        print(
            f"| {name} | {low:.0f} | {fastest / low:.3f} | {mid:.0f} | {typical / mid:.3f} "
            f"| {gc_us:.1f} |"
        )
    low, mid = min(redis_cpu), statistics.median(redis_cpu)
    print(f"| redis-server, in the redis row | {low:.0f} | | {mid:.0f} | | |")


async def scripts(args: argparse.Namespace, redis_port: int, redis_pid: int) -> None:
    store = RedisStore(StoreConfig(url=f"redis://127.0.0.1:{redis_port}/1", prefix="scripts:"))
    await store.start()
    pipe = store._pipe
    assert pipe is not None
    trivial = await pipe.call("SCRIPT", "LOAD", "return 1")
    response = StoredResponse(
        200, (("content-type", "application/json"), ("content-length", "11")), b'{"ok":true}'
    )

    async def pair(kind: str, ref: KeyRef) -> None:
        if kind == "claim + complete":
            await store.claim(ref, "run", "", 60.0)
            await store.complete(ref, "run", response, 3600.0)
            return
        keys, head = store._keys(ref)
        # The same KEYS and as many ARGV as claim (8) and complete (8) send.
        await pipe.call("EVALSHA", trivial, len(keys), *keys, *head, *["x"] * 6)
        await pipe.call("EVALSHA", trivial, len(keys), *keys, *head, *["x"] * 6)

    results: dict[str, list[tuple[float, float]]] = {"claim + complete": [], "return 1, twice": []}
    for _ in range(args.rounds):
        for kind in results:
            refs = iter(
                KeyRef(secrets.token_hex(16), "bench", str(i)) for i in range(args.requests)
            )

            async def caller(kind: str = kind, refs: Any = refs) -> None:
                for ref in refs:
                    await pair(kind, ref)

            redis_before, before = h.cpu_seconds([redis_pid]), time.process_time()
            await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
            results[kind].append(
                (
                    (h.cpu_seconds([redis_pid]) - redis_before) / args.requests * 1e6,
                    (time.process_time() - before) / args.requests * 1e6,
                )
            )
    await store.close()
    print()
    print("The store's two scripts per first request, alone (us of CPU per pair;")
    print("fastest round, then median):")
    print()
    print("| calls | redis-server, fastest | median | gateway side, fastest | median |")
    print("|---|--:|--:|--:|--:|")
    for kind, values in results.items():
        redis_us, client_us = [v[0] for v in values], [v[1] for v in values]
        print(
            f"| {kind} | {min(redis_us):.1f} | {statistics.median(redis_us):.1f} "
            f"| {min(client_us):.1f} | {statistics.median(client_us):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="per app and round")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    redis = shutil.which("redis-server")
    if redis is None:
        raise SystemExit("layers.py needs redis-server (scripts/setup installs it)")
    work = Path(tempfile.mkdtemp(prefix="layers-"))
    procs = h.Processes(work)
    with h.exit_on_signals():
        try:
            redis_port, upstream_port = h.free_port(), h.free_port()
            redis_proc = procs.start(
                "redis", [redis, "--port", str(redis_port), "--save", "", "--appendonly", "no"]
            )
            nginx = h.nginx_binary()
            if nginx is not None:
                body = h.nginx_upstream_body(upstream_port)
                upstream = h.start_nginx(procs, nginx, "upstream", body, None)
            else:
                argv = h.uvicorn_argv(
                    sys.executable, "_harness:create_upstream_app", HERE, upstream_port
                )
                upstream = procs.start("upstream", [*argv, "--lifespan", "off"])
            h.wait_ready(procs, upstream, upstream_port, PATH, BODY)
            print(f"upstream: {'nginx' if nginx else 'Python'}; logs in {work}")
            uvloop.run(layers(args, upstream_port, redis_port, redis_proc.pid))
            uvloop.run(scripts(args, redis_port, redis_proc.pid))
        finally:
            procs.stop_all()


if __name__ == "__main__":
    main()
