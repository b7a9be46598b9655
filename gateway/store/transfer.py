"""A record as it leaves one store and enters another (`Store.export_records`,
`Store.import_records`): everything needed to recreate it, its stored values as the
store keeps them.

The response, the status token and a delivery's request are the stored bytes, sealed
as they were (store.encryption_key): a copy never opens them, so the same keys read
them in the new store. Times stay the stores' clocks' (epoch milliseconds); a settled
record's expiry goes as the time it has left, so a copy keeps it and does not restart
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.records import Record

#: Records in an export page when the caller does not say.
EXPORT_PAGE = 500


@dataclass(frozen=True, slots=True)
class ExportedRecord:
    #: the record's fields as stored; its `response`, `unreadable` and `token` are what
    #: the exporting store opened and are not written back (the bytes below are)
    record: Record
    #: the stored response, sealed as stored; None if it has none
    response: bytes | None = None
    #: the status token, sealed as stored; None if it has none
    token: bytes | None = None
    #: a delivery's stored request, sealed as stored; None once it settled
    request: bytes | None = None
    #: milliseconds it has left (completed and released records); None: it never expires
    ttl_ms: int | None = None


@dataclass(frozen=True, slots=True)
class ExportPage:
    items: Sequence[ExportedRecord]
    #: where the next page starts; "" when the walk is done (a page may be short, even
    #: empty, with `next` set)
    next: str = ""
