"""A job service with a status endpoint, for the reconcile tests: it records what
reached it (each request's raw path and its raw `Idempotency-Key` bytes), counts how
many status checks it answers at once, and answers 404 for anything else, as a real
service does. It runs under uvicorn in a process of its own:

    python tests/support/job_service.py PORT

    POST|PUT /jobs/run?sleep=S
                              one run of the job named by the body's `job_key` (the
                              gateway's key, as the caller sent it); counted first,
                              finished after S seconds
    GET /jobs/{key}/status    the status check, the key in the path: 200 once a run of
                              it finished, 202 while one runs, 404 if none did
    GET /jobs/status?key=K    the same check, the key in the query
    GET /_log                 {"runs": {key: n}, "requests": [{"path", "raw_path",
                              "query", "key_header", "of"}], "status_max_concurrent",
                              "misses": [raw paths answered 404 as unknown]}
    POST /_config             {"status_sleep": S}: each status check takes S seconds
    POST /_reset              forget everything above, settings too

`key_header` is the header's bytes as received, decoded as latin-1 (one character a
byte), or null when it was absent: what a test compares is the wire spelling.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

runs: Counter[str] = Counter()
finished: Counter[str] = Counter()
requests: list[dict[str, Any]] = []
misses: list[str] = []
settings: dict[str, float] = {"status_sleep": 0.0}
concurrency = {"now": 0, "max": 0}


def _record(request: Request, of: str) -> None:
    raw_key = next((v for k, v in request.headers.raw if k.lower() == b"idempotency-key"), None)
    requests.append(
        {
            "of": of,
            "path": request.url.path,
            "raw_path": request.scope.get("raw_path", b"").decode("latin-1"),
            "query": request.url.query,
            "key_header": None if raw_key is None else raw_key.decode("latin-1"),
            "key": request.path_params.get("key", request.query_params.get("key")),
        }
    )


async def run(request: Request) -> Response:
    body = await request.body()
    key = str(json.loads(body).get("job_key", ""))
    _record(request, "run")
    requests[-1]["key"] = key
    runs[key] += 1
    try:
        await asyncio.sleep(float(request.query_params.get("sleep", "0")))
    finally:
        finished[key] += 1
    return JSONResponse({"key": key, "run": runs[key]})


async def status(request: Request) -> Response:
    _record(request, "status")
    key = request.path_params.get("key", request.query_params.get("key", ""))
    concurrency["now"] += 1
    concurrency["max"] = max(concurrency["max"], concurrency["now"])
    try:
        if settings["status_sleep"]:
            await asyncio.sleep(settings["status_sleep"])
    finally:
        concurrency["now"] -= 1
    code = 200 if finished[key] else 202 if runs[key] else 404
    return JSONResponse({"key": key}, status_code=code)


async def log(request: Request) -> Response:
    return JSONResponse(
        {
            "runs": dict(runs),
            "requests": requests,
            "status_max_concurrent": concurrency["max"],
            "misses": misses,
        }
    )


async def configure(request: Request) -> Response:
    settings.update({k: float(v) for k, v in (await request.json()).items()})
    return JSONResponse(settings)


async def reset(request: Request) -> Response:
    for counter in (runs, finished):
        counter.clear()
    requests.clear()
    misses.clear()
    settings["status_sleep"] = 0.0
    concurrency["max"] = concurrency["now"]
    return JSONResponse({"ok": True})


async def unknown(request: Request) -> Response:
    _record(request, "unknown")
    misses.append(request.scope.get("raw_path", b"").decode("latin-1"))
    return JSONResponse({"unknown": request.url.path}, status_code=404)


ANY = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]
app = Starlette(
    routes=[
        Route("/jobs/run", run, methods=["POST", "PUT"]),
        Route("/jobs/status", status),
        Route("/jobs/{key}/status", status),
        Route("/_log", log),
        Route("/_config", configure, methods=["POST"]),
        Route("/_reset", reset, methods=["POST"]),
        Route("/{rest:path}", unknown, methods=ANY),
    ]
)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
