"""Instructions per request of a whole gateway process, counted by callgrind: for
comparing source trees where CPU time on a shared VM scatters too much to resolve 5%.

    .venv/bin/python tests/benchmarks/instructions.py N SRC [SRC...]
    # e.g. N=1600, SRC=/path/to/a/worktree/of/304c8ad and . (this tree)

Each source tree's `python -m gateway run` (1 worker, a Redis store, a route keyed by
`Idempotency-Key`, nginx `return 200` upstream) runs under valgrind with counting off;
after a warm-up of 500 requests, counting is switched on (`callgrind_control -i on`) for
N requests from 16 keep-alive connections, unique keys and then one key replayed. The
last lines are each tree's count relative to the first SRC's, per workload. The count
does not depend on the machine's load; it weighs instructions, not cache misses or
system calls, so it complements `gateway.py`'s side-by-side CPU figures rather than
replacing them. Needs valgrind, nginx and redis-server. WORKLOADS=unique,same selects.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _harness as h  # noqa: E402

PY = sys.executable
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1600
SRCS = [str(Path(s).resolve()) for s in sys.argv[2:]] or [str(HERE.parents[1])]
THREADS = 16
WORKLOADS = os.environ.get("WORKLOADS", "unique,same").split(",")


def request(key: str) -> bytes:
    body = b'{"job":"nightly"}'
    return (
        b"POST /jobs/run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nContent-Length: 17\r\n\r\n" + body
    )


def read_answer(sock: socket.socket, buf: bytearray) -> None:
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end]).lower()
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            total = end + 4 + length
            if len(buf) >= total:
                if not head.startswith(b"http/1.1 200"):
                    raise RuntimeError(head)
                del buf[:total]
                return
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("closed")
        buf += chunk


def load(port: int, n: int, mode: str) -> None:
    prefix = secrets.token_hex(4)

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
                key = f"{prefix}-{t}-{i}" if mode == "unique" else f"same-{prefix}"
                sock.sendall(request(key))
                read_answer(sock, buf)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def ir_total(out: Path) -> int:
    total = 0
    for f in out.parent.glob(out.name + "*"):
        for line in f.read_text().splitlines():
            if line.startswith("summary:") or line.startswith("totals:"):
                total = max(total, int(line.split()[1]))
    return total


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="gwcount-"))
    procs = h.Processes(work)
    try:
        up = h.free_port()
        h.start_nginx(procs, h.nginx_binary(), "up", h.nginx_upstream_body(up), None)
        rport = h.free_port()
        procs.start(
            "redis",
            [
                "redis-server",
                "--port",
                str(rport),
                "--bind",
                h.HOST,
                "--save",
                "",
                "--appendonly",
                "no",
            ],
        )
        time.sleep(0.5)
        results = {}
        for src in SRCS:
            for mode in WORKLOADS:
                port = h.free_port()
                cfg = work / f"gw-{port}.yaml"
                cfg.write_text(
                    f"""\
server: {{listen: "{h.HOST}:{port}", shutdown_grace: 1s, access_log: false}}
admin: {{listen: "{h.HOST}:{h.free_port()}"}}
store: {{url: "redis://{h.HOST}:{rport}/0", prefix: "gwc{port}:"}}
routes:
  - name: bench
    match: {{path: "/{{rest:path}}"}}
    upstream: http://{h.HOST}:{up}
    key: {{header: Idempotency-Key}}
    fingerprint: none
"""
                )
                out = work / f"cg-{port}.out"
                env = {**os.environ, "PYTHONPATH": src}
                argv = [
                    "valgrind",
                    "--tool=callgrind",
                    "--instr-atstart=no",
                    f"--callgrind-out-file={out}",
                    PY,
                    "-m",
                    "gateway",
                    "run",
                    "--config",
                    str(cfg),
                    "--log-level",
                    "WARNING",
                ]
                gw = procs.start(f"gw-{port}", argv, env=env, cwd=src)
                deadline = time.monotonic() + 180
                while True:
                    try:
                        load(port, THREADS * 10, mode)
                        break
                    except (OSError, RuntimeError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(1)
                load(port, 500, mode)  # warm-up
                subprocess.run(
                    ["callgrind_control", "-i", "on", str(gw.pid)], check=True, capture_output=True
                )
                t0 = time.monotonic()
                load(port, N, mode)
                subprocess.run(
                    ["callgrind_control", "-i", "off", str(gw.pid)], check=True, capture_output=True
                )
                subprocess.run(
                    ["callgrind_control", "-d", str(gw.pid)], check=True, capture_output=True
                )
                time.sleep(1)
                ir = ir_total(out)
                n = (N // THREADS) * THREADS
                results[(src, mode)] = ir / n
                print(
                    f"{src} {mode}: {ir / n:,.0f} instr/req ({time.monotonic() - t0:.0f}s)",
                    flush=True,
                )
                procs.stop(gw)
        for mode in WORKLOADS:
            base = results[(SRCS[0], mode)]
            print(mode, " ".join(f"{results[(s, mode)] / base:.3f}" for s in SRCS))
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
