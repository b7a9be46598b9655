"""Running the gateway: the proxy and admin listeners, workers, reload and shutdown.

One process (`serve`) runs both listeners on one gateway. With `--workers N`,
`supervise` binds both listeners once, starts N worker processes that share them,
restarts a worker that dies, and passes signals on:

- SIGTERM / SIGINT: the proxy stops accepting, forwards under way get up to
  `server.shutdown_grace` to finish, and those still running then are marked
  unresolved with that reason (the engine does it as their tasks are cancelled)
  instead of being left to lease expiry.
- SIGHUP: the config file is read again; a valid one replaces routes, upstreams and
  policies without dropping requests in flight; an invalid one is rejected with the
  reason in the log, and the old config stays.

A worker whose supervisor is gone (SIGKILLed, crashed) stops as on SIGTERM: each
holds the read end of a pipe whose only write end is the supervisor's, and the
kernel closes that end when the supervisor dies. Left running, orphaned workers
would go on answering on the shared listeners with nobody to restart or stop them.

Metrics across workers use prometheus-client's multiprocess mode: each worker writes
its samples to files in PROMETHEUS_MULTIPROC_DIR, and whichever worker answers a
scrape adds them up, so every request is counted exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
from typing import Any

import uvicorn

from gateway.admin.api import create_admin_app
from gateway.admin.listener import admin_protocol
from gateway.assembly import Gateway
from gateway.config import Config, ServerConfig, load_config
from gateway.config.addresses import parse_listen
from gateway.config.summary import config_warnings, store_at_start
from gateway.errors import ConfigError
from gateway.http.protocol import GatewayHttpProtocol, protocol_for
from gateway.logs import flush_access_log
from gateway.proxy.app import ProxyApp

log = logging.getLogger("gateway")


class _Server(uvicorn.Server):
    # Signals are ours: two servers share one process and shut down in order.
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def split_listen(listen: str) -> tuple[str, int]:
    return parse_listen(listen)  # the grammar config validation checked it with


def uvicorn_server(
    app: Any,
    listen: str,
    protocol: type[GatewayHttpProtocol],
    *,
    grace: float = 5.0,
    date_header: bool = False,
) -> uvicorn.Server:
    """A uvicorn server for one listener, on `protocol`: the proxy's (gateway/http/protocol.py)
    or the admin listener's (gateway/admin/listener.py), both with problem+json
    refusals, a bounded request head, the deadlines, the connection cap and the
    keep-alive of `server.*`, read per connection. The proxy's responses carry the
    Date the app gives them (gateway/proxy/app.py adds one where there is none), not a second
    one from uvicorn; the admin listener's get uvicorn's (`date_header`)."""
    host, port = split_listen(listen)
    config = uvicorn.Config(
        app,
        http=protocol,
        host=host,
        port=port,
        lifespan="off",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=int(grace) + 1,
        server_header=False,
        # The client address is the socket's peer on both listeners: uvicorn would
        # take X-Forwarded-For/-Proto from any loopback caller (FORWARDED_ALLOW_IPS).
        # Which proxies are believed is server.trusted_proxies (upstream.py).
        proxy_headers=False,
        date_header=date_header,
        backlog=2048,
    )
    return _Server(config)


def _reload(gateway: Gateway, path: str) -> None:
    try:
        config = load_config(path)
    except ConfigError as exc:
        log.error("config reload rejected; keeping the running config:\n%s", exc)
        return
    for warning in gateway.reload(config):
        log.warning("config reload: %s", warning)
    for issue in config_warnings(config):
        log.warning("config warning: %s", issue)
    log.info("config reloaded from %s: %d route(s)", path, len(config.routes))


async def serve(
    config: Config,
    *,
    config_path: str | None = None,
    sockets: tuple[socket.socket, socket.socket] | None = None,
    supervisor_fd: int | None = None,
) -> None:
    gateway = Gateway(config)
    await gateway.start()
    for issue in config_warnings(config):
        log.warning("config warning: %s", issue)
    grace = config.server.shutdown_grace

    def settings() -> ServerConfig:  # the running config's: a reload applies
        return gateway.config.server

    proxy = uvicorn_server(
        ProxyApp(gateway, lifespan=False),
        config.server.listen,
        protocol_for(settings),
        grace=grace + 5,
    )
    admin = uvicorn_server(
        create_admin_app(gateway), config.admin.listen, admin_protocol(settings), date_header=True
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if config_path is not None:
        loop.add_signal_handler(signal.SIGHUP, _reload, gateway, config_path)
    if supervisor_fd is not None:

        def supervisor_gone() -> None:  # nothing is written: readable means EOF
            loop.remove_reader(supervisor_fd)
            log.warning("the supervisor is gone: this worker stops as on SIGTERM")
            stopping.set()

        loop.add_reader(supervisor_fd, supervisor_gone)

    servers = [
        asyncio.create_task(proxy.serve(sockets=[sockets[0]] if sockets else None)),
        asyncio.create_task(admin.serve(sockets=[sockets[1]] if sockets else None)),
    ]
    codec = gateway.store.codec
    log.info(
        "gateway listening on %s (admin %s), store %s, %s",
        config.server.listen,
        config.admin.listen,
        store_at_start(config),
        f"responses encrypted with key id {codec.writer_id}"
        if codec.encrypting
        else "responses stored unencrypted",
    )
    flusher = asyncio.create_task(_flush_logs_every(0.5))
    waiter = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait([*servers, waiter], return_when=asyncio.FIRST_COMPLETED)
    for task in servers:
        if task in done and task.exception() is not None:
            log.error("a listener failed: %s", task.exception())
    # Deliveries first: no new pick; attempts under way are engine tasks, drained below.
    gateway.delivery.stop_picking()
    log.info("shutting down: no new requests, %d forward(s) under way", len(gateway.engine.tasks))
    proxy.should_exit = True
    await gateway.engine.drain(grace)
    await asyncio.gather(servers[0], return_exceptions=True)
    admin.should_exit = True
    await asyncio.gather(servers[1], return_exceptions=True)
    waiter.cancel()
    flusher.cancel()
    await gateway.close()
    flush_access_log()
    log.info("gateway stopped")


async def _flush_logs_every(interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        flush_access_log()


def _bind(listen: str) -> socket.socket:
    host, port = split_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def supervise(config: Config, config_path: str, workers: int) -> int:
    """Run `workers` worker processes on shared listeners until SIGTERM/SIGINT."""
    from prometheus_client import multiprocess

    proxy_sock, admin_sock = _bind(config.server.listen), _bind(config.admin.listen)
    # The write end is not inheritable: only this process holds it, so its death is
    # each worker's EOF (a sibling holding it would keep the pipe open).
    alive_read, alive_write = os.pipe()
    fds = f"{proxy_sock.fileno()},{admin_sock.fileno()},{alive_read}"
    owned_dir = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(
        prefix="gateway-metrics-"
    )
    for name in os.listdir(metrics_dir):  # samples of an earlier run must not be added in
        if name.endswith(".db"):
            os.unlink(os.path.join(metrics_dir, name))
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    command = [sys.executable, "-m", "gateway", "worker", "--config", config_path, "--fds", fds]

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command, pass_fds=(proxy_sock.fileno(), admin_sock.fileno(), alive_read), env=env
        )

    flags = {"stop": False, "reload": False}

    def on_stop(signum: int, frame: object) -> None:
        flags["stop"] = True

    def on_hup(signum: int, frame: object) -> None:
        flags["reload"] = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    children = [spawn() for _ in range(workers)]
    log.info(
        "supervisor: %d workers on %s (admin %s)",
        workers,
        config.server.listen,
        config.admin.listen,
    )
    try:
        while not flags["stop"]:
            time.sleep(0.2)
            if flags["reload"]:
                flags["reload"] = False
                try:
                    load_config(config_path)
                except ConfigError as exc:
                    log.error("config reload rejected; keeping the running config:\n%s", exc)
                else:
                    for child in children:
                        child.send_signal(signal.SIGHUP)
            for i, child in enumerate(children):
                if child.poll() is not None and not flags["stop"]:
                    log.error(
                        "worker %d exited with %s; starting another", child.pid, child.returncode
                    )
                    multiprocess.mark_process_dead(child.pid, metrics_dir)  # type: ignore[no-untyped-call]
                    time.sleep(0.5)  # a worker that dies at once must not spin
                    children[i] = spawn()
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + config.server.shutdown_grace + 20
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        proxy_sock.close()
        admin_sock.close()
        os.close(alive_read)
        os.close(alive_write)
        if owned_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("supervisor stopped")
    return 0


def worker_sockets(fds: str) -> tuple[tuple[socket.socket, socket.socket], int | None]:
    """The listeners a supervisor passed (`--fds proxy,admin[,alive]`), and the read end
    of its pipe whose EOF says it is gone (None when not given)."""
    proxy_fd, admin_fd, *alive = (int(fd) for fd in fds.split(","))
    sockets = socket.socket(fileno=proxy_fd), socket.socket(fileno=admin_fd)
    return sockets, (alive[0] if alive else None)
