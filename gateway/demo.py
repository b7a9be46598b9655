"""`idempotency-gateway demo`: an example job endpoint with the gateway in front of
it, on the in-memory store, so a fresh machine can see the product work without Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.config import ServerConfig, parse_config
from gateway.http.protocol import protocol_for
from gateway.serve import serve, uvicorn_server

log = logging.getLogger("gateway.demo")


def job_app() -> Starlette:
    """The kind of endpoint users put behind the gateway: it sends a reminder,
    slowly, and has no idea about duplicates."""
    sent: Counter[str] = Counter()

    async def send_reminder(request: Request) -> JSONResponse:
        payload = await request.json()
        await asyncio.sleep(1.0)  # slow enough for the two curls to overlap
        sent[payload.get("job_key", "")] += 1
        print(
            f"[job endpoint] sending reminder to user {payload.get('user_id')} "
            f"(job_key {payload.get('job_key')!r}, run #{sent[payload.get('job_key', '')]})",
            flush=True,
        )
        return JSONResponse({"status": "sent", "user_id": payload.get("user_id")})

    async def send_invoices(request: Request) -> JSONResponse:
        payload = await request.json()
        key = payload.get("job_key", "")
        await asyncio.sleep(3.0)  # longer than a caller would like to wait: async
        sent[key] += 1
        print(
            f"[job endpoint] sending invoices for period {payload.get('period')} "
            f"(job_key {key!r}, run #{sent[key]})",
            flush=True,
        )
        return JSONResponse({"status": "sent", "period": payload.get("period")})

    return Starlette(
        routes=[
            Route("/jobs/send-reminder", send_reminder, methods=["POST"]),
            Route("/jobs/send-invoices", send_invoices, methods=["POST"]),
        ]
    )


def demo_config(port: int, admin_port: int, job_port: int) -> dict[str, object]:
    return {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "5s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "store": {"url": "memory://"},
        "routes": [
            {
                "name": "send-reminder",
                "match": {"methods": ["POST"], "path": "/jobs/send-reminder"},
                "upstream": f"http://127.0.0.1:{job_port}",
                "key": {"body": "job_key"},
            },
            {  # 202 at once; the gateway delivers it (the queue lives in this process)
                "name": "send-invoices",
                "match": {"methods": ["POST"], "path": "/jobs/send-invoices"},
                "upstream": f"http://127.0.0.1:{job_port}",
                "key": {"body": "job_key"},
                "delivery": "async",
            },
        ],
    }


def instructions(port: int, admin_port: int) -> str:
    body = json.dumps({"job_key": "test-1", "user_id": 42})
    invoices = json.dumps({"job_key": "invoices-2026-11", "period": "2026-11"})
    return f"""
Idempotency Gateway demo: job endpoint behind the gateway, in-memory store.

Send the same job twice in parallel (the test of "Make scheduled job handlers
idempotent: safe to run twice", delay.run on DEV Community):

  for i in 1 2; do
    curl -s -i -X POST localhost:{port}/jobs/send-reminder \\
      -H 'content-type: application/json' \\
      -d '{body}' &
  done; wait

The endpoint runs once (see "run #1" below); both callers get the same body, and
the second response carries `Idempotent-Replayed: true`. Send it again: replayed.

A slow job on an async route: 202 at once, the gateway delivers it.

  curl -s -i -X POST localhost:{port}/jobs/send-invoices \
    -H 'content-type: application/json' -d '{invoices}'

The answer is 202 with a status URL in `Location` (and the body's status_url); send
the same job again and you get the same 202. Poll it:

  curl -s localhost:{port}<the Location>

It says queued, then in_flight, then completed with the job's response, about 3 s
later; "run #1" below shows the endpoint ran once. (This demo's queue is in memory:
a restart loses it. Use a Redis store for real work.)
Metrics: curl -s localhost:{admin_port}/metrics | grep idempotency_gateway_
Stop with Ctrl-C.
"""


async def run_demo(port: int, admin_port: int, job_port: int) -> None:
    config = parse_config(demo_config(port, admin_port, job_port), "demo")
    listen = f"127.0.0.1:{job_port}"
    jobs = uvicorn_server(job_app(), listen, protocol_for(ServerConfig), date_header=True)
    job_task = asyncio.create_task(jobs.serve())
    while not jobs.started:
        if job_task.done():
            await job_task  # raises why it could not start
            return
        await asyncio.sleep(0.02)
    print(instructions(port, admin_port), flush=True)
    try:
        await serve(config)
    finally:
        jobs.should_exit = True
        await job_task
