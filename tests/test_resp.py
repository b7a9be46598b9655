"""The store's pipelined connection (gateway/store/redis/resp.py) against real redis-servers:
replies matched to callers under concurrency and cancellation, login, db and unix
sockets, a hung Redis failing calls in bounded time, a restarted one reloading scripts."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import hiredis
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from gateway.config import StoreConfig
from gateway.errors import StoreError
from gateway.records import KeyRef, State
from gateway.store.redis import BUCKETS, RedisStore
from gateway.store.redis.resp import Endpoint, RespConnection, RespConnectionError, RespError
from gateway.store.redis.scripts import SCRIPTS
from tests.conftest import unique
from tests.support.loops import anyio_backend  # noqa: F401  (uvloop and asyncio)
from tests.support.servers import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


def connection(port: int, **login: str | int) -> RespConnection:
    async def locate() -> Endpoint:
        return Endpoint(host="127.0.0.1", port=port, **login)  # type: ignore[arg-type]

    return RespConnection(locate, timeout=1.0, connect_timeout=1.0)


@pytest.fixture
async def conn(redis_server: RedisServer) -> AsyncIterator[RespConnection]:
    c = connection(redis_server.port)
    yield c
    await c.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server this test may stop, kill and restart."""
    server = RedisServer()
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


def ref() -> KeyRef:
    key = unique()
    return KeyRef(digest=os.urandom(16).hex(), route="r", key=key)


async def test_concurrent_calls_each_get_their_own_reply(conn: RespConnection) -> None:
    values = [f"v{i}-{'x' * (i % 50)}" for i in range(500)]
    replies = await asyncio.gather(*(conn.call("ECHO", v) for v in values))
    assert replies == [v.encode() for v in values]


class Recorder:
    """A transport that notes what is written through it."""

    def __init__(self, transport: Any) -> None:
        self.transport, self.writes = transport, []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def test_a_call_to_an_idle_redis_leaves_at_once_the_rest_together(
    conn: RespConnection,
) -> None:
    """Nothing outstanding: the command is written at once, so Redis works on it while
    the gateway goes on. Sent while replies are outstanding: held to the end of the
    loop iteration, then written together. Replies come back in order either way."""
    await conn.call("PING")
    protocol = conn._protocol
    assert protocol is not None
    recorder = Recorder(protocol.transport)
    protocol.transport = recorder  # type: ignore[assignment]
    first = protocol.send(
        hiredis.pack_command(("ECHO", "a"))
    )  # no await between: one loop iteration
    assert len(recorder.writes) == 1 and protocol.outgoing == []
    later = [protocol.send(hiredis.pack_command(("ECHO", v))) for v in ("b", "c")]
    assert len(recorder.writes) == 1 and len(protocol.outgoing) == 2
    assert await asyncio.gather(first, *later) == [b"a", b"b", b"c"]
    assert recorder.writes[1:] == [b"".join(recorder.writes[1:])]  # one write for both
    assert len(recorder.writes) == 2


async def test_a_cancelled_call_does_not_shift_the_replies(conn: RespConnection) -> None:
    # The cancelled call's reply still arrives; it must be dropped, not handed to
    # the next caller.
    for i in range(50):
        slow = asyncio.ensure_future(conn.call("ECHO", f"cancelled-{i}"))
        await asyncio.sleep(0)
        slow.cancel()
        assert await conn.call("ECHO", f"mine-{i}") == f"mine-{i}".encode()


async def test_error_reply_is_raised_and_the_connection_goes_on(conn: RespConnection) -> None:
    with pytest.raises(RespError, match="unknown command"):
        await conn.call("NOSUCHCOMMAND")
    assert await conn.call("PING") == b"PONG"


async def test_login_and_db_from_the_url(tmp_path: Path) -> None:
    server = RedisServer("--requirepass", "s3cret", "--unixsocket", str(tmp_path / "r.sock"))
    server.start()
    try:
        await server_acl(server)
        for url in (
            f"redis://:s3cret@127.0.0.1:{server.port}/3",
            f"redis://jobs:jobpass@127.0.0.1:{server.port}/3",
            f"unix://:s3cret@{tmp_path / 'r.sock'}?db=3",
        ):
            store = RedisStore(StoreConfig(url=url, prefix=unique("t") + ":"))
            await store.start()
            try:
                key = ref()
                assert await store.claim(key, "run1", "fp", 10) is None
                assert store._pipe is not None
                # The script ran on db 3, where the record now is.
                check = aioredis.Redis(port=server.port, password="s3cret", db=3)
                assert await check.dbsize() >= 1
                await check.aclose()
            finally:
                await store.close()
        bad = RedisStore(StoreConfig(url=f"redis://:wrong@127.0.0.1:{server.port}/0"))
        with pytest.raises(StoreError, match="login"):
            await bad.claim(ref(), "run1", "fp", 10)
        await bad.close()
    finally:
        server.stop()


async def server_acl(server: RedisServer) -> None:
    admin = aioredis.Redis(port=server.port, password="s3cret")
    await admin.execute_command("ACL", "SETUSER", "jobs", "on", ">jobpass", "~*", "&*", "+@all")
    await admin.aclose()


async def test_hung_redis_fails_calls_in_bounded_time_then_recovers(
    own_redis: RedisServer,
) -> None:
    store = RedisStore(
        StoreConfig(url=own_redis.url, prefix="t:", socket_timeout=0.5, connect_timeout=0.5)
    )
    await store.start()
    try:
        assert await store.claim(ref(), "run1", "fp", 10) is None
        assert own_redis.proc is not None
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            # A call and its one retry, each bounded by the timeout: an error, not a hang.
            async with asyncio.timeout(20):
                with pytest.raises(StoreError, match=r"did not answer|connect"):
                    await store.claim(ref(), "run2", "fp", 10)
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        assert await store.claim(ref(), "run3", "fp", 10) is None
    finally:
        await store.close()


async def test_restarted_redis_gets_its_scripts_again(own_redis: RedisServer) -> None:
    store = RedisStore(StoreConfig(url=own_redis.url, prefix="t:", socket_timeout=1.0))
    await store.start()
    try:
        first = ref()
        assert await store.claim(first, "run1", "fp", 10) is None
        own_redis.kill()
        own_redis.start()  # same port, no scripts loaded, no data
        # The old connection is dead and the new server has no scripts: the call
        # reconnects, gets NOSCRIPT, loads the script and runs it (with the template
        # the first claim's bucket and route got before the restart).
        second = KeyRef(first.digest[:4] + os.urandom(14).hex(), first.route, unique())
        assert await store.claim(second, "run2", "fp", 10) is None
        record = await store.get(second)
        assert record is not None and record.state is State.IN_FLIGHT
    finally:
        await store.close()


async def test_a_reloaded_script_is_sent_with_the_sha_redis_gave_it(
    redis_server: RedisServer,
) -> None:
    """The store's sha of a script is not Redis's (as if the two hashed the source
    differently): the first call's NOSCRIPT loads it, and from then on every call, in
    every bucket and route, carries the sha SCRIPT LOAD answered: no call is left with
    a template of the old one."""
    store = RedisStore(StoreConfig(url=redis_server.url, prefix=unique("t") + ":"))
    await store.start()
    try:
        script = store._scripts["claim"]
        known = script.sha
        first = ref()
        assert await store.claim(first, "run1", "fp", 10) is None  # a template, Redis's sha
        script.sha = "0" * 40
        same_slot = KeyRef(first.digest[:4] + os.urandom(14).hex(), first.route, unique())
        elsewhere = [ref() for _ in range(5)]
        for i, key in enumerate([same_slot, *elsewhere]):
            assert await store.claim(key, f"run{i}", "fp", 10) is None
            record = await store.get(key)
            assert record is not None and record.state is State.IN_FLIGHT
        assert script.sha == known
    finally:
        await store.close()


def _stores() -> list[RedisStore]:
    """Stores that never connect: the bytes are computed locally. The second's prefix
    holds what the templates mark the digest's place with, so it packs without them."""
    return [
        RedisStore(StoreConfig(url="redis://127.0.0.1:9/0", prefix=prefix))
        for prefix in ("idem:", "é\x00digest\x00{x}:")
    ]


_ARGUMENT = st.one_of(
    st.text(max_size=12),  # non-ASCII and empty among them
    st.binary(max_size=12),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(["", b"", 0, "\r\n", "$3", "\x00digest\x00"]),
)
_DIGEST = st.one_of(
    st.text("0123456789abcdef", min_size=32, max_size=32),  # what records have
    st.tuples(st.text("0123456789abcdef", min_size=4, max_size=4), st.text(max_size=40)).map(
        "".join
    ),
)
_ROUTE = st.one_of(st.sampled_from(["jobs", "r", "a\x00digest\x00b", ""]), st.text(max_size=12))


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(SCRIPTS),
            st.integers(0, 1),
            _DIGEST,
            _ROUTE,
            st.lists(_ARGUMENT, max_size=10).map(tuple),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_every_script_call_is_packed_as_hiredis_and_redis_py_pack_it(
    calls: list[tuple[str, int, str, str, tuple[Any, ...]]],
) -> None:
    """The EVALSHA the store writes, from its templates, is byte for byte the command
    hiredis packs from the store's keys and arguments, and redis-py's own packer (the
    Cluster path's): for every script, any route and digest (the templates outlive an
    example, so later ones reuse them with other digests, lengths and arities)."""
    serializer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    for name, which, digest, route, args in calls:
        store = STORES[which]
        ref = KeyRef(digest, route, "")
        keys, head = store._keys(ref)
        whole = ("EVALSHA", store._scripts[name].sha, len(keys), *keys, *head, *args)
        bucket = int(digest[:4], 16) % BUCKETS
        sent = store._commands.command(name, bucket, digest, route, args)
        assert sent == hiredis.pack_command(whole)
        assert sent == b"".join(serializer.pack(*whole))


STORES = _stores()


async def test_a_dropped_connection_fails_only_the_calls_on_it(
    own_redis: RedisServer,
) -> None:
    conn = connection(own_redis.port)
    try:
        assert await conn.call("PING") == b"PONG"
        killer = aioredis.Redis(port=own_redis.port)
        await killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        await killer.aclose()
        await asyncio.sleep(0.1)
        # The first call finds the connection gone (or loses it) and says so ...
        try:
            await conn.call("PING")
        except RespConnectionError:
            pass
        # ... and the next one opens a new connection.
        assert await conn.call("PING") == b"PONG"
    finally:
        await conn.close()


async def test_close_right_after_start_ends_the_listener(redis_server: RedisServer) -> None:
    # redis-py's get_message can swallow a cancel; close() must still end the
    # notification listener instead of returning with it running.
    for i in range(20):
        store = RedisStore(StoreConfig(url=redis_server.url, prefix="t:"))
        await store.start()
        await asyncio.sleep(0.001 * (i % 5))
        await store.close()
        assert store._listener is not None and store._listener.done()
