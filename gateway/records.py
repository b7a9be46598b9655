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
    in_flight --replicas did not confirm the pick--> queued|retrying (put back unsent,
                                           attempt n again: store.wait_for_replicas)
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
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

#: A record's digest as it is written everywhere (URLs, logs, the operator API): 32
#: lowercase hex digits (keying.record_digest makes it).
DIGEST = re.compile(r"[0-9a-f]{32}")


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


def is_status(status: int) -> bool:
    """Whether `status` is an HTTP status code at all (RFC 9110 15: 100 to 599). A
    parser reads any three digits; a code outside these is no answer to act on: from
    an upstream it is an unknown outcome (gateway/upstream/parser.py), and the gateway never
    sends one (gateway/http/cycle.py)."""
    return 100 <= status <= 599


def is_success(status: int) -> bool:
    """Whether an upstream's answer says it handled the request: 2xx, 3xx (a job
    endpoint in the Post/Redirect/Get style does the work and answers 303; the gateway
    never follows a redirect) and 4xx other than 408 and 429. The others may be tried
    again: a 5xx, a 408 (the upstream gave up reading the request), a 429 (not now),
    like a request never sent.

    The one rule: it is every route's default `cache_statuses` (what completes a key
    and is replayed; anything else releases the key, or schedules a delivery's next
    attempt), and what counts as the route's last success, for the
    `_last_success_timestamp_seconds` gauge (outbound.py) and Store.last_successes
    alike, since the overview shows the later of the two."""
    return 200 <= status < 500 and status != 408 and status != 429


#: `is_success` as a set: the default `cache_statuses`.
SUCCESS_STATUSES = frozenset(status for status in range(100, 600) if is_success(status))


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
        """What `encode` wrote; ValueError for anything else (bytes changed in the
        store: a status that is none, headers that are not text pairs)."""
        meta, _, body = data.partition(b"\n")
        status, headers, omitted, origin = _fields(meta, 4)
        if type(status) is not int or not 100 <= status <= 599 or not isinstance(origin, str):
            raise ValueError("not a stored response")
        return cls(
            status=status,
            headers=_pairs(headers),
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
        """What `encode` wrote; ValueError for anything else."""
        meta, _, body = data.partition(b"\n")
        method, target, headers = _fields(meta, 3)
        if not isinstance(method, str) or not isinstance(target, str):
            raise ValueError("method and target must be text")
        return cls(method, target, _pairs(headers), body)


def _fields(meta: bytes, count: int) -> list[Any]:
    """The JSON list of `count` fields a stored value starts with; ValueError if it is
    not one (json.loads' own errors, nesting too deep to read included)."""
    try:
        fields = json.loads(meta)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(fields, list) or len(fields) != count:
        raise ValueError(f"not a list of {count} fields")
    return fields


def _pairs(headers: Any) -> tuple[tuple[str, str], ...]:
    """Stored headers, `[[name, value], ...]` of text; ValueError for anything else.
    A loop, not all() over a generator: every replay reads its headers here."""
    if not isinstance(headers, list):
        raise ValueError("headers are not pairs of text")
    pairs = []
    for pair in headers:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError("headers are not pairs of text")
        name, value = pair
        if not (isinstance(name, str) and isinstance(value, str)):
            raise ValueError("headers are not pairs of text")
        pairs.append((name, value))
    return tuple(pairs)


#: What a history stands as when it cannot be read (its one event, `unreadable`).
HISTORY_DAMAGED = (
    "the stored history is damaged (not a list of events): someone with write access "
    "to the store changed it, so it cannot be shown"
)
#: What a stored JSON object (a last attempt, a check's answer) reads as when damaged.
OBJECT_DAMAGED = {"unreadable": "the stored value is damaged: not a JSON object"}


class _Damaged:
    """Stored JSON text that does not parse (see `stored_json`)."""


def stored_json(text: str | bytes) -> Any:
    """A JSON value the store kept, parsed; one that does not parse (changed in the
    store, or nested deeper than Python reads) as a value `read_history` and
    `read_object` say is damaged, never an exception: a record is read whatever is in
    it, so a person can see it and resolve it."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _Damaged()


def read_history(value: Any, at_ms: int) -> tuple[dict[str, Any], ...]:
    """A record's stored history (JSON text, or the value a JSON column gave; None:
    none) as its events. Anything but a list of events with their times reads as one
    `unreadable` event at `at_ms` that says so."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        value = stored_json(value)
    if isinstance(value, list) and all(
        isinstance(e, dict) and _a_time(e.get("at_ms")) and isinstance(e.get("event"), str)
        for e in value
    ):
        return tuple(value)
    return ({"at_ms": at_ms, "event": "unreadable", "reason": HISTORY_DAMAGED},)


def read_object(value: Any) -> dict[str, Any]:
    """A stored JSON object (text, or a JSON column's value; None: none, `{}`); anything
    else reads as OBJECT_DAMAGED."""
    if value is None:
        return {}
    if isinstance(value, (str, bytes)):
        value = stored_json(value)
    return value if isinstance(value, dict) else dict(OBJECT_DAMAGED)


def _a_time(value: Any) -> bool:
    return type(value) is int


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

    @classmethod
    def claimed(
        cls,
        ref: KeyRef,
        run_id: str,
        fingerprint: str,
        now: int,
        lease_until_ms: int,
        earlier: Record | None,
    ) -> Record:
        """A key claimed at `now` (ms): in flight under `run_id` until its lease ends,
        with the history of the released record it replaces, if any."""
        return cls(
            digest=ref.digest,
            route=ref.route,
            key=ref.key,
            state=State.IN_FLIGHT,
            run_id=run_id,
            fingerprint=fingerprint,
            created_ms=now,
            now_ms=now,
            since_ms=now,
            lease_until_ms=lease_until_ms,
            history=earlier.history if earlier is not None else (),
        )

    @property
    def age(self) -> float:
        return max(0, self.now_ms - self.created_ms) / 1000

    @property
    def upstream_status(self) -> int | None:
        """`upstream_status(self)`: the upstream's status at the last attempt."""
        return upstream_status(self)

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
                "runs": [attempt.to_json() for attempt in attempts_of(self)],
            }
        # The current run's start is implied by `created_ms`, not stored twice; a
        # history carried over from released runs comes before it. A delivery's
        # run id changes at each attempt: each attempt's event names its own.
        created: dict[str, Any] = {"at_ms": self.created_ms, "event": "accepted"}
        if not self.delivery:
            created = {"at_ms": self.created_ms, "event": "forwarded", "run_id": self.run_id}
        doc["history"] = sorted([*self.history, created], key=lambda e: int(e["at_ms"]))
        return doc


def history_event(at_ms: int, event: str, **fields: Any) -> dict[str, Any]:
    """One entry of a record's history, as every store writes it (the Lua scripts' own
    spell it alike): when, what, and the event's fields."""
    return {"at_ms": at_ms, "event": event, **fields}


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
    if kind == "put_back":
        times = get("times")
        again = f" ({times} times in a row)" if isinstance(times, int) and times > 1 else ""
        return f"put back unsent{again}: {get('reason', '')}"
    if kind == "unreadable":
        return f"history unreadable: {get('reason', '')}"
    if kind == "retry_scheduled":
        attempt = get("attempt")
        why = get("reason") or (attempt.get("result", "") if isinstance(attempt, dict) else "")
        return "retry scheduled" + (f": {why}" if why else "")
    details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("at_ms", "event"))
    return kind + (f" ({details})" if details else "")


def upstream_status(record: Record) -> int | None:
    """The status the upstream answered a key's last attempt with: a completed key's
    stored response from the upstream, else a delivery's last attempt's; None when
    there is none (never sent, an unknown outcome, a sync key still open)."""
    response = record.response
    if record.state is State.COMPLETED and response is not None and response.origin == "upstream":
        return response.status
    status = record.last_attempt.get("status")
    return status if type(status) is int else None


#: How an attempt ended, by the event that ended it.
_ENDINGS = frozenset({"retry_scheduled", "parked", "completed", "unknown"})


@dataclass(frozen=True, slots=True)
class Attempt:
    """One delivery attempt as the history tells it: when it started and on which
    replica, how it ended (`ended_ms` 0 while it runs), the upstream's status or the
    failure's class ("status": an answer that is not cached, "not_sent", or
    "unknown_outcome") with its detail, and when the next attempt is due (0: none)."""

    number: int
    started_ms: int
    replica: str
    run_id: str
    outcome: str = "in_flight"
    ended_ms: int = 0
    status: int | None = None
    failure: str = ""
    detail: str = ""
    next_due_ms: int = 0

    @property
    def duration_ms(self) -> int | None:
        return self.ended_ms - self.started_ms if self.ended_ms else None

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "started_ms": self.started_ms,
            "replica": self.replica,
            "run_id": self.run_id,
            "outcome": self.outcome,
            "ended_ms": self.ended_ms or None,
            "duration_ms": self.duration_ms,
            "status": self.status,
            "failure": self.failure or None,
            "detail": self.detail or None,
            "next_due_ms": self.next_due_ms or None,
        }


def attempts_of(record: Record) -> list[Attempt]:
    """A delivery's attempts, oldest first, from its history: each `attempt` event (the
    pick: when, which replica, which run) and the event that ended it (a retry scheduled
    with the attempt's status or error and the next due time, a park, a completion, an
    unknown outcome). A completion's status is the record's last attempt's."""
    found: list[Attempt] = []
    open_: Attempt | None = None
    for event in sorted(record.history, key=lambda e: int(e["at_ms"])):
        kind = event.get("event")
        if kind == "attempt":
            if open_ is not None:
                found.append(open_)
            number = event.get("attempt")
            open_ = Attempt(
                number=number if type(number) is int else len(found) + 1,
                started_ms=int(event["at_ms"]),
                replica=str(event.get("replica", "")),
                run_id=str(event.get("run_id", "")),
            )
            continue
        if open_ is None or kind not in _ENDINGS:
            continue
        found.append(_ended(open_, event, record))
        open_ = None
    if open_ is not None:
        found.append(open_)
    return found


def _ended(started: Attempt, event: dict[str, Any], record: Record) -> Attempt:
    kind = str(event["event"])
    said = event.get("attempt")
    attempt = said if isinstance(said, dict) else {}
    if kind == "completed":
        attempt = record.last_attempt if record.state is State.COMPLETED else {}
    status = attempt.get("status")
    status = status if type(status) is int else None
    detail = str(attempt.get("error") or event.get("reason") or "")
    if kind == "completed":
        failure, detail = "", ""
    elif kind == "unknown":
        failure = "unknown_outcome"
    elif status is not None:
        failure = "status"
    else:
        failure = "not_sent"
    due = event.get("due_ms") if kind == "retry_scheduled" else 0
    return replace(
        started,
        outcome=kind,
        ended_ms=int(event["at_ms"]),
        status=status,
        failure=failure,
        detail=detail,
        next_due_ms=due if type(due) is int else 0,
    )


# -- what a store reports: counts for the operator surfaces and gauges, and how it keeps records


@dataclass(frozen=True, slots=True)
class StateCount:
    """A route's records in one open state: how many, and the oldest's age."""

    route: str
    state: State
    count: int
    oldest_seconds: float


@dataclass(frozen=True, slots=True)
class QueueStat:
    """A route's pending deliveries: queued, retrying, and the longest wait."""

    route: str
    queued: int
    retrying: int
    #: the longest a due delivery has waited: queued since accepted, retrying since due
    oldest_wait_seconds: float


#: How much harm each maxmemory-policy can do to records, least first: noeviction
#: refuses writes when memory is full; volatile-* evict keys with a ttl (completed
#: and released records: their keys run again); allkeys-* evict any record.
_EVICTION_HARM = {"noeviction": 0, "volatile": 1, "allkeys": 2}
_AOF_HARM = {"yes": 0, "n/a": 0, "unknown": 1, "no": 2}


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """How the store keeps records, as it reports it (Redis: INFO, which managed
    services allow where CONFIG is disabled)."""

    #: Redis maxmemory-policy: anything but "noeviction" may drop records, and a
    #: dropped record is a key that runs again. "unknown" if INFO would not say.
    maxmemory_policy: str
    #: "yes": every write also goes to an append-only file; "no": a restart loses
    #: what the last snapshot (if any) did not hold; "n/a": nothing to persist.
    aof: str
    #: where it was read, for messages: an address, or the cluster master it came from
    source: str = ""
    #: why INFO could not be read (an ACL without +info), if it could not: Redis's
    #: words, for the log only
    error: str = ""

    @property
    def evicts(self) -> bool:
        return self.maxmemory_policy != "noeviction"

    def worse(self, other: StoreInfo) -> StoreInfo:
        """Of two servers' answers, the policy more likely to lose records and the
        persistence more likely to lose them: what holds for all of them."""

        def harm(info: StoreInfo) -> int:
            return _EVICTION_HARM.get(info.maxmemory_policy.partition("-")[0], 3)

        policy = self if harm(self) >= harm(other) else other
        aof = max(self.aof, other.aof, key=lambda aof: _AOF_HARM.get(aof, 1))
        return replace(policy, aof=aof)

    def refusal(self, allow_eviction: bool) -> str:
        """Why a gateway on this store is not ready, or "" if it is."""
        if not self.evicts or allow_eviction:
            return ""
        where = f"Redis at {self.source}" if self.source else "Redis"
        if self.error:
            # Redis's own words (which user, which command) are for the log (report).
            found = f"{where} did not say its maxmemory-policy (its INFO was refused)"
            fix = "allow the gateway's Redis user to run INFO (+info)"
        else:
            found = f"{where} has maxmemory-policy {self.maxmemory_policy}"
            fix = "set maxmemory-policy noeviction"
        return (
            f"{found}: it may evict records, and a key whose record is evicted runs "
            f"again. {fix[0].upper()}{fix[1:]}, or store.allow_eviction: true if a key "
            "may run again when Redis evicts its record"
        )
