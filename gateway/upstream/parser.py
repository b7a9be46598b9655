"""One request's answer as httptools (llhttp) parses it: the limits on its head, what its
framing says, when it is complete, and whether its connection may carry another request.

What may be reused (Exchange.reusable): a connection whose answer ended exactly
where its framing said, with nothing after it, from an upstream that did not ask to
close it. Bytes after an answer are never read as the next request's answer.

An answer that does not arrive whole ends as a `Broken` (gateway/upstream/response.py) with
the reason and the status received, if any: forward (or the answer's BodyStream)
raises it as OutcomeLost.
"""

from __future__ import annotations

import asyncio

import httptools

from gateway.headers import response_headers
from gateway.records import is_status
from gateway.upstream.response import (
    BodyStream,
    Broken,
    Carrier,
    ResponseBudget,
    UpstreamResponse,
    after_status,
)

#: The most a response's head may hold: its status line and header fields, interim
#: (1xx) answers' included, and its trailer section (dropped, but read). A head is
#: metadata: nginx refuses an upstream head over its proxy_buffer_size (4 or 8 KiB)
#: and node over 16 KiB, httpx (h11) buffers at most 16 KiB; 64 KiB leaves room for
#: large cookies and link headers while one answer's head costs kilobytes, not the
#: megabytes an upstream could send. Counted as the bytes arrive, so a head that
#: never ends is cut after this much plus one read.
MAX_RESPONSE_HEAD = 64 * 1024
#: The most header fields (and trailer fields) a response may carry: Apache allows
#: 100 per request (LimitRequestFields); 256 leaves room for many Set-Cookie lines.
#: Each field costs Python objects, so this bounds a head of many short lines that
#: fits in MAX_RESPONSE_HEAD.
MAX_RESPONSE_FIELDS = 256
#: What a chunk's size line and the CRLF after its data may take without counting
#: toward MAX_RESPONSE_HEAD: 16 hex digits, CRLF, CRLF and room for a short
#: extension. (Chunk extensions are hardly ever sent; long ones count as head.)
CHUNK_FRAMING = 64


def _framing(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool, list[bytes]]:
    """What a head says about its body: the Content-Length (None without one), whether
    the body is chunked, and the transfer codings, over every Transfer-Encoding line
    (empty: none was sent)."""
    length: int | None = None
    codings: list[bytes] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            length = int(value)  # llhttp has checked it is a number
        elif lowered == b"transfer-encoding":
            codings += [token.strip().lower() for token in value.split(b",")]
    return length, b"chunked" in codings, codings


class _Stop(Exception):
    """Raised in a parser callback to stop the parser (httptools wraps it)."""


class Exchange:
    """One request's answer as httptools parses it; its callbacks are the parser's."""

    __slots__ = (
        "budget",
        "chunk_events",
        "chunks",
        "complete",
        "connection",
        "credit",
        "error",
        "fields",
        "framing",
        "future",
        "head",
        "headers",
        "hold",
        "in_body",
        "keep_alive",
        "limit",
        "out_of_step",
        "parser",
        "read_to_end",
        "size",
        "status",
        "stream",
        "until_close",
    )

    def __init__(self, future: asyncio.Future[UpstreamResponse], head: bool, limit: int) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.future = future
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.head = head
        self.until_close = False  # no Content-Length, not chunked: the body ends at EOF
        self.in_body = False  # the head is read; what is cut off now is the body
        self.complete = False
        self.keep_alive = False
        #: something followed the answer, or its framing disagreed with its status:
        #: the connection's next bytes cannot be trusted to answer the next request
        self.out_of_step = False
        self.fields = 0  # header and trailer fields, interim answers' included
        self.framing = 0  # bytes read that were not body (head, trailers); see measure
        self.chunk_events = 0  # chunk size lines and chunk ends parsed
        self.credit = 0  # framing allowance left from the last read (see measure)
        self.error: Broken | None = None
        # Set by forward when the body may be streamed (see BodyStream).
        self.connection: Carrier | None = None
        self.budget: ResponseBudget | None = None
        self.hold = limit
        self.read_to_end = False
        self.stream: BodyStream | None = None

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        # llhttp goes on parsing after a message's end within one feed_data: a second
        # response in the same read would run its callbacks into this exchange.
        if self.complete:
            self.out_of_step = True
            raise _Stop

    def on_status(self, reason: bytes) -> None:
        # The status line is in, the headers may never be: it already says the
        # request arrived, and it goes on the record.
        status = self.parser.get_status_code()
        if not is_status(status):
            self._not_a_status(status)
        if status >= 200:
            self.status = status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields += 1
        if self.fields > MAX_RESPONSE_FIELDS:
            self.error = self._over_head(f"has more than {MAX_RESPONSE_FIELDS} header fields")
            raise _Stop
        if not self.in_body:
            self.headers.append((name, value))
        # else a trailer field (after the last chunk): it was never part of the head
        # the upstream's framing and the caller's checks were about; dropped

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if not is_status(status):
            self._not_a_status(status)  # a status line without a reason phrase
        length, chunked, coded = _framing(self.headers)
        if status < 200:
            if length or coded:
                # llhttp reads a body for some 1xx codes and not others; h11 and RFC
                # 9110 never do: where the answer starts cannot be known.
                self.error = Broken(
                    f"the upstream's interim {status} answer announces a body, which a "
                    "1xx answer cannot have; the request was sent, its outcome is unknown",
                    self.status,
                )
                raise _Stop
            self.headers = []  # 100 Continue, 103 Early Hints: the answer follows
            return
        self.status = status
        self.in_body = True
        if coded and coded != [b"chunked"]:
            # gzip under chunked would be stored decoded once and labelled as nothing
            # (its Transfer-Encoding is hop-by-hop); chunked twice is read once by
            # llhttp: either way the body is not what the upstream meant.
            self.error = Broken(
                f"the upstream's answer uses Transfer-Encoding {b', '.join(coded).decode()!r}; "
                "the gateway reads chunked alone; the request was sent, its outcome is unknown",
                self.status,
            )
            raise _Stop
        if self.head:
            self._finish(keep_alive=False)  # no body follows; the connection is not reused
            raise _Stop
        if status in (204, 304) and (length or coded):
            # Taken without a body, as RFC 9110 says; but an upstream that sent one
            # would have its next bytes read as the next request's answer.
            self.out_of_step = True
        if length is not None and length > self.limit:
            self._fail_too_large()
        self.until_close = length is None and not chunked and status not in (204, 304)

    def on_chunk_header(self) -> None:
        self.chunk_events += 1

    def on_chunk_complete(self) -> None:
        self.chunk_events += 1

    def on_body(self, body: bytes) -> None:
        size = self.size = self.size + len(body)
        if size > self.limit:
            self._fail_too_large()
        if self.stream is not None:
            self.stream.push(body)
            return
        budget = self.budget
        if budget is not None:
            if size > self.hold or budget.held + len(body) > budget.limit:
                self._start_stream(body)
                return
            budget.held += len(body)
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.status is None:
            return  # the end of a 1xx answer
        self._finish(keep_alive=self.parser.should_keep_alive())

    # -- decisions ----------------------------------------------------------------------

    def measure(self, read: int, size_before: int, events_before: int) -> None:
        """Count what one read added to the head (and trailers): its bytes that were
        not body, less an allowance of CHUNK_FRAMING for each chunk's size line and
        for its end; what a read leaves of the allowance, at most one CHUNK_FRAMING,
        covers a size line or CRLF split across reads. Per read, not per byte: llhttp
        has no limit of its own and httptools buffers a header line whole, so this
        is what bounds a head (or trailer section) that never ends."""
        allowance = self.credit + CHUNK_FRAMING * (self.chunk_events - events_before)
        excess = read - (self.size - size_before) - allowance
        if excess <= 0:
            self.credit = min(CHUNK_FRAMING, -excess)
            return
        self.credit = 0
        self.framing += excess
        if self.framing > MAX_RESPONSE_HEAD and not self.complete and self.error is None:
            self.error = self._over_head(f"is over {MAX_RESPONSE_HEAD} bytes")

    def reusable(self) -> bool:
        """Whether the connection may carry another request after this answer: only
        if the upstream did not ask to close it, the answer ended where its framing
        said and nothing followed it."""
        return self.complete and self.keep_alive and not self.out_of_step and self.error is None

    # -- outcomes -----------------------------------------------------------------------

    def _over_head(self, what: str) -> Broken:
        part = "trailer section" if self.in_body else "head"
        return Broken(
            f"the upstream's response {part} {what}; the request was sent, its outcome is unknown",
            self.status,
        )

    def _not_a_status(self, status: int) -> None:
        # llhttp reads any three digits. RFC 9110 15 has a client treat a code outside
        # 100..599 as a 5xx, which would free the key for a retry; but the request was
        # sent, and what came back cannot be read as an answer: its outcome is unknown.
        self.error = Broken(
            f"the upstream answered {status:03d}, which is no HTTP status (100 to 599); "
            "the request was sent, its outcome is unknown",
            None,
        )
        raise _Stop

    def _fail_too_large(self) -> None:
        self.error = Broken(
            f"the upstream answered {self.status} with a body larger than "
            f"max_response_body ({self.limit} bytes); reading stopped",
            self.status,
        )
        raise _Stop

    def _finish(self, *, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive
        if self.stream is not None:
            self.stream.end()
        elif not self.future.done():
            assert self.status is not None
            body = b"".join(self.chunks)  # one chunk: that very object, not a copy
            held = len(body) if self.budget is not None else 0
            self.future.set_result(
                UpstreamResponse(self.status, response_headers(self.headers), body, None, held)
            )

    def _start_stream(self, body: bytes) -> None:
        """The body outgrew what is read whole, or the budget has no room for it: hand
        the response on now, its body to follow as it arrives."""
        budget, status = self.budget, self.status
        assert budget is not None and status is not None and self.connection is not None
        if self.future.done():
            return  # forward gave up (its deadline): the connection is being closed
        if self.size <= self.hold:
            budget.full("streamed")  # the budget, not the size, made it a stream
        chunks, self.chunks = self.chunks, []
        chunks.append(body)
        budget.held += len(body)
        stream = self.stream = BodyStream(self, chunks, self.size, status, budget)
        self.future.set_result(
            UpstreamResponse(status, response_headers(self.headers), b"", stream)
        )
        stream.check_pause()

    def fail(self, error: Broken) -> None:
        if self.stream is not None:
            self.stream.fail(error)
        elif not self.future.done():
            self.future.set_exception(error)

    def end_of_stream(self) -> None:
        """The upstream ended the stream cleanly (see _closed_cleanly): the end of a
        body delimited by the connection's end."""
        if self.until_close and not self.complete and self.error is None:
            self._finish(keep_alive=False)

    def let_go(self) -> None:
        """forward gives up on this exchange (failed, past its deadline, or cancelled
        before its caller got the answer): free what it holds."""
        budget = self.budget
        future = self.future
        if future.done() and not future.cancelled() and future.exception() is None:
            response = future.result()  # an answer nobody will write
            if response.held and budget is not None:
                budget.release(response.held)
            if response.rest is not None:
                response.rest.close()
        elif budget is not None and self.chunks:
            budget.release(sum(map(len, self.chunks)))  # a body that never came whole
            self.chunks = []
        if not self.complete and self.connection is not None:
            self.connection.detach()
            self.connection.close()  # an exchange cut short leaves the connection unusable

    def connection_lost(self, exc: Exception | None) -> None:
        if self.complete:
            return
        after = after_status(self.status)
        if self.error is not None:
            self.fail(self.error)
        elif self.in_body:
            detail = "" if exc is None else f": {type(exc).__name__}: {exc}"
            if exc is None and self.until_close:
                # A clean end would have ended it (end_of_stream): this is a TLS
                # connection closed under its session, without close_notify.
                detail = ": the connection ended without TLS close_notify"
            self.fail(Broken(f"the body was cut off{after}{detail}", self.status))
        elif exc is not None:
            self.fail(Broken(f"connection broke{after}: {type(exc).__name__}: {exc}", self.status))
        else:
            self.fail(Broken(f"the upstream closed the connection{after}", self.status))
