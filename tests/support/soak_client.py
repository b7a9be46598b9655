"""One client process of the soak test (tests/test_soak.py): it sends its share of the plan.

    python tests/support/soak_client.py PLAN.json RESULTS.json

The plan says when (seconds after a shared wall-clock start) to send which request
to which gateway. Every request opens a connection of its own, so a connection error
says something about that request alone: `refused` (never reached a gateway) or
`broken` (the gateway had it, then its connection died: a killed gateway). Like a
scheduler, the client retries a connection error against the same gateway until it
gets an answer or the plan's retry deadline passes; every attempt is reported.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx

#: Not sent: nothing reached the gateway.
REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)
#: Sent, then the connection died before an answer.
BROKEN = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


async def attempt(client: httpx.AsyncClient, url: str, op: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    result: dict[str, Any] = {"t0": started}
    try:
        response = await client.post(url, json={"job_key": op["key"]}, params=op["params"])
    except REFUSED as exc:
        result.update(error="refused", detail=type(exc).__name__)
    except BROKEN as exc:
        result.update(error="broken", detail=type(exc).__name__)
    except httpx.HTTPError as exc:  # a timeout: no gateway fault explains one
        result.update(error="other", detail=f"{type(exc).__name__}: {exc}")
    else:
        content_type = response.headers.get("content-type", "")
        problem = ""
        if content_type.startswith("application/problem+json"):
            try:
                problem = str(response.json().get("type", ""))
            except ValueError:
                problem = "unparsable"
        result.update(
            status=response.status_code,
            replayed=response.headers.get("idempotent-replayed") == "true",
            resolved_by=response.headers.get("idempotent-resolved-by", ""),
            content_type=content_type,
            problem=problem,
            run=response.headers.get("x-run", ""),
        )
    result["t1"] = time.time()
    return result


async def run_op(
    client: httpx.AsyncClient, gateways: list[str], op: dict[str, Any], plan: dict[str, Any]
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, plan["start"] + op["at"] - time.time()))
    url = gateways[op["gateway"]] + op["path"]
    attempts: list[dict[str, Any]] = []
    give_up = time.time() + plan["retry_deadline"]
    backoff = 0.25
    while True:
        result = await attempt(client, url, op)
        attempts.append(result)
        if result.get("error") not in ("refused", "broken") or time.time() > give_up:
            break
        # The scheduler's retry, against the same gateway, backing off.
        await asyncio.sleep(backoff)
        backoff = min(2.0, backoff * 2)
    return {**op, "attempts": attempts}


async def main(plan_path: str, results_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=plan["timeout"]) as client:
        results = await asyncio.gather(
            *(run_op(client, plan["gateways"], op, plan) for op in plan["ops"])
        )
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
