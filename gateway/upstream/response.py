"""What `Upstream.forward` hands back, and how an answer ends that did not come whole.

An `UpstreamResponse`, its body read whole or, when too large to hold, a `BodyStream`;
the `ResponseBudget` that bounds the response bytes the process holds; and `Broken`,
how an exchange ended without a whole answer, which always becomes OutcomeLost (see
gateway/upstream/client.py for the rule).

Bodies too large to hold: with a `ResponseBudget`, `forward` reads a body whole only up
to `whole_up_to` bytes (the route's max_stored_body). A longer one, or one the
process's budget has no room for, is handed on as soon as that is known, as a
`BodyStream` the caller reads part by part as the upstream sends it; while the reader
is behind, the upstream connection stops reading, so the gateway holds about one read
of it, never the body. How it ends (whole, cut off, over `max_response_body`, late) is
classified exactly as for a body read whole.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import OutcomeLost

#: A stream stops reading from the upstream once this much waits for its reader.
STREAM_HIGH = 64 * 1024
#: Parts of a stream smaller than this that wait together reach the reader as one.
JOIN_BELOW = 64 * 1024
#: The share of the deadline a key's reader may hold the upstream read back for; after
#: it, a reader that still does is given up on, so the body is read to its end in time.
READER_SHARE = 0.75


# Not frozen: a frozen dataclass sets each field through object.__setattr__, about
# 0.1 us a field, and one of these is made on every request.
class Carrier(Protocol):
    """The kept-alive connection a body arrives on (gateway/upstream/pool.py's
    `Connection`): paused and resumed as the reader keeps up, closed when cut off."""

    transport: asyncio.Transport | None

    def detach(self) -> object: ...

    def close(self) -> None: ...


class Source(Protocol):
    """The exchange a streamed body continues (gateway/upstream/parser.py's `Exchange`)."""

    headers: list[tuple[bytes, bytes]]
    connection: Carrier | None
    read_to_end: bool


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    #: hop-by-hop headers removed; the body is the raw bytes, still content-encoded
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: the body, when it was too large to hold: `body` is then empty
    rest: BodyStream | None = None
    #: bytes of `body` counted in the budget; whoever writes them releases them
    held: int = 0


class ResponseBudget:
    """Response bytes the process holds at once, over all requests
    (`server.max_buffered_responses`): bodies being read whole, and streamed parts not
    yet written to their callers.

    At the limit nothing waits for a body being read whole (those could wait for each
    other forever): that response is streamed instead, so it is not stored whole.
    Streams stop reading from their upstreams until bytes are freed, which happens as
    callers take their parts (or are given up on after server.write_timeout)."""

    __slots__ = ("_waiting", "held", "limit", "on_full")

    def __init__(self, limit: int, on_full: Callable[[str], None] | None = None) -> None:
        self.held = 0
        self.limit = limit
        #: called with "streamed" or "paused" when the limit causes either
        self.on_full = on_full
        self._waiting: dict[BodyStream, None] = {}  # in the order they began to wait

    def release(self, size: int) -> None:
        self.held -= size
        if self._waiting and self.held <= self.limit:
            waiting, self._waiting = self._waiting, {}
            for stream in waiting:
                stream._budget_freed()

    def _wait(self, stream: BodyStream) -> None:
        """`stream`'s read stays paused until bytes are freed."""
        if stream not in self._waiting:
            self._waiting[stream] = None
            self.full("paused")

    def full(self, action: str) -> None:
        if self.on_full is not None:
            self.on_full(action)


class BodyStream:
    """The body of an answer too large to hold, read part by part as it arrives.

    Parts wait here for the reader (`read`); once STREAM_HIGH bytes wait, or the
    process's ResponseBudget is used up, the upstream connection stops reading until
    the reader catches up, so the gateway holds about one read of the body (the
    socket buffers hold the rest, and the upstream waits). How it ends is decided as
    for a body read whole: complete, or OutcomeLost (cut off, over max_response_body,
    past the deadline).

    The deadline: for a key's answer (`read_to_end`) it is the whole call's, as for a
    body read whole, so the key settles within its lease; its reader may hold the read
    back for the first READER_SHARE of it, and is given up on (its `read` raises) if it
    still does after that, the rest then read at the upstream's pace. For any other
    answer, time the read is paused for its reader does not count.

    `abandon`: the reader is gone. A key's answer is then read to its end anyway,
    parts dropped as they come, so the key is decided as if it had been read; any
    other answer's connection is closed."""

    __slots__ = (
        "_budget",
        "_connection",
        "_deadline",
        "_discarding",
        "_dropped",
        "_ended",
        "_error",
        "_give_up",
        "_late",
        "_left",
        "_on_drop",
        "_out",
        "_paused",
        "_queue",
        "_queued",
        "_read_to_end",
        "_status",
        "_timer",
        "_waiter",
        "length",
    )

    def __init__(
        self,
        exchange: Source,
        chunks: list[bytes],
        queued: int,
        status: int,
        budget: ResponseBudget,
    ) -> None:
        #: the whole body's declared length (Content-Length), if it has one
        self.length = _declared_length(exchange.headers)
        self._connection: Carrier | None = exchange.connection
        self._status = status
        self._budget = budget
        self._read_to_end = exchange.read_to_end
        self._queue = collections.deque(chunks)
        self._queued = queued  # bytes in _queue, all of them counted in the budget
        self._out = 0  # bytes the reader has now, counted until it asks for more
        self._paused = False
        self._discarding = False  # nobody reads: parts are dropped as they come
        self._dropped = False  # the reader was given up on
        self._late = False  # past the reader's share of the deadline
        self._on_drop: Callable[[str], None] | None = None
        self._error: Broken | None = None
        self._ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._give_up = 0.0  # loop time; 0: forward has not handed it on yet
        self._left = 0.0  # seconds of deadline left while paused (not read_to_end)
        self._deadline = 0.0

    # -- the reader's side -----------------------------------------------------------------

    async def read(self) -> bytes:
        """The next part of the body, b"" at its end. OutcomeLost if the body was cut
        off (the parts that came before it are read first) or the reader was given up
        on: the response this is written to must then stay visibly incomplete."""
        if self._out:
            self._budget.release(self._out)
            self._out = 0
        queue = self._queue
        while not queue:
            if self._dropped:
                raise OutcomeLost(self._drop_reason(), self._status)
            if self._error is not None:
                raise OutcomeLost(self._error.reason, self._error.status)
            if self._ended.done():
                return b""
            self._check_resume()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunk = queue.popleft()
        if queue and len(chunk) < JOIN_BELOW and len(queue[0]) < JOIN_BELOW:
            parts, size = [chunk], len(chunk)
            while queue and size < JOIN_BELOW and len(queue[0]) < JOIN_BELOW:
                part = queue.popleft()
                parts.append(part)
                size += len(part)
            chunk = b"".join(parts)
        self._out = len(chunk)
        self._queued -= len(chunk)
        self._check_resume()
        return chunk

    def abandon(self) -> None:
        """The reader is gone (or done): see the class docstring. Safe to repeat."""
        self._drop_parts()
        if self._ended.done():
            return
        if self._read_to_end:
            self._discarding = True
            self._check_resume()
        else:
            self.close()

    async def finished(self) -> None:
        """Until the body ends; OutcomeLost if it did not arrive whole."""
        await asyncio.shield(self._ended)  # a waiter cancelled is no end of the body
        if self._error is not None:
            raise OutcomeLost(self._error.reason, self._error.status)

    def close(self) -> None:
        """Stop reading: the connection is closed and the body counts as cut off."""
        self._drop_parts()
        connection = self._connection
        if not self._ended.done():
            self.fail(
                Broken(f"the gateway stopped reading the body{after_status(self._status)}", None)
            )
        if connection is not None:
            connection.detach()
            connection.close()

    @property
    def whole(self) -> bool:
        """Whether the body has ended and arrived whole (the reader may have been given
        up on: the rest was still read, for the key)."""
        return self._ended.done() and self._error is None

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the body has ended, however it ended."""
        self._ended.add_done_callback(lambda _: callback())

    def when_dropped(self, callback: Callable[[str], None]) -> None:
        """Call `callback` with the reason if the reader is given up on (see the class
        docstring): at once, while the reader may still be waiting for its caller."""
        self._on_drop = callback

    # -- the exchange's side ---------------------------------------------------------------

    def begin(self, give_up: float, deadline: float) -> None:
        """forward hands the answer on: the deadline starts to apply here."""
        self._give_up, self._deadline = give_up, deadline
        if self._ended.done():
            return
        loop = asyncio.get_running_loop()
        if self._read_to_end:
            share = give_up - deadline * (1 - READER_SHARE)
            self._timer = loop.call_at(share, self._reader_late)
        elif self._paused:
            self._left = give_up - loop.time()
        else:
            self._timer = loop.call_at(give_up, self._expire)

    def push(self, chunk: bytes) -> None:
        if self._discarding:
            return
        self._queue.append(chunk)
        self._queued += len(chunk)
        self._budget.held += len(chunk)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self.check_pause()

    def end(self) -> None:
        connection = self._connection
        if self._paused and connection is not None and connection.transport is not None:
            self._paused = False
            if not connection.transport.is_closing():
                connection.transport.resume_reading()  # it goes back to the pool reading
        self._settled()

    def fail(self, error: Broken) -> None:
        if not self._ended.done():
            self._error = error
            self._settled()

    def _settled(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._connection = None  # it may carry another request now
        if not self._ended.done():
            self._ended.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._discarding:
            self._drop_parts()

    # -- flow ------------------------------------------------------------------------------

    def check_pause(self) -> None:
        if self._paused or self._connection is None:
            return
        budget = self._budget
        if self._queued < STREAM_HIGH and budget.held <= budget.limit:
            return
        if self._late:
            self._drop_reader()  # too slow for the key's deadline: no more waiting for it
            return
        if self._queued < STREAM_HIGH:
            budget._wait(self)  # its reader is not behind: the process's memory is full
        transport = self._connection.transport
        if transport is None:
            return
        transport.pause_reading()
        self._paused = True
        if not self._read_to_end and self._timer is not None:
            self._timer.cancel()  # the reader's time is not the upstream's
            self._timer = None
            self._left = self._give_up - asyncio.get_running_loop().time()

    def _check_resume(self) -> None:
        if not self._paused or self._connection is None:
            return
        budget = self._budget
        if not self._discarding:
            if self._queued >= STREAM_HIGH:
                return
            if budget.held > budget.limit:
                budget._wait(self)
                return
        self._resume()

    def _resume(self) -> None:
        connection = self._connection
        assert connection is not None and connection.transport is not None
        self._paused = False
        if connection.transport.is_closing():
            return
        connection.transport.resume_reading()
        if not self._read_to_end and self._give_up and self._timer is None:
            loop = asyncio.get_running_loop()
            self._give_up = loop.time() + self._left
            self._timer = loop.call_at(self._give_up, self._expire)

    def _budget_freed(self) -> None:
        self._check_resume()

    def _drop_parts(self) -> None:
        dropped = self._queued + self._out
        self._queue.clear()
        self._queued = self._out = 0
        if dropped:
            self._budget.release(dropped)

    # -- time ------------------------------------------------------------------------------

    def _reader_late(self) -> None:
        loop = asyncio.get_running_loop()
        self._late = True
        self._timer = loop.call_at(self._give_up, self._expire)
        if self._paused:
            self._drop_reader()

    def _drop_reader(self) -> None:
        self._dropped = True
        self._discarding = True
        self._drop_parts()
        if self._paused:
            self._resume()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._on_drop is not None:
            self._on_drop(self._drop_reason())

    def _drop_reason(self) -> str:
        return (
            f"the caller read the body too slowly to take it within {READER_SHARE:.0%} "
            f"of the {self._deadline:g}s deadline; it was cut off and the rest is read "
            "for the key"
        )

    def _expire(self) -> None:
        self._timer = None
        connection = self._connection
        self.fail(
            Broken(
                f"no complete answer within {self._deadline:g}s{after_status(self._status)}",
                self._status,
            )
        )
        if connection is not None:
            connection.detach()
            connection.close()


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    chunked = False
    length: int | None = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            length = int(value)
        elif lowered == b"transfer-encoding":
            chunked = True
    return None if chunked else length


class Broken(Exception):
    """How an exchange ended without a whole answer; becomes OutcomeLost."""

    def __init__(self, reason: str, status: int | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


def after_status(status: int | None) -> str:
    return f" after it answered {status}" if status is not None else ""
