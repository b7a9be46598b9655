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
50 requests). The store's CPU is redis-server's; SQLite's is the gateway's own (the
store is in its processes), so compare the gateway CPU + store CPU sums. The targets
with synchronous=FULL: first requests >= 0.8x Redis's, replays >= 1.0x.
Nothing here fails on a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
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

    def next_xid(self, store: str) -> int:
        return 0

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
    p.add_argument("--workloads", default=",".join(pgb.DEFAULT_WORKLOADS))
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
        f"redis-server {site.redis.version}; SQLite synchronous={args.synchronous}; "
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
    targets = {"unique": ">= 0.8", "replays": ">= 1.0", "same": "", "storm": ""}
    print("| SQLite / Redis | req/s per run | req/s median | target | CPU (gateway + store) |")
    print("|---|---|--:|--:|--:|")
    for w in args.workloads:
        ratios = [r["sqlite"][w].rps / r["redis"][w].rps for r in runs]
        cpu = [
            r["sqlite"][w].cpu_us / (r["redis"][w].cpu_us + r["redis"][w].store_cpu_us)
            for r in runs
        ]
        print(
            f"| {w} | {', '.join(f'{x:.2f}' for x in ratios)} | **{h.median(ratios):.2f}** | "
            f"{targets[w]} | {h.median(cpu):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
