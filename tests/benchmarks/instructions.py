"""Instructions per request of a whole gateway process, counted by callgrind: for
comparing source trees where CPU time on a shared VM scatters too much to resolve 5%.

    .venv/bin/python tests/benchmarks/instructions.py N SRC [SRC...]
    # e.g. N=1600, SRC=/path/to/a/worktree/of/304c8ad and . (this tree)

Each source tree's `python -m gateway run` (1 worker, a Redis store, a route keyed by
`Idempotency-Key`, nginx `return 200` upstream) runs under valgrind with counting off;
after a warm-up of 500 requests, counting is switched on (`callgrind_control -i on`) for
N requests from 16 keep-alive connections, unique keys and then one key replayed; the
workload `accept` posts new keys to an async route (`delivery: async`) of a gateway that
delivers nothing (`server.max_deliveries: 0`), so its count is the 202's alone. The
workload `replay` replays N keys stored just before (each a different key: one round
trip per replay, where 16 callers of one key share one). The
last lines are each tree's count relative to the first SRC's, per workload. The count
does not depend on the machine's load; it weighs instructions, not cache misses or
system calls, so it complements `gateway.py`'s side-by-side CPU figures rather than
replacing them. Needs valgrind, nginx and redis-server. WORKLOADS=unique,same,accept
selects (default unique,same: trees from before asynchronous delivery lack `accept`).
REDIS=1 runs redis-server under callgrind too and counts its instructions per request
over the same requests (the scripts' work, which shares the machine's cores).
KEEP=dir copies each counted dump there as `<tree's basename>-<workload>.out`, for
`callgrind_annotate --inclusive=yes`.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness as h  # noqa: E402

PY = sys.executable
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1600
SRCS = [str(Path(s).resolve()) for s in sys.argv[2:]] or [str(HERE.parents[1])]
THREADS = 16
WORKLOADS = os.environ.get("WORKLOADS", "unique,same").split(",")


COUNT_REDIS = os.environ.get("REDIS", "") == "1"
KEEP = os.environ.get("KEEP", "")
#: what each workload's answers start with
STATUS = {"unique": b"http/1.1 200", "same": b"http/1.1 200", "replay": b"http/1.1 200"}
STATUS["accept"] = b"http/1.1 202"


def request(key: str, mode: str) -> bytes:
    body = b'{"job":"nightly"}'
    path = b"/async/run" if mode == "accept" else b"/jobs/run"
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nContent-Length: 17\r\n\r\n" + body
    )


def read_answer(sock: socket.socket, buf: bytearray, status: bytes) -> None:
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end]).lower()
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            total = end + 4 + length
            if len(buf) >= total:
                if not head.startswith(status):
                    raise RuntimeError(head)
                del buf[:total]
                return
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("closed")
        buf += chunk


def load(port: int, n: int, mode: str, prefix: str = "") -> None:
    prefix = prefix or secrets.token_hex(4)

    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            run(t)
        except BaseException as exc:
            errors.append(exc)

    def run(t: int) -> None:
        with socket.create_connection((h.HOST, port)) as sock:
            buf = bytearray()
            for i in range(n // THREADS):
                key = f"same-{prefix}" if mode == "same" else f"{prefix}-{t}-{i}"
                sock.sendall(request(key, mode))
                read_answer(sock, buf, STATUS[mode])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def newest_dump(out: Path) -> Path:
    return max(out.parent.glob(out.name + ".*"), key=lambda f: f.stat().st_mtime_ns)


def ir_last_dump(out: Path) -> int:
    """The newest dump's count (each `callgrind_control -d` holds what ran since the last)."""
    newest = newest_dump(out)
    counts = [
        int(line.split()[1])
        for line in newest.read_text().splitlines()
        if line.startswith(("summary:", "totals:"))
    ]
    return max(counts, default=0)


#: `python -m gateway`, with the loops that run by the clock (the queue watch each
#: second, the store-reset watch, the sweep) slowed to once an hour after their first
#: round: under callgrind a request takes ~50x as long, so a once-a-second loop would be
#: counted at ~50x its share per request, and by how long the run took, which the
#: machine's load decides. Names a tree does not have are skipped (older trees).
LAUNCH = """
import importlib, runpy, sys
for module, name in (("gateway.delivery", "QUEUE_WATCH"), ("gateway.delivery", "BACKSTOP"),
                     ("gateway.delivery.worker", "QUEUE_WATCH"),
                     ("gateway.delivery.worker", "BACKSTOP"),
                     ("gateway.app", "STORE_WATCH_INTERVAL"),
                     ("gateway.assembly", "STORE_WATCH_INTERVAL")):
    try:
        found = importlib.import_module(module)
    except ImportError:
        continue
    if hasattr(found, name):
        setattr(found, name, 3600.0)
import gateway.reconcile as reconcile
made = reconcile.Reconciler.__init__
def __init__(self, *args, **kwargs):
    made(self, *args, **kwargs)
    self.interval = 3600.0
reconcile.Reconciler.__init__ = __init__
sys.argv[0] = "gateway"
runpy.run_module("gateway", run_name="__main__", alter_sys=True)
"""


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def counted(pids: list[int], work: Callable[[], None]) -> list[int]:
    """Instructions each of `pids` ran during `work` (its newest callgrind dump)."""
    for pid in pids:
        control(pid, "-z")
        control(pid, "-i", "on")
    work()
    for pid in pids:
        control(pid, "-i", "off")
        control(pid, "-d")
    time.sleep(1)
    return [ir_last_dump(out_of[pid]) for pid in pids]


#: each counted process's --callgrind-out-file
out_of: dict[int, Path] = {}


def config(port: int, rport: int, up: int, mode: str) -> str:
    text = f"""\
server: {{listen: "{h.HOST}:{port}", shutdown_grace: 1s, access_log: false}}
admin: {{listen: "{h.HOST}:{h.free_port()}"}}
store: {{url: "redis://{h.HOST}:{rport}/0", prefix: "gwc{port}:"}}
routes:
"""
    if mode == "accept":  # delivers nothing: a 202's cost alone
        text = text.replace("access_log: false", "access_log: false, max_deliveries: 0")
        text += f"""\
  - name: jobs
    match: {{path: "/async/{{rest:path}}"}}
    upstream: http://{h.HOST}:{up}
    key: {{header: Idempotency-Key}}
    fingerprint: none
    delivery: {{mode: async, max_queued: 10000000}}
    on_unknown_outcome: park
"""
    return (
        text
        + f"""\
  - name: bench
    match: {{path: "/{{rest:path}}"}}
    upstream: http://{h.HOST}:{up}
    key: {{header: Idempotency-Key}}
    fingerprint: none
"""
    )


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="gwcount-"))
    procs = h.Processes(work)
    try:
        up = h.free_port()
        h.start_nginx(procs, h.nginx_binary(), "up", h.nginx_upstream_body(up), None)
        rport = h.free_port()
        rout = work / "cg-redis.out"
        argv = ["redis-server", "--port", str(rport), "--bind", h.HOST]
        argv += ["--save", "", "--appendonly", "no"]
        if COUNT_REDIS:  # its cron (memory stats, 10 a second) runs by the clock too
            argv += ["--hz", "1"]
            argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={rout}", *argv]  # fmt: skip
        redis = procs.start("redis", argv)
        out_of[redis.pid] = rout
        time.sleep(3 if COUNT_REDIS else 0.5)
        results = {}
        for src in SRCS:
            for mode in WORKLOADS:
                port = h.free_port()
                cfg = work / f"gw-{port}.yaml"
                cfg.write_text(config(port, rport, up, mode))
                out = work / f"cg-{port}.out"
                env = {**os.environ, "PYTHONPATH": src}
                argv = [
                    "valgrind",
                    "--tool=callgrind",
                    "--instr-atstart=no",
                    f"--callgrind-out-file={out}",
                    PY,
                    "-c",
                    LAUNCH,
                    "run",
                    "--config",
                    str(cfg),
                    "--log-level",
                    "WARNING",
                ]
                gw = procs.start(f"gw-{port}", argv, env=env, cwd=src)
                out_of[gw.pid] = out
                deadline = time.monotonic() + 180
                while True:
                    try:
                        load(port, THREADS * 10, mode)
                        break
                    except (OSError, RuntimeError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(1)
                if mode == "replay":  # store the keys it replays (also the warm-up)
                    prefix = secrets.token_hex(4)
                    load(port, N, "unique", prefix)
                else:
                    prefix = ""
                    load(port, 500, mode)  # warm-up
                pids = [gw.pid, redis.pid] if COUNT_REDIS else [gw.pid]
                t0 = time.monotonic()
                counts = counted(pids, functools.partial(load, port, N, mode, prefix))
                elapsed = time.monotonic() - t0
                n = (N // THREADS) * THREADS
                results[(src, mode)] = counts[0] / n
                line = f"{src} {mode}: {results[(src, mode)]:,.0f} instr/req"
                if COUNT_REDIS:
                    results[(src, mode, "redis")] = counts[1] / n
                    line += f", redis-server {results[(src, mode, 'redis')]:,.0f}"
                print(f"{line} ({elapsed:.0f}s)", flush=True)
                if KEEP:
                    Path(KEEP).mkdir(parents=True, exist_ok=True)
                    kept = Path(KEEP) / f"{Path(src).name}-{mode}.out"
                    shutil.copyfile(newest_dump(out), kept)
                procs.stop(gw)
        for mode in WORKLOADS:
            base = results[(SRCS[0], mode)]
            print(mode, " ".join(f"{results[(s, mode)] / base:.3f}" for s in SRCS))
            if COUNT_REDIS:
                base = results[(SRCS[0], mode, "redis")]
                ratios = " ".join(f"{results[(s, mode, 'redis')] / base:.3f}" for s in SRCS)
                print(mode, "redis-server", ratios)
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
