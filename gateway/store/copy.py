"""Copying every record from one store to another, with the gateway stopped
(`idempotency-gateway store copy`): from SQLite to a server store when one machine is
no longer enough, and back.

Records go as they are (store/transfer.py): open ones (in flight, unresolved, parked,
claimed, queued, retrying) with their history, attempts and stored requests, and
completed and released ones with the time they have left. A page at a time: the
records are never all in memory. A destination that already holds records is refused
before anything is written, so a copy never mixes two stores' keys.

Afterwards the copy is checked against the source: per route and state, the records
the destination walks to (those that never expire must all be there; a completed or
released one may have expired meanwhile), and the counts the operator overview reads
(`stats`, `queue_stats`) of both stores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import CopyRefused
from gateway.records import State
from gateway.store.base import Store
from gateway.store.transfer import EXPORT_PAGE

#: States a record may leave by expiring while the copy runs.
EXPIRING = frozenset({State.COMPLETED, State.RELEASED})

Tally = Counter[tuple[str, str]]


@dataclass
class CopyReport:
    #: (route, state) -> records read from the source
    read: Tally = field(default_factory=Counter)
    #: records written to the destination
    written: int = 0
    #: records the destination held already when they came (a record a Redis SCAN
    #: gave twice), not written again nor counted in `read`
    repeated: int = 0
    #: (route, state) -> records the destination holds after the copy
    found: Tally = field(default_factory=Counter)
    #: per route: queued and retrying deliveries, source's and destination's counts
    queues: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    #: what does not match, in words ([] when the copy is whole)
    mismatches: list[str] = field(default_factory=list)


async def tally(store: Store, page: int = EXPORT_PAGE) -> Tally:
    """(route, state) -> how many records `store` holds, walked a page at a time."""
    found: Tally = Counter()
    cursor = ""
    while True:
        exported = await store.export_records(cursor, page)
        found.update((item.record.route, str(item.record.state)) for item in exported.items)
        if not exported.next:
            return found
        cursor = exported.next


async def copy_records(
    source: Store,
    destination: Store,
    *,
    destination_name: str = "the destination",
    page: int = EXPORT_PAGE,
    progress: Callable[[int], None] | None = None,
) -> CopyReport:
    """Copy every record of `source` into `destination` and check the copy. CopyRefused,
    before anything is written, if the destination holds records (named as
    `destination_name`)."""
    if await destination.holds_keys():
        raise CopyRefused(
            f"{destination_name} already holds records: a copy goes into an empty store "
            "only, so two stores' keys never mix. Point --to at an empty store (another "
            "database, Redis prefix or file), or empty this one if its records are not needed"
        )
    report = CopyReport()
    cursor = ""
    while True:
        exported = await source.export_records(cursor, page)
        skipped = set(await destination.import_records(exported.items))
        written = [item.record for item in exported.items if item.record.digest not in skipped]
        report.read.update((record.route, str(record.state)) for record in written)
        report.written += len(written)
        report.repeated += len(exported.items) - len(written)
        if progress is not None:
            progress(report.written)
        if not exported.next:
            break
        cursor = exported.next
    await check(source, destination, report, page)
    return report


async def check(source: Store, destination: Store, report: CopyReport, page: int) -> None:
    """Fill the report's `found`, `queues` and `mismatches`."""
    report.found = await tally(destination, page)
    wrong = report.mismatches
    for place in sorted(report.read.keys() | report.found.keys()):
        read, found = report.read[place], report.found[place]
        route, state = place
        if found > read or (found < read and State(state) not in EXPIRING):
            wrong.append(f"route {route}, {state}: {read} read from the source, {found} copied")
    before = {(s.route, str(s.state)): s.count for s in await source.stats()}
    after = {(s.route, str(s.state)): s.count for s in await destination.stats()}
    for route, state in sorted(before.keys() | after.keys()):
        if before.get((route, state), 0) != after.get((route, state), 0):
            wrong.append(
                f"route {route}, {state}: the source counts {before.get((route, state), 0)}, "
                f"the destination {after.get((route, state), 0)}"
            )
    queues = {q.route: (q.queued, q.retrying) for q in await source.queue_stats()}
    copied = {q.route: (q.queued, q.retrying) for q in await destination.queue_stats()}
    for route in sorted(queues.keys() | copied.keys()):
        was, now = queues.get(route, (0, 0)), copied.get(route, (0, 0))
        report.queues[route] = (*was, *now)
        if was != now:
            wrong.append(
                f"route {route}: the source queues {was[0]} and retries {was[1]} deliveries, "
                f"the destination {now[0]} and {now[1]}"
            )
