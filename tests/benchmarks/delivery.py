"""What asynchronous delivery costs, side by side with the sync path, in one run.

    .venv/bin/python tests/benchmarks/delivery.py [--duration 8] [--runs 3] [--quick]

On loopback only, nothing pinned (the machine has 2 cores), with gateway.py's pieces
(its redis-server, wrk script and MONITOR parsing): a trivial upstream (nginx `return
200`, else the Python one), one gateway process, one Redis store, `wrk -t1 -c32`. One
config has a sync route (`/v1/payments`) and an async one (`/v1/jobs`, `delivery:
{mode: async, concurrency: 32}`), both `key: {header: Idempotency-Key}`, `fingerprint:
none`. Each run, in this order:

  same     replays on the sync route (one key), the accept-only gateway; 32 callers of
           one key share the store's answer in-process, so few of them reach Redis
  unique   sync first requests (a new key per request), the same gateway
  replay   replays of the keys `unique` just stored, each a different key, over and
           over: one Redis round trip per replay, as for an accept
  accept   new keys on the async route, the same gateway (`server.max_deliveries: 0`,
           so nothing is delivered while it accepts): 202s per second
  deliver  then a delivering gateway (`max_deliveries: 64`) is started on what
           `accept` left queued: jobs per second from the first pick to depth 0
  rated    (`--rate`, default 1000000/s with a burst of 1000, far above the load) the
           async route with `delivery.rate`: accept for as long again, then deliver,
           as above; the ratio to `deliver` is what taking a token costs a delivery

The ratios are taken per run and the table shows their medians: accepted / replayed
requests per second (the target >= 0.8; the replays of `same`), accepted /
replays of distinct keys (`replay`: the same one round trip per request), and delivered
jobs / sync first requests per second (>= 0.8). They are not thresholds: nothing here
fails on a figure. CPU columns: the gateway process's and redis-server's CPU time per
request (user + system, /proc) over the measured seconds.

`--layout shared` (default: nothing pinned), `split` (the gateway alone on CPU 0; Redis,
nginx and wrk on CPU 1: Redis's work per request no longer competes with the gateway's)
or `together` (gateway, Redis and nginx on CPU 0, wrk on CPU 1: it competes in full).

`--slices K`: the replays of one key and the accepts take K turns of duration/K seconds
each (after unique and replay), so a change in the machine's load weighs on both alike.

`--baseline-src DIR` measures another checkout's gateway in every run too (the order
alternating), for its figures side by side; `--skip-deliver` leaves out the delivering
phase (the accept ratios only, in half the time).

`--extras commands` (default): Redis round trips per accepted request, per delivery and
per sync first request (MONITOR, EVALSHA by script name; the queue watch's reads and
other background commands set aside), over `--commands-n` requests; and per delivery
with `--rate` (its token: one EVALSHA of lua/rate.lua).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
from loadgen import DEFAULT_BODY

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SYNC_PATH = "/v1/payments"
ASYNC_PATH = "/v1/jobs"
ROUTE = "jobs"
PREFIX = "idem:"
#: With --slices: the workloads that take turns, so a change in the machine's load
#: between them weighs on both alike.
TURNS = ("same", "accept")
#: CPUs per part (None: not pinned); Redis's entry is also nginx's.
LAYOUTS: dict[str, dict[str, int | None]] = {
    "shared": {"gateway": None, "redis": None, "wrk": None},
    "split": {"gateway": 0, "redis": 1, "wrk": 1},
    "together": {"gateway": 0, "redis": 0, "wrk": 1},
}
#: What the queue watch reads each second (queue_stats) and the rescan
#: (due_candidates), besides gateway.py's background commands: not per request.
WATCH = frozenset({"HGETALL", "ZRANGE", "ZCARD", "TIME"})


bg = h.bench_gateway()


@dataclass
class Run:
    rps: dict[str, float] = field(default_factory=dict)
    cpu_us: dict[str, float] = field(default_factory=dict)
    redis_us: dict[str, float] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    queued: int = 0


@dataclass
class Site:
    args: argparse.Namespace
    procs: h.Processes
    redis: Any  # bench_gateway.RedisServer
    work_dir: Path
    wrk: str
    upstream_port: int = 0
    scripts: dict[str, str] = field(default_factory=dict)

    def config(self, port: int, max_deliveries: int, rate: str = "") -> Path:
        limit = f", rate: {rate}, burst: {self.args.burst}" if rate else ""
        text = f"""\
server: {{listen: "{h.HOST}:{port}", shutdown_grace: 1s, max_deliveries: {max_deliveries}}}
admin: {{listen: "{h.HOST}:{h.free_port()}"}}
store: {{url: "{self.redis.url(0)}", prefix: "{PREFIX}"}}
routes:
  - name: sync
    match: {{path: "{SYNC_PATH}"}}
    upstream: http://{h.HOST}:{self.upstream_port}
    key: {{header: Idempotency-Key}}
    fingerprint: none
  - name: {ROUTE}
    match: {{path: "{ASYNC_PATH}"}}
    upstream: http://{h.HOST}:{self.upstream_port}
    key: {{header: Idempotency-Key}}
    fingerprint: none
    delivery: {{mode: async, concurrency: 32, max_queued: 10000000{limit}}}
    on_unknown_outcome: park
"""
        path = self.work_dir / f"gateway-{port}.yaml"
        path.write_text(text)
        return path

    @contextlib.contextmanager
    def gateway(
        self, tag: str, max_deliveries: int, src: Path = REPO, rate: str = ""
    ) -> Iterator[tuple[int, Any]]:
        port = h.free_port()
        argv = [
            sys.executable,
            "-m",
            "gateway",
            "run",
            "--config",
            str(self.config(port, max_deliveries, rate)),
        ]
        argv += ["--log-level", "WARNING"]
        env = h.gateway_env()
        argv = h.pinned(LAYOUTS[self.args.layout]["gateway"], argv)
        proc = self.procs.start(tag, argv, env=env, cwd=src)  # -m finds its gateway
        try:
            h.wait_ready(self.procs, proc, port, SYNC_PATH, DEFAULT_BODY)
            yield port, proc
        finally:
            self.procs.stop(proc)

    def wrk_run(
        self, port: int, path: str, mode: str, duration: float, tag: str, cycle: int = 1
    ) -> dict[str, Any]:
        script = self.work_dir / f"{path.strip('/').replace('/', '-')}.lua"
        if not script.exists():
            body = DEFAULT_BODY.decode()
            script.write_text(
                bg.WRK_LUA.format(path=path, body=body, response=bg.WRK_COUNT_REPLAYS)
            )
        args = (tag, mode, "1", str(cycle))
        cpu = LAYOUTS[self.args.layout]["wrk"]
        return h.run_wrk(self.wrk, cpu, self.args.connections, duration, script, port, path, args)

    def depth(self) -> int:
        """Queued plus retrying deliveries of the async route: its due indexes' sizes."""
        client = self.redis.clients[0]
        pipe = client.pipeline(transaction=False)
        for b in range(64):
            for state in ("queued", "retrying"):
                pipe.zcard(f"{PREFIX}{{{b:02x}}}:i:{state}:{ROUTE}")
        return sum(int(v or 0) for v in pipe.execute())


def measure(site: Site, run: int, src: Path = REPO) -> Run:
    out = Run()
    d = site.args.duration
    site.redis.clients[0].flushdb()
    redis = [site.redis.proc.pid]
    with site.gateway(f"accepting-{run}-{src.name}", 0, src) as (port, proc):
        pids = h.group_pids(proc.pid)
        stored, cycle = "", 1
        paths = {"same": SYNC_PATH, "unique": SYNC_PATH, "replay": SYNC_PATH, "accept": ASYNC_PATH}
        modes = {"same": "same", "unique": "unique", "replay": "cycle", "accept": "unique"}
        k = site.args.slices
        # The order of the measurements; with --slices, same and accept take turns.
        plan = [(name, d) for name in ("same", "unique", "replay", "accept")]
        if k > 1:
            plan = [("unique", d), ("replay", d), *[(n, d / k) for _ in range(k) for n in TURNS]]
        sums: dict[str, list[float]] = {}  # name -> requests, us, gateway s, redis s, errors
        tags = {name: f"r{run}{name}{os.urandom(2).hex()}" for name in modes}
        for name, seconds in plan:
            path, mode = paths[name], modes[name]
            # replay: the keys unique stored (all but the last ones, maybe still in flight);
            # accept: new keys in every turn
            tag = stored if name == "replay" else tags[name]
            if name == "accept" and name in sums:
                tag += f"t{int(sums[name][0])}"  # requests so far: a new prefix
            if name not in sums:
                if site.args.warmup > 0:  # replay's warm-up replays too
                    warm = tag if name == "replay" else tag + "w"
                    site.wrk_run(port, path, mode, site.args.warmup, warm, cycle)
                if name == "accept" or (name == "same" and k > 1):
                    site.redis.clients[0].flushdb()  # only this run's 202s are queued
                sums[name] = [0.0] * 5
            cpu, redis_cpu = h.cpu_seconds(pids), h.cpu_seconds(redis)
            data = site.wrk_run(port, path, mode, seconds, tag, cycle)
            n = int(data["requests"])
            errors = h.wrk_errors(data)
            if name == "replay":  # answers not replayed (wrk's last ones may go uncounted)
                errors += max(0, n - int(data["replayed"]) - site.args.connections)
            got = (n, data["duration_us"], h.cpu_seconds(pids) - cpu)
            got += (h.cpu_seconds(redis) - redis_cpu, errors)
            sums[name] = [a + b for a, b in zip(sums[name], got, strict=True)]
            if name == "unique":
                stored, cycle = tag, max(1, n - 4 * site.args.connections)
        for name, (n, us, cpu, redis_cpu, errors) in sums.items():
            out.rps[name] = n / (us / 1e6)
            out.cpu_us[name] = cpu * 1e6 / max(n, 1)
            out.redis_us[name] = redis_cpu * 1e6 / max(n, 1)
            out.errors[name] = int(errors)
    out.queued = site.depth()
    if site.args.skip_deliver:
        out.rps["deliver"] = out.cpu_us["deliver"] = out.redis_us["deliver"] = 0.0
        out.errors["deliver"] = 0
        return out
    drain(site, out, "deliver", out.queued, f"delivering-{run}-{src.name}", src)
    if site.args.rate:
        with site.gateway(f"accepting-rated-{run}-{src.name}", 0, src, site.args.rate) as (
            port,
            _,
        ):
            site.redis.clients[0].flushdb()
            tag = f"r{run}rated{os.urandom(2).hex()}"
            site.wrk_run(port, ASYNC_PATH, "unique", d, tag)
        queued = site.depth()
        tag = f"delivering-rated-{run}-{src.name}"
        drain(site, out, "rated", queued, tag, src, site.args.rate)
    return out


def drain(
    site: Site, out: Run, name: str, queued: int, tag: str, src: Path, rate: str = ""
) -> None:
    """A delivering gateway on the `queued` deliveries: jobs per second from its first
    pick to depth 0, and its and Redis's CPU per job, as `out`'s `name`."""
    redis = [site.redis.proc.pid]
    with site.gateway(tag, 64, src, rate) as (_port, proc):
        pids = h.group_pids(proc.pid)
        cpu = h.cpu_seconds(pids)
        deadline = time.monotonic() + 600
        while (depth := site.depth()) >= queued and time.monotonic() < deadline:
            time.sleep(0.005)
        first, first_depth = time.monotonic(), depth
        cpu, redis_cpu = h.cpu_seconds(pids), h.cpu_seconds(redis)
        while depth > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
            depth = site.depth()
        elapsed = time.monotonic() - first
        out.rps[name] = first_depth / elapsed if elapsed > 0 else 0.0
        out.cpu_us[name] = (h.cpu_seconds(pids) - cpu) * 1e6 / max(first_depth, 1)
        out.redis_us[name] = (h.cpu_seconds(redis) - redis_cpu) * 1e6 / max(first_depth, 1)
        out.errors[name] = depth


def commands(site: Site, n: int) -> dict[str, Any]:
    """Round trips per request: n sync first requests and n accepts (accept-only
    gateway), then a delivering gateway drains those n deliveries."""
    site.redis.clients[0].flushdb()
    found: dict[str, Any] = {}
    shim = h.monitor_site(site.redis, site.procs)
    with site.gateway("cmd-accepting", 0) as (port, _):
        client = bg.Client(port)
        for name, path in (("sync first request", SYNC_PATH), ("accepted request", ASYNC_PATH)):
            with bg.Monitor(shim, f"monitor-{name.split()[0]}") as mon:
                tag = os.urandom(4).hex()
                for i in range(n):
                    status, _ = client.post(f"{tag}-{i}", path)
                    assert status in (200, 202), status
            found[name] = per(mon.lines(), site.scripts, n)
    with bg.Monitor(shim, "monitor-deliver") as mon:
        with site.gateway("cmd-delivering", 64):
            deadline = time.monotonic() + 60
            while site.depth() > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
    found["delivery"] = per(mon.lines(), site.scripts, n, skip_ready=True)
    if site.args.rate:
        with site.gateway("cmd-accepting-rated", 0, rate=site.args.rate) as (port, _):
            client = bg.Client(port)
            tag = os.urandom(4).hex()
            for i in range(n):
                status, _ = client.post(f"{tag}-{i}", ASYNC_PATH)
                assert status == 202, status
        with bg.Monitor(shim, "monitor-deliver-rated") as mon:
            with site.gateway("cmd-delivering-rated", 64, rate=site.args.rate):
                deadline = time.monotonic() + 60
                while site.depth() > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
        found["delivery with delivery.rate"] = per(mon.lines(), site.scripts, n, skip_ready=True)
    return found


def per(
    lines: list[str], scripts: dict[str, str], n: int, skip_ready: bool = False
) -> dict[str, Any]:
    # The benchmark's own depth polls (ZCARD of the due indexes) are not the gateway's.
    lines = [line for line in lines if not ('"ZCARD"' in line and ":i:" in line)]
    parsed = bg.parse_monitor(lines, scripts)
    top: Counter[str] = Counter()
    for cmd, count in parsed["round_trips"].items():
        if cmd.split()[0] in WATCH or cmd == "HELLO":  # HELLO: a connection's set-up
            continue
        top[cmd] += count
    if skip_ready:  # the readiness probe: a replay of the key "ready" (one claim)
        top["EVALSHA claim"] -= 1
    top = Counter({k: v for k, v in top.items() if v > 0})
    return {
        "per_request": round(sum(top.values()) / n, 3),
        "by_command": {k: round(v / n, 3) for k, v in sorted(top.items())},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--extras", default="commands", help="commands or none")
    p.add_argument("--commands-n", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="1 run x 4 s, 100 requests for commands")
    p.add_argument("--json", default="")
    p.add_argument("--baseline-src", default="", help="another checkout, measured alongside")
    p.add_argument("--skip-deliver", action="store_true", help="no delivering phase")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="shared")
    p.add_argument("--slices", type=int, default=1, help="same and accept take turns")
    p.add_argument("--rate", default="1000000/s", help='delivery.rate of "rated" ("": none)')
    p.add_argument("--burst", type=int, default=1000, help="delivery.burst of rated")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.duration, args.commands_n = 1, 4.0, 100
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="bench-delivery-"))
    procs = h.Processes(work_dir)
    print(f"# logs in {work_dir}", file=sys.stderr, flush=True)
    with h.exit_on_signals():
        try:
            cpus = LAYOUTS[args.layout]
            redis = bg.RedisServer(procs, cpus["redis"], work_dir)
            site = Site(args, procs, redis, work_dir, wrk)
            site.scripts = bg.lua_script_names(REPO)
            rate_lua = REPO / "gateway" / "store" / "redis" / "lua" / "rate.lua"
            site.scripts[hashlib.sha1(rate_lua.read_bytes()).hexdigest()] = "rate"  # alone
            site.upstream_port = h.free_port()
            h.start_upstream(procs, site.upstream_port, cpus["redis"], SYNC_PATH, DEFAULT_BODY)
            trees = [REPO, *([Path(args.baseline_src).resolve()] if args.baseline_src else [])]
            runs: dict[Path, list[Run]] = {tree: [] for tree in trees}
            for run in range(args.runs):
                for tree in trees if run % 2 == 0 else trees[::-1]:
                    r = measure(site, run, tree)
                    runs[tree].append(r)
                    print(
                        f"# run {run} {tree}: "
                        + json.dumps(
                            {
                                "rps": r.rps,
                                "cpu_us": r.cpu_us,
                                "redis_us": r.redis_us,
                                "errors": r.errors,
                                "queued": r.queued,
                            },
                            default=round,
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
            extras = commands(site, args.commands_n) if args.extras == "commands" else {}
        finally:
            procs.stop_all()
    for tree, found in runs.items():
        if len(runs) > 1:
            print(f"\n## {tree}\n")
        report(found, extras if tree == REPO else {})
    if len(runs) > 1:
        compare(runs[REPO], runs[trees[1]])
    if args.json:
        data = {str(tree): [r.__dict__ for r in found] for tree, found in runs.items()}
        Path(args.json).write_text(json.dumps({"runs": data, "extras": extras}, indent=2))
    return 0


def compare(now: list[Run], base: list[Run]) -> None:
    """This tree against the baseline, run by run (each pair measured back to back)."""
    print("\n## this tree / baseline, per run (median; per run)\n")
    print("| figure | ratio |")
    print("|---|--:|")
    for name in ("same", "replay", "accept"):

        def cpu(r: Run, name: str = name) -> float:
            return r.cpu_us[name]

        values = [cpu(a) / cpu(b) for a, b in zip(now, base, strict=True)]
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"| gateway CPU per request, {name} | {h.median(values):.2f} ({shown}) |")
    values = [
        (a.rps["accept"] / a.rps["same"]) / (b.rps["accept"] / b.rps["same"])
        for a, b in zip(now, base, strict=True)
    ]
    shown = ", ".join(f"{v:.2f}" for v in values)
    print(f"| accepted / replayed req/s | {h.median(values):.2f} ({shown}) |")


def report(runs: list[Run], extras: dict[str, Any]) -> None:
    def med(name: str, what: str = "rps") -> float:
        return h.median([getattr(r, what)[name] for r in runs])

    print("| workload | req/s (jobs/s) | gateway CPU us/req | Redis CPU us/req | errors |")
    print("|---|--:|--:|--:|--:|")
    labels = {
        "same": "sync replays (one key)",
        "unique": "sync first requests",
        "replay": "sync replays of distinct keys",
        "accept": "async: accepted (202), nothing delivered",
        "deliver": f"async: delivered, {h.median([r.queued for r in runs]):,.0f} queued",
        "rated": "async: delivered, with delivery.rate far above the load",
    }
    for name, label in labels.items():
        if name not in runs[0].rps:
            continue
        errors = sum(r.errors[name] for r in runs)
        cpu, redis_cpu = med(name, "cpu_us"), med(name, "redis_us")
        print(f"| {label} | {h.fmt_int(med(name))} | {cpu:.0f} | {redis_cpu:.0f} | {errors} |")

    def ratio(top: str, bottom: str, what: str = "rps") -> str:
        values = [getattr(r, what)[top] / getattr(r, what)[bottom] for r in runs]
        return f"{h.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"

    print()
    print("| ratio (median of per-run ratios; per run) | value | target |")
    print("|---|--:|--:|")
    print(f"| accepted / replayed req/s | {ratio('accept', 'same')} | >= 0.8 |")
    print(f"| accepted / replays of distinct keys req/s | {ratio('accept', 'replay')} | |")
    print(f"| delivered jobs/s / sync first requests/s | {ratio('deliver', 'unique')} | >= 0.8 |")
    print(f"| gateway CPU per replay / per accept | {ratio('same', 'accept', 'cpu_us')} | |")
    if "rated" in runs[0].rps:
        rated = ratio("rated", "deliver")
        print(f"| delivered jobs/s with delivery.rate / without | {rated} | >= 0.9 |")
    if extras:
        print()
        print("| Redis round trips | per request | by command |")
        print("|---|--:|---|")
        for name, found in extras.items():
            by = ", ".join(f"{k} {v:g}" for k, v in found["by_command"].items())
            print(f"| {name} | {found['per_request']:g} | {by} |")


if __name__ == "__main__":
    sys.exit(main())
