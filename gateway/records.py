"""What the store keeps about a key: its state, its owner and the response to replay.

Every legal move of a key, in one place (the store scripts enforce these; the
engine and the operator API only ask for them):

    (none)      --claim-->            in_flight   (a run id holds a lease)
    in_flight   --complete(run)-->    completed   (response stored, replayed, expires)
    in_flight   --release(run)-->     (none)      (never sent, or a status not cached)
    in_flight   --unknown(run)-->     unresolved  (sent, answer lost; or lease ran out)
    unresolved  --complete-->         completed   (a late answer, or reconciled done)
    unresolved  --release-->          (none)      (reconciled not done, or policy release)
    unresolved  --park-->             parked      (no conclusive check in time)
    parked      --claim(operator)-->  claimed
    claimed     --claim(force)-->     claimed     (takeover, recorded)
    claimed     --resolve(done)-->    completed
    claimed     --resolve(retry)-->   (none)

Unresolved, parked and claimed records never expire.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class State(StrEnum):
    #: claimed by a run id that holds a lease; the upstream call is under way
    IN_FLIGHT = "in_flight"
    #: the response is stored and replayed to every repeat
    COMPLETED = "completed"
    #: the request was sent but its outcome is unknown; it is never resent blind
    UNRESOLVED = "unresolved"
    #: no conclusive check in time: waits for a person
    PARKED = "parked"
    #: a person has taken it (see `holder`)
    CLAIMED = "claimed"


#: States that need a decision before the key can run again.
OPEN_STATES = frozenset({State.UNRESOLVED, State.PARKED, State.CLAIMED})


@dataclass(frozen=True, slots=True)
class KeyRef:
    """Where a key's record lives: `digest` names it; route and key are for people."""

    digest: str
    route: str
    key: str


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: the body was larger than max_stored_body: repeats get status and headers only
    body_omitted: bool = False
    #: "upstream", "reconciled" or "operator": where the response came from
    origin: str = "upstream"

    def encode(self) -> bytes:
        meta = json.dumps(
            [self.status, self.headers, int(self.body_omitted), self.origin],
            separators=(",", ":"),
        ).encode()
        return meta + b"\n" + self.body

    @classmethod
    def decode(cls, data: bytes) -> StoredResponse:
        meta, _, body = data.partition(b"\n")
        status, headers, omitted, origin = json.loads(meta)
        return cls(
            status=status,
            headers=tuple((k, v) for k, v in headers),
            body=body,
            body_omitted=bool(omitted),
            origin=origin,
        )


@dataclass(frozen=True, slots=True)
class Record:
    """A snapshot of one key's record, as the store returned it."""

    digest: str
    route: str
    key: str
    state: State
    run_id: str
    fingerprint: str
    created_ms: int
    #: the store's clock when this snapshot was read, so ages need no local clock
    now_ms: int
    lease_until_ms: int = 0
    response: StoredResponse | None = None
    reason: str = ""  # why it is unresolved
    since_ms: int = 0  # when it entered its current state
    holder: str = ""  # the operator holding a claimed record
    reconcile: dict[str, Any] = field(default_factory=dict)  # last check and its answer
    history: tuple[dict[str, Any], ...] = ()

    @property
    def age(self) -> float:
        return max(0, self.now_ms - self.created_ms) / 1000

    @property
    def state_age(self) -> float:
        return max(0, self.now_ms - (self.since_ms or self.created_ms)) / 1000

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "route": self.route,
            "key": self.key,
            "digest": self.digest,
            "state": str(self.state),
            "run_id": self.run_id,
            "age_seconds": round(self.age, 3),
            "state_age_seconds": round(self.state_age, 3),
            "created_ms": self.created_ms,
        }
        if self.reason:
            doc["reason"] = self.reason
        if self.holder:
            doc["holder"] = self.holder
        if self.reconcile:
            doc["reconcile"] = self.reconcile
        if self.response is not None:
            doc["response"] = {
                "status": self.response.status,
                "origin": self.response.origin,
                "body_omitted": self.response.body_omitted,
            }
        doc["history"] = list(self.history)
        return doc
