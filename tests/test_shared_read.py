"""gateway/shared_read.py alone: one read in flight for every reader, its answer kept
for `ttl`, a failure kept by no one. In process, with a counting read: no timers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.shared_read import SharedRead

pytestmark = pytest.mark.anyio


class Reads:
    def __init__(self) -> None:
        self.count = 0
        self.release = asyncio.Event()
        self.fail = False

    async def __call__(self) -> int:
        self.count += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the store is down")
        return self.count


async def test_concurrent_readers_share_one_read() -> None:
    reads = Reads()
    shared = SharedRead(reads, ttl=60)
    readers = [asyncio.ensure_future(shared.get()) for _ in range(50)]
    await asyncio.sleep(0)
    reads.release.set()
    assert await asyncio.gather(*readers) == [1] * 50
    assert reads.count == 1


async def test_an_answer_serves_later_readers_for_its_ttl_then_is_read_again() -> None:
    reads = Reads()
    reads.release.set()
    kept = SharedRead(reads, ttl=60)
    assert [await kept.get() for _ in range(5)] == [1] * 5
    assert reads.count == 1
    fresh = SharedRead(reads, ttl=0)
    assert [await fresh.get() for _ in range(3)] == [2, 3, 4]


async def test_a_failed_read_is_kept_by_no_one() -> None:
    reads = Reads()
    reads.release.set()
    reads.fail = True
    shared = SharedRead(reads, ttl=60)
    with pytest.raises(RuntimeError):
        await shared.get()
    reads.fail = False
    assert await shared.get() == 2


async def test_a_reader_that_gives_up_leaves_the_read_to_the_others() -> None:
    reads = Reads()
    shared = SharedRead(reads, ttl=60)
    quitter = asyncio.ensure_future(shared.get())
    stayer = asyncio.ensure_future(shared.get())
    await asyncio.sleep(0)
    quitter.cancel()
    reads.release.set()
    assert await stayer == 1
    assert reads.count == 1
