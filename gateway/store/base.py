"""The store interface: one async method per operation on a key's record.

Every method is atomic on one record: it reads and changes the record in one step
(a Lua script on Redis, a critical section with no await in memory). Times come
from the store's clock, never the caller's, so replicas with skewed clocks agree on
leases and ages. Every state change is conditional on the run id (or operator)
that is allowed to make it, and is safe to repeat: a retried command that already
took effect reports success again instead of doing it twice.

Both implementations pass the contract suite in tests/test_store_contract.py.
"""

from __future__ import annotations

import abc
import asyncio
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gateway.records import KeyRef, Record, State, StoredResponse


@dataclass(frozen=True, slots=True)
class StateCount:
    route: str
    state: State
    count: int
    oldest_seconds: float


class Store(abc.ABC):
    """Records of idempotency keys. See the module docstring for the guarantees."""

    def __init__(self) -> None:
        self.notifier = Notifier()

    async def start(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Connect (and subscribe to change notifications). Called once."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Records stay where the store keeps them."""

    async def ping(self) -> None:  # noqa: B027 - an in-process store always answers
        """Raise StoreError unless the store answers."""

    @abc.abstractmethod
    async def claim(
        self, ref: KeyRef, run_id: str, fingerprint: str, lease: float
    ) -> Record | None:
        """Claim `ref` for `run_id`, or read what is there, in one atomic step.

        Returns None when the key was free: it is now `in_flight`, owned by `run_id`,
        with a lease of `lease` seconds from the store's clock. A claim repeated by the
        same run id (a retried command) returns the record it already created, which
        the caller recognises by its run id.

        Otherwise returns the record. An `in_flight` record whose lease has run out
        (the gateway holding it died) is turned `unresolved` first, reason
        "lease_expired": it is never released blind.
        """

    @abc.abstractmethod
    async def complete(
        self, ref: KeyRef, run_id: str, response: StoredResponse, ttl: float
    ) -> bool:
        """Store the response and make the record `completed`, expiring after `ttl`.

        Only the run that claimed the key may complete it, and only from `in_flight`
        or `unresolved` (a late answer is still the answer). Returns False, changing
        nothing, for any other run or state: a stale worker never overwrites a newer
        run, nor a record a person holds. Waiters are notified.
        """

    @abc.abstractmethod
    async def release(self, ref: KeyRef, run_id: str) -> bool:
        """Delete the record so the next request runs, if `run_id` owns it and it is
        `in_flight`. Returns False otherwise. Waiters are notified."""

    @abc.abstractmethod
    async def mark_unresolved(self, ref: KeyRef, run_id: str, reason: str) -> bool:
        """Turn `run_id`'s `in_flight` record `unresolved` with `reason`; it no longer
        expires. Returns False, changing nothing, if `run_id` does not own it in
        `in_flight`. Waiters are notified."""

    @abc.abstractmethod
    async def get(self, ref: KeyRef) -> Record | None:
        """The record, or None. Reads only: an expired lease is reported as it is."""

    async def wait(self, ref: KeyRef, watch: asyncio.Event, timeout: float) -> None:
        """Wait until `watch` (from `notifier.watch`) fires or a jittered fallback
        delay passes, whichever is first, never longer than `timeout`.

        Notifications are at-most-once (a reconnect drops them), so callers re-read
        after this returns; the fallback delay keeps that from becoming a tight loop.
        """
        fallback = min(timeout, random.uniform(0.5, 1.0))
        try:
            async with asyncio.timeout(fallback):
                await watch.wait()
        except TimeoutError:
            pass


class Notifier:
    """Per-process fan-out of "this key changed" to local waiters.

    A waiter registers *before* it reads the record, so a change that lands between
    the read and the wait is not missed.
    """

    def __init__(self) -> None:
        self._watchers: dict[str, set[asyncio.Event]] = {}

    @contextmanager
    def watch(self, digest: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        watchers = self._watchers.setdefault(digest, set())
        watchers.add(event)
        try:
            yield event
        finally:
            watchers.discard(event)
            if not watchers:
                self._watchers.pop(digest, None)

    def notify(self, digest: str) -> None:
        for event in self._watchers.get(digest, ()):
            event.set()

    def notify_all(self) -> None:
        """After a reconnect, when notifications may have been lost."""
        for watchers in self._watchers.values():
            for event in watchers:
                event.set()
