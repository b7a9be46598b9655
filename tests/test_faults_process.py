"""Process faults under a duplicate storm: gateways SIGKILLed at each point of a
request's life, and Redis SIGKILLed and restarted with and without persistence.

Everything here is a real process: redis-server, the test upstream under uvicorn, and
`idempotency-gateway run`. The points of a request's life are reached from outside,
with no hooks in the gateway:

- claimed, not yet sent: the route's upstream is a socket whose accept queue is full,
  so the gateway's connect hangs after the claim;
- during the forward: the upstream holds the request (`?hold=1`) until the test lets go;
- answered, completion not stored: the upstream holds the request until the test has
  SIGSTOPped redis-server, then answers; once the upstream has written its response,
  the test SIGKILLs the gateway and SIGCONTs Redis.

After each kill a gateway is started again on the same Redis; its sweep opens the dead
leases and its reconciler asks the upstream's `/_status/{key}`, which answers 404 for
work that never ran (released), 200 for work that ran (completed) and 202 for work still
held (inconclusive: parked after `park_after`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.records import Record, State
from tests.conftest import unique, upstream_count
from tests.support.ledger import Ledger
from tests.support.records import read_record
from tests.support.servers import (
    Process,
    RedisServer,
    for_this_test,
    free_port,
    gateway_process,
    wait_for_port,
)

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis]

AREA = "process faults"
COPIES = 8  # concurrent copies of each key in a storm
#: lease = upstream_timeout + 4 x socket_timeout + 2 x connect_timeout + 1 = 6.2 s
UPSTREAM_TIMEOUT = "4s"


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A Redis of this test's own: the tests stop, kill and restart it."""
    server = RedisServer()
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)  # a failed test may leave it stopped
    server.stop()


@contextmanager
def blackhole() -> Iterator[int]:
    """A port whose accept queue is full: a connect to it hangs (the SYN is dropped),
    so a request sent there is claimed but never leaves the gateway."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    filler = socket.create_connection(("127.0.0.1", port), timeout=2)
    try:
        yield port
    finally:
        filler.close()
        listener.close()


@dataclass
class Setup:
    config: Path
    port: int
    admin_port: int
    prefix: str
    redis: RedisServer
    upstream: Process

    def gateway(self) -> Process:
        gateway = gateway_process(self.config, self.port).start()
        for_this_test(gateway)
        wait_for_port(self.admin_port, gateway.proc)
        return gateway

    async def record(self, route: str, key: str) -> Record | None:
        return await read_record(self.redis, self.prefix, route, key)

    async def release(self, key: str) -> None:
        async with httpx.AsyncClient() as client:
            await client.post(f"{self.upstream.url}/_release", json={"key": key})

    async def set_status(self, key: str, status: int) -> None:
        async with httpx.AsyncClient() as client:
            await client.post(
                f"{self.upstream.url}/_set_status", json={"key": key, "status": status}
            )

    async def sent(self, key: str) -> int:
        async with httpx.AsyncClient() as client:
            response = await client.get(
                f"{self.upstream.url}/_count", params={"key": key, "of": "sent"}
            )
            return int(response.json()["count"])


def make_setup(
    tmp_path: Path,
    upstream: Process,
    redis: RedisServer,
    *,
    stuck_port: int | None = None,
    park_after: str = "1s",
) -> Setup:
    port, admin_port = free_port(), free_port()
    prefix = unique("pf") + ":"

    def route(name: str, target: str) -> dict[str, Any]:
        return {
            "name": name,
            "match": {"methods": ["POST"], "path": f"/jobs/{name}"},
            "upstream": target,
            "key": {"body": "job_key"},
            "fingerprint": ["method", "path", "body"],
            "upstream_timeout": UPSTREAM_TIMEOUT,
            "wait_timeout": "20s",
            "on_unknown_outcome": "reconcile",
            "reconcile": {
                "url": upstream.url + "/_status/{key}",
                "every": "300ms",
                "timeout": "1s",
                "park_after": park_after,
            },
        }

    routes = [route("charge", upstream.url)]
    if stuck_port is not None:
        routes.append(route("stuck", f"http://127.0.0.1:{stuck_port}"))
    config = {
        "server": {"listen": f"127.0.0.1:{port}", "shutdown_grace": "1s"},
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        # Short store timeouts keep the lease margin small (see UPSTREAM_TIMEOUT).
        "store": {
            "url": redis.url,
            "prefix": prefix,
            "socket_timeout": "200ms",
            "connect_timeout": "200ms",
        },
        "routes": routes,
    }
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return Setup(path, port, admin_port, prefix, redis, upstream)


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    """Wait for a condition; fail loudly, naming it, if it never comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting until {what}")


def storm(
    client: httpx.AsyncClient, route: str, keys: list[str], **params: str
) -> list[asyncio.Task[httpx.Response]]:
    """COPIES concurrent requests for every key, interleaved."""
    return [
        asyncio.create_task(
            client.post(f"/jobs/{route}", json={"job_key": key}, params=params, timeout=30)
        )
        for _ in range(COPIES)
        for key in keys
    ]


async def finish(tasks: list[asyncio.Task[httpx.Response]]) -> list[httpx.Response]:
    """The answers that came back; the rest died with their gateway."""
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, httpx.TransportError):
            raise result
    return [r for r in results if isinstance(r, httpx.Response)]


SETTLED = frozenset({State.COMPLETED, State.RELEASED, State.PARKED})


async def settle(setup: Setup, keys: list[tuple[str, str]], timeout: float = 30) -> None:
    """Until no key is in flight or unresolved: the restarted gateway's sweep and
    reconciler have decided each one."""

    async def settled() -> bool:
        for route, key in keys:
            record = await setup.record(route, key)
            if record is not None and record.state not in SETTLED:
                return False
        return True

    await until("every key is settled by the restarted gateway", settled, timeout)


@dataclass
class Verdict:
    route: str
    key: str
    runs: int
    record: Record | None

    @property
    def state(self) -> str:
        return "absent" if self.record is None else str(self.record.state)

    @property
    def lost(self) -> bool:
        """The work ran, yet the key is free or forgotten: a repeat would run it again."""
        return self.runs > 0 and (self.record is None or self.record.state is State.RELEASED)

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.runs > 1:
            out.append(f"ran {self.runs} times")
        if self.lost:
            out.append(f"ran, but is {self.state}")
        if self.record is not None:
            if self.record.state in (State.IN_FLIGHT, State.UNRESOLVED, State.CLAIMED):
                out.append(f"left {self.state}")
            if self.record.state in (State.UNRESOLVED, State.PARKED) and not self.record.reason:
                out.append(f"{self.state} without a reason")
            if self.record.state is State.COMPLETED and self.runs != 1:
                out.append(f"completed, but ran {self.runs} times")
        return [f"{self.route}/{self.key}: {p}" for p in out]


async def verdicts(setup: Setup, keys: list[tuple[str, str]]) -> list[Verdict]:
    return [
        Verdict(
            route, key, await upstream_count(setup.upstream, key), await setup.record(route, key)
        )
        for route, key in keys
    ]


def tally(found: list[Verdict]) -> dict[str, int]:
    """End states, completed ones by where the response came from (the upstream's
    answer stored, or the reconciler's check after a kill)."""
    counts: dict[str, int] = {}
    for verdict in found:
        name = verdict.state
        record = verdict.record
        if record is not None and record.response is not None:
            name += f" ({record.response.origin})"
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


@pytest.mark.slow
async def test_gateway_sigkill_at_each_point_of_a_request(
    tmp_path: Path, upstream: Process, redis: RedisServer, ledger: Ledger
) -> None:
    """(c) answered but not stored, then (a) claimed but not sent and (b) held by the
    upstream, each under a storm of duplicates; a third gateway settles them all."""
    with blackhole() as stuck_port:
        setup = make_setup(tmp_path, upstream, redis, stuck_port=stuck_port)
        sent_requests = 0

        # (c) The upstream answers while Redis is stopped; the gateway dies before
        # it can store the completion.
        answered = [unique("answered") for _ in range(3)]
        first = setup.gateway()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{setup.port}") as client:
            tasks = storm(client, "charge", answered, hold="1")
            sent_requests += len(tasks)

            async def all_held() -> bool:
                return all([await upstream_count(upstream, k) == 1 for k in answered])

            await until("the upstream holds every (c) key", all_held)
            for key in answered:
                record = await setup.record("charge", key)
                assert record is not None and record.state is State.IN_FLIGHT, record
            redis.signal(signal.SIGSTOP)
            try:
                for key in answered:
                    await setup.release(key)

                async def all_sent() -> bool:
                    return all([await setup.sent(k) == 1 for k in answered])

                await until("the upstream has sent every (c) response", all_sent)
                first.kill()
            finally:
                redis.signal(signal.SIGCONT)
            await finish(tasks)
        # Commands the gateway wrote before it died may still be in Redis's socket
        # buffer; Redis runs them as it resumes. Either way the key must not be lost.
        landed = sum(
            [
                (r := await setup.record("charge", k)) is not None and r.state is State.COMPLETED
                for k in answered
            ]
        )

        # (a) claimed, never sent, and (b) held by the upstream, in one storm.
        unsent = [unique("unsent") for _ in range(3)]
        held = [unique("held") for _ in range(4)]
        second = setup.gateway()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{setup.port}") as client:
            tasks = storm(client, "stuck", unsent) + storm(client, "charge", held, hold="1")
            sent_requests += len(tasks)

            async def all_at_their_point() -> bool:
                for key in unsent:
                    record = await setup.record("stuck", key)
                    if record is None or record.state is not State.IN_FLIGHT:
                        return False
                return all([await upstream_count(upstream, k) == 1 for k in held])

            await until("(a) keys are claimed and (b) keys held", all_at_their_point)
            for key in held:
                record = await setup.record("charge", key)
                assert record is not None and record.state is State.IN_FLIGHT, record
            second.kill()
            await finish(tasks)
        # Two held keys finish after their gateway died (the status endpoint then says
        # 200: done); two stay held (it says 202: inconclusive, so they get parked).
        for key in held[:2]:
            await setup.release(key)

        keys = (
            [("charge", k) for k in answered]
            + [("stuck", k) for k in unsent]
            + [("charge", k) for k in held]
        )
        third = setup.gateway()
        try:
            await settle(setup, keys)
            found = {v.key: v for v in await verdicts(setup, keys)}
            # A repeat of each charge key now: replayed if completed, 409 if parked.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{setup.port}") as client:
                repeats = {
                    key: await client.post("/jobs/charge", json={"job_key": key}, timeout=30)
                    for key in answered + held
                }
            sent_requests += len(repeats)
            after_repeat = {key: await upstream_count(upstream, key) for key in repeats}
        finally:
            third.stop()
            for key in held[2:]:
                await setup.release(key)

    all_found = list(found.values())
    problems = [p for v in all_found for p in v.problems()]
    ledger.record(
        AREA,
        "gateway_sigkill_at_each_point",
        requests=sent_requests,
        faults=2,
        upstream_duplicates=sum(max(0, n - 1) for n in after_repeat.values())
        + sum(max(0, v.runs - 1) for v in all_found),
        records_lost=sum(v.lost for v in all_found),
        detail=(
            f"{len(keys)} keys x {COPIES} copies; ends {tally(all_found)}; "
            f"(c) completion written by Redis on resume for {landed} of {len(answered)}"
        ),
    )
    assert problems == []
    for key in unsent:  # never reached the upstream: checked, and freed to run
        assert (found[key].runs, found[key].state) == (0, "released")
        assert found[key].record is not None
        assert [e["event"] for e in found[key].record.history][:1] == ["unknown"]
    for key in answered + held[:2]:  # ran: completed, by the late write or the check
        assert (found[key].runs, found[key].state) == (1, "completed")
        assert repeats[key].status_code == 200
    for key in held[2:]:  # still running as far as anyone can tell: a person decides
        assert (found[key].runs, found[key].state) == (1, "parked")
        assert found[key].record is not None and found[key].record.reason == "lease_expired"
        assert repeats[key].status_code == 409 and repeats[key].json()["state"] == "parked"
    assert all(n == 1 for n in after_repeat.values()), after_repeat


@pytest.mark.slow
@pytest.mark.long
async def test_gateway_sigkill_at_random_points_of_a_storm(
    tmp_path: Path, upstream: Process, redis: RedisServer, ledger: Ledger
) -> None:
    """Rounds of storms, each ended by a SIGKILL at a random moment; each round's
    gateway is also the restart after the last kill, and repeats a key of it."""
    seed = int(os.environ.get("FAULT_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    setup = make_setup(tmp_path, upstream, redis)
    rounds, per_round = 4, 4
    keys: list[str] = []
    sent_requests = 0
    answers: dict[int, int] = {}
    for _ in range(rounds):
        fresh = [unique("rnd") for _ in range(per_round)]
        repeated = rng.sample(keys, min(2, len(keys)))  # a kill's leftovers, asked again
        keys += fresh
        gateway = setup.gateway()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{setup.port}") as client:
            tasks = [
                task
                for key in fresh + repeated
                for task in storm(client, "charge", [key], sleep=f"{rng.uniform(0.1, 1.5):.3f}")
            ]
            sent_requests += len(tasks)
            await asyncio.sleep(rng.uniform(0, 0.8))
            gateway.kill()
            for response in await finish(tasks):
                answers[response.status_code] = answers.get(response.status_code, 0) + 1
    final = setup.gateway()
    try:
        await settle(setup, [("charge", k) for k in keys])
        found = await verdicts(setup, [("charge", k) for k in keys])
    finally:
        final.stop()

    ledger.record(
        AREA,
        "gateway_sigkill_at_random_points",
        requests=sent_requests,
        faults=rounds,
        upstream_duplicates=sum(max(0, v.runs - 1) for v in found),
        records_lost=sum(v.lost for v in found),
        detail=f"seed {seed}; answers before the kills {answers}; ends {tally(found)}",
    )
    assert [p for v in found for p in v.problems()] == [], f"FAULT_SEED={seed}"
    assert 500 not in answers


@dataclass
class Sent:
    key: str
    started: float
    ended: float
    status: int
    problem: bool
    retry_after: str


async def load(
    client: httpx.AsyncClient, out: list[Sent], stop: asyncio.Event, every: float = 0.02
) -> None:
    """First requests with fresh keys, one after another, until told to stop."""
    while not stop.is_set():
        key = unique("load")
        started = time.monotonic()
        try:
            response = await client.post("/jobs/charge", json={"job_key": key}, timeout=30)
        except httpx.TransportError:
            continue
        out.append(
            Sent(
                key,
                started,
                time.monotonic(),
                response.status_code,
                response.headers.get("content-type") == "application/problem+json",
                response.headers.get("retry-after", ""),
            )
        )
        await asyncio.sleep(every)


async def resets(setup: Setup) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{setup.admin_port}/metrics")).text
    for line in text.splitlines():
        if line.startswith("idempotency_gateway_store_resets_total "):
            return float(line.split()[1])
    raise AssertionError("no idempotency_gateway_store_resets_total in /metrics")


PERSISTENCE = {
    "none": (),
    "aof-always": ("--appendonly", "yes", "--appendfsync", "always"),
    "aof-everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
}


@pytest.mark.slow
@pytest.mark.parametrize("persistence", list(PERSISTENCE))
async def test_redis_sigkill_and_restart_mid_load(
    tmp_path: Path, upstream: Process, persistence: str, ledger: Ledger
) -> None:
    """Redis dies under load with one key completed and one in flight, and comes back
    on the same port and data directory.

    While it is down every request fails closed (503 problem+json, Retry-After) and none
    reaches the upstream. After it is back: with AOF the completed keys replay and the
    in-flight key is unresolved (its lease ran out), with nothing lost. Without
    persistence the records are gone: the gateway notices (store_resets, a loud log),
    and repeats of keys completed before run again, the documented cost."""
    redis = RedisServer(*PERSISTENCE[persistence])
    redis.start()
    setup = make_setup(tmp_path, upstream, redis, park_after="1h")
    gateway = setup.gateway()
    results: list[Sent] = []
    stop = asyncio.Event()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{setup.port}") as client:
            pending = unique("pending")  # the upstream holds it across the outage
            await setup.set_status(pending, 503)  # its status check stays inconclusive
            held = asyncio.create_task(
                client.post("/jobs/charge", json={"job_key": pending}, params={"hold": "1"})
            )
            await until("the upstream holds the pending key", _ran(upstream, pending))
            loader = asyncio.create_task(load(client, results, stop))
            await until("some load completed", _answered(results, 200, 5))
            killed = time.monotonic()
            redis.kill()
            await setup.release(pending)  # the gateway gets its answer, cannot store it
            pending_answer = await held
            await until("requests fail closed", _answered(results, 503, 10, after=killed))
            restarted = time.monotonic()
            redis.start()
            await until("load recovers", _answered(results, 200, 5, after=restarted))
            stop.set()
            await loader
            before = [s for s in results if s.ended < killed and s.status == 200]
            down = [s for s in results if s.started > killed and s.ended < restarted]
            runs_before = {s.key: await upstream_count(upstream, s.key) for s in before}
            if persistence == "none":
                await until("the gateway notices the reset", _resets(setup))
            repeats = [
                await client.post("/jobs/charge", json={"job_key": s.key}, timeout=30)
                for s in before
            ]
            runs_after = {s.key: await upstream_count(upstream, s.key) for s in before}
            reached = [s.key for s in results if s.status == 503 if await _ran(upstream, s.key)()]
            if persistence == "none":
                pending_record = await setup.record("charge", pending)
            else:
                await until(
                    "the pending key's lease runs out into unresolved",
                    _state(setup, pending, State.UNRESOLVED),
                )
                pending_record = await setup.record("charge", pending)
            reset_count = await resets(setup)
    finally:
        stop.set()
        gateway.stop()
        redis.stop()

    reran = sum(runs_after[k] - runs_before[k] for k in runs_after)
    lost = int(pending_record is None or pending_record.state is State.RELEASED)
    ledger.record(
        # Its own row: a Redis without persistence forgets by design (see the docs);
        # every other process fault must show zero duplicates and zero losses.
        AREA if persistence != "none" else "redis without persistence (by design)",
        f"redis_sigkill_restart[{persistence}]",
        requests=len(results) + len(repeats) + 1,
        faults=1,
        upstream_duplicates=reran + len(reached),
        records_lost=lost,
        detail=(
            f"{len(down)} requests while down, {len(reached)} reached the upstream; "
            f"{reran} of {len(before)} completed keys ran again after the restart; "
            f"in-flight key {pending_record.state if pending_record else 'lost'}; "
            f"store_resets {reset_count:g}; pending answer {pending_answer.status_code}"
        ),
    )
    assert down, "no request was answered while Redis was down"
    assert {s.status for s in down} == {503}
    assert all(s.problem and s.retry_after for s in down)
    assert reached == []  # fail closed: not one of them reached the upstream
    assert {s.status for s in results} <= {200, 503}
    assert pending_answer.status_code == 200  # the caller still got the answer
    assert all(r.status_code == 200 for r in repeats)
    if persistence == "none":
        assert reset_count == 1
        assert "STORE RESET" in gateway.output()
        assert pending_record is None  # its unknown outcome is forgotten: nobody checks
        assert reran == len(before)  # the cost of no persistence: each ran again
        assert not any(r.headers.get("idempotent-replayed") for r in repeats)
    else:
        assert reset_count == 0
        assert "STORE RESET" not in gateway.output()
        assert pending_record is not None and pending_record.reason == "lease_expired"
        assert reran == 0
        assert all(r.headers["idempotent-replayed"] == "true" for r in repeats)


def _ran(upstream: Process, key: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await upstream_count(upstream, key) > 0

    return check


def _answered(
    results: list[Sent], status: int, count: int, after: float = 0
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return sum(s.status == status and s.started > after for s in results) >= count

    return check


def _resets(setup: Setup) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await resets(setup) >= 1

    return check


def _state(setup: Setup, key: str, state: State) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        record = await setup.record("charge", key)
        return record is not None and record.state is state

    return check


async def test_claims_redis_runs_after_the_gateway_gave_up_are_released(
    tmp_path: Path, upstream: Process, redis: RedisServer
) -> None:
    """Claims written to Redis's socket while it is stopped time out (503, nothing
    sent); Redis runs them when it resumes, under run ids nobody forwards on. The
    gateway releases what they took, so a retry runs each job at once (not after the
    lease, and never through an unknown outcome), and each job runs once."""
    setup = make_setup(tmp_path, upstream, redis)
    setup.gateway()
    keys = [unique("late") for _ in range(6)]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{setup.port}") as client:
        warm = await client.post("/jobs/charge", json={"job_key": unique("warm")}, timeout=10)
        assert warm.status_code == 200, warm.text
        redis.signal(signal.SIGSTOP)
        try:
            answers = await finish(
                [
                    asyncio.create_task(
                        client.post("/jobs/charge", json={"job_key": key}, timeout=30)
                    )
                    for _ in range(3)
                    for key in keys
                ]
            )
        finally:
            redis.signal(signal.SIGCONT)
        assert [a.status_code for a in answers] == [503] * len(answers)
        for key in keys:
            assert await upstream_count(upstream, key) == 0

        async def retry(key: str) -> tuple[int, float]:
            started = time.monotonic()
            response = await client.post("/jobs/charge", json={"job_key": key}, timeout=30)
            return response.status_code, time.monotonic() - started

        # The lease is 6.2 s: a retry that waited for it (or for a check of the
        # upstream) would take far longer than the store's few timeouts.
        retries = await asyncio.gather(*(retry(key) for key in keys))
        assert all(status == 200 for status, _ in retries), retries
        assert max(took for _, took in retries) < 3, retries
    for key in keys:
        assert await upstream_count(upstream, key) == 1
        record = await setup.record("charge", key)
        assert record is not None and record.state is State.COMPLETED, record
        assert not [e for e in record.history if e.get("reason") == "lease_expired"], record
