"""A key's history as a timeline a person reads: what happened, when, who, and why.

The store records each move of a key as an event (gateway/records.py's legend,
`Record.to_json()["history"]`): `forwarded` or `accepted`, `attempt`, `unknown` and
why, each `reconcile` check and its answer, `parked`, `claimed` by whom (and from
whom, for a takeover), `resolved` by whom, how and with what note, `completed`,
`released`, `retry_scheduled`, `put_back` (a pick the store's replicas did not
confirm, undone unsent), `unreadable` (a history that was damaged in the store). Each
becomes one entry, worded by `records.describe_event` (the words `keys show` prints
too); fields it does not say are listed beside it, so an event or field added later
is never hidden.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.records import Record, describe_event

#: Fields records.describe_event already says in its words; the rest are listed.
_SAID = {
    "at_ms", "event", "operator", "reason", "note", "takeover_from", "outcome", "run_id",
    "origin", "result", "answer",
}  # fmt: skip

#: How the events say through what an operator acted.
_VIA = {
    "shared_token": "through the shared admin token",
    "identity_header": "through the single-sign-on proxy",
}


@dataclass(frozen=True, slots=True)
class Entry:
    at_ms: int
    event: str
    #: the event in words, as `keys show` says it (records.describe_event)
    what: str
    #: the operator who acted, if one did
    who: str
    details: tuple[tuple[str, str], ...]


def fields(value: Any) -> str:
    """A value as a person reads it: a mapping as `name value, ...` (unset ones left
    out), anything else as its text (or JSON)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ", ".join(
            f"{str(k).replace('_', ' ')} {fields(v)}"
            for k, v in sorted(value.items())
            if v not in (None, "")
        )
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


#: The events describe_event words; of any other, it lists every field itself.
_KNOWN = {
    "forwarded", "accepted", "unknown", "parked", "released", "completed", "reconcile",
    "claimed", "resolved", "attempt", "retry_scheduled", "put_back", "unreadable",
}  # fmt: skip


def entry(event: dict[str, Any]) -> Entry:
    said = describe_event(event)
    known = event.get("event") in _KNOWN
    details = tuple(
        (name.replace("_", " "), _VIA.get(str(value), fields(value)))
        for name, value in event.items()
        if known
        and name not in _SAID
        and value not in (None, "")
        # an attempt's number is in its words; a parked delivery's last attempt is not
        and not (name == "attempt" and event.get("event") == "attempt")
    )
    what = said[:1].upper() + said[1:]
    return Entry(
        int(event.get("at_ms", 0)),
        str(event.get("event", "")),
        what,
        str(event.get("operator") or ""),
        details,
    )


def timeline(record: Record) -> list[Entry]:
    """Every event of the record, oldest first (the record's own order)."""
    return [entry(event) for event in record.to_json()["history"]]
