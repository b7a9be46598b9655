"""A PostgreSQL server of the tests' own: `initdb` into a temp dir, `postgres` on a free
loopback port (and a unix socket in its data dir), stopped or killed by its own pid.

Never the machine's own service (Debian's on 5432): every server here is a child of
the test run, so `kill()` is a crash of exactly this database (SIGKILL to the
postmaster and the processes it started, by pid) and `start()` again recovers it from
its WAL, as a real restart would. Durable by default: fsync and
synchronous_commit on, as production runs it.

PostgreSQL refuses to run as root. Run as root (CI is), the server runs as the
`postgres` user Debian's package creates, and its data dir belongs to that user.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.servers import Process, free_port

USER = "gateway"
DATABASE = "gateway"


def pg_binary(name: str) -> str:
    """`initdb`, `postgres`, ...: on PATH, or the newest of Debian's
    /usr/lib/postgresql/<version>/bin (which Debian does not put on PATH)."""
    found = shutil.which(name)
    if found is not None:
        return found
    candidates = glob.glob(f"/usr/lib/postgresql/*/bin/{name}")

    def version(path: str) -> tuple[int, ...]:
        part = Path(path).parts[-3]
        return tuple(int(x) for x in part.split(".") if x.isdigit())

    candidates.sort(key=version, reverse=True)
    if not candidates:
        raise RuntimeError(
            f"{name} is not on PATH nor in /usr/lib/postgresql/*/bin: run scripts/setup, "
            "which installs Debian's postgresql"
        )
    return candidates[0]


def _run_as() -> pwd.struct_passwd | None:
    """Who the server runs as: None (this user) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(
            "PostgreSQL will not run as root, and there is no postgres user to run it as: "
            "run scripts/setup (Debian's postgresql package creates it)"
        ) from None


class PostgresServer(Process):
    """One PostgreSQL cluster in a temp dir. `settings` are `-c name=value` options
    (e.g. fsync="off"); the defaults are the server's own (durable)."""

    def __init__(self, port: int | None = None, **settings: str) -> None:
        port = port or free_port()
        self.owner = _run_as()
        self.dir = Path(tempfile.mkdtemp(prefix="postgres-"))
        self.data = self.dir / "data"
        options = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.dir),
            "max_connections": "200",
            "synchronous_commit": "on",
            **settings,
        }
        args = [pg_binary("postgres"), "-D", str(self.data), "-p", str(port)]
        for name, value in options.items():
            args += ["-c", f"{name}={value}"]
        super().__init__(args, port, "postgres")
        if self.owner is not None:
            os.chown(self.dir, self.owner.pw_uid, self.owner.pw_gid)
            self.popen.update(user=self.owner.pw_uid, group=self.owner.pw_gid)
        # A session of its own: a ^C to the test run is not a fast shutdown of it.
        self.popen["start_new_session"] = True
        self._initialised = False

    def _initdb(self) -> None:
        log = self.log_path.open("ab")
        try:
            subprocess.run(
                [
                    pg_binary("initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    USER,
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",  # initdb's own files only; the server syncs as usual
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=120,
                **self.popen,
            )
        except subprocess.CalledProcessError:
            raise RuntimeError(f"initdb failed:\n{self.output()}") from None
        finally:
            log.close()
        self._initialised = True

    def start(self, wait: bool = True) -> PostgresServer:
        if not self._initialised:
            if self.owner is not None:
                os.chown(self.log_path.parent, self.owner.pw_uid, self.owner.pw_gid)
            self._initdb()
        super().start(wait=wait)
        if wait:
            self.wait_ready()
            self._create_database()
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        """Until the server accepts a query (it listens before recovery is done)."""
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn("postgres"), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"postgres exited:\n{self.output()}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"postgres not ready after {timeout}s:\n{self.output()}"
                    ) from None
                time.sleep(0.05)

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
            if found.fetchone() is None:
                conn.execute(f"CREATE DATABASE {DATABASE}")

    def sql(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement on the gateway database (autocommit); its rows, if any."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description is not None else []

    def dsn(self, database: str = DATABASE) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.dsn()

    @property
    def socket_dir(self) -> Path:
        return self.dir

    def stop(self, timeout: float = 10) -> int | None:
        """A fast shutdown (SIGINT: SIGTERM would wait for every client to leave)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def children(self) -> list[int]:
        """Pids of the postmaster's processes (backends, checkpointer, walwriter...).
        Each is a session of its own (PostgreSQL calls setsid), so a process group
        does not reach them: their parent does."""
        if self.proc is None:
            return []
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == self.proc.pid:  # ppid
                found.append(int(stat.parent.name))
        return found

    def kill(self) -> None:
        """SIGKILL to the postmaster and every process it started: a crash. The next
        start() recovers from the WAL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        children = self.children()
        for pid in [self.proc.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        # The next start refuses while any of them still holds the shared memory.
        deadline = time.monotonic() + 10
        while children and time.monotonic() < deadline:
            children = [pid for pid in children if Path(f"/proc/{pid}").exists()]
            time.sleep(0.02)

    def remove(self) -> None:
        """Delete the data dir (after stop)."""
        shutil.rmtree(self.dir, ignore_errors=True)


#: The gateway's own sessions (postgres_sql.connect_args) waiting for a lock.
_GATEWAY_LOCK_WAITS = (
    "FROM pg_stat_activity"
    " WHERE application_name = 'idempotency-gateway' AND wait_event_type = 'Lock'"
)


async def sessions_waiting_on_a_lock(server: PostgresServer, n: int = 1) -> None:
    """Until `n` of the gateway's sessions wait for a lock another session holds."""
    for _ in range(500):
        if server.sql(f"SELECT count(*) {_GATEWAY_LOCK_WAITS}")[0][0] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} of the store's sessions never waited on a lock")


def end_sessions_waiting_on_a_lock(server: PostgresServer) -> None:
    """pg_terminate_backend on every gateway session that waits for a lock."""
    server.sql(f"SELECT pg_terminate_backend(pid) {_GATEWAY_LOCK_WAITS}")


async def lock_record(conn: Any, prefix: str, digest: str) -> None:
    """Hold the record's row in `conn`'s open transaction (SELECT ... FOR UPDATE)."""
    await conn.execute(
        "SELECT 1 FROM gateway_records WHERE prefix = $1 AND digest = $2 FOR UPDATE",
        prefix,
        digest,
    )
