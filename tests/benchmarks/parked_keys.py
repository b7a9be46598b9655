"""The proxy's latency while an operator watches a long list of waiting keys, and the
memory the gateway holds to show it.

    python tests/benchmarks/parked_keys.py [--keys 50000] [--small 5000] [--rounds 3]
        [--duration 20] [--rate 200] [--root DIR]

One redis-server and one upstream of its own, and a gateway process (one worker: its
admin listener runs on the proxy's event loop, as it always does) per condition,
started from DIR (default: this checkout; point it at another checkout to compare).

1. Latency, side by side: rounds alternate between
   - none: no parked key, nobody on the console;
   - parked: `--keys` parked keys, and a console keys page refreshing every 3 s (its
     rows fragment fetched in full each time, as a refresh without its ETag is: the
     worst case; the browser's refresh sends the ETag and mostly gets a 304).
   In both, Prometheus scrapes /metrics every 5 s, and the proxy takes first requests
   of new keys at a fixed `--rate` (open loop: each request is timed from when it was
   due, so a stall counts for every request it held up). Printed: p50, p99 and max of
   each, their medians over the rounds, and parked's p99 over none's (target: 1.2x).
2. Memory: a fresh gateway with `--small` parked keys, then one with `--keys`; each
   serves the list 40 times (the keys page, the API's listing, the overview and
   /metrics); its resident memory before and after (target: flat in the number of
   keys).

The keys are parked through the gateway's own store code (a claim, then an unknown
outcome under `on_unknown_outcome: park`), run in DIR's checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _harness import (  # noqa: E402
    HOST,
    Processes,
    exit_on_signals,
    free_port,
    gateway_env,
    start_upstream,
)

from tests.support.servers import RedisServer, wait_for_port  # noqa: E402

TOKEN = "bench-operator-token-0123456789"
ROUTE = "charge"
PAGE_PERIOD = 3.0
SCRAPE_PERIOD = 5.0

#: Parks keys through a checkout's own store code (run with that checkout as cwd):
#: argv url, prefix, route, count.
FILL = """
import asyncio, sys
from gateway.config import StoreConfig
from gateway.keying import record_digest
from gateway.records import KeyRef
from gateway.store import open_store

async def main(url, prefix, route, count):
    store = open_store(StoreConfig(url=url, prefix=prefix))
    await store.start()
    refs = [KeyRef(record_digest(route, "", f"parked-{i}"), route, f"parked-{i}")
            for i in range(count)]
    for start in range(0, count, 500):
        part = refs[start:start + 500]
        await asyncio.gather(*(store.claim(r, "bench", "fp", 3600) for r in part))
        await asyncio.gather(
            *(store.mark_unresolved(r, "bench", "timed out", park=True) for r in part))
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Gateway:
    """A gateway process on one Redis prefix, with an operator token and a console."""

    def __init__(self, procs: Processes, root: Path, redis: str, upstream: int) -> None:
        self.port, self.admin = free_port(), free_port()
        self.prefix = f"bench{time.time_ns()}:"
        self.root, self.redis = root, redis
        directory = Path(tempfile.mkdtemp(prefix="parked-keys-"))
        config = {
            "server": {"listen": f"{HOST}:{self.port}", "access_log": False},
            "admin": {
                "listen": f"{HOST}:{self.admin}",
                "operators": [{"name": "olga", "role": "operator", "token_env": "OLGA_TOKEN"}],
                "session_secret_env": "CONSOLE_SECRET",
            },
            "store": {"url": redis, "prefix": self.prefix},
            "routes": [
                {
                    "name": ROUTE,
                    "match": {"path": "/charge"},
                    "upstream": f"http://{HOST}:{upstream}",
                    "key": {"header": "Idempotency-Key"},
                }
            ],
        }
        (directory / "gateway.yaml").write_text(yaml.safe_dump(config))
        env = {**gateway_env(), "OLGA_TOKEN": TOKEN, "CONSOLE_SECRET": "c" * 40}
        command = [sys.executable, "-m", "gateway", "run", "--config"]
        self.proc = procs.start(
            f"gateway-{self.port}", [*command, str(directory / "gateway.yaml")], env, root
        )
        wait_for_port(self.port, self.proc)
        wait_for_port(self.admin, self.proc)

    def park(self, count: int) -> None:
        if count:
            args = [sys.executable, "-c", FILL, self.redis, self.prefix, ROUTE, str(count)]
            subprocess.run(args, cwd=self.root, check=True, timeout=600)

    def cookie(self) -> str:
        """A console session of its own (the sign-in form's answer sets it)."""
        request = urllib.request.Request(
            f"http://{HOST}:{self.admin}/console/signin",
            data=f"token={TOKEN}".encode(),
            headers={"Origin": f"http://{HOST}:{self.admin}"},
            method="POST",
        )

        class Keep(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: Any, **kwargs: Any) -> None:
                return None

        opener = urllib.request.build_opener(Keep)
        try:
            opener.open(request, timeout=30)
        except urllib.error.HTTPError as answer:  # the 303 after signing in
            cookie = answer.headers.get("set-cookie", "")
            return cookie.split(";", 1)[0]
        raise RuntimeError("signing in did not answer 303")

    def get(self, path: str, headers: dict[str, str] | None = None) -> int:
        """GET on the admin listener: the body's size."""
        request = urllib.request.Request(f"http://{HOST}:{self.admin}{path}", headers=headers or {})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return len(answer.read())


async def paced_load(port: int, rate: float, duration: float) -> list[float]:
    """First requests of new keys at `rate` a second for `duration`, each timed from when
    it was due (open loop: a stall delays every request due during it). Connections are
    kept alive and opened as needed. Latencies in ms."""
    loop = asyncio.get_running_loop()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    latencies: list[float] = []
    start = loop.time() + 0.2
    prefix = f"k{time.time_ns()}"

    async def one(n: int, due: float) -> None:
        conn = idle.pop() if idle else await asyncio.open_connection(HOST, port)
        reader, writer = conn
        writer.write(
            f"POST /charge HTTP/1.1\r\nHost: {HOST}\r\nIdempotency-Key: {prefix}-{n}\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        await reader.readexactly(length)
        latencies.append((loop.time() - due) * 1000)
        idle.append(conn)

    tasks = []
    total = int(rate * duration)
    for n in range(total):
        due = start + n / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
        tasks.append(asyncio.create_task(one(n, due)))
    await asyncio.gather(*tasks)
    for _, writer in idle:
        writer.close()
    return latencies


def load_in_child(port: int, rate: float, duration: float) -> list[float]:
    """paced_load in a process of its own, so the pollers never delay its requests."""
    code = (
        "import asyncio, json, sys; sys.path.insert(0, sys.argv[1]); "
        "from parked_keys import paced_load; "
        "print(json.dumps(asyncio.run(paced_load(int(sys.argv[2]), float(sys.argv[3]), "
        "float(sys.argv[4])))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(HERE), str(port), str(rate), str(duration)],
        check=True,
        capture_output=True,
        text=True,
        timeout=duration + 120,
    ).stdout
    values: list[float] = json.loads(out)
    return values


async def poll(gateway: Gateway, period: float, path: str, headers: dict[str, str]) -> None:
    while True:
        await asyncio.to_thread(gateway.get, path, headers)
        await asyncio.sleep(period)


async def latency_round(
    gateway: Gateway, page: bool, rate: float, duration: float
) -> dict[str, float]:
    pollers = [asyncio.create_task(poll(gateway, SCRAPE_PERIOD, "/metrics", {}))]
    if page:
        cookie = gateway.cookie()
        pollers.append(
            asyncio.create_task(
                poll(gateway, PAGE_PERIOD, "/console/keys/rows", {"Cookie": cookie})
            )
        )
    try:
        latencies = sorted(await asyncio.to_thread(load_in_child, gateway.port, rate, duration))
    finally:
        for task in pollers:
            task.cancel()
        await asyncio.gather(*pollers, return_exceptions=True)
    return {
        "p50": statistics.quantiles(latencies, n=100)[49],
        "p99": statistics.quantiles(latencies, n=100)[98],
        "max": latencies[-1],
        "requests": len(latencies),
    }


def serve_list(gateway: Gateway, times: int) -> int:
    """The list, `times` over: the keys page, the API's first page, the overview, metrics."""
    cookie = {"Cookie": gateway.cookie()}
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    largest = 0
    for _ in range(times):
        largest = max(
            largest,
            gateway.get("/console/keys", cookie),
            gateway.get("/console/keys/rows", cookie),
            gateway.get("/admin/keys", bearer),
            gateway.get("/admin/overview", bearer),
            gateway.get("/metrics"),
        )
    return largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--small", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args()
    procs = Processes(Path(tempfile.mkdtemp(prefix="parked-keys-logs-")))
    redis = RedisServer()
    with exit_on_signals():
        try:
            redis.start()
            upstream = free_port()
            start_upstream(procs, upstream, None, "/charge", b"{}")
            print(f"gateway from {args.root}; {args.keys:,} parked keys; {args.rate:g} req/s")
            none_gw = Gateway(procs, args.root, redis.url, upstream)
            parked_gw = Gateway(procs, args.root, redis.url, upstream)
            parked_gw.park(args.keys)
            rows: dict[str, list[dict[str, float]]] = {"none": [], "parked": []}
            for n in range(args.rounds):
                for name, gateway, page in (("none", none_gw, False), ("parked", parked_gw, True)):
                    figures = asyncio.run(latency_round(gateway, page, args.rate, args.duration))
                    rows[name].append(figures)
                    print(
                        f"round {n + 1} {name:>6}: p50 {figures['p50']:7.2f} ms  p99 "
                        f"{figures['p99']:7.2f} ms  max {figures['max']:8.2f} ms  "
                        f"({figures['requests']:.0f} requests)",
                        flush=True,
                    )
            p99 = {name: statistics.median(r["p99"] for r in runs) for name, runs in rows.items()}
            worst = {name: max(r["max"] for r in runs) for name, runs in rows.items()}
            print(
                f"median p99: none {p99['none']:.2f} ms, parked {p99['parked']:.2f} ms: "
                f"{p99['parked'] / p99['none']:.2f}x (target 1.2x); worst max: none "
                f"{worst['none']:.1f} ms, parked {worst['parked']:.1f} ms"
            )
            for gateway in (none_gw, parked_gw):
                procs.stop(gateway.proc)
            for count in (args.small, args.keys):
                gateway = Gateway(procs, args.root, redis.url, upstream)
                gateway.park(count)
                gateway.get("/metrics")
                before = rss_mib(gateway.proc.pid)
                largest = serve_list(gateway, 40)
                after = rss_mib(gateway.proc.pid)
                print(
                    f"RSS with {count:>6,} parked keys: {before:6.1f} MiB before serving the "
                    f"list 40 times, {after:6.1f} MiB after (largest body {largest:,} bytes)"
                )
                procs.stop(gateway.proc)
        finally:
            procs.stop_all()
            redis.stop()


if __name__ == "__main__":
    main()
