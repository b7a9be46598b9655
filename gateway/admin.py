"""The admin listener: health, readiness, metrics (and the operator API)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import StoreError

if TYPE_CHECKING:
    from gateway.app import Gateway


def create_admin_app(gateway: Gateway) -> Starlette:
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        checks = {"config": "loaded", "store": "ok"}
        status = 200
        if not gateway.started:
            checks["store"] = "not started"
            status = 503
        else:
            try:
                await gateway.store.ping()
            except StoreError as exc:
                checks["store"] = str(exc)
                status = 503
        return JSONResponse({"ready": status == 200, "checks": checks}, status_code=status)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
        ]
    )
