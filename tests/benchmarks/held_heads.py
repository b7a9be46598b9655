"""Memory held by connections that each keep an unfinished request head open.

    python tests/benchmarks/held_heads.py [--connections 150] [--head-bytes N] [--root DIR]

Starts a gateway process from DIR (default: this checkout; point it at another
checkout to compare), opens the connections, sends each an unfinished head of N bytes
(default: just under what this checkout's listener holds before it refuses,
server.max_header_bytes + listener.READ_SLACK), and prints the process's resident memory
before and after, and how many connections it still holds (not refused).
server.header_timeout is set long on checkouts that know it, so the deadline does not
end them during the measurement.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.http.protocol import READ_SLACK  # noqa: E402
from tests.support.servers import free_port, wait_for_port  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def held(socks: list[socket.socket]) -> int:
    """Connections the gateway neither answered nor closed."""
    count = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            sock.recv(1)
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=150)
    parser.add_argument("--head-bytes", type=int, default=16 * 1024 + READ_SLACK - 1024)
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args()
    port, admin = free_port(), free_port()
    server: dict[str, str] = {"listen": f"127.0.0.1:{port}"}
    package = args.root / "gateway"
    sources = [package / "config.py", *sorted((package / "config").glob("*.py"))]
    if any(p.is_file() and "header_timeout" in p.read_text() for p in sources):
        server["header_timeout"] = "10m"
    config = {
        "server": server,
        "admin": {"listen": f"127.0.0.1:{admin}"},
        "routes": [{"name": "r", "match": {"path": "/x"}, "upstream": "http://127.0.0.1:9"}],
    }
    directory = Path(tempfile.mkdtemp())
    (directory / "gateway.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "gateway", "run", "--config", str(directory / "gateway.yaml")]
    with (directory / "output.log").open("ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=args.root)
    try:
        wait_for_port(port, proc)
        time.sleep(1)
        before = rss_mib(proc.pid)
        head = b"POST /x HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * args.head_bytes
        socks = []
        for _ in range(args.connections):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(head)
            socks.append(sock)
        time.sleep(3)
        after = rss_mib(proc.pid)
        print(
            f"{args.connections} connections x {args.head_bytes} head bytes: RSS "
            f"{before:.1f} -> {after:.1f} MiB (+{after - before:.1f}); "
            f"{held(socks)} held open"
        )
        for sock in socks:
            sock.close()
    finally:
        proc.terminate()
        proc.wait(20)


if __name__ == "__main__":
    main()
