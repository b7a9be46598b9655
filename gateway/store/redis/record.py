"""The Redis record: the legend of its hash fields (FIELDS), and reading one into a Record.

A record is one hash, `{prefix}{bucket}:{digest}` (see store/redis/store.py), written only by
the Lua scripts in store/redis/lua/, whose comments point here. Names are a letter or two
because every request writes them. Times are integer milliseconds on the store's clock
(`TIME`), never a gateway's. tests/test_redis_record.py checks that the field names the
scripts use and FIELDS are the same, and who writes each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import RedisError

from gateway.errors import StoreError
from gateway.records import Record, State, read_history, read_object
from gateway.store.base import Opener

Encoding = Literal[
    "text", "state", "ms", "count", "json list", "json object", "response", "token", "flag"
]


@dataclass(frozen=True, slots=True)
class Field:
    meaning: str
    #: how the value is written (and read: see _DECODE)
    encoding: Encoding
    #: the scripts whose HSET writes it; `_lib` is the helpers every script starts with
    written_by: tuple[str, ...]
    #: the Record attribute it is read into; None for the scripts' own bookkeeping
    attribute: str | None


#: Every field of a record's hash, by its name in Redis.
FIELDS: dict[str, Field] = {
    "s": Field(
        "state: in_flight, completed, released, unresolved, parked, claimed, queued or "
        "retrying; moved by _lib's move()",
        "state",
        ("_lib", "accept", "claim", "complete", "import"),
        "state",
    ),
    "u": Field(
        "when it entered its current state",
        "ms",
        ("_lib", "accept", "claim", "complete", "import"),
        "since_ms",
    ),
    "r": Field(
        "run_id of the claim that owns the key (a delivery's: its latest attempt's)",
        "text",
        ("accept", "claim", "pick", "import"),
        "run_id",
    ),
    "f": Field(
        "the request's fingerprint (a repeat must match it)",
        "text",
        ("accept", "claim", "import"),
        "fingerprint",
    ),
    "c": Field(
        "when the key was first claimed (or accepted)",
        "ms",
        ("accept", "claim", "import"),
        "created_ms",
    ),
    "rt": Field("the route's name", "text", ("accept", "claim", "import"), "route"),
    "k": Field(
        "the idempotency key, as the caller sent it", "text", ("accept", "claim", "import"), "key"
    ),
    "l": Field(
        "lease deadline of an in_flight run (the sweep's index score too); dropped when "
        "the run settles or turns open",
        "ms",
        ("claim", "pick", "import"),
        "lease_until_ms",
    ),
    "w": Field(
        "someone waits on an in_flight record: its changes are published (see _lib's notify)",
        "flag",
        ("claim",),
        None,
    ),
    "resp": Field(
        "the stored response: StoredResponse.encode(), sealed when encryption is on (store.codec)",
        "response",
        ("check_end", "complete", "op_resolve", "import"),
        "response",
    ),
    "why": Field(
        "why the outcome is unknown (unresolved), or why it is parked",
        "text",
        ("_lib", "check_end", "pick", "retry", "import"),
        "reason",
    ),
    "h": Field(
        "the history: a list of events {at_ms, event, ...}, carried over a released "
        "tombstone's next claim",
        "json list",
        ("_lib", "accept", "claim", "put_back", "import"),
        "history",
    ),
    "ck": Field(
        "a check of the upstream holds the record until then",
        "ms",
        ("check_begin", "import"),
        "check_lock_ms",
    ),
    "ckt": Field(
        "the token of the call holding the check lock, so its retry recognises it",
        "text",
        ("check_begin",),
        None,
    ),
    "lc": Field("when the last check began", "ms", ("check_begin", "import"), "last_check_ms"),
    "rc": Field(
        "the last check's answer (result and the upstream's reply)",
        "json object",
        ("check_end", "import"),
        "reconcile",
    ),
    "op": Field("the operator holding a claimed record", "text", ("op_claim", "import"), "holder"),
    "os": Field("when that operator took it", "ms", ("op_claim", "import"), "holder_since_ms"),
    "dl": Field(
        "made by accept: a delivery, whose request is kept at `rq:<digest>` until it settles",
        "flag",
        ("accept", "import"),
        "delivery",
    ),
    "n": Field(
        "delivery attempts started (pick counts them; a pick put back unsent and a refused "
        "probe do not; an operator's retry starts again)",
        "count",
        ("accept", "op_resolve", "pick", "put_back", "retry", "import"),
        "attempts",
    ),
    "due": Field(
        "when a queued or retrying delivery is due (its queue index's score too)",
        "ms",
        ("accept", "check_end", "op_resolve", "put_back", "retry", "import"),
        "due_ms",
    ),
    "la": Field(
        "the last delivery attempt that did not complete it, or the one that did (JSON)",
        "json object",
        ("complete", "retry", "import"),
        "last_attempt",
    ),
    "tk": Field(
        "the status URL's token, sealed like the response (store.codec, KIND_TOKEN)",
        "token",
        ("accept", "import"),
        "token",
    ),
}


def text(value: bytes | str | None) -> str:
    """A value Redis returned, as text ("" for none)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


#: A missing field reads as "", 0 or empty, as a Record's defaults are. JSON that does
#: not parse reads as damaged (records.read_history, read_object), never an exception.
_DECODE: dict[Encoding, Callable[[bytes | None], Any]] = {
    "text": text,
    "state": lambda value: State(text(value)),
    "ms": lambda value: 0 if value is None else int(value),
    "count": lambda value: 0 if value is None else int(value),
    "flag": lambda value: value is not None and value != b"0",
    "json object": read_object,
}

#: (name, attribute, decode) of the fields read as they are; the response and token
#: need the store, the history the record's time.
_READ = tuple(
    (name.encode(), field.attribute, _DECODE[field.encoding])
    for name, field in FIELDS.items()
    if field.attribute is not None and field.encoding not in ("response", "token", "json list")
)


def decode_record(opener: Opener, digest: str, now_ms: int, flat: list[Any]) -> Record:
    """The Record of hash `flat` (name, value, name, value, ... as HGETALL gives it)."""
    fields: dict[bytes, bytes] = dict(zip(flat[::2], flat[1::2], strict=True))
    raw = fields.get(b"resp")
    response, unreadable = (None, "") if raw is None else opener.read_response(digest, raw)
    sealed = fields.get(b"tk")
    token = "" if sealed is None else opener.read_token(digest, sealed)
    values = {attribute: decode(fields.get(name)) for name, attribute, decode in _READ}
    return Record(
        digest=digest,
        now_ms=now_ms,
        response=response,
        unreadable=unreadable,
        token=token,
        history=read_history(fields.get(b"h"), values["created_ms"]),
        **values,
    )


async def server_now_ms(client: Any) -> int:
    """Redis's clock (TIME) in milliseconds: the one every record's times come from."""
    try:
        seconds, micros = await client.time()
    except RedisError as exc:
        raise StoreError.because("redis unreachable", exc) from exc
    return int(seconds) * 1000 + int(micros) // 1000
