"""Gateways whose clocks are minutes off Redis's, on one real Redis.

A `sitecustomize.py` on the gateway process's PYTHONPATH moves its wall clock
(`time.time`, `time.time_ns`, `datetime.now`/`utcnow`/`today`) by SKEW seconds, ahead
or behind; monotonic clocks, which timeouts use, stay as they are. Leases, record
times and the sweep's "now" all come from Redis TIME inside the scripts, so:

- a lease lasts deadline + margin from the moment Redis saw the claim, whichever
  gateway claimed it (never 10 minutes early or late);
- a killed gateway's lease runs out on Redis's schedule, and another gateway's sweep
  opens the key then, not before and not 10 minutes later;
- a sweeping gateway whose clock runs ahead never parks another gateway's healthy keys.

What does read the local clock, by design: the `{period}` window of a key (a route's
period is the gateway's own calendar), the access log's `ts`, the
`last_success_timestamp` metric, and the Date header.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import StoreConfig
from gateway.records import Record, State
from gateway.store.redis import RedisStore
from tests.conftest import unique
from tests.support.ledger import Ledger
from tests.support.raw_upstream import raw_upstream_server
from tests.support.records import read_record
from tests.support.servers import Process, RedisServer, free_port, gateway_process

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.redis]

AREA = "clock"
SKEW = 600.0  # ten minutes
PREFIX = unique("clock") + ":"
DEADLINE = 4.0  # the route's upstream_timeout: 2 s to spare on a loaded machine
#: Store timeouts of 200 ms make the lease margin 4 x 0.2 + 2 x 0.2 + 1 = 2.2 s.
LEASE_MS = int((DEADLINE + 2.2) * 1000)

SITECUSTOMIZE = '''
"""Skews this process's wall clock by GATEWAY_TEST_CLOCK_SKEW seconds (tests only)."""
import datetime as _datetime
import os as _os
import time as _time

_skew = float(_os.environ["GATEWAY_TEST_CLOCK_SKEW"])
_time_time, _time_ns = _time.time, _time.time_ns
_time.time = lambda: _time_time() + _skew
_time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
_shift = _datetime.timedelta(seconds=_skew)


class _SkewedDatetime(_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return super().now(tz) + _shift

    @classmethod
    def utcnow(cls):
        return super().now(_datetime.timezone.utc).replace(tzinfo=None) + _shift

    @classmethod
    def today(cls):
        return cls.now()


_datetime.datetime = _SkewedDatetime
'''


@pytest.fixture(scope="module")
def raw() -> Iterator[Process]:
    server = raw_upstream_server().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def skew_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("skewed-clock")
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


class Skewed:
    """Starts gateway processes whose wall clock is `skew` seconds off."""

    def __init__(self, tmp: Path, skew_dir: Path, raw: Process, redis: RedisServer) -> None:
        self.tmp, self.skew_dir, self.raw, self.redis = tmp, skew_dir, raw, redis
        self.started: list[Process] = []

    def start(self, skew: float) -> Process:
        port = free_port()
        config = {
            "server": {
                "listen": f"127.0.0.1:{port}",
                "shutdown_grace": "2s",
                "log_format": "json",
            },
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
            "store": {
                "url": self.redis.url,
                "prefix": PREFIX,
                "socket_timeout": "200ms",
                "connect_timeout": "200ms",
            },
            "routes": [
                {
                    "name": "work",
                    "match": {"methods": ["POST"], "path": "/work"},
                    "upstream": self.raw.url,
                    "key": {"header": "Idempotency-Key"},
                    "upstream_timeout": f"{DEADLINE:g}s",
                    # The default: a key whose lease runs out is parked.
                    "on_unknown_outcome": "park",
                },
                {
                    # Only here so that the sweep runs every 200 ms (the tightest
                    # `every` of any route sets its pace): many chances to go wrong.
                    "name": "tick",
                    "match": {"methods": ["GET"], "path": "/tick"},
                    "upstream": self.raw.url,
                    "key": {"header": "Idempotency-Key"},
                    "on_unknown_outcome": "reconcile",
                    "reconcile": {"url": self.raw.url + "/_status/{key}", "every": "200ms"},
                },
            ],
        }
        path = self.tmp / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        pythonpath = os.pathsep.join(
            p for p in (str(self.skew_dir), os.environ.get("PYTHONPATH", "")) if p
        )
        env = {"PYTHONPATH": pythonpath, "GATEWAY_TEST_CLOCK_SKEW": str(skew)}
        gateway = gateway_process(path, port, env=env).start()
        self.started.append(gateway)
        return gateway


@pytest.fixture(scope="module")
def skewed(
    tmp_path_factory: pytest.TempPathFactory,
    skew_dir: Path,
    raw: Process,
    redis_server: RedisServer,
) -> Iterator[Skewed]:
    starter = Skewed(tmp_path_factory.mktemp("clock"), skew_dir, raw, redis_server)
    yield starter
    for gateway in starter.started:
        gateway.stop()


@pytest.fixture(scope="module")
def ahead(skewed: Skewed) -> Process:
    return skewed.start(+SKEW)


@pytest.fixture(scope="module")
def behind(skewed: Skewed) -> Process:
    return skewed.start(-SKEW)


async def redis_now_ms(redis: RedisServer) -> int:
    store = RedisStore(StoreConfig(url=redis.url, prefix=PREFIX))
    try:
        seconds, micros = await store.client.time()
        return int(seconds) * 1000 + int(micros) // 1000
    finally:
        await store.close()


async def upstream_count(raw: Process, key: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{raw.url}/_count", params={"key": key})
        return int(response.json()["count"])


async def until_in_flight(redis: RedisServer, key: str) -> Record:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        record = await read_record(redis, PREFIX, "work", key)
        if record is not None:
            assert record.state is State.IN_FLIGHT, record
            return record
        await asyncio.sleep(0.02)
    raise AssertionError(f"{key} was never claimed")


async def assert_skewed(gateway: Process, skew: float) -> None:
    """The gateway process really runs on a skewed wall clock: its Date header and
    its access log's `ts` are `skew` off this process's clock (give or take a minute,
    against a skew of ten)."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        answer = await http.get("/nowhere")
    date = parsedate_to_datetime(answer.headers["date"]).timestamp()
    assert abs(date - (time.time() + skew)) < 60, (date, time.time())
    deadline = time.monotonic() + 10  # the access log is flushed every 0.5 s
    while not (stamps := _log_stamps(gateway)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert stamps and abs(stamps[-1] - (time.time() + skew)) < 60, stamps


def _log_stamps(gateway: Process) -> list[float]:
    lines = [line for line in gateway.output().splitlines() if line.startswith("{")]
    return [float(json.loads(line)["ts"]) for line in lines]


def check_lease(record: Record, before_ms: int, after_ms: int) -> None:
    """Claimed at Redis's time (between two Redis TIME reads around the request), with
    a lease of exactly deadline + margin on Redis's clock."""
    assert before_ms <= record.created_ms <= after_ms, (before_ms, record.created_ms, after_ms)
    assert record.lease_until_ms - record.created_ms == LEASE_MS, record


async def test_skewed_gateways_keep_each_others_healthy_leases(
    ahead: Process, behind: Process, raw: Process, redis_server: RedisServer, ledger: Ledger
) -> None:
    """One gateway 10 minutes ahead, one 10 minutes behind, both sweeping every 200 ms:
    slow requests through each (2 s of a 4 s deadline) finish, are stored once, and no
    sweep takes another gateway's key for a dead one."""
    await assert_skewed(ahead, +SKEW)
    await assert_skewed(behind, -SKEW)
    keys = {gateway.url: [unique("healthy") for _ in range(3)] for gateway in (ahead, behind)}
    before = await redis_now_ms(redis_server)
    async with httpx.AsyncClient(timeout=30) as http:
        sends = [
            http.post(f"{url}/work", params={"sleep": "2"}, headers={"Idempotency-Key": key})
            for url, url_keys in keys.items()
            for key in url_keys
        ]
        answers = asyncio.gather(*sends)
        claimed = [await until_in_flight(redis_server, k) for ks in keys.values() for k in ks]
        after = await redis_now_ms(redis_server)
        responses = await answers
    all_keys = [key for url_keys in keys.values() for key in url_keys]
    records = [await read_record(redis_server, PREFIX, "work", key) for key in all_keys]
    runs = [await upstream_count(raw, key) for key in all_keys]
    ledger.record(
        AREA,
        "two gateways skewed +-10 min, healthy leases",
        requests=len(all_keys),
        faults=2,
        upstream_duplicates=sum(max(0, n - 1) for n in runs),
        records_lost=sum(r is None or r.state is not State.COMPLETED for r in records),
        detail="2 s of work under a 4 s deadline through each gateway; both sweep every 200 ms",
    )
    for record in claimed:
        check_lease(record, before, after)
    assert [r.status_code for r in responses] == [200] * len(all_keys)
    assert all("idempotent-replayed" not in r.headers for r in responses)
    for record in records:
        assert record is not None and record.state is State.COMPLETED, record
        assert not [e for e in record.history if e["event"] in ("unknown", "parked")], record
    assert runs == [1] * len(all_keys)


@pytest.mark.parametrize(
    ("victim_skew", "sweeper_skew"),
    [(+SKEW, -SKEW), (-SKEW, +SKEW)],
    ids=["victim-ahead", "victim-behind"],
)
async def test_killed_gateways_lease_runs_out_on_redis_time(
    request: pytest.FixtureRequest,
    skewed: Skewed,
    raw: Process,
    redis_server: RedisServer,
    ledger: Ledger,
    victim_skew: float,
    sweeper_skew: float,
) -> None:
    """A gateway dies mid-request (SIGKILL); another, skewed the other way, sweeps.
    The key stays in flight while Redis's clock is before the lease's end, and is
    parked (lease_expired) once it passes: not 10 minutes early, not 10 minutes late."""
    sweeper: Process = request.getfixturevalue("ahead" if sweeper_skew > 0 else "behind")
    victim = skewed.start(victim_skew)
    await assert_skewed(victim, victim_skew)
    await assert_skewed(sweeper, sweeper_skew)
    key = unique("killed")
    body: dict[str, Any] = {"params": {"sleep": "2.5"}, "headers": {"Idempotency-Key": key}}
    before = await redis_now_ms(redis_server)
    async with httpx.AsyncClient(base_url=victim.url, timeout=30) as http:
        request = asyncio.create_task(http.post("/work", **body))
        claimed = await until_in_flight(redis_server, key)
        after = await redis_now_ms(redis_server)
        while await upstream_count(raw, key) < 1:  # the upstream has the request
            await asyncio.sleep(0.02)
        victim.kill()
        with pytest.raises(httpx.TransportError):
            await request
    snapshots: list[Record] = []
    deadline = time.monotonic() + 20  # the lease is 6.2 s; the sweep runs every 200 ms
    while time.monotonic() < deadline:
        record = await read_record(redis_server, PREFIX, "work", key)
        assert record is not None
        snapshots.append(record)
        if record.state is not State.IN_FLIGHT:
            break
        await asyncio.sleep(0.05)
    opened = snapshots[-1]
    runs = await upstream_count(raw, key)
    ledger.record(
        AREA,
        f"killed gateway skewed {victim_skew:+g}s, sweeper {sweeper_skew:+g}s",
        requests=2,
        faults=2,
        upstream_duplicates=max(0, runs - 1),
        records_lost=int(opened.state is not State.PARKED),
        detail="SIGKILL mid-request; the other gateway's sweep opens the key",
    )
    check_lease(claimed, before, after)
    # Every snapshot read before the lease's end (Redis time) saw it in flight ...
    for record in snapshots:
        if record.now_ms < claimed.lease_until_ms:
            assert record.state is State.IN_FLIGHT, record
    # ... and it was parked, at or after the lease's end, within the test's bound.
    assert opened.state is State.PARKED, opened
    assert opened.since_ms >= claimed.lease_until_ms
    assert opened.history[0]["reason"] == "lease_expired"
    async with httpx.AsyncClient(base_url=sweeper.url, timeout=30) as http:
        retry = await http.post("/work", **body)
    assert retry.status_code == 409 and retry.json()["state"] == "parked"
    assert runs == 1 and await upstream_count(raw, key) == 1
