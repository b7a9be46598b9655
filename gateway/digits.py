"""Numbers written by someone outside the process, read one strict way.

Headers (Content-Length, Retry-After), query strings, form fields, config values and
command-line arguments are read here, never with `int()`, `float()` or `str.isdigit()`
alone: `int()` takes `٢٠٠` (Arabic-Indic digits), `1_0`, `+5` and Unicode spaces
around the digits; `str.isdigit()` takes `²` and `¹`, which `int()` then refuses with a
ValueError nobody expected; and 5,000 digits make `int()` raise too. A number here is
what RFC 9110 writes `1*DIGIT`: ASCII digits and nothing else, of bounded length.
"""

from __future__ import annotations

#: Digits read at most: more than any count, size or port the gateway takes
#: (2^63 has 19 digits), and well inside `int()`'s own limit.
MAX_DIGITS = 18


def whole_number(text: str, max_digits: int = MAX_DIGITS) -> int | None:
    """`text` as a whole number when it is 1 to `max_digits` ASCII digits and nothing
    else (no sign, space, underscore, or another script's digits); None otherwise."""
    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None


def capped_number(text: str, cap: int) -> int | None:
    """`text` as a whole number of ASCII digits, any number of them, read as `cap` when
    larger: RFC 9111 1.2.2's rule for delta-seconds (a value too large to hold is "the
    greatest positive integer it can conveniently represent"); None when it is not
    digits alone."""
    if not (text and text.isascii() and text.isdigit()):
        return None
    significant = text.lstrip("0")
    if len(significant) > len(str(cap)):
        return cap
    return min(int(significant or "0"), cap)
