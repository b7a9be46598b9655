"""Real servers for tests: redis-server, the test upstream, gateway processes
(PostgreSQL's is in postgres.py).

Each is a child process of the test run, on a free loopback port, so a test can
kill it, restart it, or send it a signal. Nothing here touches a Redis or port the
tests did not start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


#: Ports free_port has handed out in this process. The kernel may hand a port it just
#: released to the next bind(0), so two calls in a row (a gateway's listen and admin
#: ports) could name the same port: CI saw `admin.listen ... clashes with
#: server.listen`. A port is handed out once per test run.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before in this process."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free loopback port that was not handed out already")


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 15
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class Process:
    """A child process on a port, with its output in a log file."""

    def __init__(self, args: list[str], port: int, name: str, env: dict[str, str] | None = None):
        self.args = args
        self.port = port
        self.name = name
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(tempfile.mkdtemp(prefix=f"{name}-")) / "output.log"
        self.proc: subprocess.Popen[bytes] | None = None
        #: more Popen arguments (a user to run as, a session of its own)
        self.popen: dict[str, Any] = {}

    def start(self, wait: bool = True) -> Process:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, **self.popen
        )
        log.close()
        if wait:
            try:
                wait_for_port(self.port, self.proc)
            except Exception:
                self.stop()
                raise RuntimeError(f"{self.name} did not start:\n{self.output()}") from None
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_output(self, text: str, count: int = 1, timeout: float = 15) -> None:
        """Wait (bounded) until the process has written `text` `count` times: what it
        does after a signal, for example, it does when it gets to it."""
        deadline = time.monotonic() + timeout
        while self.output().count(text) < count:
            assert time.monotonic() < deadline, f"{text!r} never logged {count}x:\n{self.output()}"
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: no chance to clean up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 10) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


#: Processes started for the test that runs now (`for_this_test`). tests/conftest.py's
#: autouse fixture kills whatever of them still runs when the test ends, so a test that
#: fails midway (a broken build, see scripts/mutants) leaves no gateway holding ports
#: and CPU for the rest of the session.
_THIS_TEST: list[Process] = []


def for_this_test(process: Process) -> Process:
    """Register `process` to be killed when the running test ends; returns it."""
    _THIS_TEST.append(process)
    return process


def kill_what_this_test_started() -> None:
    while _THIS_TEST:
        _THIS_TEST.pop().kill()


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not on PATH: run scripts/setup, which installs it")
    return path


class RedisServer(Process):
    """A redis-server of our own, no persistence unless asked, killable."""

    def __init__(self, *extra: str, port: int | None = None) -> None:
        port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-")
        args = [
            redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            *extra,
        ]
        super().__init__(args, port, "redis")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def upstream_server() -> Process:
    port = free_port()
    return Process(
        [sys.executable, str(ROOT / "tests" / "support" / "upstream_app.py"), str(port)],
        port,
        "upstream",
    )


def job_service_server() -> Process:
    """tests/support/job_service.py: a job and its status endpoint, recording what came."""
    port = free_port()
    return Process(
        [sys.executable, str(ROOT / "tests" / "support" / "job_service.py"), str(port)],
        port,
        "job-service",
    )


def gateway_process(config_path: Path, port: int, env: dict[str, str] | None = None) -> Process:
    return Process(
        [sys.executable, "-m", "gateway", "run", "--config", str(config_path)],
        port,
        "gateway",
        env=env,
    )
