"""What the PostgreSQL store costs next to the Redis store, in the same runs.

    .venv/bin/python tests/benchmarks/postgres.py [--duration 6] [--runs 5] [--quick]

On loopback only, nothing pinned (the machine has 2 cores, and PostgreSQL is a process
per connection), with gateway.py's pieces (its redis-server, wrk script and MONITOR
parsing): a trivial upstream (nginx `return 200`, else the Python one), its own
redis-server (`--save "" --appendonly no`, as gateway.py runs it) and its own PostgreSQL
(tests/support/postgres.py: initdb into a temp dir on this machine's disk, fsync and
synchronous_commit on, the server's other settings at their defaults), one gateway
process at a time, `wrk -t1 -c32`. The gateway's config is gateway.py's (one route,
`key: {header: Idempotency-Key}`, `fingerprint: none`, the access log on); only
`store.url` differs (and, with `--pg-connections N`, the PostgreSQL store's
`max_connections`: by default the gateway's, 64 per process).

Each run measures both stores, in alternating order (Redis first in even runs,
PostgreSQL first in odd ones), each on a fresh gateway and an emptied store, with the
workloads `unique` (first requests), `replays` (each request a different completed key,
cycling through REPLAY_KEYS written just before: one store read per replay) and `storm`
(a new key every 50 requests: concurrent duplicates); `same` (one key) on request: the
gateway shares one read among a process's concurrent requests for a key, so `same`
measures the gateway more than the store. Per run: requests per second, the gateway's CPU per
request, and the store's own CPU per request (redis-server's; the postmaster's and
every backend's, from /proc). The ratios PostgreSQL / Redis are taken per run; the
table shows their medians. The targets (docs/performance.md, "Targets"): first requests
>= 0.5x, replays >= 0.7x.
Nothing here fails on a figure.

`--extras commands` (default): round trips per first request and per replay over
`--commands-n` sequential requests on a fresh gateway: PostgreSQL's statements from its
own log (`log_statement = all` for the gateway's sessions, by application_name, each
statement named by the SQL file it came from), Redis's commands from MONITOR. Statements
a gateway runs on its own (the sweep, the reaper, the reset marker, the listener's
keep-alive) are counted apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
from loadgen import DEFAULT_BODY

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from tests.support.postgres import PostgresServer, pg_binary  # noqa: E402

PATH = "/v1/payments"
PREFIX = "idem:"
STORES = ("redis", "postgres")
WORKLOADS = ("unique", "replays", "same", "storm")
DEFAULT_WORKLOADS = ("unique", "replays", "storm")
#: completed keys the `replays` workload cycles through (written before it starts)
REPLAY_KEYS = 2000
#: The gateway's sessions (postgres_sql.connect_args) in the server's log.
APP = "idempotency-gateway"
#: What a gateway runs by itself, not per request: the sweep's lease list, the reaper,
#: the reset marker, the settings read, the listener's keep-alive and LISTEN, gauges.
BACKGROUND_SQL = frozenset(
    {"leases", "reap", "stats", "queue_stats", "due", "listing", "marker", "settings",
     "ping", "listen", "schema"}
)  # fmt: skip


bg = h.bench_gateway()


@dataclass
class Measured:
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float
    store_cpu_us: float
    replayed: int
    errors: int
    #: PostgreSQL's transactions that wrote (each takes a transaction id) per request:
    #: 2 for a first request whose claim and completion commit alone, less when the
    #: store's group commit (postgres_batch.py) puts several in one statement
    xids: float = 0.0


@dataclass
class Site:
    args: argparse.Namespace
    procs: h.Processes
    redis: Any  # bench_gateway.RedisServer
    pg: PostgresServer
    work_dir: Path
    wrk: str
    upstream_port: int = 0
    scripts: dict[str, str] = field(default_factory=dict)

    def url(self, store: str) -> str:
        return self.redis.url(0) if store == "redis" else self.pg.url

    def pool_size(self, store: str) -> str:
        n = self.args.pg_connections
        return f", max_connections: {n}" if store == "postgres" and n else ""

    def config(self, store: str, port: int) -> Path:
        text = f"""\
server: {{listen: "{h.HOST}:{port}", shutdown_grace: 1s}}
admin: {{listen: "{h.HOST}:{h.free_port()}"}}
store: {{url: "{self.url(store)}", prefix: "{PREFIX}"{self.pool_size(store)}}}
routes:
  - name: bench
    match: {{path: "/{{rest:path}}"}}
    upstream: http://{h.HOST}:{self.upstream_port}
    key: {{header: Idempotency-Key}}
    fingerprint: none
"""
        path = self.work_dir / f"gateway-{store}-{port}.yaml"
        path.write_text(text)
        return path

    @contextlib.contextmanager
    def gateway(self, store: str, tag: str) -> Iterator[tuple[int, Any]]:
        port = h.free_port()
        argv = [sys.executable, "-m", "gateway", "run", "--config", str(self.config(store, port))]
        argv += ["--log-level", "WARNING"]
        env = h.gateway_env()
        proc = self.procs.start(tag, argv, env=env, cwd=REPO)
        try:
            h.wait_ready(self.procs, proc, port, PATH, DEFAULT_BODY)
            yield port, proc
        finally:
            self.procs.stop(proc)

    def empty(self, store: str) -> None:
        if store == "redis":
            self.redis.clients[0].flushdb()
        else:
            self.pg.sql("TRUNCATE gateway_records")

    def next_xid(self, store: str) -> int:
        """The next transaction id PostgreSQL will assign (read without taking one)."""
        if store != "postgres":
            return 0
        return int(self.pg.sql("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")[0][0])

    @contextlib.contextmanager
    def writes(self, store: str, gateway_pids: list[int]) -> Iterator[list[int]]:
        """The store's writes while the block runs, in the list's one item: PostgreSQL's
        transaction ids taken."""
        found = [0]
        xid = self.next_xid(store)
        yield found
        found[0] = self.next_xid(store) - xid

    def store_pids(self, store: str) -> list[int]:
        if store == "redis":
            return [self.redis.proc.pid]
        assert self.pg.proc is not None
        return [self.pg.proc.pid, *self.pg.children()]

    def wrk_lua(self) -> str:
        """gateway.py's script, with one more mode: keys tag-1 .. tag-REPLAY_KEYS in turn."""
        body = DEFAULT_BODY.decode()
        lua = bg.WRK_LUA.replace(
            '    if mode == "same" then',
            '    if mode == "replays" then\n'
            f'        key = prefix .. "-" .. ((counter - 1) % {REPLAY_KEYS} + 1)\n'
            '    elseif mode == "same" then',
        )
        return str(lua.format(path=PATH, body=body, response=bg.WRK_COUNT_REPLAYS))

    def wrk_run(self, port: int, mode: str, duration: float, tag: str) -> dict[str, Any]:
        script = self.work_dir / "count.lua"
        if not script.exists():
            script.write_text(self.wrk_lua())
        args = (tag, mode, "1")
        return h.run_wrk(self.wrk, None, self.args.connections, duration, script, port, PATH, args)


def measure(site: Site, store: str, run: int) -> dict[str, Measured]:
    out: dict[str, Measured] = {}
    with site.gateway(store, f"{store}-run{run}") as (port, proc):
        gateway_pids = h.group_pids(proc.pid)
        for mode in site.args.workloads:
            site.empty(store)
            tag = f"r{run}{store[0]}{mode}{os.urandom(2).hex()}"
            if mode == "replays":
                prime(port, tag)
            if site.args.warmup > 0:
                site.wrk_run(port, mode, site.args.warmup, tag + "w")
            before_store = site.store_pids(store)
            with site.writes(store, gateway_pids) as writes:
                cpu = h.cpu_seconds(gateway_pids), h.cpu_seconds(before_store)
                data = site.wrk_run(port, mode, site.args.duration, tag)
                cpu_after = h.cpu_seconds(gateway_pids)
            # Backends opened during the run count from 0; none close (the pool keeps them).
            after_store = sorted(set(before_store) | set(site.store_pids(store)))
            n = max(int(data["requests"]), 1)
            out[mode] = Measured(
                rps=n / (data["duration_us"] / 1e6),
                p50_ms=data["p50_us"] / 1000,
                p99_ms=data["p99_us"] / 1000,
                cpu_us=(cpu_after - cpu[0]) * 1e6 / n,
                store_cpu_us=(h.cpu_seconds(after_store) - cpu[1]) * 1e6 / n,
                replayed=int(data["replayed"]),
                errors=h.wrk_errors(data),
                xids=writes[0] / n,
            )
            m = out[mode]
            print(
                f"# run {run} {store:<8} {mode:<6} {m.rps:>8,.0f} req/s  p99 {m.p99_ms:6.1f} ms  "
                f"gateway {m.cpu_us:4.0f} us/req  store {m.store_cpu_us:4.0f} us/req  "
                f"errors {m.errors}" + (f"  writes {m.xids:.2f}/req" if m.xids else ""),
                file=sys.stderr,
                flush=True,
            )
    return out


# -- round trips ------------------------------------------------------------------------


def sql_names() -> dict[str, str]:
    """The first line of each statement file (a comment naming what it does) -> name."""
    found = {}
    for path in sorted((REPO / "gateway" / "store" / "sql").glob("*.sql")):
        first = path.read_text().splitlines()[0].strip()
        found[first] = path.stem
    return found


_LOGGED = re.compile(r"\] (?P<app>\S*) LOG:  (?:execute [^:]*|statement): (?P<sql>.*)$")


def name_statement(first_line: str, names: dict[str, str]) -> str:
    line = first_line.strip()
    if line in names:
        return names[line]
    lowered = line.lower()
    for needle, name in (
        ("gateway_markers", "marker"),
        ("current_setting", "settings"),
        ("listen ", "listen"),
        ("gateway_schema", "schema"),
        ("select 1", "ping"),
        ("select t.now, r.digest", "listing"),  # open_records: the gauges, the sweep
    ):
        if needle in lowered:
            return name
    return line[:60]


def pg_statements(log: str, names: dict[str, str]) -> Counter[str]:
    found: Counter[str] = Counter()
    for line in log.splitlines():
        match = _LOGGED.search(line)
        if match and match["app"] == APP:
            found[name_statement(match["sql"], names)] += 1
    return found


def prime(port: int, tag: str) -> None:
    """Complete the keys the `replays` workload asks for (as wrk names them)."""
    client = bg.Client(port)
    with ThreadPoolExecutor(16) as pool:
        keys = [f"{tag}-{i}" for i in range(1, REPLAY_KEYS + 1)]
        statuses = list(pool.map(lambda key: client.post(key)[0], keys))
    assert statuses == [200] * REPLAY_KEYS, Counter(statuses)


def send(client: Any, keys: list[str], replay: bool) -> None:
    for key in keys:
        status, replayed = client.post(key)
        assert status == 200 and replayed == replay, (status, replayed)


def commands(site: Site, n: int) -> dict[str, Any]:
    """Round trips per first request and per replay, n sequential requests each, on a
    fresh gateway of each store whose pool is open and statements prepared."""
    out: dict[str, Any] = {}
    names = sql_names()
    for store in STORES:
        site.empty(store)
        with site.gateway(store, f"cmd-{store}") as (port, _):
            client = bg.Client(port)
            tag = os.urandom(3).hex()
            send(client, [f"warm-{tag}-{i}" for i in range(20)], replay=False)
            send(client, [f"warm-{tag}-{i}" for i in range(20)], replay=True)
            keys = [f"first-{tag}-{i}" for i in range(n)]
            for scenario, replay in (("first request", False), ("replay", True)):
                if store == "redis":
                    shim = h.monitor_site(site.redis, site.procs)
                    with bg.Monitor(shim, f"monitor-{scenario.split()[0]}") as mon:
                        send(client, keys, replay)
                    parsed = bg.parse_monitor(mon.lines(), site.scripts)
                    trips, background = parsed["round_trips"], parsed["background"]
                else:
                    log = site.pg.log_path
                    offset = log.stat().st_size
                    site.pg.sql("ALTER SYSTEM SET log_statement = 'all'")
                    site.pg.sql("SELECT pg_reload_conf()")
                    time.sleep(0.3)
                    send(client, keys, replay)
                    time.sleep(0.3)
                    site.pg.sql("ALTER SYSTEM RESET log_statement")
                    site.pg.sql("SELECT pg_reload_conf()")
                    with log.open("rb") as f:
                        f.seek(offset)
                        seen = pg_statements(f.read().decode(errors="replace"), names)
                    trips = Counter({k: v for k, v in seen.items() if k not in BACKGROUND_SQL})
                    background = Counter({k: v for k, v in seen.items() if k in BACKGROUND_SQL})
                out.setdefault(store, {})[scenario] = {
                    "per_request": round(sum(trips.values()) / n, 3),
                    "by_statement": {k: round(v / n, 3) for k, v in sorted(trips.items())},
                    "background_total": dict(background),
                }
    return out


# -- main -------------------------------------------------------------------------------


def start_postgres() -> PostgresServer:
    server = PostgresServer(log_line_prefix="%m [%p] %a ")
    server.start()
    from tests.conftest import migrate_database

    migrate_database(server.url)
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    p.add_argument("--extras", default="commands", help="commands or none")
    p.add_argument(
        "--pg-connections", type=int, default=0, help="the PostgreSQL store's max_connections"
    )
    p.add_argument("--commands-n", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="1 run x 3 s, 100 requests for commands")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if set(args.workloads) - set(WORKLOADS):
        p.error(f"workloads are {', '.join(WORKLOADS)}")
    if args.quick:
        args.runs, args.duration, args.commands_n = 1, 3.0, 100
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="bench-postgres-"))
    procs = h.Processes(work_dir)
    print(f"# logs in {work_dir}", file=sys.stderr, flush=True)
    pg: PostgresServer | None = None
    runs: list[dict[str, dict[str, Measured]]] = []
    with h.exit_on_signals():
        try:
            pg = start_postgres()
            site = Site(args, procs, bg.RedisServer(procs, None, work_dir), pg, work_dir, wrk)
            site.scripts = bg.lua_script_names(REPO)
            site.upstream_port = h.free_port()
            h.start_upstream(procs, site.upstream_port, None, PATH, DEFAULT_BODY)
            for run in range(args.runs):
                order = STORES if run % 2 == 0 else STORES[::-1]
                runs.append({store: measure(site, store, run) for store in order})
            extras = commands(site, args.commands_n) if args.extras == "commands" else {}
            versions = {
                "postgres": subprocess.run(
                    [pg_binary("postgres"), "--version"], capture_output=True, text=True
                ).stdout.strip(),
                "redis": site.redis.version,
                "settings": dict(
                    pg.sql(
                        "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', "
                        "'synchronous_commit', 'shared_buffers', 'wal_sync_method', "
                        "'max_connections')"
                    )
                ),
            }
        finally:
            procs.stop_all()
            if pg is not None:
                pg.stop()
                pg.remove()
    report(args, runs, extras, versions)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "runs": [
                        {s: {w: m.__dict__ for w, m in r[s].items()} for s in r} for r in runs
                    ],
                    "extras": extras,
                    "versions": versions,
                },
                indent=2,
            )
        )
    return 0


def report(
    args: argparse.Namespace,
    runs: list[dict[str, dict[str, Measured]]],
    extras: dict[str, Any],
    versions: dict[str, Any],
) -> None:
    print(
        f"{versions['postgres']} ({versions['settings']}); redis-server {versions['redis']}; "
        f"{os.cpu_count()} CPUs, nothing pinned; wrk -t1 -c{args.connections}; "
        f"{len(runs)} runs x {args.duration:g} s, stores in alternating order"
    )
    print()
    print("| store | workload | req/s | p50 ms | p99 ms | gateway CPU us/req | store CPU us/req "
          "| replayed | errors | writing transactions/req |")  # fmt: skip
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for store in STORES:
        for w in args.workloads:
            ms = [r[store][w] for r in runs]

            def med(attr: str, ms: list[Measured] = ms) -> float:
                return h.median([getattr(m, attr) for m in ms])

            print(
                f"| {store} | {w} | {h.fmt_int(med('rps'))} | {h.fmt_ms(med('p50_ms'))} | "
                f"{h.fmt_ms(med('p99_ms'))} | {med('cpu_us'):.0f} | {med('store_cpu_us'):.0f} | "
                f"{sum(m.replayed for m in ms):,} | {sum(m.errors for m in ms)} | "
                f"{med('xids'):.2f} |"
            )
    print()
    targets = {"unique": ">= 0.5", "replays": ">= 0.7", "same": "", "storm": ""}
    print("| PostgreSQL / Redis, per run | req/s per run | req/s median | target "
          "| gateway CPU median | store CPU median |")  # fmt: skip
    print("|---|---|--:|--:|--:|--:|")
    for w in args.workloads:
        ratios = [r["postgres"][w].rps / r["redis"][w].rps for r in runs]
        cpu = [r["postgres"][w].cpu_us / r["redis"][w].cpu_us for r in runs]
        store = [
            r["postgres"][w].store_cpu_us / max(r["redis"][w].store_cpu_us, 1e-9) for r in runs
        ]
        print(
            f"| {w} | {', '.join(f'{x:.2f}' for x in ratios)} | **{h.median(ratios):.2f}** | "
            f"{targets[w]} | {h.median(cpu):.2f} | {h.median(store):.2f} |"
        )
    if extras:
        print()
        print("| round trips | store | per request | by statement / command | background (total) |")
        print("|---|---|--:|---|---|")
        for store, scenarios in extras.items():
            for scenario, found in scenarios.items():
                by = ", ".join(f"{k} {v:g}" for k, v in found["by_statement"].items())
                bg_total = ", ".join(f"{k} {v}" for k, v in found["background_total"].items())
                print(f"| {scenario} | {store} | {found['per_request']:g} | {by} | {bg_total} |")


if __name__ == "__main__":
    sys.exit(main())
