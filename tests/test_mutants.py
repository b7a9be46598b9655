"""Every mutant in tests/mutants/ still applies, and names tests that exist.

`scripts/mutants` runs the broken builds (minutes each); this checks in milliseconds
that a rename or a refactor has not left a mutant pointing at text that is gone, at a
file that moved, or at a test that was renamed, which would make it "missed" for the
wrong reason or, worse, silently never run.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tests.mutants as package
from tests.mutants import Mutant

ROOT = Path(__file__).resolve().parents[1]


def _mutants() -> list[Mutant]:
    found: list[Mutant] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        found.extend(getattr(importlib.import_module(f"tests.mutants.{info.name}"), "MUTANTS", []))
    return found


MUTANTS = _mutants()


def _test_names(path: Path) -> set[str]:
    """Top-level test functions and `Class::method` names defined in a test file."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}::{item.name}")
    return names


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_applies_exactly_once_and_names_real_tests(mutant: Mutant) -> None:
    target = ROOT / mutant.path
    assert target.is_file(), f"{mutant.name}: {mutant.path} does not exist"
    count = target.read_text().count(mutant.old)
    assert count == 1, f"{mutant.name}: its text occurs {count} times in {mutant.path}"
    assert mutant.old != mutant.new
    assert mutant.tests, f"{mutant.name} names no test"
    for node in mutant.tests:
        file, _, name = node.partition("::")
        path = ROOT / file
        assert path.is_file(), f"{mutant.name}: {file} does not exist"
        if name:
            base = name.split("[", 1)[0]
            assert base in _test_names(path), f"{mutant.name}: {node} is not defined"


def _mutants_by_file() -> dict[str, int]:
    """Each file of tests/mutants/ with the number of broken builds it declares."""
    return {
        f"{info.name}.py": len(
            getattr(importlib.import_module(f"tests.mutants.{info.name}"), "MUTANTS", [])
        )
        for info in pkgutil.iter_modules(package.__path__)
    }


def table_of_mutant_files(page: str) -> tuple[dict[str, int], int | None]:
    """The counts docs/reliability.md's table of mutant files gives (each file's first
    mention in it, as "`name.py` (N)"), and the total its prose states."""
    section = page[page.index("## Broken builds the suite catches") :]
    table = section[section.index("| file (mutants) |") :].split("\n\n", 1)[0]
    counts: dict[str, int] = {}
    for name, count in re.findall(r"`(\w+\.py)` \((\d+)\)", table):
        assert name not in counts, f"{name} counted twice in the table"
        counts[name] = int(count)
    total = re.search(r"There are ([\d,]+) broken builds", section)
    return counts, int(total[1].replace(",", "")) if total else None


def test_the_reliability_table_lists_every_mutant_file_with_its_count() -> None:
    """docs/reliability.md's table names every file of tests/mutants/ with its count, and
    its prose the total, so a new file or mutant shows up there."""
    counts, total = table_of_mutant_files((ROOT / "docs" / "reliability.md").read_text())
    actual = _mutants_by_file()
    assert counts == actual, {
        "not in the table": sorted(set(actual) - set(counts)),
        "not in tests/mutants/": sorted(set(counts) - set(actual)),
        "wrong count": {n: (c, actual[n]) for n, c in counts.items() if actual.get(n, c) != c},
    }
    assert total == sum(actual.values())


def test_the_table_check_sees_a_missing_file_and_a_wrong_count() -> None:
    page = (
        "## Broken builds the suite catches\n\nThere are 7 broken builds in 2 files.\n\n"
        "| file (mutants) | what its mutants break |\n|---|---|\n"
        "| `a.py` (3), `b.py` (4) | things |\n| `b.py` (the rest) | more |\n\n"
        "| `c.py` (9) | another table |\n"
    )
    assert table_of_mutant_files(page) == ({"a.py": 3, "b.py": 4}, 7)
