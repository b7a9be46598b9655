"""Running the gateway: the proxy and admin listeners on one gateway, and shutdown.

On SIGTERM or SIGINT the proxy stops accepting, forwards under way get up to
`server.shutdown_grace` to finish, and those still running then are marked
unresolved with that reason (the engine does it as their tasks are cancelled)
instead of being left to lease expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator

import uvicorn

from gateway.admin import create_admin_app
from gateway.app import Gateway, ProxyApp
from gateway.config import Config

log = logging.getLogger("gateway")


class _Server(uvicorn.Server):
    # Signals are ours: two servers share one process and shut down in order.
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def uvicorn_server(app: object, listen: str, *, grace: float = 5.0) -> uvicorn.Server:
    host, port = split_listen(listen)
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        lifespan="off",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=int(grace) + 1,
        server_header=False,
    )
    return _Server(config)


async def serve(config: Config) -> None:
    gateway = Gateway(config)
    await gateway.start()
    grace = config.server.shutdown_grace
    proxy = uvicorn_server(ProxyApp(gateway, lifespan=False), config.server.listen, grace=grace + 5)
    admin = uvicorn_server(create_admin_app(gateway), config.admin.listen)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    servers = [asyncio.create_task(proxy.serve()), asyncio.create_task(admin.serve())]
    log.info(
        "gateway listening on %s (admin %s), store %s",
        config.server.listen,
        config.admin.listen,
        config.store.url.split("@")[-1],
    )
    done, _ = await asyncio.wait(
        [*servers, asyncio.create_task(stopping.wait())], return_when=asyncio.FIRST_COMPLETED
    )
    for task in servers:
        if task in done and task.exception() is not None:
            log.error("a listener failed: %s", task.exception())
    log.info("shutting down: no new requests, %d forward(s) under way", len(gateway.engine.tasks))
    proxy.should_exit = True
    await gateway.engine.drain(grace)
    await asyncio.gather(servers[0], return_exceptions=True)
    admin.should_exit = True
    await asyncio.gather(servers[1], return_exceptions=True)
    await gateway.close()
    log.info("gateway stopped")
