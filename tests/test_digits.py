"""gateway/digits.py: a number from outside is ASCII digits alone, of bounded length.

Each place that reads one has its own test where it lives (Retry-After in
test_delivery.py, Content-Length in test_proxy.py, test_admin.py and
test_console_parts.py, the resolve form's status in test_console_parts.py, older_than
in test_admin.py, config values in test_config.py, arguments in test_process.py)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.digits import MAX_DIGITS, capped_number, whole_number

#: What int(), float() or str.isdigit() take that is no number here.
NOT_NUMBERS = [
    "",
    "²",  # str.isdigit() says yes; int() raises
    "1²",
    "\u0662\u0660\u0660",  # Arabic-Indic 200: int() reads it
    "\uff12\uff10\uff10",  # fullwidth 200
    "\u0968",  # Devanagari 2
    "1_0",  # int() reads 10
    "+5",
    "-5",
    " 5",
    "5 ",
    "\u20035",
    "5\n",
    "0x10",
    "1e3",
    "1.0",
]


@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_only_ascii_digits_are_a_number(text: str) -> None:
    assert whole_number(text) is None
    assert capped_number(text, 100) is None


def test_a_number_is_its_digits_within_the_bound() -> None:
    assert whole_number("0") == 0
    assert whole_number("007") == 7
    assert whole_number("9" * MAX_DIGITS) == int("9" * MAX_DIGITS)
    assert whole_number("9" * (MAX_DIGITS + 1)) is None
    assert whole_number("200", 3) == 200
    assert whole_number("2000", 3) is None
    assert whole_number("9" * 5000) is None  # never int()'s own ValueError


def test_a_capped_number_reads_any_length_and_saturates() -> None:
    assert capped_number("30", 2**31) == 30
    assert capped_number("0" * 5000 + "30", 2**31) == 30
    assert capped_number("9" * 5000, 2**31) == 2**31
    assert capped_number("2147483648", 2**31) == 2**31
    assert capped_number("2147483649", 2**31) == 2**31
    assert capped_number("000", 2**31) == 0


@settings(max_examples=500, deadline=None, database=None, derandomize=True)
@given(st.text(max_size=30))
def test_any_text_is_a_number_exactly_when_it_is_ascii_digits(text: str) -> None:
    digits = re.fullmatch(r"[0-9]{1,18}", text) is not None
    assert (whole_number(text) is not None) == digits
    if digits:
        assert whole_number(text) == int(text)
    capped = capped_number(text, 10**6)
    assert (capped is not None) == (re.fullmatch(r"[0-9]+", text) is not None)
    if capped is not None:
        assert capped == min(int(text), 10**6)
