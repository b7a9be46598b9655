"""The soak: mixed traffic from several processes through two gateways, with faults.

A scaled-down "ten minutes in production": four client processes send a planned mix
(unique keys, concurrent duplicates to both gateways, replays of completed keys, slow
answers, 500s that release the key, answers slower than the deadline) through two
gateway processes sharing one Redis (AOF, fsync always), while the test kills and
restarts a gateway, drains one with SIGTERM, and restarts Redis. The figures are
counts, not rates: a slow machine sends the same plan, later.

At the end every key is sent once more, and the test checks the promise for every
key and every answer:

- the upstream ran each key at most once, beyond runs that answered 5xx (released);
- every key the upstream ran to a 2xx is still in the store: completed, or open
  (unresolved, parked) for a check or a person; none lost;
- every answer is a 2xx (first or replay), the upstream's own 500 on the keys that
  ask for one, or a problem+json 409/422/502/503/504; never a gateway 500;
- every connection error happened while its gateway was down, and the client's retry
  after the restart got an answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.keying import record_digest
from gateway.records import KeyRef, Record, State
from gateway.store.redis import RedisStore
from tests.support.ledger import Ledger
from tests.support.servers import (
    ROOT,
    Process,
    RedisServer,
    free_port,
    gateway_process,
    upstream_server,
    wait_for_port,
)

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis, pytest.mark.slow]

#: Seconds of planned traffic; the faults are placed in it. Same plan on any machine.
TRAFFIC = 36.0
CLIENTS = 4
SEED = int(os.environ.get("SOAK_SEED", "6"))
DEADLINE = "1500ms"  # upstream_timeout; "timeout" keys sleep past it
PROBLEM_STATUSES = {409, 422, 502, 503, 504}
ROUTES = {"charge": "reconcile", "report": "park"}


@dataclass
class Fault:
    name: str
    target: str  # "gw0", "gw1" or "redis"
    at: float  # planned offset in the traffic
    started: float = 0.0  # wall clock
    ready: float = 0.0  # wall clock: the target serves again
    detail: str = ""


@dataclass
class Plan:
    ops: list[list[dict[str, Any]]] = field(default_factory=lambda: [[] for _ in range(CLIENTS)])
    keys: dict[str, str] = field(default_factory=dict)  # key -> route
    kinds: Counter[str] = field(default_factory=Counter)

    def add(self, client: int, at: float, key: str, gateway: int, **params: str) -> None:
        route = self.keys[key]
        self.ops[client].append(
            {"at": round(at, 3), "key": key, "path": f"/jobs/{route}", "gateway": gateway,
             "params": params}
        )  # fmt: skip


def make_plan(rng: random.Random, prefix: str) -> Plan:
    """Events spread over TRAFFIC seconds; each is a key and the requests sent for it."""
    plan = Plan()
    kinds = ["unique"] * 40 + ["dup"] * 20 + ["replay"] * 15 + ["slow"] * 10
    kinds += ["fail"] * 10 + ["timeout"] * 5
    at = 0.0
    n = 0
    while at < TRAFFIC:
        kind = rng.choice(kinds)
        route = "charge" if rng.random() < 0.75 else "report"
        key = f"{prefix}{kind}-{n}"
        n += 1
        plan.keys[key] = route
        plan.kinds[kind] += 1
        client = rng.randrange(CLIENTS)
        other = (client + 1 + rng.randrange(CLIENTS - 1)) % CLIENTS
        gw = rng.randrange(2)
        if kind == "unique":
            plan.add(client, at, key, gw)
        elif kind == "dup":  # concurrent copies, both gateways, two processes
            sleep = f"{rng.uniform(0.2, 0.8):.2f}"
            for copy in range(rng.randint(2, 4)):
                plan.add((client, other)[copy % 2], at, key, (gw + copy) % 2, sleep=sleep)
        elif kind == "replay":  # repeats once the first has finished
            plan.add(client, at, key, gw)
            for later in (rng.uniform(2, 5), rng.uniform(5, 8)):
                plan.add(other, at + later, key, rng.randrange(2))
        elif kind == "slow":  # a slow answer, a duplicate waits on the other gateway
            sleep = f"{rng.uniform(0.5, 1.2):.2f}"
            plan.add(client, at, key, gw, sleep=sleep)
            plan.add(other, at + 0.1, key, 1 - gw, sleep=sleep)
        elif kind == "fail":  # 500 releases the key; the retry runs it; then a replay
            plan.add(client, at, key, gw, status="500")
            plan.add(other, at + rng.uniform(1.5, 3), key, 1 - gw)
            plan.add(client, at + rng.uniform(4, 6), key, gw)
        else:  # past the deadline: outcome unknown; repeats while it is checked, and after
            plan.add(client, at, key, gw, sleep="2.5")
            plan.add(other, at + 1.0, key, 1 - gw)
            plan.add(client, at + rng.uniform(7, 9), key, gw)
        at += rng.expovariate(10.0)  # about ten events a second
    return plan


def write_config(
    tmp_path: Path, name: str, redis: RedisServer, upstream: Process, prefix: str
) -> Process:
    port, admin_port = free_port(), free_port()
    routes = []
    for route, policy in ROUTES.items():
        spec: dict[str, Any] = {
            "name": route,
            "match": {"methods": ["POST"], "path": f"/jobs/{route}"},
            "upstream": upstream.url,
            "key": {"body": "job_key"},
            # The query string is the plan's control channel to the test upstream.
            "fingerprint": ["method", "path", "body"],
            "upstream_timeout": DEADLINE,
            "wait_timeout": "6s",
            "on_unknown_outcome": policy,
        }
        if policy == "reconcile":
            spec["reconcile"] = {
                "url": upstream.url + "/_status/{key}",
                "every": "500ms",
                "timeout": "500ms",
                "park_after": "1h",
            }
        routes.append(spec)
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "3s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        # Short store timeouts: a lease is the deadline plus about 2.8 s.
        "store": {
            "url": redis.url,
            "prefix": prefix,
            "socket_timeout": "300ms",
            "connect_timeout": "300ms",
        },
        "routes": routes,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return gateway_process(path, port)


async def restart(process: Process) -> None:
    await asyncio.to_thread(process.start)


async def inject(fault: Fault, gateways: list[Process], redis: RedisServer) -> None:
    fault.started = time.time()
    if fault.target == "redis":
        redis.kill()
        await asyncio.sleep(1.0)  # requests meanwhile fail closed
        await restart(redis)
    else:
        gateway = gateways[int(fault.target[-1])]
        if fault.name == "sigkill":
            gateway.kill()
        else:  # SIGTERM: a graceful drain; requests under way finish
            gateway.signal(signal.SIGTERM)
            assert gateway.proc is not None
            code = await asyncio.to_thread(gateway.proc.wait, 30)
            fault.detail = f"exit {code}"
        await restart(gateway)
    fault.ready = time.time()


def classify(op: dict[str, Any], result: dict[str, Any]) -> str:
    """What one answer was, in the promise's words; "VIOLATION: ..." if it breaks it."""
    if "error" in result:
        return f"connection {result['error']}"
    status = result["status"]
    if 200 <= status < 300:
        return "2xx replay" if result["replayed"] else "2xx first"
    if status == 500 and op["params"].get("status") == "500" and result["run"]:
        return "500 from the upstream (released)"
    if status in PROBLEM_STATUSES and result["problem"]:
        return f"{status} problem"
    return f"VIOLATION: {status} {result['content_type']} {result['problem']}"


def explained(result: dict[str, Any], gateway: int, faults: list[Fault]) -> bool:
    """A connection error while its gateway was down (killed, draining, restarting)."""
    when = result["t1"]
    return any(
        f.target == f"gw{gateway}" and f.started - 0.2 <= when <= f.ready + 1.0 for f in faults
    )


async def read_records(redis: RedisServer, prefix: str, keys: dict[str, str]) -> dict[str, Any]:
    store = RedisStore(StoreConfig(url=redis.url, prefix=prefix, socket_timeout=5))
    try:
        return {
            key: await store.get(KeyRef(record_digest(route, "", key), route, key))
            for key, route in keys.items()
        }
    finally:
        await store.close()


async def settle(redis: RedisServer, prefix: str, timeout: float = 30) -> list[Record]:
    """Wait until no record is in flight (dead gateways' leases ran out and were
    opened) and the reconcile route's unknown outcomes were checked."""
    store = RedisStore(StoreConfig(url=redis.url, prefix=prefix, socket_timeout=5))
    deadline = time.monotonic() + timeout
    try:
        while True:
            pending = await store.open_records(frozenset({State.IN_FLIGHT, State.UNRESOLVED}))
            if not pending or time.monotonic() > deadline:
                return pending
            await asyncio.sleep(0.3)
    finally:
        await store.close()


async def final_pass(gateways: list[Process], keys: dict[str, str]) -> list[dict[str, Any]]:
    """Every key once more, alternating gateways: replayed, 409, or (never ran) a first."""
    limits = httpx.Limits(max_connections=16)
    out = []
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        sem = asyncio.Semaphore(16)

        async def one(i: int, key: str, route: str) -> dict[str, Any]:
            async with sem:
                response = await client.post(
                    f"{gateways[i % 2].url}/jobs/{route}", json={"job_key": key}
                )
            return {
                "key": key,
                "status": response.status_code,
                "replayed": response.headers.get("idempotent-replayed") == "true",
                "problem": response.headers.get("content-type", "").startswith(
                    "application/problem+json"
                ),
            }

        out = await asyncio.gather(
            *(one(i, key, route) for i, (key, route) in enumerate(sorted(keys.items())))
        )
    return list(out)


async def upstream_counts(upstream: Process, prefix: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{upstream.url}/_counts", params={"prefix": prefix})
    return dict(response.json())


def duplicates(runs: int, answers: dict[str, int]) -> int:
    """Runs beyond the first, not counting runs that answered 5xx (the gateway
    released those keys, so the retry ran them again on purpose)."""
    released = sum(n for status, n in answers.items() if int(status) >= 500)
    return max(0, runs - released - 1)


@pytest.mark.timeout(300)
@pytest.mark.long
async def test_soak_mixed_traffic_with_faults(tmp_path: Path, ledger: Ledger) -> None:
    began = time.monotonic()
    rng = random.Random(SEED)
    prefix = f"soak{SEED}-{os.getpid()}-"
    plan = make_plan(rng, prefix)
    redis = RedisServer("--appendonly", "yes", "--appendfsync", "always").start()
    upstream = upstream_server().start()
    gateways = [write_config(tmp_path, f"gw{i}", redis, upstream, "soak:") for i in range(2)]
    clients: list[subprocess.Popen[bytes]] = []
    faults = [
        Fault("sigkill", "gw0", 6.0),
        Fault("sigterm", "gw1", 13.0),
        Fault("restart", "redis", 20.0),
        Fault("sigkill", "gw1", 27.0),
        Fault("sigterm", "gw0", 32.0),
    ]
    try:
        for gateway in gateways:
            gateway.start()
            wait_for_port(gateway.port)
        start = time.time() + 3.0  # the clients' imports take a moment
        for i, ops in enumerate(plan.ops):
            plan_path = tmp_path / f"plan-{i}.json"
            plan_path.write_text(
                json.dumps(
                    {
                        "gateways": [g.url for g in gateways],
                        "start": start,
                        "retry_deadline": 40,
                        "timeout": 30,
                        "ops": sorted(ops, key=lambda op: op["at"]),
                    }
                )
            )
            clients.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(ROOT / "tests" / "support" / "soak_client.py"),
                        str(plan_path),
                        str(tmp_path / f"results-{i}.json"),
                    ],
                    cwd=ROOT,
                )
            )
        for fault in faults:
            await asyncio.sleep(max(0.0, start + fault.at - time.time()))
            await inject(fault, gateways, redis)
        timeout_keys = plan.kinds["timeout"]
        client_deadline = time.monotonic() + 120
        for client in clients:
            code = await asyncio.to_thread(
                client.wait, max(1.0, client_deadline - time.monotonic())
            )
            assert code == 0, f"a soak client failed with {code}"
        traffic_end = time.monotonic()
        results = [
            op
            for i in range(CLIENTS)
            for op in json.loads((tmp_path / f"results-{i}.json").read_text())
        ]
        still_open = await settle(redis, "soak:")
        stuck = [r for r in still_open if r.state is State.IN_FLIGHT]
        before = await upstream_counts(upstream, prefix)
        last = await final_pass(gateways, plan.keys)
        counts = await upstream_counts(upstream, prefix)
        records = await read_records(redis, "soak:", plan.keys)
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait(10)
        exits = [gateway.stop(timeout=20) for gateway in gateways]
        upstream.stop()
        redis.stop()

    # -- the figures ---------------------------------------------------------------
    answers: Counter[str] = Counter()
    violations: list[str] = []
    connection_errors: Counter[str] = Counter()
    retries: Counter[str] = Counter()
    unknown_keys: set[str] = set()
    rerun_after_broken: list[tuple[str, str]] = []
    for op in results:
        for i, result in enumerate(op["attempts"]):
            what = classify(op, result)
            answers[what] += 1
            if what.startswith("VIOLATION"):
                violations.append(f"{op['key']} on gw{op['gateway']}: {what}")
            if "error" in result:
                if explained(result, op["gateway"], faults):
                    connection_errors[f"{result['error']} (gateway down)"] += 1
                else:
                    connection_errors[f"{result['error']} UNEXPLAINED"] += 1
                    violations.append(
                        f"{op['key']} on gw{op['gateway']}: {result['error']} "
                        f"{result.get('detail')} at +{result['t1'] - start:.2f}s, no fault"
                    )
                if result["error"] == "broken":
                    unknown_keys.add(op["key"])
            elif result.get("status") == 504:
                unknown_keys.add(op["key"])
            if i > 0 and "error" not in result:  # the retry that got an answer
                after = (
                    "broken"
                    if any(a.get("error") == "broken" for a in op["attempts"])
                    else "refused"
                )
                retries[f"after {after}: {classify(op, result)}"] += 1
                if after == "broken" and classify(op, result) == "2xx first":
                    # Only if the gateway died before forwarding: this is the one run.
                    rerun_after_broken.append((op["key"], result["run"]))
        if "error" in op["attempts"][-1]:
            violations.append(f"{op['key']}: no answer before the retry deadline")
    for result in last:
        if result["status"] == 500 or not (
            200 <= result["status"] < 300 or (result["status"] in PROBLEM_STATUSES)
        ):
            violations.append(f"final pass {result['key']}: {result['status']}")

    per_key_duplicates: dict[str, int] = {}
    for key in plan.keys:
        runs = counts["runs"].get(key, 0)
        per_key_duplicates[key] = duplicates(runs, counts["answers"].get(key, {}))
    # Keys the upstream had run to a 2xx before the final pass: the pass must replay
    # them (or 409 while open), never run them.
    succeeded = {
        key
        for key, by_status in before["answers"].items()
        if any(200 <= int(s) < 300 for s in by_status)
    }
    final_states: Counter[str] = Counter()
    lost: list[str] = []
    for key, record in records.items():
        state = "none" if record is None else str(record.state)
        if record is not None and record.state is State.COMPLETED and record.response is not None:
            state += f" ({record.response.origin})"
        if record is not None and any(e.get("event") == "unknown" for e in record.history):
            unknown_keys.add(key)
        if key in unknown_keys:
            final_states[state] += 1
        if key in succeeded and (record is None or record.state is State.RELEASED):
            lost.append(f"{key}: the upstream ran it to a 2xx, but the record is {state}")
        elif key in unknown_keys and before["runs"].get(key, 0) and state in ("none", "in_flight"):
            lost.append(f"{key}: its outcome was unknown, and the record is {state}")
    # A replay of a key whose record vanished would show up as a second run too.
    final_firsts_of_done_keys = [
        r["key"]
        for r in last
        if r["key"] in succeeded and 200 <= r["status"] < 300 and not r["replayed"]
    ]

    requests = sum(len(op["attempts"]) for op in results) + len(last)
    upstream_dups = sum(per_key_duplicates.values())
    figures = {
        "seed": SEED,
        "keys": len(plan.keys),
        "events by kind": dict(plan.kinds),
        "requests sent": requests,
        "answers": dict(answers),
        "replays": answers["2xx replay"],
        "final pass": dict(Counter(_final(r) for r in last)),
        "faults": [
            f"{f.name} {f.target} at +{f.started - start:.1f}s, back after "
            f"{f.ready - f.started:.1f}s {f.detail}".strip()
            for f in faults
        ]
        + [f"{timeout_keys} keys slower than the deadline"],
        "connection errors": dict(connection_errors),
        "answers to retries after a connection error": dict(retries),
        "upstream runs": sum(counts["runs"].values()),
        "upstream duplicates": upstream_dups,
        "unknown-outcome records": len(unknown_keys),
        "their final states": dict(final_states),
        "records lost": len(lost),
        "in flight after settling": len(stuck),
        "traffic seconds": round(traffic_end - began, 1),
        "total seconds": round(time.monotonic() - began, 1),
    }
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "soak.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    ledger.record(
        "soak",
        "test_soak_mixed_traffic_with_faults",
        requests=requests,
        faults=len(faults) + timeout_keys,
        upstream_duplicates=upstream_dups,
        records_lost=len(lost),
        detail=(
            f"{len(plan.keys)} keys, {answers['2xx replay']} replays, "
            f"{sum(connection_errors.values())} connection errors while a gateway was down, "
            f"{len(unknown_keys)} unknown outcomes: {dict(final_states)}"
        ),
    )

    assert not [k for k, n in per_key_duplicates.items() if n], {
        k: (counts["runs"][k], counts["answers"][k]) for k, n in per_key_duplicates.items() if n
    }
    assert not lost, lost
    assert not stuck, f"records still in flight long after their leases: {stuck[:3]}"
    assert not final_firsts_of_done_keys, final_firsts_of_done_keys[:5]
    assert not [
        (key, run) for key, run in rerun_after_broken if run != "1" or before["runs"][key] != 1
    ], "a scheduler's retry after a killed gateway ran the work a second time"
    assert not violations, violations[:20]
    assert exits == [0, 0], "the gateways did not stop cleanly"
    assert all(f.detail in ("", "exit 0") for f in faults), [f.detail for f in faults]
    # The mix really happened: the faults hit traffic, and every kind of answer came up.
    assert answers["2xx replay"] and answers["2xx first"] and answers["503 problem"]
    assert answers["409 problem"] and answers["504 problem"]
    assert answers["500 from the upstream (released)"]
    assert sum(connection_errors.values()) and unknown_keys


def _final(result: dict[str, Any]) -> str:
    if 200 <= result["status"] < 300:
        return "2xx replay" if result["replayed"] else "2xx first"
    return f"{result['status']}"
