"""A job endpoint for tests, run under uvicorn in a process of its own.

It counts how often each idempotency key reached it (the `Idempotency-Key` header
the gateway forwards, else the body's `job_key`), and behaves as the request asks:

    ?sleep=3.5        take that long (the counter moves first: the work "happened")
    ?status=503       answer with that status (204 and 304: with no body)
    ?location=/x      with that Location (a redirect: ?status=303&location=/done/1)
    ?size=2000000     answer with a body of that many bytes
    ?cookie=1         set a cookie
    ?gzip=1           answer with a gzip-encoded body
    ?hold=1           hold the request (counted, not finished) until POST /_release
    ?fail_first=3     the key's first 3 runs answer ?fail_status (503), with a
                      Retry-After of ?retry_after seconds if given
    ?sleep_runs=1     only the key's first run sleeps ?sleep

GET /_count?key=K         how often K ran (?of=status: how often its status was asked;
                          ?of=sent: how many of its responses were sent in full)
GET /_counts?prefix=P     every key starting with P: how often it ran, and the statuses
                          its runs answered (a run that answered 5xx was released), and
                          when each run arrived (this process's time.time())
POST /_release            {"key": K}: let K's held requests (and later ones) answer
GET /_status/{key}        the reconcile endpoint, like a real one: 202 while K runs,
                          200 once it ran, 404 if it never did; unless overridden by
POST /_set_status         {"key": K, "status": 200 | 404 | 500, "sleep": seconds}
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import sys
import time
from collections import Counter

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

counts: Counter[str] = Counter()
finished: Counter[str] = Counter()
status_calls: Counter[str] = Counter()
statuses: dict[str, tuple[int, float]] = {}
answers: dict[str, Counter[int]] = {}
sent: Counter[str] = Counter()
holds: dict[str, asyncio.Event] = {}
arrivals: dict[str, list[float]] = {}


def _key(request: Request, body: bytes) -> str:
    key = request.headers.get("idempotency-key")
    if key:
        return key
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    key = str(doc.get("job_key", "")) if isinstance(doc, dict) else ""
    # A lone surrogate ("\ud800" in the JSON) cannot be encoded in the answer.
    return key.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


async def job(request: Request) -> Response:
    received_at = time.time()
    body = await request.body()
    key = _key(request, body)
    arrivals.setdefault(key, []).append(time.time())
    counts[key] += 1
    run = counts[key]
    q = request.query_params
    try:
        if "sleep" in q and run <= int(q.get("sleep_runs", run)):
            await asyncio.sleep(float(q["sleep"]))
        if "hold" in q:
            await holds.setdefault(key, asyncio.Event()).wait()
    finally:
        finished[key] += 1  # the work is done even if the caller is gone
    status = int(q.get("status", "200"))
    if run <= int(q.get("fail_first", 0)):
        status = int(q.get("fail_status", "503"))
        answers.setdefault(key, Counter())[status] += 1
        extra = {"retry-after": q["retry_after"]} if "retry_after" in q else {}
        return JSONResponse({"key": key, "run": run, "failed": True}, status, headers=extra)
    answers.setdefault(key, Counter())[status] += 1
    if status in (204, 304):  # no body: its framing says so (RFC 9110 6.4.1)
        headers = {"x-run": str(run)}
        if "location" in q:
            headers["location"] = q["location"]
        return Response(status_code=status, headers=headers)
    if "gzip" in q:
        data = gzip.compress(json.dumps({"key": key, "run": run}).encode())
        return Response(data, headers={"content-encoding": "gzip", "x-run": str(run)})
    if "size" in q:
        return Response(b"x" * int(q["size"]), status_code=status, media_type="text/plain")
    payload = {
        "job": request.path_params.get("name", request.url.path),
        "key": key,
        "run": run,
        "pid": os.getpid(),
        "received_at": received_at,  # POSIX time the request arrived, by this clock
        "method": request.method,
        "query": request.url.query,
        "raw_path": request.scope.get("raw_path", b"").decode("latin-1"),
        "body": body.decode("utf-8", "replace"),
        "headers": {k: v for k, v in request.headers.items()},
        # every line as received, repeated names included (the dict keeps the last)
        "header_lines": [
            [k.decode("latin-1"), v.decode("latin-1")] for k, v in request.headers.raw
        ],
    }
    response = JSONResponse(payload, status_code=status)
    if "cookie" in q:
        response.set_cookie("session", f"secret-{run}")
    for line in q.getlist("answer_header"):  # Name:value, a header of the answer
        name, _, value = line.partition(":")
        response.headers.append(name, value)
    response.headers["x-run"] = str(run)
    if "location" in q:
        response.headers["location"] = q["location"]

    def was_sent() -> None:  # runs once the whole response is written
        sent[key] += 1

    response.background = BackgroundTask(was_sent)
    return response


async def count(request: Request) -> Response:
    key = request.query_params["key"]
    of = request.query_params.get("of")
    source = status_calls if of == "status" else sent if of == "sent" else counts
    return JSONResponse({"count": source[key]})


async def all_counts(request: Request) -> Response:
    prefix = request.query_params.get("prefix", "")
    return JSONResponse(
        {
            "runs": {k: n for k, n in counts.items() if k.startswith(prefix)},
            "answers": {
                k: {str(code): n for code, n in by_status.items()}
                for k, by_status in answers.items()
                if k.startswith(prefix)
            },
            "arrivals": {k: at for k, at in arrivals.items() if k.startswith(prefix)},
        }
    )


async def set_status(request: Request) -> Response:
    doc = await request.json()
    statuses[doc["key"]] = (int(doc["status"]), float(doc.get("sleep", 0)))
    return JSONResponse({"ok": True})


async def release(request: Request) -> Response:
    doc = await request.json()
    holds.setdefault(doc["key"], asyncio.Event()).set()
    return JSONResponse({"ok": True})


async def status(request: Request) -> Response:
    key = request.path_params["key"]
    status_calls[key] += 1
    if key in statuses:
        code, delay = statuses[key]
        if delay:
            await asyncio.sleep(delay)
    elif finished[key]:
        code = 200
    elif counts[key]:
        code = 202  # still running: neither done nor not done
    else:
        code = 404
    return JSONResponse({"key": key, "status": code}, status_code=code)


app = Starlette(
    routes=[
        Route("/_count", count),
        Route("/_counts", all_counts),
        Route("/_set_status", set_status, methods=["POST"]),
        Route("/_release", release, methods=["POST"]),
        Route("/_status/{key:path}", status),
        Route("/jobs/{name}", job, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        Route("/{rest:path}", job, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
