"""What the store keeps about a key: its state, its owner and the response to replay.

Every legal move of a key, in one place (the store scripts enforce these; the
engine, the reconciler and the operator API only ask for them):

    (none)|released --claim-->          in_flight   (a run id holds a lease)
    in_flight   --complete(run)-->      completed   (response stored, replayed, expires)
    in_flight   --release(run)-->       (none)      (never sent, or a status not cached)
    in_flight   --unknown(run)-->       unresolved | parked (per route policy)
    in_flight   --lease ran out-->      unresolved | parked | released (per route policy)
    unresolved  --complete(run)-->      completed   (a late answer)
    unresolved  --check: done-->        completed   (the upstream says it ran)
    unresolved  --check: not done-->    released    (the upstream says it did not)
    unresolved  --check: inconclusive-> unresolved, or parked after park_after
    unresolved|parked|claimed --operator claim--> claimed (force: a recorded takeover)
    claimed     --resolve(holder) done--> completed
    claimed     --resolve(holder) retry-> released

Delivery records (made by `accept`, `Record.delivery`; routes with delivery: async)
hold their request, stored apart, until they settle:

    (none)|released --accept(run)-->       queued      (request stored, due now; caller got 202)
    queued|retrying (due) --pick(run')-->  in_flight   (attempt n+1: a new run id, a lease)
    queued|retrying --pick, none left-->   parked      (the attempt limit was lowered)
    in_flight   --complete(run')-->        completed   (request deleted)
    in_flight   --retry_later(run', delay)-> retrying  (never sent, or a status not cached)
    in_flight   --retry_later(run', none)--> parked    (attempts exhausted)
    in_flight   --unknown|lease ran out--> unresolved | parked (per policy; never retried)
    unresolved  --check: not done-->       retrying    (parked when no attempt is left)
    claimed     --resolve(holder) retry--> queued      (attempts start again from 0)

Every other move above applies to delivery records unchanged (a late answer, check
done, operator claim and takeover, resolve done); each one that settles the key
deletes its request in the same step. An expired delivery lease under policy
`release` becomes unresolved: what a caller was told is accepted is never dropped.

Unresolved, parked, claimed, queued and retrying records never expire. A released
record is a tombstone that keeps its history until its ttl; the next claim (or
accept) carries it on.
"""

from __future__ import annotations

import _json
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
    #: decided "run it again" by a check or a person; the next request runs it
    RELEASED = "released"
    #: a delivery accepted (202) and waiting for its first attempt
    QUEUED = "queued"
    #: a delivery whose last attempt was never sent or refused: due again at `due_ms`
    RETRYING = "retrying"


#: States that need a decision before the key can run again.
OPEN_STATES = frozenset({State.UNRESOLVED, State.PARKED, State.CLAIMED})

#: Deliveries waiting for an attempt (neither counts among the open states).
QUEUE_STATES = frozenset({State.QUEUED, State.RETRYING})


@dataclass(frozen=True, slots=True)
class KeyRef:
    """Where a key's record lives: `digest` names it; route and key are for people."""

    digest: str
    route: str
    key: str


def is_success(status: int) -> bool:
    """Whether an upstream's answer is the route's success: below 500. One rule for the
    `_last_success_timestamp_seconds` gauge (outbound.py) and Store.last_successes,
    since the overview shows the later of the two."""
    return status < 500


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
        meta = _meta([self.status, self.headers, int(self.body_omitted), self.origin])
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


def _unstorable(value: object) -> Any:
    raise TypeError(f"{type(value).__name__} cannot be stored")


#: What json.dumps(value, separators=(",", ":")) writes, from the C encoder built once:
#: json's own encode() builds one on every call, with a dict of the containers seen
#: (a guard against cycles, which tuples of strings and numbers cannot have). Every
#: completion and every accepted request encodes one (tests/test_redis_record.py
#: checks the two agree).
_META_CHUNKS = _json.make_encoder(
    None, _unstorable, _json.encode_basestring_ascii, None, ":", ",", False, False, True
)


def _meta(value: list[Any]) -> bytes:
    return "".join(_META_CHUNKS(value, 0)).encode()


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """A delivery's request, as it was accepted, to be sent at each attempt."""

    method: str
    #: the path as matched and forwarded, with "?" and the query if there was one
    target: str
    #: as forwarded at acceptance, minus delivery.drop_headers and the key header
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def encode(self) -> bytes:
        return _meta([self.method, self.target, self.headers]) + b"\n" + self.body

    @classmethod
    def decode(cls, data: bytes) -> StoredRequest:
        meta, _, body = data.partition(b"\n")
        method, target, headers = json.loads(meta)
        if not isinstance(method, str) or not isinstance(target, str):
            raise TypeError("method and target must be text")
        return cls(method, target, tuple((k, v) for k, v in headers), body)


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
    #: why the stored response cannot be read (see gateway.encryption); it stays stored
    unreadable: str = ""
    reason: str = ""  # why it is unresolved
    since_ms: int = 0  # when it entered its current state
    holder: str = ""  # the operator holding a claimed record
    holder_since_ms: int = 0
    check_lock_ms: int = 0  # a check of the upstream holds the record until then
    last_check_ms: int = 0
    reconcile: dict[str, Any] = field(default_factory=dict)  # last check and its answer
    history: tuple[dict[str, Any], ...] = ()
    #: made by `accept`: a delivery, whose request the store keeps until it settles
    delivery: bool = False
    attempts: int = 0  # delivery attempts started
    due_ms: int = 0  # when a queued or retrying delivery is due
    #: the last delivery attempt that did not complete it: result, status, error
    last_attempt: dict[str, Any] = field(default_factory=dict)
    #: the status URL's token, opened ("" if it cannot be); never in to_json()
    token: str = field(default="", repr=False)

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
            doc["holder_since_ms"] = self.holder_since_ms
        if self.reconcile:
            doc["reconcile"] = self.reconcile
        if self.unreadable:
            doc["response"] = {"unreadable": self.unreadable}
        if self.response is not None:
            doc["response"] = {
                "status": self.response.status,
                "origin": self.response.origin,
                "body_omitted": self.response.body_omitted,
            }
        if self.delivery:
            doc["delivery"] = {
                "attempts": self.attempts,
                "next_attempt_ms": self.due_ms or None,
                "last_attempt": self.last_attempt,
            }
        # The current run's start is implied by `created_ms`, not stored twice; a
        # history carried over from released runs comes before it. A delivery's
        # run id changes at each attempt: each attempt's event names its own.
        created: dict[str, Any] = {"at_ms": self.created_ms, "event": "accepted"}
        if not self.delivery:
            created = {"at_ms": self.created_ms, "event": "forwarded", "run_id": self.run_id}
        doc["history"] = sorted([*self.history, created], key=lambda e: int(e["at_ms"]))
        return doc


def describe_event(event: dict[str, Any]) -> str:
    """One history event in words, for a timeline (the console's and `keys show`'s):
    who did what, and why, from the fields the store records with it."""
    kind, get = str(event.get("event", "")), event.get
    who = get("operator") or ""
    if kind == "forwarded":
        return f"forwarded to the upstream (run {get('run_id', '')})"
    if kind == "accepted":
        return "accepted for delivery (202)"
    if kind == "unknown":
        return f"outcome unknown: {get('reason', '')}"
    if kind in ("parked", "released"):
        return f"{kind}: {get('reason', '')}" if get("reason") else kind
    if kind == "completed":
        return f"completed (response from the {get('origin', 'upstream')})"
    if kind == "reconcile":
        answer = get("answer")
        said = f"; it answered {json.dumps(answer)}" if answer not in (None, "", {}) else ""
        return f"checked with the upstream: {get('result', '')}{said}"
    if kind == "claimed":
        if get("takeover_from"):
            return f"taken over by {who} from {get('takeover_from')}"
        return f"claimed by {who}"
    if kind == "resolved":
        note = f": {get('note')}" if get("note") else ""
        return f"resolved {get('outcome', '')} by {who}{note}"
    if kind == "attempt":
        return f"delivery attempt {get('attempt', '')} (run {get('run_id', '')})"
    if kind == "retry_scheduled":
        attempt = get("attempt")
        why = get("reason") or (attempt.get("result", "") if isinstance(attempt, dict) else "")
        return "retry scheduled" + (f": {why}" if why else "")
    details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("at_ms", "event"))
    return kind + (f" ({details})" if details else "")
