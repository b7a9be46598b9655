"""Shared pieces of the benchmarks (clients.py, gateway.py, delivery.py, postgres.py): child
processes, CPU pinning, nginx, wrk, readiness checks, a trivial Python upstream, gateway.py's
pieces for the benchmarks built on it, and table formatting.

Every child is started in its own session and killed by process group (never by name), so a
benchmark leaves nothing running after an exception, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
READY_TIMEOUT_S = 20.0
UPSTREAM_BODY = '{"ok":true}'
#: a 1 KiB JSON body served at KIB_PATH, for the "Redis memory per stored key" figure
KIB_PATH = "/kib"
KIB_BODY = '{"data":"' + "x" * (1024 - 11) + '"}'
#: the Python upstream answers paths under SLOW_PATH after SLOW_DELAY_S
SLOW_PATH = "/slow"
SLOW_DELAY_S = 0.3

# --------------------------------------------------------------------------- processes


class Processes:
    """Starts children in their own sessions and always kills their whole process groups."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[bytes]:
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.procs[proc.pid] = (proc, log)
        return proc

    def log_tail(self, proc: subprocess.Popen[bytes], lines: int = 20) -> str:
        _, log = self.procs.get(proc.pid, (proc, None))
        if log is None or not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def stop(
        self, proc: subprocess.Popen[bytes], timeout: float = 5.0, sig: int = signal.SIGTERM
    ) -> None:
        """Signal the child's process group (its pgid is its pid), then SIGKILL if needed."""
        for s in (sig, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, s)
            try:
                proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group (e.g. nginx workers)
        self.procs.pop(proc.pid, None)

    def stop_all(self) -> None:
        for proc, _ in list(self.procs.values()):
            self.stop(proc, timeout=3.0)


def raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt (even when started with SIGINT ignored, e.g. `cmd &`);
    SIGTERM/SIGHUP raise SystemExit; so `finally` blocks always run and kill the children."""
    previous: dict[int, Any] = {
        sig: signal.signal(sig, raise_system_exit) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def pinned(cpu: int | str | None, argv: Sequence[str]) -> list[str]:
    """argv under `taskset -c cpu` (taskset execs, so the pid is the program's own)."""
    taskset = shutil.which("taskset")
    if cpu is None or taskset is None:
        return list(argv)
    return [taskset, "-c", str(cpu), *argv]


def post(
    port: int, path: str, body: bytes, headers: dict[str, str], timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """One POST on a fresh connection: (status, lower-cased headers, body)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    finally:
        conn.close()


def wait_ready(
    procs: Processes,
    proc: subprocess.Popen[bytes],
    port: int,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    expect: str = UPSTREAM_BODY,
) -> None:
    """Wait until a POST to `port` answers 200 with the JSON `expect`."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last_error = "no answer"
    hdrs = {"Content-Type": "application/json", "Idempotency-Key": "ready", **(headers or {})}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"process {proc.args!r} exited with {proc.returncode}:\n{procs.log_tail(proc)}"
            )
        try:
            status, _, data = post(port, path, body, hdrs, timeout=2.0)
            if status == 200 and json.loads(data) == json.loads(expect):
                return
            last_error = f"{status} {data[:200]!r}"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            last_error = repr(exc)
        time.sleep(0.1)
    raise RuntimeError(
        f"port {port} not ready after {READY_TIMEOUT_S}s: {last_error}\n{procs.log_tail(proc)}"
    )


def process_group_rss_kib(pgid: int) -> int:
    """Resident memory of every process in a group (a master and its workers), in KiB."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:  # field 5 of stat: pgrp
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time these processes have used so far (exited ones count 0)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # stat fields 14 and 15: utime, stime
    return total / ticks


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return sorted(pids)


# --------------------------------------------------------------------------- nginx

NGINX_COMMON = """\
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
{body}
}}
"""

NGINX_UPSTREAM = """\
    server {{
        listen {host}:{port} backlog=4096;
        default_type application/json;
        location / {{ return 200 '{response}'; }}
        location = {kib_path} {{ return 200 '{kib_body}'; }}
    }}
"""

NGINX_PROXY = """\
    upstream app {{
        server {host}:{upstream_port};
        keepalive 128;
        keepalive_requests 1000000;
    }}
    server {{
        listen {host}:{port} backlog=4096;
        location / {{
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def nginx_version(binary: str | None) -> str:
    if binary is None:
        return "absent"
    proc = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10, check=False)
    return proc.stderr.strip().removeprefix("nginx version: ")


def nginx_upstream_body(port: int) -> str:
    return NGINX_UPSTREAM.format(
        host=HOST, port=port, response=UPSTREAM_BODY, kib_path=KIB_PATH, kib_body=KIB_BODY
    )


def nginx_proxy_body(port: int, upstream_port: int) -> str:
    return NGINX_PROXY.format(host=HOST, port=port, upstream_port=upstream_port)


def start_nginx(
    procs: Processes, binary: str, name: str, body: str, cpu: int | str | None
) -> subprocess.Popen[bytes]:
    conf_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=procs.log_dir))
    conf_dir.chmod(0o755)  # workers may run as an unprivileged user
    conf = conf_dir / "nginx.conf"
    conf.write_text(NGINX_COMMON.format(dir=conf_dir, body=body))
    argv = [binary, "-p", str(conf_dir), "-e", str(conf_dir / "error.log"), "-c", str(conf)]
    return procs.start(name, pinned(cpu, argv))


# --------------------------------------------------------------------------- uvicorn


def uvicorn_argv(python: str, factory: str, app_dir: Path, port: int) -> list[str]:
    """A one-worker uvicorn (uvloop, httptools) serving `module:factory` from app_dir."""
    return [
        python,
        "-m",
        "uvicorn",
        factory,
        "--factory",
        "--app-dir",
        str(app_dir),
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--no-access-log",
        "--log-level",
        "warning",
        "--timeout-keep-alive",
        "75",
    ]


# --------------------------------------------------------------------------- Python upstream

_OK = UPSTREAM_BODY.encode()
_KIB = KIB_BODY.encode()


def _json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]


def create_upstream_app() -> Callable[..., Any]:
    """Trivial upstream (run with `--lifespan off`): 200 '{"ok":true}'; a 1 KiB body at
    KIB_PATH; paths under SLOW_PATH answer after SLOW_DELAY_S (for waiting duplicates)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:  # drain the request body
            message = await receive()
            more = message.get("more_body", False)
        path: str = scope["path"]
        body = _KIB if path == KIB_PATH else _OK
        if path.startswith(SLOW_PATH):
            await asyncio.sleep(SLOW_DELAY_S)
        await send({"type": "http.response.start", "status": 200, "headers": _json_headers(body)})
        await send({"type": "http.response.body", "body": body})

    return app


# --------------------------------------------------------------------------- on gateway.py


def bench_gateway() -> ModuleType:
    """gateway.py (its redis-server, wrk script, client and MONITOR parsing), loaded once
    under another name (its own name is the package's), for the benchmarks built on it."""
    if "bench_gateway" in sys.modules:
        return sys.modules["bench_gateway"]
    spec = importlib.util.spec_from_file_location(
        "bench_gateway", Path(__file__).with_name("gateway.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gateway"] = module
    spec.loader.exec_module(module)
    return module


def gateway_env() -> dict[str, str]:
    """The environment a gateway under test runs in: none of this shell's GATEWAY_*
    settings, and no PYTHONPATH (`-m gateway` from its checkout finds its own package)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.pop("PYTHONPATH", None)
    return env


def start_upstream(
    procs: Processes, port: int, cpu: int | None, path: str, body: bytes
) -> subprocess.Popen[bytes]:
    """The trivial upstream on `port`: nginx `return 200` when installed, else the Python
    one (create_upstream_app); ready when it returns."""
    nginx = nginx_binary()
    if nginx is not None:
        proc = start_nginx(procs, nginx, "upstream", nginx_upstream_body(port), cpu)
    else:
        argv = uvicorn_argv(sys.executable, "_harness:create_upstream_app", HERE, port)
        proc = procs.start("upstream", pinned(cpu, [*argv, "--lifespan", "off"]))
    wait_ready(procs, proc, port, path, body)
    return proc


def monitor_site(redis: Any, procs: Processes) -> Any:
    """What gateway.py's Monitor reads from its bench object: the Redis and the processes."""
    return type("MonitorSite", (), {"redis": redis, "procs": procs})()


def wrk_errors(data: dict[str, Any]) -> int:
    """Failed requests in a wrk_result: socket errors, statuses > 399 and timeouts."""
    return sum(int(data[k]) for k in ("connect", "read", "write", "status", "timeout"))


# --------------------------------------------------------------------------- formatting


def dist_version(dist: str) -> str:
    """The installed version of a distribution, or "?"."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def dist_versions(dists: Sequence[str]) -> str:
    """The installed versions, as `starlette 1.0, uvicorn 0.30` (for the environment lines)."""
    return ", ".join(f"{d} {dist_version(d)}" for d in dists)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def median_rps_ratio(results: Sequence[Any], base: Sequence[Any]) -> float | None:
    """Median over the runs of results[i].rps / base[i].rps (run i of the contender against run
    i of the reference); None unless there is one reference run per run."""
    if not base or len(base) != len(results):
        return None
    return median([r.rps / b.rps for r, b in zip(results, base, strict=True) if b.rps > 0])


def fmt_int(value: float) -> str:
    return f"{value:,.0f}"


def fmt_ms(value: float) -> str:
    if value < 10:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:.0f}"


def run_bounded(argv: list[str], timeout: float) -> str:
    """Run to completion (killed on timeout or error, Ctrl-C reaches only us); stdout."""
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, start_new_session=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}):\n{done.stderr}{done.stdout}")
    return done.stdout


def wrk_result(out: str) -> dict[str, Any]:
    """The BENCH_JSON line the benchmarks' wrk scripts print in `done()`."""
    line = next((ln for ln in out.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if line is None:
        raise RuntimeError(f"no result from wrk:\n{out}")
    data: dict[str, Any] = json.loads(line.removeprefix("BENCH_JSON "))
    return data


def run_wrk(
    binary: str,
    cpu: int | None,
    connections: int,
    duration: float,
    script: Path,
    port: int,
    path: str,
    script_args: Sequence[str],
) -> dict[str, Any]:
    """`wrk -t1` on `cpu` for `duration` (whole seconds, at least 1) with a script that prints
    BENCH_JSON (`script_args` go to its `init`); bounded in time; its wrk_result."""
    argv = [
        binary,
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "5s",
        "--latency",
        "-s",
        str(script),
        f"http://{HOST}:{port}{path}",
        "--",
        *script_args,
    ]
    return wrk_result(run_bounded(pinned(cpu, argv), duration + 30.0))


def wrk_load_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The loadgen.LoadResult fields of a wrk_result."""
    return {
        "requests": data["requests"],
        "duration_s": data["duration_us"] / 1e6,
        "p50_ms": data["p50_us"] / 1000.0,
        "p99_ms": data["p99_us"] / 1000.0,
        "non_2xx": data["status"],  # wrk counts statuses > 399
        "socket_errors": data["connect"] + data["read"] + data["write"],
        "timeouts": data["timeout"],
    }
