"""A key's history as a timeline a person reads: what happened, when, who, and why.

The store records each move of a key as an event (gateway/records.py's legend,
`Record.to_json()["history"]`): `forwarded` or `accepted`, `attempt`, `unknown` and
why, each `reconcile` check and its answer, `parked`, `claimed` by whom (and from
whom, for a takeover), `resolved` by whom, how and with what note, `completed`,
`released`, `retry_scheduled`. Each becomes one entry; fields this module does not
know are shown as they are, so an event added later is never hidden.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.records import Record

_WHAT = {
    "accepted": "Accepted for delivery (202)",
    "forwarded": "Forwarded to the upstream",
    "attempt": "Delivery attempt",
    "unknown": "Outcome unknown",
    "reconcile": "Checked with the upstream",
    "parked": "Parked for an operator",
    "claimed": "Claimed",
    "resolved": "Resolved",
    "completed": "Completed",
    "released": "Released",
    "retry_scheduled": "Retry scheduled",
}

#: Fields drawn in the entry's own words, not listed again as details.
_SHOWN = {"at_ms", "event", "operator", "reason", "note", "takeover_from", "outcome"}

#: How the events say who acted: the operator's name, and through what.
_VIA = {
    "shared_token": "through the shared admin token",
    "identity_header": "through the single-sign-on proxy",
}


@dataclass(frozen=True, slots=True)
class Entry:
    at_ms: int
    event: str
    what: str
    who: str
    why: str
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


def entry(event: dict[str, Any]) -> Entry:
    name = str(event.get("event", ""))
    what = _WHAT.get(name, name.replace("_", " ").capitalize() or "Event")
    who = str(event.get("operator") or "")
    why = str(event.get("reason") or "")
    if name == "claimed" and event.get("takeover_from"):
        what = f"Taken over from {event['takeover_from']}"
    if name == "resolved":
        outcome = event.get("outcome", "")
        what = {"done": "Resolved done", "retry": "Resolved retry"}.get(outcome, what)
        note = str(event.get("note") or "")
        why = f"Note: {note}" if note else "No note"
    if name == "completed" and event.get("origin") not in (None, "upstream"):
        what = f"Completed ({event['origin']})"
    details = tuple(
        (field.replace("_", " "), _VIA.get(str(value), fields(value)))
        for field, value in event.items()
        if field not in _SHOWN and value not in (None, "")
    )
    return Entry(int(event.get("at_ms", 0)), name, what, who, why, details)


def timeline(record: Record) -> list[Entry]:
    """Every event of the record, oldest first (the record's own order)."""
    return [entry(event) for event in record.to_json()["history"]]
