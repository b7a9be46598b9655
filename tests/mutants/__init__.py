"""Deliberately broken builds, and the tests that must catch them.

Each module here lists `MUTANTS`: a one-place edit that breaks part of the promise, and
the tests that must then fail. `scripts/mutants` applies each edit to a scratch copy of
the repository, runs those tests there, and reports whether they failed (caught) or
passed (missed: the suite has a hole). The working tree is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    #: File to edit, relative to the repository root.
    path: str
    #: Exact text to replace; must occur exactly once in the file.
    old: str
    new: str
    #: pytest node ids (or files) that must fail with the edit in place.
    tests: tuple[str, ...]
    #: What the edit breaks, in the promise's words.
    breaks: str
