"""Which Python HTTP client should a Starlette reverse proxy use to forward to an upstream?

Reproduces shared/measurements/upstream-clients.md on this machine:

* upstream: nginx `return 200 '{"ok":true}'` (1 worker, keep-alive) on a free loopback port, or a
  minimal uvicorn app when nginx is not installed;
* contenders, one process at a time, each serving on its own free port:
  - wrk straight to the upstream (reference), nginx `proxy_pass` (1 worker, upstream keep-alive),
  - the Starlette catch-all proxy of proxy_app.py under uvicorn (1 worker, uvloop, httptools)
    forwarding with httpx default limits (without and with `sniffio` importable), httpx with 128
    connections, httpx2 with 128, httpx + httpx_aiohttp.AiohttpTransport with 128, an aiohttp
    ClientSession with TCPConnector(limit=128), and the gateway's own client
    (gateway/upstream/client.py);
    `sniffio` is importable only in the "+ sniffio" row (from --sniffio-dir, or the venv; when the
    venv has it, the other rows block it), so the rows mean the same in every environment;
* servers under test are pinned to --server-cpu (0), the load generator to --load-cpu (1):
  `wrk -t1 -c32 -d8s --latency` POSTing a small JSON body with a unique Idempotency-Key per request,
  or loadgen.py when wrk is missing;
* runs alternate the contenders (run 1: all, run 2: all, ...); the table shows medians of req/s,
  p50, p99 and of the per-run ratio to nginx proxy_pass.

Every process started here is in its own session and is killed (process group) on exit, Ctrl-C,
SIGTERM or error. Usage:

    .venv/bin/python tests/benchmarks/clients.py [--duration 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _harness import (
    HOST,
    Processes,
    dist_version,
    dist_versions,
    exit_on_signals,
    fmt_int,
    fmt_ms,
    free_port,
    median_rps_ratio,
    nginx_binary,
    nginx_proxy_body,
    nginx_upstream_body,
    nginx_version,
    pinned,
    run_bounded,
    run_wrk,
    start_nginx,
    uvicorn_argv,
    wrk_load_fields,
)
from _harness import wait_ready as _wait_ready
from loadgen import DEFAULT_BODY, LoadResult

HERE = Path(__file__).resolve().parent
PATH = "/v1/payments"
DEFAULT_SNIFFIO_DIR = Path("/tmp/sniffio-site")


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    kind: str  # "direct" | "nginx" | "python"
    client: str | None = None
    sniffio: bool = False


def all_contenders() -> list[Contender]:
    hx, hx2 = dist_version("httpx"), dist_version("httpx2")
    return [
        Contender("direct", "upstream called directly", "direct"),
        Contender("nginx", "nginx proxy_pass", "nginx"),
        Contender(
            "httpx-default", f"httpx {hx}, default limits (no sniffio)", "python", "httpx-default"
        ),
        Contender(
            "httpx-default-sniffio",
            f"httpx {hx}, default limits + sniffio {_sniffio_version()}",
            "python",
            "httpx-default",
            sniffio=True,
        ),
        Contender("httpx-128", f"httpx {hx}, 128 connections", "python", "httpx-128"),
        Contender("httpx2-128", f"httpx2 {hx2}, 128", "python", "httpx2-128"),
        Contender(
            "httpx-aiohttp-128",
            f"httpx + AiohttpTransport (httpx-aiohttp {dist_version('httpx-aiohttp')}), 128",
            "python",
            "httpx-aiohttp-128",
        ),
        Contender(
            "aiohttp-128",
            f"aiohttp {dist_version('aiohttp')} ClientSession, TCPConnector limit 128",
            "python",
            "aiohttp-128",
        ),
        Contender(
            "gateway-128",
            "the gateway's own client (gateway/upstream/client.py), 128",
            "python",
            "gateway-128",
        ),
    ]


#: The module each client needs (the bench extra installs them).
CLIENT_MODULES = {
    "httpx-default": "httpx",
    "httpx-128": "httpx",
    "httpx2-128": "httpx2",
    "httpx-aiohttp-128": "httpx_aiohttp",
    "aiohttp-128": "aiohttp",
}


_SNIFFIO_DIR: Path | None = None


def _sniffio_version() -> str:
    if _SNIFFIO_DIR is None:
        return dist_version("sniffio").replace("?", "")
    for meta in sorted(_SNIFFIO_DIR.glob("sniffio-*.dist-info")):
        return meta.name.removeprefix("sniffio-").removesuffix(".dist-info")
    return ""


def wait_ready(procs: Processes, proc: subprocess.Popen[bytes], port: int) -> None:
    """Wait until a POST through `port` answers 200 with the upstream's body."""
    _wait_ready(procs, proc, port, PATH, DEFAULT_BODY)


# --------------------------------------------------------------------------- load


WRK_LUA = """\
-- POST a small JSON body; every request has a unique Idempotency-Key.
wrk.method = "POST"
wrk.path = "{path}"
wrk.body = '{body}'
local counter = 0
local prefix = "k"
local hdrs = {{["Content-Type"] = "application/json", ["Idempotency-Key"] = ""}}

function init(args)
    prefix = args[1] or prefix
end

function request()
    counter = counter + 1
    hdrs["Idempotency-Key"] = prefix .. "-" .. counter
    return wrk.format(nil, nil, hdrs, nil)
end

function done(summary, latency, requests)
    local e = summary.errors
    io.write(string.format(
        'BENCH_JSON {{"requests":%d,"duration_us":%d,"p50_us":%.1f,"p99_us":%.1f,' ..
        '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\\n',
        summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
        e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@dataclass
class LoadDriver:
    """wrk (preferred) or loadgen.py, pinned to `cpu`; each call bounded in time."""

    cpu: int | None
    connections: int
    work_dir: Path
    wrk: str | None = field(default=None)
    calls: int = 0

    def __post_init__(self) -> None:
        if self.wrk is not None:
            self.lua = self.work_dir / "post.lua"
            self.lua.write_text(WRK_LUA.format(path=PATH, body=DEFAULT_BODY.decode()))

    @property
    def name(self) -> str:
        return "wrk" if self.wrk else "loadgen.py"

    def run(self, port: int, duration: float) -> LoadResult:
        self.calls += 1
        prefix = f"r{os.getpid()}x{self.calls}"
        if self.wrk is not None:
            data = run_wrk(
                self.wrk, self.cpu, self.connections, duration, self.lua, port, PATH, (prefix,)
            )
            return LoadResult(**wrk_load_fields(data))
        argv = [
            sys.executable,
            str(HERE / "loadgen.py"),
            "--port",
            str(port),
            "--path",
            PATH,
            "--duration",
            str(duration),
            "--connections",
            str(self.connections),
            "--json",
        ]
        out = run_bounded(pinned(self.cpu, argv), duration + 30.0)
        return LoadResult.from_json(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------- benchmark


@dataclass
class Bench:
    args: argparse.Namespace
    procs: Processes
    load: LoadDriver
    nginx: str | None
    sniffio_dir: Path | None
    sniffio_in_venv: bool
    upstream_port: int = 0

    def start_upstream(self) -> None:
        self.upstream_port = free_port()
        if self.nginx is not None:
            body = nginx_upstream_body(self.upstream_port)
            proc = start_nginx(
                self.procs, self.nginx, "upstream-nginx", body, self.args.upstream_cpu
            )
        else:
            argv = [
                *self._uvicorn("proxy_app:create_upstream_app", self.upstream_port),
                "--lifespan",
                "off",
            ]
            proc = self.procs.start("upstream-uvicorn", pinned(self.args.upstream_cpu, argv))
        wait_ready(self.procs, proc, self.upstream_port)

    def _uvicorn(self, factory: str, port: int) -> list[str]:
        return uvicorn_argv(sys.executable, factory, HERE, port)

    @contextlib.contextmanager
    def serving(self, contender: Contender, tag: str) -> Iterator[int]:
        """Start the contender's server (if any) and yield the port the load goes to."""
        if contender.kind == "direct":
            yield self.upstream_port
            return
        port = free_port()
        if contender.kind == "nginx":
            assert self.nginx is not None
            body = nginx_proxy_body(port, self.upstream_port)
            proc = start_nginx(self.procs, self.nginx, tag, body, self.args.server_cpu)
        else:
            assert contender.client is not None
            env = dict(os.environ)
            env["BENCH_UPSTREAM"] = f"http://{HOST}:{self.upstream_port}"
            env["BENCH_CLIENT"] = contender.client
            env.pop("PYTHONPATH", None)
            env.pop("BENCH_BLOCK_MODULES", None)
            if contender.sniffio:
                if self.sniffio_dir is not None:
                    env["PYTHONPATH"] = str(self.sniffio_dir)
            elif self.sniffio_in_venv:
                env["BENCH_BLOCK_MODULES"] = "sniffio"  # else it is absent, as in a plain install
            argv = self._uvicorn("proxy_app:create_app", port)
            proc = self.procs.start(tag, pinned(self.args.server_cpu, argv), env=env)
        try:
            wait_ready(self.procs, proc, port)
            if contender.kind == "python" and contender.sniffio != self._sniffio_loaded(proc):
                raise RuntimeError(f"{contender.key}: sniffio importability is not as intended")
            yield port
        finally:
            self.procs.stop(proc)

    def _sniffio_loaded(self, proc: subprocess.Popen[bytes]) -> bool:
        """Read the proxy's startup line (proxy_app prints whether sniffio is importable)."""
        for line in self.procs.log_tail(proc, lines=200).splitlines():
            if line.startswith("BENCH_PROXY "):
                return "sniffio=yes" in line.split()
        raise RuntimeError(f"no BENCH_PROXY line in the log of {proc.args!r}")

    def measure(self, contender: Contender, run: int) -> LoadResult:
        with self.serving(contender, f"{contender.key}-run{run}") as port:
            if self.args.warmup > 0:
                self.load.run(port, self.args.warmup)
            return self.load.run(port, self.args.duration)


def render_table(
    contenders: list[Contender], results: dict[str, list[LoadResult]], baseline: str | None
) -> str:
    base = results.get(baseline or "", [])
    ratio_name = "x direct" if baseline == "direct" else "x nginx"
    lines = [
        f"| client | req/s | p50 ms | p99 ms | {ratio_name} | non-2xx | socket errors + timeouts |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for c in contenders:
        rs = results.get(c.key, [])
        if not rs:
            continue
        rps = statistics.median(r.rps for r in rs)
        p50 = statistics.median(r.p50_ms for r in rs)
        p99 = statistics.median(r.p99_ms for r in rs)
        ratio = median_rps_ratio(rs, base)
        if ratio is None:
            ratio_s = "n/a"
        else:
            ratio_s = "1" if c.key == baseline else f"{ratio:.3g}"
        non_2xx = sum(r.non_2xx for r in rs)
        errors = sum(r.socket_errors + r.timeouts for r in rs)
        lines.append(
            f"| {c.label} | {fmt_int(rps)} | {fmt_ms(p50)} | {fmt_ms(p99)} | {ratio_s} "
            f"| {non_2xx} | {errors} |"
        )
    return "\n".join(lines)


def venv_has_module(name: str) -> bool:
    """Whether `name` is importable by this interpreter without PYTHONPATH (as the proxies run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=30, check=False)
    return proc.returncode == 0


def resolve_sniffio_dir(arg: str | None) -> Path | None:
    if arg:
        path = Path(arg)
    else:
        path = DEFAULT_SNIFFIO_DIR
    if (path / "sniffio" / "__init__.py").exists():
        return path.resolve()
    return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark upstream HTTP clients for a Starlette reverse proxy."
    )
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs over all contenders")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured load")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--server-cpu", type=int, default=0, help="CPU for the server under test")
    parser.add_argument("--load-cpu", type=int, default=1, help="CPU for the load generator")
    parser.add_argument(
        "--upstream-cpu", type=int, default=None, help="CPU for the upstream (default: unpinned)"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated contender keys (default: all available)"
    )
    parser.add_argument(
        "--sniffio-dir",
        default=None,
        help=f"directory with sniffio for the '+ sniffio' row (default: {DEFAULT_SNIFFIO_DIR}; "
        "create with: pip install --target DIR sniffio)",
    )
    parser.add_argument("--no-nginx", action="store_true", help="act as if nginx was absent")
    parser.add_argument("--no-wrk", action="store_true", help="use loadgen.py even if wrk exists")
    parser.add_argument("--json", dest="json_out", default=None, help="write raw results here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.duration <= 0 or args.connections < 1:
        parser.error("--runs and --connections must be >= 1, --duration > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    global _SNIFFIO_DIR
    args = parse_args(argv)
    nginx = None if args.no_nginx else nginx_binary()
    wrk = None if args.no_wrk else shutil.which("wrk")
    sniffio_in_venv = venv_has_module("sniffio")
    _SNIFFIO_DIR = None if sniffio_in_venv else resolve_sniffio_dir(args.sniffio_dir)

    contenders = all_contenders()
    wanted = {k for k in args.only.split(",") if k}
    unknown = wanted - {c.key for c in contenders}
    if unknown:
        print(f"unknown contenders: {sorted(unknown)}", file=sys.stderr)
        return 2
    skipped: list[str] = []
    selected: list[Contender] = []
    for c in contenders:
        if wanted and c.key not in wanted:
            continue
        if c.kind == "nginx" and nginx is None:
            skipped.append(f"{c.key} (nginx not installed)")
        elif c.client in CLIENT_MODULES and not venv_has_module(CLIENT_MODULES[c.client]):
            skipped.append(f"{c.key} ({CLIENT_MODULES[c.client]} not installed)")
        elif c.sniffio and not sniffio_in_venv and _SNIFFIO_DIR is None:
            skipped.append(
                f"{c.key} (sniffio not importable; pip install --target {DEFAULT_SNIFFIO_DIR} "
                "sniffio, or pass --sniffio-dir)"
            )
        else:
            selected.append(c)
    if not selected:
        print("nothing to run", file=sys.stderr)
        return 2

    work_dir = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    procs = Processes(work_dir)
    results: dict[str, list[LoadResult]] = {c.key: [] for c in selected}
    load = LoadDriver(args.load_cpu, args.connections, work_dir, wrk)
    bench = Bench(args, procs, load, nginx, _SNIFFIO_DIR, sniffio_in_venv)
    estimate = (args.duration + args.warmup + 2.5) * len(selected) * args.runs
    print(
        f"# {len(selected)} contenders x {args.runs} runs, ~{estimate:.0f} s; "
        f"load: {load.name} -c{args.connections} on cpu {args.load_cpu}; "
        f"servers on cpu {args.server_cpu}; upstream: {'nginx' if nginx else 'uvicorn'}; "
        f"logs in {work_dir}",
        file=sys.stderr,
    )
    for s in skipped:
        print(f"# skipped: {s}", file=sys.stderr)
    keep_logs = False
    try:
        # Ctrl-C raises KeyboardInterrupt even when started with SIGINT ignored (e.g. `cmd &`);
        # SIGTERM/SIGHUP raise SystemExit; either way the finally block kills every child.
        with exit_on_signals():
            bench.start_upstream()
            for run in range(1, args.runs + 1):
                for c in selected:
                    r = bench.measure(c, run)
                    results[c.key].append(r)
                    print(
                        f"run {run} {c.key:<22} {r.rps:>10,.0f} req/s  p50 {r.p50_ms:7.2f} ms  "
                        f"p99 {r.p99_ms:7.2f} ms  non-2xx {r.non_2xx}  "
                        f"errors {r.socket_errors}+{r.timeouts}",
                        file=sys.stderr,
                        flush=True,
                    )
    except Exception:
        keep_logs = True
        raise
    finally:
        procs.stop_all()
        if keep_logs:
            print(f"# logs kept in {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)

    if args.json_out:
        raw = {k: [json.loads(r.to_json()) for r in v] for k, v in results.items()}
        Path(args.json_out).write_text(json.dumps(raw, indent=2) + "\n")
    baseline = next((k for k in ("nginx", "direct") if k in results), None)
    print(environment_line(load, nginx, args))
    print()
    print(render_table(selected, results, baseline))
    return 0


def environment_line(load: LoadDriver, nginx: str | None, args: argparse.Namespace) -> str:
    versions = dist_versions(("starlette", "uvicorn", "uvloop", "httptools", "httpcore"))
    return (
        f"Python {sys.version.split()[0]}, {versions}; "
        f"upstream/proxy nginx: {nginx_version(nginx)}; "
        f"load: {load.name} 1 thread, {args.connections} connections, cpu {args.load_cpu}; "
        f"servers on cpu {args.server_cpu}; {args.runs} runs x {args.duration:g} s, medians"
    )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; all benchmark processes stopped", file=sys.stderr)
        sys.exit(130)
