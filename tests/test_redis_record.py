"""The Redis record's field legend (gateway.store.redis.record.FIELDS) against the Lua
scripts that write the fields and the decoder that reads them: neither can drift from it."""

from __future__ import annotations

import dataclasses
import json
import re
from importlib import resources

import pytest

from gateway.records import OBJECT_DAMAGED, Record, State, StoredRequest, StoredResponse
from gateway.store.memory import MemoryStore
from gateway.store.redis.record import FIELDS, decode_record

LUA = resources.files("gateway.store.redis") / "lua"
SCRIPTS = sorted(p.name.removesuffix(".lua") for p in LUA.iterdir() if p.name.endswith(".lua"))
HASH_COMMANDS = ("HSET", "HGET", "HMGET", "HDEL", "HEXISTS")
#: commands on the record that name no field
WHOLE_RECORD = ("HGETALL", "DEL", "PEXPIRE", "PERSIST", "EXISTS")
#: the Record attributes no hash field holds: given by the reader, or the response's
NOT_FIELDS = {"digest", "now_ms", "unreadable"}


def _calls(source: str) -> list[tuple[str, list[str]]]:
    """(command, its arguments after the record) of every redis.call on the record R."""
    calls = []
    for match in re.finditer(r"redis\.call\('(\w+)',\s*R\b", source):
        depth, start, args = 1, match.end(), []
        i = start
        while depth:  # the arguments up to the call's closing parenthesis
            ch = source[i]
            if ch in "({":
                depth += 1
            elif ch in ")}":
                depth -= 1
            if (ch == "," and depth == 1) or depth == 0:
                args.append(source[start:i].strip())
                start = i + 1
            i += 1
        calls.append((match.group(1), [a for a in args if a]))
    return calls


def _names(arg: str, source: str) -> list[str]:
    """The field names an argument stands for: a literal, or unpack() of a literal table."""
    if literal := re.fullmatch(r"'(\w+)'", arg):
        return [literal.group(1)]
    if table := re.fullmatch(r"unpack\((\w+)\)", arg):
        body = re.search(rf"local {table.group(1)} = \{{([^}}]*)\}}", source)
        assert body is not None, f"{arg}: its table is not a literal in the script"
        return re.findall(r"'(\w+)'", body.group(1))
    raise AssertionError(f"field name {arg!r} is not a literal: FIELDS cannot be checked")


def _fields(name: str) -> tuple[set[str], set[str]]:
    """(every field the script names, the fields its HSETs write)."""
    source = (LUA / f"{name}.lua").read_text()
    lib = (LUA / "_lib.lua").read_text()
    named: set[str] = set()
    written: set[str] = set()
    for command, args in _calls(source):
        if command in WHOLE_RECORD:
            continue
        assert command in HASH_COMMANDS, f"{name}.lua: {command} on the record: check it here"
        # HSET takes name, value pairs; the others take names only.
        names = args[::2] if command == "HSET" else args
        for arg in names:
            found = _names(arg, source + lib)
            named.update(found)
            if command == "HSET":
                written.update(found)
    return named, written


def test_scripts_are_found() -> None:
    assert {"_lib", "claim", "complete", "release"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_field_a_script_names_is_in_the_legend(script: str) -> None:
    named, _ = _fields(script)
    assert named - FIELDS.keys() == set(), "add them to FIELDS in store/redis/record.py"


def test_every_field_in_the_legend_is_used_and_its_writers_are_right() -> None:
    named: set[str] = set()
    writers: dict[str, set[str]] = {field: set() for field in FIELDS}
    for script in SCRIPTS:
        in_script, written = _fields(script)
        named |= in_script
        for field in written:
            writers.setdefault(field, set()).add(script)
    assert FIELDS.keys() - named == set(), "fields no script uses"
    assert {f: set(spec.written_by) for f, spec in FIELDS.items()} == writers


def test_every_script_points_to_the_legend() -> None:
    for script in SCRIPTS:
        # the operator roster, route pauses, a rate limit: no record's fields
        if script in ("roster", "pause", "rate"):
            continue
        head = (LUA / f"{script}.lua").read_text().splitlines()[0]
        assert "store/redis/record.py" in head, f"{script}.lua: its first line points to FIELDS"


def test_the_legend_covers_every_record_attribute_once() -> None:
    attributes = [spec.attribute for spec in FIELDS.values() if spec.attribute is not None]
    assert len(attributes) == len(set(attributes))
    assert set(attributes) == {f.name for f in dataclasses.fields(Record)} - NOT_FIELDS


def test_a_record_decodes_every_field_of_the_legend() -> None:
    store = MemoryStore()
    response = StoredResponse(201, (("content-type", "text/plain"),), b"made")
    flat = [
        b"s", b"parked", b"u", b"7", b"r", b"run", b"f", b"fp", b"c", b"5", b"rt", b"jobs",
        b"k", b"key-1", b"l", b"9", b"w", b"1", b"resp", store.codec.encode("d", response),
        b"why", b"lease_expired", b"h", b'[{"at_ms": 6, "event": "unknown"}]', b"ck", b"11",
        b"ckt", b"token", b"lc", b"10", b"rc", b'{"result": "inconclusive"}', b"op", b"alice",
        b"os", b"12", b"dl", b"1", b"n", b"3", b"due", b"13", b"la", b'{"status": 503}',
        b"tk", store.codec.encode_token("d", "tok"),
    ]  # fmt: skip
    assert sorted(flat[::2]) == sorted(name.encode() for name in FIELDS)
    record = decode_record(store.opener, "d", 99, flat)
    assert record == Record(
        digest="d",
        route="jobs",
        key="key-1",
        state=State.PARKED,
        run_id="run",
        fingerprint="fp",
        created_ms=5,
        now_ms=99,
        lease_until_ms=9,
        response=response,
        reason="lease_expired",
        since_ms=7,
        holder="alice",
        holder_since_ms=12,
        check_lock_ms=11,
        last_check_ms=10,
        reconcile={"result": "inconclusive"},
        history=({"at_ms": 6, "event": "unknown"},),
        delivery=True,
        attempts=3,
        due_ms=13,
        last_attempt={"status": 503},
        token="tok",
    )
    bare = decode_record(store.opener, "d", 99, [b"s", b"in_flight"])
    assert bare == Record("d", "", "", State.IN_FLIGHT, "", "", 0, 99)


@pytest.mark.parametrize(
    "history",
    [b"{not json", b"[" * 100_000, b'"text"', b"[1, 2]", b'[{"event": "x"}]',
     b'[{"at_ms": "6", "event": "x"}]', b"\xff\xfe"],
)  # fmt: skip
def test_a_record_whose_json_was_damaged_is_read_and_says_so(history: bytes) -> None:
    """Someone with write access to Redis changed a record's history, last attempt
    and check answer into text that is no such JSON: the record is read all the same
    (an operator can see it and resolve it; a caller's repeat is answered), the history
    as one `unreadable` event at the record's creation that says so, the objects as
    an `unreadable` member."""
    flat = [b"s", b"parked", b"c", b"5", b"h", history, b"la", history, b"rc", history]
    record = decode_record(MemoryStore().opener, "d", 99, flat)
    [event] = record.history
    assert (event["at_ms"], event["event"]) == (5, "unreadable")
    assert "history is damaged" in event["reason"]
    assert record.last_attempt == record.reconcile == OBJECT_DAMAGED
    assert [e["event"] for e in record.to_json()["history"]] == ["unreadable", "forwarded"]


@pytest.mark.parametrize(
    "meta",
    [b"[600, [], 0, \"upstream\"]", b'["200", [], 0, "upstream"]', b'[200, [["a"]], 0, "x"]',
     b'[200, [[1, "v"]], 0, "x"]', b"[200, [], 0]", b"{}", b"[" * 100_000, b'[true, [], 0, "x"]'],
)  # fmt: skip
def test_a_stored_response_that_is_no_response_is_unreadable(meta: bytes) -> None:
    """Bytes that are no stored response (a status that is none or outside 100..599,
    headers that are not pairs of text, nesting too deep for the JSON reader) read as
    unreadable, said in the gateway's words: never replayed, never an exception."""
    response, why = MemoryStore().read_response("d", meta + b"\nbody")
    assert response is None and why == "the stored bytes are damaged: not a stored response"


def test_a_delivery_record_shows_its_attempts_never_its_token() -> None:
    token = "Qk3-9w_0123456789abcd"
    record = Record(
        "d", "jobs", "k", State.RETRYING, "run-2", "fp", 5, 99, delivery=True, attempts=2,
        due_ms=120, last_attempt={"result": "status", "status": 503}, token=token,
        history=({"at_ms": 50, "event": "attempt", "attempt": 1},),
    )  # fmt: skip
    doc = record.to_json()
    assert token not in json.dumps(doc) and token not in repr(record)
    assert doc["delivery"] == {
        "attempts": 2,
        "next_attempt_ms": 120,
        "last_attempt": {"result": "status", "status": 503},
        "runs": [
            {
                "attempt": 1, "started_ms": 50, "replica": "", "run_id": "",
                "outcome": "in_flight", "ended_ms": None, "duration_ms": None, "status": None,
                "failure": None, "detail": None, "next_due_ms": None,
            }
        ],
    }  # fmt: skip
    assert [e["event"] for e in doc["history"]] == ["accepted", "attempt"]
    assert "delivery" not in Record("d", "", "", State.IN_FLIGHT, "", "", 0, 99).to_json()


@pytest.mark.parametrize(
    "text", ["plain", 'quote " and \\ backslash', "\x00\x1f\x7f control", "é ü 中 \u2028 😀", ""]
)
def test_stored_encodings_are_compact_json_of_their_fields(text: str) -> None:
    """records.py encodes with a C encoder built once instead of json.dumps: the bytes
    stored must be exactly json.dumps' (older records and other readers parse them)."""
    response = StoredResponse(203, (("x-" + text, text), ("b", "c")), b"\x00body", True, text)
    meta = [203, [["x-" + text, text], ["b", "c"]], 1, text]
    assert response.encode() == json.dumps(meta, separators=(",", ":")).encode() + b"\n\x00body"
    assert StoredResponse.decode(response.encode()) == response
    request = StoredRequest("POST", "/p?" + text, ((text or "n", text),), b"{}")
    meta = ["POST", "/p?" + text, [[text or "n", text]]]
    assert request.encode() == json.dumps(meta, separators=(",", ":")).encode() + b"\n{}"
    assert StoredRequest.decode(request.encode()) == request
