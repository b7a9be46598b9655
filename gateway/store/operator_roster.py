"""The operator roster a store keeps: since when each way an operator signs in to the
console is valid, one answer for every replica (gateway/roster.py is its reader).

A console cookie names an operator and a fingerprint of the credential that signed
them in (console/session.py), and both can come back: an operator removed and added
again with the very token they had, a token rotated and rotated back. So the store
keeps, per entry (an operator's way of signing in), the time from which its sessions
are valid, renewed whenever the entry joins the roster or its credential changes; a
cookie carries the time its entry had when it was issued, and counts only while the
roster still gives that time. Times are the store's, never a replica's, and each one
given out is later than every one before it, so an old time never matches again.

Part of the store interface (Store, store/base.py, takes it on): memory.py's MemoryRoster,
redis/roster.py and postgres/roster.py implement it, and the contract suite
(tests/test_store_contract.py) holds each to it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RosterEntry:
    #: what the config says of the entry's credential (opaque to the store)
    mark: str
    #: the store's time (ms) from which the entry's console sessions are valid
    since_ms: int


class OperatorRoster(abc.ABC):
    @abc.abstractmethod
    async def record_roster(self, marks: Mapping[str, str]) -> dict[str, RosterEntry]:
        """Make `marks` (an entry's name -> its mark) the roster, in one atomic step,
        and return the roster as it then is.

        An entry the roster did not hold, or held with another mark, is valid from the
        store's now; one it held with the same mark keeps its time; an entry not given
        leaves the roster. A time given out is later than every time given out before
        under the store's prefix, whatever the clock does (a failover to a server whose
        clock is behind), so no entry gets a time it had before. Two processes
        recording at once are applied one after the other, each whole. Raises
        StoreError if the store does not answer (nothing, or all of it, was done)."""

    @abc.abstractmethod
    async def roster(self) -> dict[str, RosterEntry]:
        """The roster as the last `record_roster` (by any process) left it; empty if
        none ever ran. Reads only."""
