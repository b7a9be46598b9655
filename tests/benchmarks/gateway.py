"""What does the idempotency gateway cost per request, next to nginx and a bare Python proxy?

One command starts, on loopback only, and always stops again (process groups, also on Ctrl-C,
SIGTERM, errors and after --max-minutes):

* a trivial upstream: nginx `return 200 '{"ok":true}'` (1 worker, keep-alive), or a minimal
  uvicorn app when nginx is not installed; a second, Python upstream answers `/slow/...` after
  0.3 s (only for the "waiting duplicate" figure);
* its own redis-server (free port, `--save "" --appendonly no`); db 0 starts empty (FLUSHDB
  before every gateway workload), db 1 is preloaded with --preload real-looking completed
  records (same hash layout `idem:{xx}:<digest>`, same fields, 24 h TTL) for the O(1) check;
* contenders, one at a time, pinned to --server-cpu (with the upstream and Redis), while
  `wrk -t1 -c32` runs on --load-cpu:
  - direct: wrk straight to the upstream; nginx: nginx proxy_pass (upstream keep-alive);
  - bare: proxy_app.py's Starlette catch-all proxy with the gateway's own upstream client
    (gateway/upstream/client.py; no idempotency), the "same client" reference; bare-aiohttp: the
    same proxy with aiohttp (needs the bench extra), the client the gateway used before;
  - gateway: `python -m gateway run` (uvloop, httptools), one route,
    `key: {header: Idempotency-Key}`, `fingerprint: none` (or --fingerprint default),
    Redis store on db 0; gateway-1m: the same on db 1 (1M records stored); gateway-2w:
    `run --workers 2` when the CLI has that option (gateway-3w: 3); gateway-mem: the
    memory:// store;
* workloads (the gateway rows; the references see unique keys, which they ignore):
  unique (a new key per request: counter + random prefix per run), same (one key: replays),
  storm (the key changes every 50 requests: with 32 connections, concurrent duplicates),
  mix (80% new keys, 20% repeats of the 256 most recent ones);
* runs alternate the contenders; the table shows medians of req/s, p50, p99 and of the
  per-run ratios to nginx proxy_pass and to the bare proxy.

Then, on fresh gateway processes: Redis commands per request (MONITOR for the round trips,
INFO commandstats deltas for the work inside scripts) for first requests, replays, storms and
a duplicate that waits on another gateway process; Redis memory per stored key for a 1 KiB
response (MEMORY USAGE of sampled records); gateway RSS before and after 200,000 requests;
a py-spy CPU profile of the unique-key workload (top functions).

Usage (nothing here runs under pytest; `--quick` is a smoke run of about a minute; the
reference clients come with `pip install -e '.[test,bench]'`):

    .venv/bin/python tests/benchmarks/gateway.py [--duration 8] [--runs 3] [--quick]
        [--only gateway,nginx,bare] [--workloads unique,same] [--extras commands,memory]
        [--json out.json]

Profile by hand: start the gateway, then `py-spy top --pid PID` or
`py-spy record --pid PID --duration 20 --nonblocking -o profile.svg` while wrk runs
(py-spy: `python3 -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import http.client
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import _harness as h
from loadgen import DEFAULT_BODY, LoadResult

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PATH = "/v1/payments"
WORKLOADS = ("unique", "same", "storm", "mix")
EXTRAS = ("commands", "memory", "rss", "profile")
PREFIX = "idem:"
DEFAULT_PYSPY = "/tmp/pyspy/bin/py-spy"
#: Commands the gateway sends on its own, not per request: the lease sweep (a pipeline of
#: TIME + one ZRANGEBYSCORE per bucket), health checks, the notification subscription; and
#: the benchmark's own INFO and ZCARD (it waits for a key to be in flight).
BACKGROUND = frozenset(
    {"TIME", "ZRANGEBYSCORE", "PING", "SSUBSCRIBE", "SUBSCRIBE", "CLIENT", "INFO", "ZCARD"}
)


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    kind: str  # "direct" | "nginx" | "bare" | "gateway"
    client: str = "gateway-128"  # bare: proxy_app.py's BENCH_CLIENT
    store: str = "redis"  # gateway: "redis" | "memory"
    db: int = 0
    workers: int = 1
    src: str = ""  # gateway: the checkout it runs from ("" = --gateway-src)

    @property
    def is_gateway(self) -> bool:
        return self.kind == "gateway"


def all_contenders(preload: int) -> list[Contender]:
    return [
        Contender("direct", "upstream called directly", "direct"),
        Contender("nginx", "nginx proxy_pass", "nginx"),
        # "bare" uses the gateway's own upstream client: the "x bare" ratio is the cost
        # of the idempotency layer with the same client.
        Contender("bare", "bare Starlette proxy, the gateway's client", "bare"),
        Contender(
            "bare-aiohttp",
            f"bare Starlette proxy, aiohttp {h.dist_version('aiohttp')}",
            "bare",
            client="aiohttp-128",
        ),
        Contender("gateway", "gateway, Redis, 1 worker", "gateway"),
        Contender(
            "gateway-1m", f"gateway, Redis with {preload:,} keys stored, 1 worker", "gateway", db=1
        ),
        Contender("gateway-2w", "gateway, Redis, 2 workers", "gateway", workers=2),
        Contender("gateway-3w", "gateway, Redis, 3 workers", "gateway", workers=3),
        Contender("gateway-mem", "gateway, memory://, 1 worker", "gateway", store="memory"),
    ]


@dataclass(frozen=True)
class Result(LoadResult):
    """A wrk run (LoadResult's fields, same order) and what the gateway rows add."""

    replayed: int = 0
    #: CPU time the contender's processes (and Redis) used per request during the run:
    #: unlike req/s, barely moved by whatever else the machine is doing.
    cpu_us: float = 0.0
    redis_cpu_us: float = 0.0


# --------------------------------------------------------------------------- wrk

WRK_LUA = """\
-- POST a small JSON body with an Idempotency-Key chosen by the workload (args: prefix, mode,
-- seed, cycle). unique: a new key per request; same: one key; storm: a new key every 50
-- requests; mix: 80% new keys, 20% repeats of the 256 most recent new keys; cycle: the
-- keys unique made with the same prefix, 1..cycle over and over (replays of distinct keys).
wrk.method = "POST"
wrk.path = "{path}"
wrk.body = '{body}'
local counter = 0
local prefix = "k"
local mode = "unique"
local cycle = 1
local recent = {{}}
local nrecent = 0
local RECENT = 256
local hdrs = {{["Content-Type"] = "application/json", ["Idempotency-Key"] = ""}}
local threads = {{}}
replayed = 0

function setup(thread)
    table.insert(threads, thread)
end

function init(args)
    prefix = args[1] or prefix
    mode = args[2] or mode
    math.randomseed(tonumber(args[3] or "1"))
    cycle = tonumber(args[4] or "1")
end

function request()
    counter = counter + 1
    local key
    if mode == "same" then
        key = prefix .. "-same"
    elseif mode == "cycle" then
        key = prefix .. "-" .. ((counter - 1) % cycle + 1)
    elseif mode == "storm" then
        key = prefix .. "-s" .. math.floor((counter - 1) / 50)
    elseif mode == "mix" and nrecent > 0 and math.random() < 0.2 then
        key = recent[math.random(math.min(nrecent, RECENT))]
    else
        key = prefix .. "-" .. counter
        if mode == "mix" then
            nrecent = nrecent + 1
            recent[((nrecent - 1) % RECENT) + 1] = key
        end
    end
    hdrs["Idempotency-Key"] = key
    return wrk.format(nil, nil, hdrs, nil)
end
{response}
function done(summary, latency, requests)
    local rep = 0
    for _, t in ipairs(threads) do rep = rep + (tonumber(t:get("replayed")) or 0) end
    local e = summary.errors
    io.write(string.format(
        'BENCH_JSON {{"requests":%d,"duration_us":%d,"p50_us":%.1f,"p99_us":%.1f,' ..
        '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,"replayed":%d}}\\n',
        summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
        e.connect, e.read, e.write, e.status, e.timeout, rep))
end
"""

WRK_COUNT_REPLAYS = """
function response(status, headers, body)
    if headers["idempotent-replayed"] or headers["Idempotent-Replayed"] then
        replayed = replayed + 1
    end
end
"""


@dataclass
class Wrk:
    binary: str
    cpu: int | None
    connections: int
    work_dir: Path
    calls: int = 0
    run_tag: str = field(default_factory=lambda: secrets.token_hex(3))

    def __post_init__(self) -> None:
        body = DEFAULT_BODY.decode()
        self.lua_plain = self.work_dir / "plain.lua"
        self.lua_plain.write_text(WRK_LUA.format(path=PATH, body=body, response=""))
        self.lua_count = self.work_dir / "count.lua"
        self.lua_count.write_text(WRK_LUA.format(path=PATH, body=body, response=WRK_COUNT_REPLAYS))

    def run(
        self, port: int, duration: float, mode: str = "unique", count_replays: bool = False
    ) -> Result:
        self.calls += 1
        prefix = f"{self.run_tag}x{self.calls}"  # a random prefix per run
        lua = self.lua_count if count_replays else self.lua_plain
        args = (prefix, mode, str(self.calls))
        data = h.run_wrk(self.binary, self.cpu, self.connections, duration, lua, port, PATH, args)
        return Result(**h.wrk_load_fields(data), replayed=data["replayed"])


# --------------------------------------------------------------------------- redis


def lua_script_names(src: Path) -> dict[str, str]:
    """sha1 -> script name, computed the way gateway/store/redis/store.py builds its scripts."""
    lua = src / "gateway" / "store" / "redis" / "lua"
    lib = (lua / "_lib.lua").read_text()
    names = {}
    for path in sorted(lua.glob("*.lua")):
        if path.name.startswith("_"):
            continue
        source = lib + "\n" + path.read_text()
        names[hashlib.sha1(source.encode()).hexdigest()] = path.stem
    return names


PRELOAD_LUA = """\
-- Create ARGV[2] completed records numbered from ARGV[1], in the gateway's layout:
-- hash <prefix>{bucket}:<digest> with the fields claim.lua + complete.lua leave behind.
local prefix, first, n, resp, ttl = ARGV[3], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[4], ARGV[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000
for i = first, first + n - 1 do
  local digest = string.sub(redis.sha1hex('preload/' .. i), 1, 32)
  local bucket = tonumber(string.sub(digest, 1, 4), 16) % 64
  local key = prefix .. string.format('{%02x}:', bucket) .. digest
  redis.call('HSET', key, 's', 'completed', 'r', string.sub(redis.sha1hex('run' .. i), 1, 16),
    'f', '', 'c', now, 'u', now, 'rt', 'bench', 'k', 'preload-' .. i, 'resp', resp)
  redis.call('PEXPIRE', key, ttl)
end
return n
"""

PRELOAD_RESP = (
    '[200,[["server","nginx"],["date","Sun, 29 Nov 2026 09:00:00 GMT"],'
    '["content-type","application/json"]],0,"upstream"]\n{"ok":true}'
)


class RedisServer:
    def __init__(self, procs: h.Processes, cpu: int | None, work_dir: Path) -> None:
        import redis  # the venv's redis-py

        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (scripts/setup installs it)")
        self.port = h.free_port()
        argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            h.HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(work_dir),
            "--databases",
            "4",
        ]
        self.proc = procs.start("redis", h.pinned(cpu, argv))
        self.clients = [redis.Redis(h.HOST, self.port, db=db) for db in range(2)]
        deadline = time.monotonic() + 10
        while True:
            try:
                self.clients[0].ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server did not start:\n{procs.log_tail(self.proc)}"
                    ) from None
                time.sleep(0.05)
        self.version = str(self.clients[0].info("server")["redis_version"])

    def url(self, db: int) -> str:
        return f"redis://{h.HOST}:{self.port}/{db}"

    def preload(self, db: int, count: int) -> dict[str, float]:
        client = self.clients[db]
        client.flushdb()
        before = int(client.info("memory")["used_memory"])
        started = time.monotonic()
        batch = 50_000
        for first in range(0, count, batch):
            n = min(batch, count - first)
            client.eval(PRELOAD_LUA, 0, first, n, PREFIX, PRELOAD_RESP, 86_400_000)
        after = int(client.info("memory")["used_memory"])
        return {
            "records": count,
            "seconds": round(time.monotonic() - started, 1),
            "used_memory_per_record": (after - before) / count if count else 0.0,
            "dbsize": client.dbsize(),
        }

    def commandstats(self) -> dict[str, dict[str, float]]:
        return {k.upper(): v for k, v in self.clients[0].info("commandstats").items()}


# --------------------------------------------------------------------------- the benchmark


@dataclass
class Bench:
    args: argparse.Namespace
    procs: h.Processes
    wrk: Wrk
    nginx: str | None
    redis: RedisServer
    work_dir: Path
    upstream_port: int = 0
    slow_port: int = 0
    workers_flag: bool = False

    # -- servers

    def start_upstreams(self) -> None:
        self.upstream_port = h.free_port()
        if self.nginx is not None:
            body = h.nginx_upstream_body(self.upstream_port)
            proc = h.start_nginx(self.procs, self.nginx, "upstream", body, self.args.server_cpu)
        else:
            proc = self._python_upstream("upstream", self.upstream_port)
        h.wait_ready(self.procs, proc, self.upstream_port, PATH, DEFAULT_BODY)
        self.slow_port = h.free_port()
        slow = self._python_upstream("slow-upstream", self.slow_port)
        h.wait_ready(self.procs, slow, self.slow_port, PATH, DEFAULT_BODY)

    def _python_upstream(self, name: str, port: int) -> subprocess.Popen[bytes]:
        argv = h.uvicorn_argv(sys.executable, "_harness:create_upstream_app", HERE, port)
        return self.procs.start(name, h.pinned(self.args.server_cpu, [*argv, "--lifespan", "off"]))

    def gateway_config(self, c: Contender, port: int, admin_port: int) -> Path:
        url = "memory://" if c.store == "memory" else self.redis.url(c.db)
        fp = "fingerprint: none" if self.args.fingerprint == "none" else ""
        access_log = "true" if self.args.access_log == "on" else "false"
        text = f"""\
server: {{listen: "{h.HOST}:{port}", shutdown_grace: 1s, access_log: {access_log}}}
admin: {{listen: "{h.HOST}:{admin_port}"}}
store: {{url: "{url}", prefix: "{PREFIX}"}}
routes:
  - name: slow
    match: {{path: "{h.SLOW_PATH}/{{rest:path}}"}}
    upstream: http://{h.HOST}:{self.slow_port}
    key: {{header: Idempotency-Key}}
    {fp}
  - name: bench
    match: {{path: "/{{rest:path}}"}}
    upstream: http://{h.HOST}:{self.upstream_port}
    key: {{header: Idempotency-Key}}
    {fp}
"""
        path = self.work_dir / f"gateway-{c.key}-{port}.yaml"
        path.write_text(text)
        return path

    @contextlib.contextmanager
    def serving(self, c: Contender, tag: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
        """Start the contender (if any); yield the port the load goes to and its process."""
        if c.kind == "direct":
            yield self.upstream_port, self.procs.start(tag, ["sleep", "3600"])
            return
        port = h.free_port()
        if c.kind == "nginx":
            assert self.nginx is not None
            body = h.nginx_proxy_body(port, self.upstream_port)
            proc = h.start_nginx(self.procs, self.nginx, tag, body, self.args.server_cpu)
        elif c.kind == "bare":
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
            env["BENCH_UPSTREAM"] = f"http://{h.HOST}:{self.upstream_port}"
            env["BENCH_CLIENT"] = c.client
            env["BENCH_GATEWAY_SRC"] = str(Path(self.args.gateway_src).resolve())
            argv = h.uvicorn_argv(sys.executable, "proxy_app:create_app", HERE, port)
            proc = self.procs.start(tag, h.pinned(self.args.server_cpu, argv), env=env)
        else:
            config = self.gateway_config(c, port, h.free_port())
            argv = [sys.executable, "-m", "gateway", "run", "--config", str(config)]
            argv += ["--log-level", "WARNING"]
            if c.workers > 1:
                argv += ["--workers", str(c.workers)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
            env.pop("PYTHONPATH", None)
            if self.args.gateway_pythonpath:  # e.g. a --target dir with hiredis, to try it
                env["PYTHONPATH"] = self.args.gateway_pythonpath
            proc = self.procs.start(
                tag,
                h.pinned(self.args.server_cpu, argv),
                env=env,
                cwd=c.src or self.args.gateway_src,
            )
        try:
            h.wait_ready(self.procs, proc, port, PATH, DEFAULT_BODY)
            yield port, proc
        finally:
            self.procs.stop(proc)

    def flush(self, c: Contender) -> None:
        if c.is_gateway and c.store == "redis" and c.db == 0:
            self.redis.clients[0].flushdb()

    # -- the table

    def measure_run(
        self, c: Contender, run: int, workloads: Sequence[str], report: Callable[..., None]
    ) -> dict[str, Result]:
        out: dict[str, Result] = {}
        with self.serving(c, f"{c.key}-run{run}") as (port, proc):
            for w in workloads if c.is_gateway else ("unique",):
                self.flush(c)
                if self.args.warmup > 0:
                    self.wrk.run(port, self.args.warmup, w)
                pids = h.group_pids(proc.pid)
                cpu = h.cpu_seconds(pids), h.cpu_seconds([self.redis.proc.pid])
                r = self.wrk.run(port, self.args.duration, w, count_replays=c.is_gateway)
                if r.requests:
                    r = replace(
                        r,
                        cpu_us=(h.cpu_seconds(pids) - cpu[0]) * 1e6 / r.requests,
                        redis_cpu_us=(
                            (h.cpu_seconds([self.redis.proc.pid]) - cpu[1]) * 1e6 / r.requests
                        ),
                    )
                out[w] = r
                report(run, c, w if c.is_gateway else "-", r)
        return out


# --------------------------------------------------------------------------- extras


class Monitor:
    """`redis-cli monitor` into a file for the duration of a `with` block."""

    def __init__(self, bench: Bench, name: str) -> None:
        self.bench = bench
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Monitor:
        cli = shutil.which("redis-cli") or "redis-cli"
        argv = [cli, "-h", h.HOST, "-p", str(self.bench.redis.port), "monitor"]
        self.proc = self.bench.procs.start(self.name, argv)
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        assert self.proc is not None
        self.bench.procs.stop(self.proc)

    def lines(self) -> list[str]:
        return (
            (self.bench.procs.log_dir / f"{self.name}.log").read_text(errors="replace").splitlines()
        )


_MONITOR_RE = re.compile(r'^[\d.]+ \[(\d+) ([^\]]+)\] "([^"]+)"(?: "([^"]*)")?')


def parse_monitor(lines: list[str], scripts: dict[str, str]) -> dict[str, Counter]:
    """Top-level commands (EVALSHA by script name) and commands run inside scripts."""
    top: Counter = collections.Counter()
    inner: Counter = collections.Counter()
    background: Counter = collections.Counter()
    for line in lines:
        m = _MONITOR_RE.match(line)
        if m is None:
            continue
        source, cmd, arg = m.group(2), m.group(3).upper(), m.group(4) or ""
        if source == "lua":
            inner[cmd] += 1
        elif cmd in BACKGROUND or (cmd in ("GET", "SET") and arg.endswith(":m")):
            # ...and the store-reset markers every process reads once a second
            background[cmd] += 1
        elif cmd == "EVALSHA":
            top["EVALSHA " + scripts.get(arg.lower(), arg[:8])] += 1
        else:
            top[cmd] += 1
    return {"round_trips": top, "inside_scripts": inner, "background": background}


Counter = collections.Counter


class Client:
    """A keep-alive HTTP/1.1 client for the extras (one connection per thread)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.local = threading.local()

    def post(self, key: str, path: str = PATH) -> tuple[int, bool]:
        # A kept-alive connection the server closed meanwhile (uvicorn: after 5 s idle) is
        # replaced once: resending is safe, the request never reached the application.
        for attempt in (1, 2):
            conn: http.client.HTTPConnection | None = getattr(self.local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = http.client.HTTPConnection(h.HOST, self.port, timeout=10)
                self.local.conn = conn
            try:
                conn.request(
                    "POST",
                    path,
                    body=DEFAULT_BODY,
                    headers={"Content-Type": "application/json", "Idempotency-Key": key},
                )
                response = conn.getresponse()
                response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if reused and attempt == 1:
                    continue
                raise
            return response.status, response.getheader("idempotent-replayed") == "true"
        raise AssertionError("unreachable")


def commands_per_request(bench: Bench, db: int, n: int) -> dict[str, Any]:
    """Round trips per request from MONITOR, and Redis work from INFO commandstats deltas."""
    scripts = lua_script_names(Path(bench.args.gateway_src))
    c = Contender(f"cmd-db{db}", "", "gateway", db=db)
    out: dict[str, Any] = {}
    tag = secrets.token_hex(3)
    with (
        bench.serving(c, f"commands-a-db{db}") as (port_a, _),
        bench.serving(c, f"commands-b-db{db}") as (port_b, _),
    ):
        a, b = Client(port_a), Client(port_b)
        for i in range(20):  # load the scripts, fill the pools
            a.post(f"warm-{tag}-{i}")
            b.post(f"warm-{tag}-{i}")
        storms = max(2, n // 50)
        pool = ThreadPoolExecutor(max_workers=50)

        def first(t: str) -> int:
            for i in range(n):
                assert a.post(f"first-{t}-{i}")[0] == 200
            return n

        def replay(t: str) -> int:
            a.post(f"replay-{t}")
            for _ in range(n):
                assert a.post(f"replay-{t}") == (200, True)
            return n

        def storm(t: str) -> int:
            for s in range(storms):
                key = f"storm-{t}-{s}"
                futures = [pool.submit(a.post, key) for _ in range(50)]
                assert all(f.result()[0] == 200 for f in futures)
            return storms * 50

        indexes = [f"{PREFIX}{{{b:02x}}}:i:in_flight" for b in range(64)]

        def in_flight(deadline: float) -> None:
            """Until the first request holds its key (ZCARD is left out of the counts)."""
            client = bench.redis.clients[db]
            while time.monotonic() < deadline:
                pipe = client.pipeline(transaction=False)
                for index in indexes:
                    pipe.zcard(index)
                if sum(pipe.execute()):
                    return
                time.sleep(0.005)

        def waiting(t: str) -> int:
            # A duplicate reaching another gateway process while the first is in flight:
            # it waits for the store's notification instead of polling.
            pairs = max(2, n // 50)
            for i in range(pairs):
                key = f"wait-{t}-{i}"
                fut = pool.submit(a.post, key, h.SLOW_PATH + "/x")
                in_flight(time.monotonic() + h.SLOW_DELAY_S / 2)
                status, replayed = b.post(key, h.SLOW_PATH + "/x")
                assert status == 200 and replayed, (status, replayed)
                assert fut.result()[0] == 200
            return pairs

        scenarios: list[tuple[str, Callable[[str], int], str]] = [
            ("first request (new key)", first, "per request"),
            ("replay (completed key)", replay, "per request"),
            ("50-way storm, one process", storm, "per request"),
            ("waiting duplicate on a 2nd process + its first", waiting, "per pair"),
        ]
        try:
            for name, fn, unit in scenarios:
                # Redis CPU and calls without MONITOR (it slows every command down), then
                # the same scenario on fresh keys under MONITOR for the round trips.
                stats0 = bench.redis.commandstats()
                count = fn(f"{tag}s")
                stats1 = bench.redis.commandstats()
                parsed: dict[str, Counter] = {}
                if not bench.args.no_monitor:
                    with Monitor(bench, f"monitor-{db}-{fn.__name__}") as mon:
                        fn(f"{tag}m")
                    parsed = parse_monitor(mon.lines(), scripts)
                delta = {
                    cmd: stats1[cmd]["calls"] - stats0.get(cmd, {}).get("calls", 0)
                    for cmd in stats1
                    if cmd not in ("CMDSTAT_INFO",)
                }
                usec = sum(
                    stats1[cmd]["usec"] - stats0.get(cmd, {}).get("usec", 0)
                    for cmd in stats1
                    if cmd.startswith(("CMDSTAT_EVAL", "CMDSTAT_FCALL"))
                )
                row: dict[str, Any] = {
                    "unit": unit,
                    "count": count,
                    "commandstats_calls_per_unit": {
                        k.removeprefix("CMDSTAT_"): round(v / count, 2)
                        for k, v in sorted(delta.items())
                        if v
                    },
                    "script_usec_per_unit": round(usec / count, 1),
                }
                if parsed:
                    trips = parsed["round_trips"]
                    row["round_trips"] = round(sum(trips.values()) / count, 3)
                    row["round_trips_by_command"] = {
                        k: round(v / count, 3) for k, v in sorted(trips.items())
                    }
                    row["inside_scripts"] = {
                        k: round(v / count, 2) for k, v in sorted(parsed["inside_scripts"].items())
                    }
                    row["background_total"] = dict(parsed["background"])
                out[name] = row
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    return out


def memory_per_key(bench: Bench, n: int) -> dict[str, Any]:
    client = bench.redis.clients[0]
    c = Contender("mem-db0", "", "gateway")
    with bench.serving(c, "memory-db0") as (port, _):
        gw = Client(port)
        client.flushdb()
        before = int(client.info("memory")["used_memory"])
        tag = secrets.token_hex(3)
        for i in range(n):
            gw.post(f"kib-{tag}-{i}", h.KIB_PATH)
        after = int(client.info("memory")["used_memory"])
        sizes = []
        fields: set[str] = set()
        for key in client.scan_iter(match=PREFIX + "{*}:*", count=1000):
            if b":i:" in key or key.endswith(b":c"):
                continue
            if client.type(key) != b"hash":
                continue
            sizes.append(int(client.memory_usage(key, samples=0) or 0))
            if not fields:
                fields = {f.decode() for f in client.hkeys(key)}
                resp_len = client.hstrlen(key, "resp")
                encoding = client.object("encoding", key)
            if len(sizes) >= 500:
                break
    preload_fields = set()
    for key in bench.redis.clients[1].scan_iter(match=PREFIX + "{*}:*", count=100):
        preload_fields = {f.decode() for f in bench.redis.clients[1].hkeys(key)}
        break
    return {
        "requests": n,
        "records_sampled": len(sizes),
        "memory_usage_median_bytes": statistics.median(sizes) if sizes else 0,
        "memory_usage_min_max": [min(sizes), max(sizes)] if sizes else [],
        "used_memory_delta_per_key": round((after - before) / n, 1),
        "stored_response_bytes": resp_len if sizes else 0,
        "encoding": encoding.decode() if sizes and isinstance(encoding, bytes) else "",
        "record_fields": sorted(fields),
        "preloaded_fields_match": (not preload_fields) or preload_fields == fields,
    }


def rss_over(bench: Bench, total: int) -> dict[str, Any]:
    c = Contender("rss", "", "gateway")
    with bench.serving(c, "rss") as (port, proc):
        bench.redis.clients[0].flushdb()
        warm = bench.wrk.run(port, 3, "unique")
        start_kib = h.process_group_rss_kib(proc.pid)
        done = 0
        trail = []
        chunk_s = 10.0 if total >= 100_000 else 3.0
        deadline = time.monotonic() + 600
        while done < total and time.monotonic() < deadline:
            r = bench.wrk.run(port, chunk_s, "unique")
            done += r.requests
            trail.append([done, round(h.process_group_rss_kib(proc.pid) / 1024, 1)])
        end_kib = h.process_group_rss_kib(proc.pid)
    return {
        "warmup_requests": warm.requests,
        "requests": done,
        "rss_mib_before": round(start_kib / 1024, 1),
        "rss_mib_after": round(end_kib / 1024, 1),
        "trail_requests_rss_mib": trail,
    }


def profile(bench: Bench, seconds: float) -> dict[str, Any]:
    pyspy = bench.args.py_spy or shutil.which("py-spy")
    if not pyspy or not os.access(pyspy, os.X_OK):
        return {
            "skipped": "py-spy not found: python3 -m venv /tmp/pyspy && "
            "/tmp/pyspy/bin/pip install py-spy"
        }
    c = Contender("profile", "", "gateway")
    raw = bench.work_dir / "profile.txt"
    with bench.serving(c, "profile") as (port, proc):
        bench.redis.clients[0].flushdb()
        workload = bench.args.profile_workload
        bench.wrk.run(port, 2, workload)
        argv = [pyspy, "record", "--pid", str(proc.pid), "--duration", str(int(seconds))]
        argv += ["--rate", "250", "--nonblocking", "--format", "raw", "--output", str(raw)]
        spy = bench.procs.start("py-spy", argv)
        time.sleep(0.5)
        result = bench.wrk.run(port, seconds + 1, workload)
        try:
            spy.wait(timeout=seconds + 30)
        finally:
            bench.procs.stop(spy)
    if not raw.exists():
        return {"skipped": f"py-spy wrote nothing: {bench.procs.log_tail(spy)}"}
    stacks = _read_collapsed(raw)
    return {"rps_while_sampled": round(result.rps), **_summarize(stacks)}


def _read_collapsed(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


_FRAME_RE = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def _frame_name(frame: str) -> str:
    m = _FRAME_RE.match(frame)
    if m is None:
        return frame
    file = m.group("file")
    for marker in ("site-packages/", "/lib/python3", "/work/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    if "/gateway/" in file:
        file = "gateway/" + file.split("/gateway/", 1)[1]
    return f"{m.group('func')} ({file})"


def _area(frame: str) -> str:
    name = _frame_name(frame)
    file = name[name.rfind("(") + 1 : -1]
    for area in ("gateway/", "aiohttp", "redis", "uvicorn", "starlette", "yarl", "multidict"):
        if file.startswith(area) or area in file.split("/")[0]:
            return area.rstrip("/")
    if file.startswith(".") or "asyncio" in file or "uvloop" in file:
        return "asyncio/uvloop"
    return "other: " + file.split("/")[0]


def _summarize(stacks: list[tuple[list[str], int]], top: int = 18) -> dict[str, Any]:
    total = sum(n for _, n in stacks) or 1
    self_time: Counter = collections.Counter()
    inclusive: Counter = collections.Counter()
    areas: Counter = collections.Counter()
    for frames, n in stacks:
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        self_time[_frame_name(frames[-1])] += n
        areas[_area(frames[-1])] += n
        for name in {_frame_name(f) for f in frames}:
            inclusive[name] += n

    def pct(counter: Counter) -> list[list[Any]]:
        return [[name, round(100 * n / total, 1)] for name, n in counter.most_common(top)]

    gateway_incl = collections.Counter(
        {k: v for k, v in inclusive.items() if "(gateway/" in k or "proxy_app" in k}
    )
    return {
        "samples": total,
        "self_pct": pct(self_time),
        "inclusive_pct_gateway_code": pct(gateway_incl),
        "inclusive_pct": pct(inclusive),
        "self_pct_by_area": pct(areas),
    }


# --------------------------------------------------------------------------- output


def render_table(
    contenders: list[Contender],
    workloads: Sequence[str],
    results: dict[str, dict[str, list[Result]]],
) -> tuple[str, dict[str, dict[str, dict[str, float]]]]:
    def refs(key: str) -> list[Result]:
        return results.get(key, {}).get("-", [])

    nginx, bare = refs("nginx"), refs("bare")
    lines = [
        "| contender | workload | req/s | p50 ms | p99 ms | x nginx | x bare | CPU us/req | "
        "CPU x bare | Redis CPU us/req | replayed | non-2xx | errors |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    summary: dict[str, dict[str, dict[str, float]]] = {}

    for c in contenders:
        for w in workloads if c.is_gateway else ("-",):
            rs = results.get(c.key, {}).get(w, [])
            if not rs:
                continue
            xn, xb = h.median_rps_ratio(rs, nginx), h.median_rps_ratio(rs, bare)
            cpu = h.median([r.cpu_us for r in rs])
            bare_cpu = h.median([r.cpu_us for r in bare]) if bare else 0.0
            redis_cpu = h.median([r.redis_cpu_us for r in rs]) if c.is_gateway else None
            requests = sum(r.requests for r in rs)
            row = {
                "rps": h.median([r.rps for r in rs]),
                "p50_ms": h.median([r.p50_ms for r in rs]),
                "p99_ms": h.median([r.p99_ms for r in rs]),
                "x_nginx": xn if xn is not None else float("nan"),
                "x_bare": xb if xb is not None else float("nan"),
                "replayed_pct": 100 * sum(r.replayed for r in rs) / requests if requests else 0,
                "cpu_us": cpu,
                "cpu_x_bare": cpu / bare_cpu if bare_cpu else float("nan"),
                "redis_cpu_us": redis_cpu if redis_cpu is not None else float("nan"),
            }
            summary.setdefault(c.key, {})[w] = row
            replayed = f"{row['replayed_pct']:.0f}%" if c.is_gateway else ""
            lines.append(
                f"| {c.label} | {w} | {h.fmt_int(row['rps'])} | {h.fmt_ms(row['p50_ms'])} | "
                f"{h.fmt_ms(row['p99_ms'])} | {'n/a' if xn is None else f'{xn:.3g}'} | "
                f"{'n/a' if xb is None else f'{xb:.3g}'} | "
                f"{cpu:.0f} | {cpu / bare_cpu if bare_cpu else float('nan'):.2f} | "
                f"{'' if redis_cpu is None else f'{redis_cpu:.0f}'} | "
                f"{replayed} | "
                f"{sum(r.non_2xx for r in rs)} | "
                f"{sum(r.socket_errors + r.timeouts for r in rs)} |"
            )
    return "\n".join(lines), summary


def render_extras(extras: dict[str, Any]) -> str:
    out: list[str] = []
    if "workers" in extras:
        out.append(f"--workers: {extras['workers']}")
    if "preload" in extras:
        p = extras["preload"]
        out.append(
            f"preload: {p['records']:,} records in db 1 in {p['seconds']} s "
            f"({p['used_memory_per_record']:.0f} B used_memory per record, 11 B body); "
            f"dbsize {p['dbsize']:,}"
        )
    for db, rows in extras.get("commands", {}).items():
        out.append(f"\nRedis commands ({db}):")
        out.append(
            "| scenario | round trips | by command | commands run inside scripts | "
            "script µs (Redis CPU) |"
        )
        out.append("|---|--:|---|---|--:|")
        for name, row in rows.items():
            trips = row.get("round_trips", "n/a")
            by = ", ".join(f"{k} {v:g}" for k, v in row.get("round_trips_by_command", {}).items())
            inner = sum(row.get("inside_scripts", {}).values())
            out.append(
                f"| {name} ({row['unit']}, n={row['count']}) | {trips} | {by} | {inner:.1f} | "
                f"{row['script_usec_per_unit']} |"
            )
    if "memory" in extras:
        m = extras["memory"]
        out.append(
            f"\nRedis memory per stored key (1 KiB response, {m['requests']} keys): MEMORY USAGE "
            f"median {m['memory_usage_median_bytes']:.0f} B (min/max {m['memory_usage_min_max']}), "
            f"used_memory delta {m['used_memory_delta_per_key']:.0f} B/key; stored 'resp' "
            f"{m['stored_response_bytes']} B; encoding {m['encoding']}; "
            f"fields {m['record_fields']}; preloaded records "
            f"have the same fields: {m['preloaded_fields_match']}"
        )
    if "rss" in extras:
        r = extras["rss"]
        out.append(
            f"\nGateway RSS: {r['rss_mib_before']} MiB after warm-up -> {r['rss_mib_after']} MiB "
            f"after {r['requests']:,} unique-key requests; trail {r['trail_requests_rss_mib']}"
        )
    if "profile" in extras:
        p = extras["profile"]
        if "skipped" in p:
            out.append(f"\nprofile: skipped: {p['skipped']}")
        else:
            out.append(
                f"\npy-spy profile, unique keys ({p['samples']} samples, "
                f"{p['rps_while_sampled']} req/s while sampled):"
            )
            out.append(
                "self time by area: " + ", ".join(f"{a} {v}%" for a, v in p["self_pct_by_area"])
            )
            out.append("top self time:")
            out += [f"  {v:5.1f}%  {name}" for name, v in p["self_pct"]]
            out.append("top inclusive time, gateway code:")
            out += [f"  {v:5.1f}%  {name}" for name, v in p["inclusive_pct_gateway_code"]]
    for note in extras.get("notes", []):
        out.append(f"\nnote: {note}")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def gateway_has_workers(src: str) -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=src,
    )
    return "--workers" in proc.stdout


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs (medians)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured load")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--server-cpu", type=int, default=0, help="CPU of the server side")
    parser.add_argument("--load-cpu", type=int, default=1, help="CPU of wrk")
    parser.add_argument(
        "--layout",
        choices=("pinned", "shared"),
        default="pinned",
        help="pinned: server side on --server-cpu, wrk on --load-cpu; shared: nothing "
        "pinned, every process shares the cores (the setting for --workers figures)",
    )
    parser.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--extras", default=",".join(EXTRAS), help=f"comma-separated subset of {EXTRAS}, or none"
    )
    parser.add_argument("--preload", type=int, default=1_000_000, help="records in db 1")
    parser.add_argument("--rss-requests", type=int, default=200_000)
    parser.add_argument("--profile-seconds", type=float, default=15.0)
    parser.add_argument("--command-requests", type=int, default=500)
    parser.add_argument("--fingerprint", choices=("none", "default"), default="none")
    parser.add_argument(
        "--access-log", choices=("on", "off"), default="on", help="the gateway's access log"
    )
    parser.add_argument("--py-spy", default=DEFAULT_PYSPY, help="py-spy binary for the profile")
    parser.add_argument(
        "--profile-workload", default="unique", choices=WORKLOADS, help="workload to profile"
    )
    parser.add_argument("--no-monitor", action="store_true", help="commandstats only")
    parser.add_argument("--no-nginx", action="store_true", help="act as if nginx was absent")
    parser.add_argument(
        "--gateway-src", default=str(REPO), help="directory holding the gateway package"
    )
    parser.add_argument(
        "--baseline-src",
        default="",
        help="another checkout (e.g. a git worktree of an older commit): every gateway "
        "contender also runs from it, as KEY@base, alternating in the same runs",
    )
    parser.add_argument(
        "--gateway-pythonpath", default="", help="PYTHONPATH for the gateway (experiments)"
    )
    parser.add_argument("--max-minutes", type=float, default=30.0, help="hard time limit")
    parser.add_argument("--quick", action="store_true", help="smoke run: short and small")
    parser.add_argument("--json", dest="json_out", default=None, help="write all results here")
    args = parser.parse_args(argv)
    if args.layout == "shared":
        args.server_cpu = args.load_cpu = None
    if args.quick:
        args.duration, args.runs, args.warmup = 2.0, 1, 0.5
        args.preload = min(args.preload, 20_000)
        args.rss_requests = min(args.rss_requests, 10_000)
        args.profile_seconds = 3.0
        args.command_requests = 100
    if args.runs < 1 or args.duration <= 0 or args.connections < 1:
        parser.error("--runs and --connections must be >= 1, --duration > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wrk_bin = shutil.which("wrk")
    if wrk_bin is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    nginx = None if args.no_nginx else h.nginx_binary()
    workloads = [w for w in args.workloads.split(",") if w]
    extras_wanted = [] if args.extras == "none" else [e for e in args.extras.split(",") if e]
    bad = (set(workloads) - set(WORKLOADS)) | (set(extras_wanted) - set(EXTRAS))
    if bad:
        print(f"unknown workloads/extras: {sorted(bad)}", file=sys.stderr)
        return 2
    contenders = all_contenders(args.preload)
    wanted = {k for k in args.only.split(",") if k}
    unknown = wanted - {c.key for c in contenders}
    if unknown:
        print(f"unknown contenders: {sorted(unknown)}", file=sys.stderr)
        return 2
    workers_flag = gateway_has_workers(args.gateway_src)
    notes: list[str] = []
    selected: list[Contender] = []
    for c in contenders:
        if wanted and c.key not in wanted:
            continue
        if c.kind == "nginx" and nginx is None:
            notes.append("nginx proxy_pass skipped: nginx is not installed")
        elif c.workers > 1 and not workers_flag:
            notes.append(
                f"{c.key} skipped: `python -m gateway run --help` has no --workers option yet"
            )
        elif c.db == 1 and args.preload <= 0:
            notes.append(f"{c.key} skipped: --preload 0")
        elif c.client == "aiohttp-128" and importlib.util.find_spec("aiohttp") is None:
            notes.append(f"{c.key} skipped: aiohttp is not installed (pip install -e '.[bench]')")
        else:
            selected.append(c)
    if args.baseline_src:
        base = str(Path(args.baseline_src).resolve())
        selected += [
            replace(c, key=f"{c.key}@base", label=f"{c.label} (at {base})", src=base)
            for c in list(selected)
            if c.is_gateway
        ]

    work_dir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs = h.Processes(work_dir)
    results: dict[str, dict[str, list[Result]]] = {c.key: {} for c in selected}
    extras: dict[str, Any] = {"notes": notes}
    extras["workers"] = "available" if workers_flag else "not available (2-worker row skipped)"
    per_run = sum(
        (args.warmup + args.duration + 0.3) * (len(workloads) if c.is_gateway else 1) + 2
        for c in selected
    )
    estimate = per_run * args.runs + (90 if extras_wanted else 0)
    placement = (
        "and every server unpinned (layout shared)"
        if args.layout == "shared"
        else f"on cpu {args.load_cpu}, server side on cpu {args.server_cpu}"
    )
    print(
        f"# {len(selected)} contenders x {len(workloads)} workloads x {args.runs} runs "
        f"+ extras {extras_wanted or 'none'}, ~{estimate / 60:.1f} min; wrk -t1 "
        f"-c{args.connections} {placement}; "
        f"logs in {work_dir}",
        file=sys.stderr,
        flush=True,
    )
    for note in notes:
        print(f"# {note}", file=sys.stderr)

    def report(run: int, c: Contender, w: str, r: Result) -> None:
        print(
            f"run {run} {c.key:<12} {w:<7} {r.rps:>9,.0f} req/s  p50 {r.p50_ms:6.2f} ms  "
            f"p99 {r.p99_ms:7.2f} ms  replayed {r.replayed}  non-2xx {r.non_2xx}  "
            f"errors {r.socket_errors}+{r.timeouts}",
            file=sys.stderr,
            flush=True,
        )

    keep_logs = False
    signal.signal(signal.SIGALRM, h.raise_system_exit)
    signal.alarm(int(args.max_minutes * 60))
    try:
        with h.exit_on_signals():
            redis_server = RedisServer(procs, args.server_cpu, work_dir)
            wrk = Wrk(wrk_bin, args.load_cpu, args.connections, work_dir)
            bench = Bench(args, procs, wrk, nginx, redis_server, work_dir)
            bench.workers_flag = workers_flag
            bench.start_upstreams()
            if args.preload > 0 and (
                any(c.db == 1 for c in selected) or "commands" in extras_wanted
            ):
                extras["preload"] = redis_server.preload(1, args.preload)
                print(f"# preloaded: {extras['preload']}", file=sys.stderr, flush=True)
            for run in range(1, args.runs + 1):
                for c in selected:
                    for w, r in bench.measure_run(c, run, workloads, report).items():
                        results[c.key].setdefault(w if c.is_gateway else "-", []).append(r)
            if "commands" in extras_wanted:
                extras["commands"] = {
                    "db 0 (empty)": commands_per_request(bench, 0, args.command_requests)
                }
                if args.preload > 0:
                    extras["commands"][f"db 1 ({args.preload:,} keys)"] = commands_per_request(
                        bench, 1, args.command_requests
                    )
                print("# commands measured", file=sys.stderr, flush=True)
            if "memory" in extras_wanted:
                extras["memory"] = memory_per_key(bench, 2000 if not args.quick else 200)
            if "rss" in extras_wanted:
                extras["rss"] = rss_over(bench, args.rss_requests)
                print("# rss measured", file=sys.stderr, flush=True)
            if "profile" in extras_wanted:
                extras["profile"] = profile(bench, args.profile_seconds)
                extras["profile_raw"] = str(work_dir / "profile.txt")
    except BaseException:
        keep_logs = True
        raise
    finally:
        signal.alarm(0)
        procs.stop_all()
        if keep_logs or "profile" in extras_wanted:
            print(f"# logs (and profile.txt) kept in {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)

    table, summary = render_table(selected, workloads, results)
    env_line = (
        f"Python {sys.version.split()[0]}; "
        + h.dist_versions(("starlette", "uvicorn", "uvloop", "httptools", "aiohttp", "redis"))
        + f"; redis-server {redis_server.version}; nginx {h.nginx_version(nginx)}; "
        f"{os.cpu_count()} CPUs; wrk -t1 -c{args.connections} {placement}; "
        f"{args.runs} runs x {args.duration:g} s, "
        f"medians; fingerprint: {args.fingerprint}"
    )
    print(env_line)
    print()
    print(table)
    print()
    print(render_extras(extras))
    if args.json_out:
        raw = {
            "environment": env_line,
            "results": {
                k: {w: [asdict(r) for r in rs] for w, rs in v.items()} for k, v in results.items()
            },
            "summary": summary,
            "extras": extras,
        }
        Path(args.json_out).write_text(json.dumps(raw, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; all benchmark processes stopped", file=sys.stderr)
        sys.exit(130)
