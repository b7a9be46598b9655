"""The pause of an async route whose upstream refuses: one row per route, kept in the
store so every replica and worker reads and changes the same one.

A row holds the route's consecutive attempts that were refused or never sent
(`failures`), whether it is paused (`since_ms`, 0 when not), who paused it or last
resumed it (`by`: "auto" or an operator's name), why, and when the next probe may go
out (`probe_ms`). Every change is one `PauseMove` applied by `apply_move` (the Redis
store's lua/pause.lua is the same rules in Lua) in one atomic step on the row, so two
workers never both take one probe and a count is never lost.

The moves:

- "refused": an attempt was refused or never sent (connect refused, 5xx, 429): one
  more failure; at `pause_after` (0: never) a route not paused is paused by "auto",
  its first probe `probe_ms` from now.
- "answered": the upstream answered (a status that is not 5xx or 429): the count is
  0, and a pause by "auto" is lifted. A manual pause stays until a manual resume.
- "probe": take the probe of an automatic pause whose time has come: the next probe
  is `probe_ms` from now, and the verdict is "probe" for this caller alone; "closed"
  for anyone else, and for a manual pause (an operator's pause sends nothing).
- "pause": an operator pauses the route (`by`, `why`); a pause by "auto" becomes the
  operator's, keeping its since.
- "resume": an operator resumes it (`by`, `why`): not paused, the count 0.

An unknown outcome (sent, then no answer) is no move: it says nothing of whether the
upstream takes connections, so the count stays as it is.

Part of the store interface (Store, store/base.py, takes it on); the contract suite
(tests/test_store_contract.py) holds every store to it.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Literal

AUTO = "auto"

MoveName = Literal["refused", "answered", "probe", "pause", "resume"]
Verdict = Literal["open", "probe", "closed"]


@dataclass(frozen=True, slots=True)
class PauseState:
    """A route's row, as of the store's `now_ms`."""

    route: str
    failures: int = 0
    #: the store's time (ms) the route was paused, 0 when it is not
    since_ms: int = 0
    #: who paused it, or who last resumed it: "auto" or an operator's name
    by: str = ""
    why: str = ""
    #: when an automatic pause's next probe may go out (ms); 0 for a manual pause
    probe_ms: int = 0
    #: the store's time (ms) of the last pause or resume
    changed_ms: int = 0
    now_ms: int = 0

    @property
    def paused(self) -> bool:
        return self.since_ms > 0

    @property
    def verdict(self) -> Verdict:
        """What a worker may do now without changing the row: "open" (not paused),
        "probe" (an automatic pause's probe is due: take it with a "probe" move), or
        "closed"."""
        if not self.paused:
            return "open"
        if self.by == AUTO and self.now_ms >= self.probe_ms:
            return "probe"
        return "closed"


@dataclass(frozen=True, slots=True)
class PauseMove:
    move: MoveName
    #: an operator's name ("pause", "resume")
    by: str = ""
    why: str = ""
    #: consecutive failures that pause the route ("refused"); 0: never
    pause_after: int = 0
    #: between probes, ms ("refused", "probe")
    probe_every_ms: int = 1000


def apply_move(state: PauseState, move: PauseMove, now: int) -> tuple[PauseState, Verdict]:
    """The row after `move` at the store's `now`, and the verdict for its caller
    (the module docstring's rules)."""
    s = dataclasses.replace(state, now_ms=now)
    if move.move == "refused":
        s = dataclasses.replace(s, failures=s.failures + 1)
        if not s.paused and move.pause_after > 0 and s.failures >= move.pause_after:
            s = dataclasses.replace(
                s,
                since_ms=now,
                by=AUTO,
                why=move.why,
                probe_ms=now + move.probe_every_ms,
                changed_ms=now,
            )
    elif move.move == "answered":
        s = dataclasses.replace(s, failures=0)
        if s.paused and s.by == AUTO:
            s = dataclasses.replace(
                s, since_ms=0, probe_ms=0, why="a probe was answered", changed_ms=now
            )
    elif move.move == "probe":
        if s.verdict != "probe":
            return s, s.verdict
        return dataclasses.replace(s, probe_ms=now + move.probe_every_ms), "probe"
    elif move.move == "pause":
        since = s.since_ms if s.paused else now
        s = dataclasses.replace(
            s, since_ms=since, by=move.by, why=move.why, probe_ms=0, changed_ms=now
        )
    else:  # resume
        s = dataclasses.replace(
            s, failures=0, since_ms=0, by=move.by, why=move.why, probe_ms=0, changed_ms=now
        )
    return s, s.verdict


class RoutePauses(abc.ABC):
    @abc.abstractmethod
    async def route_pause(self, route: str) -> PauseState:
        """`route`'s row as of the store's now (a route never changed: failures 0, not
        paused). Reads only: the worker's look before each attempt."""

    @abc.abstractmethod
    async def route_pauses(self) -> dict[str, PauseState]:
        """Every route's row that any move ever wrote, by route, as of the store's now.
        Reads only, O(routes)."""

    @abc.abstractmethod
    async def change_pause(self, route: str, move: PauseMove) -> tuple[PauseState, Verdict]:
        """Apply `move` to `route`'s row (`apply_move`) in one atomic step by the store's
        clock, and return the row after it and the verdict: of two callers taking
        one probe at once, exactly one gets "probe"; moves at once are applied one
        after the other, none lost. Raises StoreError if the store does not answer
        (then nothing, or all of it, was done)."""
