"""Since when each operator's console sessions are valid: the store's roster
(store/operator_roster.py), as this process keeps it.

An entry is one way an operator signs in to the console (`Operators.roster`: by their
token, and with the identity header configured, by it), its mark a keyed fingerprint
of the credential behind it. Each process records its config's roster in the store
when it loads one (at start and at every reload) and answers from memory: a console
request waits for the store only when its session is newer than this copy (another
replica recorded a change first). Every replica gets the same answer from the
store, and each reads the roster again every REFRESH seconds, so a replica agrees
with one that reloaded after it (an operator removed there is refused here too,
within REFRESH seconds). A config without a session secret (the console off) leaves
the store's roster alone, and one that names no operator reads nothing.

A config loaded takes effect here at once: an entry it drops or changes has no time
until the store has recorded the new roster, so none of its sessions passes meanwhile
(and none can pass with an old time after it). Configs loaded while the store is down
are recorded in order when it answers, folded into two recordings: what they all
agree on, then the last (an operator removed and added back while the store was down
still comes back with a new time).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from datetime import UTC, datetime
from typing import TypeVar

from gateway.errors import StoreError
from gateway.store.base import Store
from gateway.store.operator_roster import RosterEntry
from gateway.tasks import stop_if_cancelled

log = logging.getLogger("gateway.admin")

#: Seconds between reads of the store's roster.
REFRESH = 3.0

T = TypeVar("T")


class Roster:
    def __init__(self, store: Store) -> None:
        self._store = store
        #: the current config's entries and their marks
        self._marks: dict[str, str] = {}
        #: the store's answer, for the entries whose mark is the config's
        self._known: dict[str, RosterEntry] = {}
        #: while a config's roster waits to be recorded: the entries every config
        #: loaded since the last recording gives with the same mark
        self._agreed: dict[str, str] | None = None
        #: counts the configs loaded: an answer asked for under an older one is stale
        self._loads = 0
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        #: whether the store answered the last time it was asked
        self.reachable = False

    def configure(self, marks: Mapping[str, str] | None) -> None:
        """A config was loaded whose roster is `marks`: record it soon (`run`). None:
        the config has no session secret, so no session is made or accepted here and
        the store's roster is left as it is (other replicas may have one)."""
        if marks is None:
            self._marks, self._known, self._agreed = {}, {}, None
            self._loads += 1
            return
        marks = dict(marks)
        agreed = marks if self._agreed is None else self._agreed
        self._agreed = {entry: mark for entry, mark in agreed.items() if marks.get(entry) == mark}
        self._marks = marks
        self._loads += 1
        self._keep(self._known)
        self._wake.set()

    def since(self, entry: str) -> int | None:
        """The time (ms, the store's) from which `entry`'s sessions are valid; None
        while the store's roster does not give it with the config's mark."""
        known = self._known.get(entry)
        return known.since_ms if known is not None else None

    async def confirmed(self, entry: str) -> int | None:
        """`since`, for a new session: an entry the store's roster does not hold as
        this config has it (the store lost it, or another replica's config differs)
        is recorded first, with the rest of this config's roster. StoreError if the
        store does not answer."""
        if self.since(entry) is None and entry in self._marks:
            if self._agreed is None:
                self._agreed = dict(self._marks)
            await self.record()
        return self.since(entry)

    async def record(self) -> None:
        """Record the configs loaded since the last recording, if any."""
        async with self._lock:
            await self._asking(self._record())

    async def refresh(self) -> None:
        """Record a config's roster that waits, or else read the store's again (not
        while the config names nobody: there is nothing to check)."""
        async with self._lock:
            if self._agreed is not None:
                await self._asking(self._record())
                return
            if not self._marks:
                return
            loads = self._loads
            entries = await self._asking(self._store.roster())
            if loads == self._loads:
                self._keep(entries)

    async def _asking(self, call: Awaitable[T]) -> T:
        """`call`'s answer, noting whether the store answered."""
        try:
            answer = await call
        except StoreError:
            self.reachable = False
            raise
        self.reachable = True
        return answer

    async def _record(self) -> None:
        while self._agreed is not None:
            loads, agreed, marks = self._loads, self._agreed, self._marks
            if agreed != marks:
                await self._store.record_roster(agreed)
            entries = await self._store.record_roster(marks)
            if loads == self._loads:  # else a config came meanwhile: record it too
                self._agreed = None
                self._keep(entries)
                times = [f"{entry} from {_iso(e.since_ms)}" for entry, e in sorted(entries.items())]
                log.info(
                    "operator roster recorded; console sessions count for %s",
                    ", ".join(times) or "nobody (no operators, or the console is off)",
                    extra={"fields": {"action": "roster", "entries": sorted(entries)}},
                )

    def _keep(self, entries: Mapping[str, RosterEntry]) -> None:
        self._known = {
            entry: found for entry, found in entries.items() if self._marks.get(entry) == found.mark
        }

    async def run(self) -> None:
        """Record and read the roster until cancelled: at once when a config is
        loaded, every REFRESH seconds otherwise."""
        failing = False
        while True:
            self._wake.clear()
            try:
                await self.refresh()
                if failing:
                    log.info("operator roster: the store answers again")
                failing = False
            except StoreError as exc:
                if not failing:  # once, not every REFRESH seconds
                    log.warning(
                        "operator roster: the store did not answer (%s); console sessions "
                        "of operators whose entry is not known here are refused until it does",
                        exc,
                    )
                failing = True
            except Exception:
                log.exception("operator roster: reading the store failed")
            stop_if_cancelled()  # a driver may have turned the cancellation into its error
            try:
                async with asyncio.timeout(REFRESH):
                    await self._wake.wait()
            except TimeoutError:
                pass


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
