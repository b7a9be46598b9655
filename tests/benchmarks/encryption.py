"""What `store.encryption_key` costs: CPU per replay and per first request, and Redis
bytes per record with a 1 KiB body, with and without encryption, side by side.

    PYTHONPATH=. .venv/bin/python tests/benchmarks/encryption.py [--requests 400] [--rounds 5]

Two in-process gateways (one plain, one with a key) share one redis-server and the
test upstream (both started here, on free loopback ports, and stopped by PID). Requests
go through httpx's ASGITransport, so the CPU figure (this process's CPU time, per
request) includes the client's share; the upstream runs in its own process and is not
counted. Rounds alternate between the two gateways and the median round is reported,
so a noisy neighbour hits both alike. The ratio is what to read, not the absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from gateway.assembly import Gateway  # noqa: E402
from gateway.config import parse_config  # noqa: E402
from gateway.encryption import PLAIN, ResponseCodec, new_key, parse_key  # noqa: E402
from gateway.keying import record_digest  # noqa: E402
from gateway.proxy.app import ProxyApp  # noqa: E402
from gateway.records import StoredResponse  # noqa: E402
from gateway.store.redis import BUCKETS  # noqa: E402
from tests.support.servers import RedisServer, upstream_server  # noqa: E402

ROUTE = "bench"
KIB = 1024


def gateway(redis_url: str, upstream_url: str, prefix: str, key: str | None) -> Gateway:
    store: dict[str, Any] = {"url": redis_url, "prefix": prefix}
    if key:
        store["encryption_key"] = key
    route = {
        "name": ROUTE,
        "match": {"methods": ["POST"], "path": "/jobs/bench"},
        "upstream": upstream_url,
        "key": {"header": "Idempotency-Key"},
        "fingerprint": "none",
    }
    return Gateway(parse_config({"store": store, "routes": [route]}, "bench"), sweep=False)


async def cpu_per_request(client: httpx.AsyncClient, keys: list[str]) -> float:
    """Process CPU seconds per request for one request with each key, in order."""
    started = time.process_time()
    for key in keys:
        response = await client.post(
            "/jobs/bench", params={"size": KIB}, headers={"idempotency-key": key}
        )
        response.raise_for_status()
    return (time.process_time() - started) / len(keys)


def codec_micro(rounds: int = 20000) -> dict[str, float]:
    response = StoredResponse(
        200, (("content-type", "text/plain"), ("x-run", "1")), b"x" * KIB, origin="upstream"
    )
    digest = record_digest(ROUTE, "", "k")
    sealed = ResponseCodec(parse_key(new_key()))
    figures: dict[str, float] = {}
    for name, codec in (("plain", PLAIN), ("encrypted", sealed)):
        data = codec.encode(digest, response)
        started = time.process_time()
        for _ in range(rounds):
            codec.encode(digest, response)
        figures[f"{name} encode"] = (time.process_time() - started) / rounds
        started = time.process_time()
        for _ in range(rounds):
            codec.decode(digest, data)
        figures[f"{name} decode"] = (time.process_time() - started) / rounds
    return figures


def redis_bytes(client: redis.Redis, prefix: str, key: str) -> tuple[int, int]:
    """(MEMORY USAGE of the record's hash, length of its stored response field)."""
    digest = record_digest(ROUTE, "", key)
    name = f"{prefix}{{{int(digest[:4], 16) % BUCKETS:02x}}}:{digest}"
    return int(client.memory_usage(name, samples=0) or 0), int(client.hstrlen(name, "resp"))


async def main(requests: int, rounds: int) -> None:
    redis_server, upstream = RedisServer(), upstream_server()
    redis_server.start()
    upstream.start()
    try:
        await measure(redis_server, upstream.url, requests, rounds)
    finally:
        upstream.stop()
        redis_server.stop()


async def measure(redis_server: RedisServer, upstream_url: str, requests: int, rounds: int) -> None:
    key = new_key()
    gateways = {
        "plain": gateway(redis_server.url, upstream_url, "bench-plain:", None),
        "encrypted": gateway(redis_server.url, upstream_url, "bench-sealed:", key),
    }
    clients: dict[str, httpx.AsyncClient] = {}
    for name, gw in gateways.items():
        await gw.start()
        clients[name] = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=ProxyApp(gw, lifespan=False)),
            base_url="http://gateway.bench",
            timeout=60,
        )
    replay: dict[str, list[float]] = {name: [] for name in gateways}
    first: dict[str, list[float]] = {name: [] for name in gateways}
    try:
        for name, client in clients.items():  # warm up: connections, one stored record
            await cpu_per_request(client, [f"replayed-{name}"] * 20 + [f"warm-{name}"])
        for round_no in range(rounds):
            for name, client in clients.items():
                replay[name].append(await cpu_per_request(client, [f"replayed-{name}"] * requests))
                fresh = [f"first-{name}-{round_no}-{i}" for i in range(requests // 4)]
                first[name].append(await cpu_per_request(client, fresh))
    finally:
        for name, client in clients.items():
            await client.aclose()
            await gateways[name].close()

    raw = redis.Redis(port=redis_server.port)
    memory = {
        "plain": redis_bytes(raw, "bench-plain:", "replayed-plain"),
        "encrypted": redis_bytes(raw, "bench-sealed:", "replayed-encrypted"),
    }
    raw.close()

    def line(what: str, plain: float, sealed: float, unit: str, scale: float) -> str:
        return (
            f"| {what} | {plain * scale:,.1f} {unit} | {sealed * scale:,.1f} {unit} | "
            f"{sealed / plain:.3f}x |"
        )

    print(f"{requests} replays and {requests // 4} first requests per round, {rounds} rounds,")
    print("median round; CPU of the gateway process (with the in-process client's share)\n")
    print("| per request | plain | encrypted | ratio |")
    print("|---|--:|--:|--:|")
    for label, figures in (("replay CPU", replay), ("first request CPU", first)):
        plain, sealed = statistics.median(figures["plain"]), statistics.median(figures["encrypted"])
        print(line(label, plain, sealed, "µs", 1e6))
    micro = codec_micro()
    for step in ("encode", "decode"):
        print(line(f"codec {step}, 1 KiB body", micro[f"plain {step}"], micro[f"encrypted {step}"],
                   "µs", 1e6))  # fmt: skip
    (plain_mem, plain_resp), (sealed_mem, sealed_resp) = memory["plain"], memory["encrypted"]
    print(line("Redis MEMORY USAGE, record with 1 KiB body", plain_mem, sealed_mem, "B", 1))
    print(line("stored response field (HSTRLEN resp)", plain_resp, sealed_resp, "B", 1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))
