"""Text an operator gives, checked before anything keeps it.

An operator's words go into a record (a holder's name, a note in the history, a
response repeats get) and from there into every store, log line, listing and
terminal that shows them. Each kind of field has one rule here, and
gateway/operators/actions.py applies them before the store is asked anything, for the API and
the console alike; a refusal is `InvalidText` (422), naming the field and saying
what is wrong in words.

- Nowhere a lone surrogate (U+D800 to U+DFFF): half of a UTF-16 pair, no character
  at all. JSON's `\\uD800` escape carries one in; no UTF-8 text, and so no store,
  can hold it.
- In a name and a note, no NUL (PostgreSQL's text refuses it) and no other control
  character (C0, DEL, C1): a terminal acts on ESC and CSI, so a name in a `keys`
  listing or a note in a log line could move the cursor or retitle the window. A
  note may hold line breaks (LF, CR) and tabs. A name is one line of characters that
  show: no line or paragraph separator (U+2028, U+2029), and no format character
  (Unicode category Cf), which shows nothing or changes how the text around it
  shows: the bidirectional marks and overrides (U+202E turns `kcatta` into `attack`
  on screen), zero-width spaces and joiners, U+FEFF (`x\ufeffy` would show as `xy`,
  another name). A holder's name must read as what it is. A note keeps them:
  right-to-left text needs them.
- A name is at most NAME_LIMIT characters (an operator name of admin.operators is
  as long), a note at most NOTE_LIMIT.
- A response body given as text may hold any character UTF-8 can write: a body is
  bytes, and NUL or a control character is its own business. Its size is the
  route's max_stored_body's to bound (gateway/operators/response.py).
"""

from __future__ import annotations

import re
import unicodedata

from gateway.errors import InvalidText

NAME_LIMIT = 100
NOTE_LIMIT = 4000

#: Unicode's categories of the characters that show nothing of their own: format
#: characters (Cf: bidirectional marks, overrides and isolates, zero-width spaces and
#: joiners, U+FEFF, the soft hyphen) and the line and paragraph separators (Zl, Zp).
#: A name refuses them; the console spells them out wherever it shows a caller's text
#: (gateway/console/rendering.py), so they can neither hide nor reorder it.
INVISIBLE = frozenset({"Cf", "Zl", "Zp"})
#: What a name refuses: the invisible ones, the control characters (Cc: C0, DEL, C1)
#: and the lone surrogates (Cs).
_NOT_IN_A_NAME = INVISIBLE | {"Cc", "Cs"}

_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: C0, DEL and C1 control characters but line breaks and tabs, and the lone surrogates.
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_NAMES = {
    0: "NUL", 9: "TAB", 0xA: "LINE FEED", 0xD: "CARRIAGE RETURN", 0x1B: "ESC", 0x7F: "DEL",
    0x9B: "CSI",
}  # fmt: skip


def is_invisible(char: str) -> bool:
    """Whether `char` shows nothing of its own (see INVISIBLE)."""
    return unicodedata.category(char) in INVISIBLE


def check_name(value: str, field: str = "operator") -> None:
    """An operator's name as given with the shared token: one line of characters that
    show, no control character."""
    allowed = "a name is one line of printable text, with no mark that hides or reorders it"
    _check(value, field, "the operator's name", _first_not_in_a_name(value), NAME_LIMIT, allowed)


def check_note(value: str, field: str = "note") -> None:
    """A note: printable text, line breaks and tabs."""
    allowed = "a note may hold line breaks and tabs, and no other control character"
    _check(value, field, "the note", _first(_CONTROL_BUT_LINES, value), NOTE_LIMIT, allowed)


def check_body(value: str, field: str = "response.body") -> None:
    """A response body given as text: anything UTF-8 can write."""
    _check(value, field, "the response body", _first(_SURROGATE, value), None, "")


def _first(refused: re.Pattern[str], value: str) -> int | None:
    found = refused.search(value)
    return None if found is None else found.start()


def _first_not_in_a_name(value: str) -> int | None:
    # As far as a name may go: a longer one is refused for its length anyway.
    for at, char in enumerate(value[: NAME_LIMIT + 1]):
        if unicodedata.category(char) in _NOT_IN_A_NAME:
            return at
    return None


def _check(
    value: str, field: str, what: str, found: int | None, limit: int | None, allowed: str
) -> None:
    if found is not None:
        char, at = value[found], found + 1
        category = unicodedata.category(char)
        if category == "Cs":
            raise InvalidText(
                f"{what.capitalize()} holds a lone surrogate ({_code(char)}) at character "
                f"{at}: half of a UTF-16 pair, which is no character and cannot be stored. "
                "Send the whole character, or remove it.",
                field=field,
            )
        kind = {
            "Cf": "a format character, which shows nothing or reorders the text around it",
            "Zl": "a line separator",
            "Zp": "a paragraph separator",
        }.get(category, "a control character")
        raise InvalidText(
            f"{what.capitalize()} holds {character_name(char)} at character {at}, {kind}; "
            f"{allowed}.",
            field=field,
        )
    if limit is not None and len(value) > limit:
        raise InvalidText(
            f"{what.capitalize()} is {len(value)} characters, longer than {limit}; shorten it.",
            field=field,
        )


def _code(char: str) -> str:
    return f"U+{ord(char):04X}"


def character_name(char: str) -> str:
    """A character in words, for a message: `ZERO WIDTH SPACE (U+200B)`, `ESC (U+001B)`."""
    name = _NAMES.get(ord(char)) or unicodedata.name(char, "")
    return f"{name} ({_code(char)})" if name else _code(char)
