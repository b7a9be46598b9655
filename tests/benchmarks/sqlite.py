"""What the SQLite store costs next to the Redis store, in the same runs.

    .venv/bin/python tests/benchmarks/sqlite.py [--duration 6] [--runs 5] [--workers 1] [--quick]

postgres.py's harness with SQLite in PostgreSQL's place: on loopback, nothing pinned, a
trivial upstream (nginx `return 200`, else the Python one), its own redis-server
(`--save "" --appendonly no`, as gateway.py runs it), one gateway at a time (`run
--workers N`), `wrk -t1 -c32`, the same config but `store.url`. SQLite's file is a fresh
one per gateway in the run's temp dir on this machine's disk, WAL with
`synchronous=FULL` (the default; `--synchronous normal` to compare). Each run measures
both stores in alternating order; the workloads are postgres.py's: `unique` (first
requests), `replays` (completed keys, one store read each) and `storm` (a new key every
50 requests), and `accept`: new keys posted to an async route (`delivery: async`) of a
gateway that delivers nothing (`server.max_deliveries: 0`), so each is a 202 and one
accept in the store, as instructions.py drives them. The store's CPU is redis-server's;
SQLite's is the gateway's own (the store is in its processes), so compare the gateway
CPU + store CPU sums. SQLite's fsyncs per request are the gateway processes' fsync and
fdatasync calls while wrk runs (every thread's, counted by `perf stat` on the syscall
tracepoints: SQLite's commits and its checkpoints), or nothing where perf cannot count
them. `--redis-appendfsync always` gives Redis SQLite's promise (every write on disk
before it is answered). The targets with synchronous=FULL: first requests >= 0.8x
Redis's, replays >= 1.0x, accepts >= 0.8x. Nothing here fails on a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _harness as h
import postgres as pgb
from loadgen import DEFAULT_BODY

REPO = Path(__file__).resolve().parents[2]
STORES = ("redis", "sqlite")
DEFAULT_WORKLOADS = (*pgb.DEFAULT_WORKLOADS, "accept")
#: The async route `accept` posts to, ahead of the bench route that matches every path.
ASYNC_PATH = "/async/run"
#: The syscall tracepoints of a commit's (and a checkpoint's) flush to disk.
FSYNCS = "syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync"


def count_fsyncs(pids: list[int]) -> subprocess.Popen[str] | None:
    """`perf stat` counting the fsyncs of `pids` (every thread) until it is sent
    SIGINT, or None where perf is missing."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    argv = [perf, "stat", "-x", ",", "-e", FSYNCS, "-p", ",".join(map(str, pids))]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc


def fsyncs_counted(proc: subprocess.Popen[str] | None) -> int:
    """What `count_fsyncs` counted (0 where it could not count)."""
    if proc is None:
        return 0
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return 0
    total = 0
    for line in err.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith("syscalls:") and fields[0].isdigit():
            total += int(fields[0])
    return total


class Site(pgb.Site):
    files = 0

    def url(self, store: str) -> str:
        if store == "redis":
            return str(self.redis.url(0))
        return f"sqlite://{self.work_dir / f'gateway-{self.files}.db'}"

    def pool_size(self, store: str) -> str:
        if store == "sqlite" and self.args.synchronous != "full":
            return f", sqlite: {{synchronous: {self.args.synchronous}}}"
        return ""

    def config(self, store: str, port: int) -> Path:
        path = super().config(store, port)
        text = path.read_text()
        # `accept`: a route that queues and a gateway that delivers nothing (a 202 alone).
        text = text.replace("shutdown_grace: 1s", "shutdown_grace: 1s, max_deliveries: 0")
        text = text.replace(
            "routes:\n",
            "routes:\n"
            "  - name: jobs\n"
            f'    match: {{path: "{ASYNC_PATH}"}}\n'
            f"    upstream: http://{h.HOST}:{self.upstream_port}\n"
            "    key: {header: Idempotency-Key}\n"
            "    fingerprint: none\n"
            "    delivery: {mode: async, max_queued: 10000000}\n"
            "    on_unknown_outcome: park\n",
        )
        path.write_text(text)
        return path

    def wrk_lua(self) -> str:
        """postgres.py's script; `accept` posts new keys to the async route."""
        return (
            super()
            .wrk_lua()
            .replace(
                "return wrk.format(nil, nil, hdrs, nil)",
                f'return wrk.format(nil, mode == "accept" and "{ASYNC_PATH}" or nil, hdrs, nil)',
            )
        )

    @contextlib.contextmanager
    def writes(self, store: str, gateway_pids: list[int]) -> Iterator[list[int]]:
        """SQLite's fsyncs (the gateway's) while the block runs; nothing for Redis."""
        found = [0]
        counting = count_fsyncs(gateway_pids) if store == "sqlite" else None
        yield found
        found[0] = fsyncs_counted(counting)

    @contextlib.contextmanager
    def gateway(self, store: str, tag: str) -> Iterator[tuple[int, Any]]:
        self.files += 1  # a fresh file per gateway
        port = h.free_port()
        argv = [sys.executable, "-m", "gateway", "run", "--config", str(self.config(store, port))]
        argv += ["--log-level", "WARNING", "--workers", str(self.args.workers)]
        proc = self.procs.start(tag, argv, env=h.gateway_env(), cwd=REPO)
        try:
            h.wait_ready(self.procs, proc, port, pgb.PATH, DEFAULT_BODY)
            yield port, proc
        finally:
            self.procs.stop(proc)

    def empty(self, store: str) -> None:
        if store == "redis":
            self.redis.clients[0].flushdb()
        # SQLite: every workload's keys are new (its own tag); the file is the gateway's.

    def store_pids(self, store: str) -> list[int]:
        return [self.redis.proc.pid] if store == "redis" else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--synchronous", choices=("full", "normal"), default="full")
    p.add_argument(
        "--redis-appendfsync",
        choices=("off", "everysec", "always"),
        default="off",
        help="Redis's append-only file (off: none, as gateway.py runs Redis; always: "
        "SQLite's promise, a write on disk before its answer)",
    )
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    p.add_argument("--quick", action="store_true", help="1 run x 3 s")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.pg_connections = 0
    if args.quick:
        args.runs, args.duration = 1, 3.0
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="bench-sqlite-"))
    procs = h.Processes(work_dir)
    print(f"# logs in {work_dir}", file=sys.stderr, flush=True)
    runs: list[dict[str, dict[str, pgb.Measured]]] = []
    with h.exit_on_signals():
        try:
            redis = pgb.bg.RedisServer(procs, None, work_dir)
            if args.redis_appendfsync != "off":
                redis.clients[0].config_set("appendfsync", args.redis_appendfsync)
                redis.clients[0].config_set("appendonly", "yes")
            site = Site(args, procs, redis, None, work_dir, wrk)  # type: ignore[arg-type]
            site.upstream_port = h.free_port()
            h.start_upstream(procs, site.upstream_port, None, pgb.PATH, DEFAULT_BODY)
            for run in range(args.runs):
                order = STORES if run % 2 == 0 else STORES[::-1]
                runs.append({store: pgb.measure(site, store, run) for store in order})
        finally:
            procs.stop_all()
            shutil.rmtree(work_dir, ignore_errors=True)
    print(
        f"redis-server {site.redis.version} (appendfsync {args.redis_appendfsync}); "
        f"SQLite synchronous={args.synchronous}; "
        f"{os.cpu_count()} CPUs, nothing pinned; wrk -t1 -c{args.connections}; "
        f"--workers {args.workers}; {len(runs)} runs x {args.duration:g} s, alternating"
    )
    print()
    print("| store | workload | req/s | p50 ms | p99 ms | gateway CPU us/req | store CPU us/req |")
    print("|---|---|--:|--:|--:|--:|--:|")
    for store in STORES:
        for w in args.workloads:
            ms = [r[store][w] for r in runs]

            def med(attr: str, ms: list[pgb.Measured] = ms) -> float:
                return h.median([getattr(m, attr) for m in ms])

            print(
                f"| {store} | {w} | {h.fmt_int(med('rps'))} | {h.fmt_ms(med('p50_ms'))} | "
                f"{h.fmt_ms(med('p99_ms'))} | {med('cpu_us'):.0f} | {med('store_cpu_us'):.0f} |"
            )
    print()
    targets = {"unique": ">= 0.8", "replays": ">= 1.0", "same": "", "storm": "", "accept": ">= 0.8"}
    print(
        "| SQLite / Redis | req/s per run | req/s median | target | CPU (gateway + store) "
        "| SQLite fsyncs/req |"
    )
    print("|---|---|--:|--:|--:|--:|")
    for w in args.workloads:
        ratios = [r["sqlite"][w].rps / r["redis"][w].rps for r in runs]
        cpu = [
            r["sqlite"][w].cpu_us / (r["redis"][w].cpu_us + r["redis"][w].store_cpu_us)
            for r in runs
        ]
        fsyncs = h.median([r["sqlite"][w].xids for r in runs])
        print(
            f"| {w} | {', '.join(f'{x:.2f}' for x in ratios)} | **{h.median(ratios):.2f}** | "
            f"{targets[w]} | {h.median(cpu):.2f} | {fsyncs:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
