"""A listing's pages: where a record stands in one (`place_of`), the cursor that says
where a page starts (`Cursor`, opaque to callers), and the page itself (`Page`,
`page_of`), the same for every store, so a cursor means the same everywhere.

A listing goes by (place, digest), ascending: a record's place is the time it entered
its state, by the store's clock (a queued or retrying delivery's: when it is due; an
in-flight record's: when its lease ends; a completed delivery's: when it completed).
Completed deliveries are listed by route (`check_states`), while their records are
kept (the route's response_ttl); completed keys of sync routes are never listed.
A cursor is the position of a page's first or last row and a direction; the page
after it holds the records whose position follows it when that page is read.

So a walk with `next` (`prev` walks back alike): a record in a listed state throughout
is listed exactly once, and none is skipped or repeated while records around it
change state. A record that changes state during the walk (a takeover too: the claim
starts again) leaves its place: it is listed again at its new, later place if its new
state is listed and the walk has not passed it (seen twice, once per stay, each time
as it was when read), and not again otherwise.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from gateway.records import Record, State, upstream_status

#: Rows in a listing page when the caller does not say, and the most it may ask for.
PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

#: The most rounds of `limit + 1` index entries one page reads past what its filters
#: drop (an in-flight key too young for `older_than`, a record moved since its index
#: was read): a page's cost is bounded whatever the filter drops, and a page that
#: reads its bound before it fills is answered short (even empty), its `next`
#: going on from where the read stopped.
READ_ROUNDS = 4

#: The states whose records the store counts as they change (`stats`, `queue_stats`,
#: and `accept`'s bound): every one a person or a worker waits on. In-flight and
#: settled records are not counted: every request passes through them.
COUNTED_STATES = frozenset(
    {State.UNRESOLVED, State.PARKED, State.CLAIMED, State.QUEUED, State.RETRYING}
)


def place_of(record: Record) -> int:
    """Where a record stands in a listing, by the store's clock (ms): the time it
    entered its state; a queued or retrying delivery, when it is due; an in-flight
    record, when its lease ends."""
    if record.state is State.IN_FLIGHT:
        return record.lease_until_ms
    if record.state in (State.QUEUED, State.RETRYING):
        return record.due_ms
    return record.since_ms or record.created_ms


@dataclass(frozen=True, slots=True)
class Match:
    """What a listing keeps besides its states and route: places in a time range (store
    clock ms, both ends included; 0: no bound), which the indexes serve, and the
    records whose key starts with `key_prefix` (a literal prefix: no character in it is
    a pattern), whose reason holds `reason` (literal text too) and whose upstream status
    (records.upstream_status) is `status`, which a store reads and drops within its
    bound (READ_ROUNDS), as it drops the rest."""

    since_ms: int = 0
    until_ms: int = 0
    key_prefix: str = ""
    status: int | None = None
    reason: str = ""

    @property
    def reads_past(self) -> bool:
        """Whether the store drops records after reading them for this match."""
        return bool(self.key_prefix) or bool(self.reason) or self.status is not None

    def keeps(self, record: Record) -> bool:
        """Whether `record` passes what the indexes cannot serve."""
        if self.key_prefix and not record.key.startswith(self.key_prefix):
            return False
        if self.reason and self.reason not in record.reason:
            return False
        return self.status is None or upstream_status(record) == self.status

    def floor(self) -> int | None:
        """The earliest place listed, or None."""
        return self.since_ms or None

    def ceiling(self, now_ms: int, older_than: float) -> int | None:
        """The latest place listed for a state whose place is its age's start: the
        range's end, or `older_than` seconds before `now_ms`, whichever is earlier."""
        ends = [self.until_ms] if self.until_ms else []
        if older_than > 0:
            ends.append(now_ms - int(older_than * 1000))
        return min(ends) if ends else None


#: A listing's match when it asks for nothing more.
ANY = Match()


def check_states(states: frozenset[State], route: str | None) -> None:
    """ValueError for completed records asked for without a route: a route's completed
    deliveries are an index of their own, and every route's at once would be a walk
    over every route's."""
    if State.COMPLETED in states and route is None:
        raise ValueError("completed deliveries are listed by route: name one")


def listed_completed(record: Record) -> bool:
    """Whether a completed record is filed for listings: a delivery's is."""
    return record.state is State.COMPLETED and record.delivery


class InvalidCursor(ValueError):
    """A cursor no listing gave (mistyped, cut short, or made up)."""


_CURSOR = re.compile(r"([ab]):(0|[1-9][0-9]{0,15}):([0-9A-Za-z_-]{1,64})")


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """A place in a listing's order: (place, digest), compared as a pair."""

    place: int
    digest: str


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a listing page starts: after `position` (forward) or before it (backward,
    the page before). Opaque to callers: `encode` gives the text they pass back."""

    position: Position
    backward: bool = False

    def encode(self) -> str:
        direction = "b" if self.backward else "a"
        text = f"{direction}:{self.position.place}:{self.position.digest}"
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor | None:
        """The cursor `text` names; None for "" (the first page). InvalidCursor for
        anything a listing did not give."""
        if text == "":
            return None
        if len(text) > 128 or not re.fullmatch(r"[0-9A-Za-z_-]+", text):
            raise InvalidCursor("not a cursor a listing gave")
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("ascii")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise InvalidCursor("not a cursor a listing gave") from None
        match = _CURSOR.fullmatch(raw)
        if match is None:
            raise InvalidCursor("not a cursor a listing gave")
        return cls(Position(int(match[2]), match[3]), backward=match[1] == "b")


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a listing, in the listing's order (ascending, whichever way it was
    walked), and the cursors of its neighbours ("" where the walk ends)."""

    records: list[Record]
    #: the page after this one; "" when no record followed this page when it was read
    #: (a page may be short, even empty, with `next` set: its read reached its bound)
    next: str
    #: the page before this one; "" when this page starts the listing
    prev: str
    #: the store's clock when the page was read
    now_ms: int


def page_of(
    found: list[tuple[Position, Record]],
    cursor: Cursor | None,
    limit: int,
    now_ms: int,
    more: bool = False,
    resume: Position | None = None,
) -> Page:
    """A Page from what a store found: up to limit + 1 (position, record) pairs in the
    walk's order (ascending forward, descending backward), the extra one saying that
    more follow; `more` says so too (a store that read limit + 1 entries of its
    indexes and dropped some, moved since, cannot tell that none follows). `resume`
    is the last position a store read when it stopped at its bound (READ_ROUNDS)
    before the page filled: the walk goes on from there. Shared by every store, so
    the cursors mean the same everywhere."""
    if len(found) > limit:
        resume = None  # the page filled: it goes on from its last row
    more = more or len(found) > limit or resume is not None
    rows = found[:limit]
    backward = cursor is not None and cursor.backward
    if backward:
        rows.reverse()
        before_more, after_more = more, True
    else:
        before_more, after_more = cursor is not None, more
    if not rows:
        # An empty page: walking on from where it was asked for finds what arrives.
        if cursor is None and resume is None:
            return Page([], "", "", now_ms)
        on = Cursor(resume) if resume is not None and not backward else None
        back = Cursor(resume, backward=True) if resume is not None and backward else None
        if cursor is not None:
            on = on or (Cursor(cursor.position) if backward else None)
            back = back or (Cursor(cursor.position, backward=True) if not backward else None)
        return Page([], on.encode() if on else "", back.encode() if back else "", now_ms)
    first, last = rows[0][0], rows[-1][0]
    # Stopped at its bound, a page goes on from where its read stopped, past the rows
    # its filters dropped after its last (its first, walked backward).
    if resume is not None:
        first, last = (resume, last) if backward else (first, resume)
    return Page(
        [record for _, record in rows],
        Cursor(last).encode() if after_more else "",
        Cursor(first, backward=True).encode() if before_more else "",
        now_ms,
    )


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"a page holds 1 to {MAX_PAGE_SIZE} records, not {limit}")
    return limit
