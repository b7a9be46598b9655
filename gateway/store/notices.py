"""Notices between processes, fanned out to local listeners: "this key changed"
(`Notifier`, for waiting duplicates) and "this delivery is due" (`DueFeed`, for the
delivery workers). Both are at-most-once: a store's reconnect may drop some, and
says so (`notify_all`, `lost`), so every listener re-reads the store after."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gateway.records import KeyRef, StoredResponse


class Watch(asyncio.Event):
    """Set when the watched key changed. `completed` holds the fingerprint and
    response of a completion that came with its notice, else None: read the record."""

    def __init__(self) -> None:
        super().__init__()
        self.completed: tuple[str, StoredResponse] | None = None


class Notifier:
    """Per-process fan-out of "this key changed" to local waiters.

    A change is announced to every caller whose `claim` found the record in flight
    (the Redis store publishes only then: most keys never have a waiter).

    A waiter registers *before* it reads the record, so a change that lands between
    the read and the wait is not missed.
    """

    def __init__(self) -> None:
        self._watchers: dict[str, set[Watch]] = {}

    @contextmanager
    def watch(self, digest: str) -> Iterator[Watch]:
        event = Watch()
        watchers = self._watchers.setdefault(digest, set())
        watchers.add(event)
        try:
            yield event
        finally:
            watchers.discard(event)
            if not watchers:
                self._watchers.pop(digest, None)

    def watching(self, digest: str) -> bool:
        return digest in self._watchers

    def notify(self, digest: str, completed: tuple[str, StoredResponse] | None = None) -> None:
        """Wake the key's watchers; `completed` (fingerprint, response) when the
        change was a completion whose response came with the notice."""
        for event in self._watchers.get(digest, ()):
            if completed is not None:
                event.completed = completed
            event.set()

    def notify_all(self) -> None:
        """After a reconnect, when notifications may have been lost."""
        for watchers in self._watchers.values():
            for event in watchers:
                event.set()


@dataclass(frozen=True, slots=True)
class Due:
    """A hint: the delivery at `ref` is (or will be) due at `due_ms`, store clock. From
    a notice, `origin` is the replica that queued or scheduled it ("" from a scan, or
    when nobody in particular did); `now_ms` is the store's clock when it was said.
    A hint can be stale: `pick` decides."""

    ref: KeyRef
    due_ms: int
    now_ms: int = 0
    origin: str = ""


_Listener = tuple[Callable[[Due], None], Callable[[str], None], Callable[[], None]]


def _ignore(_: object) -> None:
    return None


class DueFeed:
    """Per-process fan-out of delivery notices to the workers that listen: "due"
    (queued or scheduled), "taken" (picked by someone) and "lost" (notices may have
    been missed: rescan). At-most-once, like `Notifier`; callbacks run at once, never
    awaited, so they must only record the hint and wake someone.

    A store may hear "due" and "taken" only while a listener wants them (`listening`;
    it is told of a change through `changed`): a process that delivers nothing (no
    async route, or `server.max_deliveries: 0`) then never reads one. Listeners with
    `notices=False` get `lost` only. A store reports `lost` whenever it (re)subscribes,
    so listeners rescan what was said while it was not hearing."""

    def __init__(self) -> None:
        self._listeners: list[_Listener] = []
        self._notices = 0  # listeners that want due and taken
        #: Called when `listening` turns true or false (set by the store).
        self.changed: Callable[[], None] = lambda: None

    @property
    def listening(self) -> bool:
        return self._notices > 0

    def listen(
        self,
        on_due: Callable[[Due], None],
        on_taken: Callable[[str], None],
        on_lost: Callable[[], None],
        *,
        notices: bool = True,
    ) -> Callable[[], None]:
        """Register callbacks; returns the call that removes them."""
        entry = (on_due, on_taken, on_lost) if notices else (_ignore, _ignore, on_lost)
        self._listeners.append(entry)
        self._count(notices, 1)

        def unlisten() -> None:
            if entry in self._listeners:
                self._listeners.remove(entry)
                self._count(notices, -1)

        return unlisten

    def _count(self, notices: bool, step: int) -> None:
        if notices:
            before = self.listening
            self._notices += step
            if self.listening != before:
                self.changed()

    def announce(self, due: Due) -> None:
        for on_due, _, _ in list(self._listeners):
            on_due(due)

    def taken(self, digest: str) -> None:
        for _, on_taken, _ in list(self._listeners):
            on_taken(digest)

    def lost(self) -> None:
        for _, _, on_lost in list(self._listeners):
            on_lost()
